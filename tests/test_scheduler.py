"""The scheduler's step protocol, driven without a model: rank 0 issues step k+1 before it has read step k's
tokens (the engine's overlapped loop). The outputs must equal those of issuing one step at a time."""
import pytest
import torch

from tp_engine.sampling.sampler import SamplingParams
from tp_engine.runtime.page_pool import PagePool
from tp_engine.runtime.request import RequestOutput, RequestState
from tp_engine.runtime.scheduler import Scheduler
from tp_engine.runtime.step_message import PageTables, decode_message
from tp_engine.runtime.step_plan import step_message

V, EOS = 50, 7


def next_token(token: int, position: int) -> int:
    """A stand-in model whose output depends on the input token and its position, so a wrong reference
    or position changes what follows."""
    return (token * 31 + position * 7 + 5) % V


def issue(sched: Scheduler, plan) -> torch.Tensor:
    """What Engine.issue does on the host: the plan's message, and the step counted as issued."""
    msg = step_message(plan, sched.page_size).encode()
    sched.commit(plan)
    return msg


def drive(lagged: bool, num_pages: int, max_batch: int = 8, fed: bool = False) -> tuple[list, int]:
    sched = Scheduler(PagePool(num_pages, 4), max_batch, 64, num_pages * 4, (EOS,))
    tables = PageTables()
    prompts = [[1, 2, 3], [4] * 9, [9, 8], [11, 12, 13, 14, 15, 16], [20]]
    reqs = [RequestOutput(i, p, SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=i % 2 == 0))
            for i, p in enumerate(prompts)]
    made, states = [], {}  # the scheduler's state of each request, as the plans show them

    def source():
        for r in reqs:
            made.append(r)
            yield r
    if fed:
        sched.feed(source())
    else:
        for r in reqs:
            sched.add(r)
    device_tokens = [0] * max_batch  # what Engine.last_tokens holds: the tokens of the latest step
    inflight = None
    while sched.has_work():
        if fed:  # made, not finished: those running, and at most a batch of waiting ones
            assert len([r for r in made if r.finish_reason is None]) <= 2 * max_batch
        plan = sched.schedule()
        states.update((id(r), r) for r in plan.reqs)
        issued = None
        if plan.reqs:
            batch = decode_message(issue(sched, plan), tables)
            ids = [t if t >= 0 else device_tokens[-1 - t] for t in batch.input_ids.tolist()]
            pos = batch.positions.tolist()
            rows = batch.logit_rows.tolist()
            tokens = [next_token(ids[i], pos[i]) for i in rows]
            device_tokens[:len(tokens)] = tokens
            issued = (plan, tokens)
        if not lagged and issued is not None:
            sched.update(*issued)
            continue
        assert issued is not None or inflight is not None
        if inflight is not None:
            sched.update(*inflight)
        inflight = issued
    assert len(states) == len(reqs) and all(r.pending == 0 and not r.pages for r in states.values())
    assert sched.pool.num_free == num_pages
    return reqs, sched.num_preempted


@pytest.mark.parametrize("num_pages", [64, 7])
def test_overlapped_steps_equal_one_at_a_time(num_pages):
    ref, _ = drive(False, num_pages)
    got, preempted = drive(True, num_pages)
    if num_pages == 7:
        assert preempted > 0  # the small pool exercises preemption with a token still in flight
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in ref]
    stopped = [r for r in got if r.finish_reason == "stop"]
    assert stopped and all(r.output_ids[-1] == EOS for r in stopped)  # the extra token after EOS is dropped
    for r in got:
        if r.finish_reason == "length":
            assert len(r.output_ids) == r.params.max_new_tokens


@pytest.mark.parametrize("num_pages", [64, 7])
def test_requests_fed_as_room_comes_run_as_if_all_were_added(num_pages):
    """The engine feeds requests from a generator, so that a job of any length holds only a batch of them
    ahead: they must run exactly as when all are added at the start."""
    ref, _ = drive(True, num_pages, max_batch=2)
    got, _ = drive(True, num_pages, max_batch=2, fed=True)
    assert [(r.output_ids, r.finish_reason) for r in got] == [(r.output_ids, r.finish_reason) for r in ref]


def test_length_limit_is_not_overrun():
    """A request whose in-flight token is its last is left out of the next step."""
    sched = Scheduler(PagePool(16, 4), 4, 64, 64, ())
    r = RequestOutput(0, [1, 2], SamplingParams(max_new_tokens=2))
    state = sched.add(r)
    first = sched.schedule()
    issue(sched, first)  # prefill: samples output token 1
    second = sched.schedule()
    assert second.reqs == [state]
    issue(sched, second)  # samples output token 2, the last
    assert sched.schedule().reqs == []  # nothing to issue until those tokens are read
    sched.update(first, [5])
    sched.update(second, [6])
    assert r.output_ids == [5, 6] and r.finish_reason == "length" and not sched.has_work()


def test_engine_issues_the_next_step_before_reading_tokens(tmp_path):
    """Engine.run keeps one step in flight: it issues step k+1 before it reads step k's tokens."""
    from helpers import make_checkpoint
    from tp_engine.llm import LLM

    llm = LLM(model=str(make_checkpoint(tmp_path / "m", vocab=256)), device="cpu")
    events = []
    issue, take = llm.engine.issue, llm.engine.take_tokens
    llm.engine.issue = lambda *a: events.append("issue") or issue(*a)
    llm.engine.take_tokens = lambda *a: events.append("take") or take(*a)
    out = llm.generate([{"input_ids": [5, 6, 7]}], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out[0]["output_token_ids"]) == 4
    # prefill, then 3 decode steps; each step's tokens are read after the next step is issued
    assert events == ["issue", "issue", "take", "issue", "take", "issue", "take", "take"]


def test_page_table_holds_exactly_each_requests_pages():
    """kv_cache.page_table, the one page table all attention backends read, from per-request tables (which
    may hold a page more than the tokens need)."""
    import numpy as np

    from tp_engine.base.batch import Batch
    from tp_engine.attention.kv_cache import page_table

    seq, tables = [9, 1, 4, 13], [[7, 2, 5], [0], [3], [8, 1, 6, 4]]  # page size 4
    longer = [t + [99] for t in tables]
    z = torch.zeros(0, dtype=torch.int64)
    for tabs in (tables, longer, [np.array(t, dtype=np.int32) for t in longer]):
        batch = Batch(False, z, z, z, seq, [1] * 4, tabs, z)
        indptr, ids, last = page_table(batch, 4)
        assert indptr.dtype == ids.dtype == last.dtype == np.int32
        assert indptr.tolist() == [0, 3, 4, 5, 9]
        assert ids.tolist() == [7, 2, 5, 0, 3, 8, 1, 6, 4]
        assert last.tolist() == [1, 1, 4, 1]


def test_step_budget_grants_the_most_tokens_that_fit():
    """StepBudget.take against a search over every chunk length: the longest chunk whose cost fits, at least
    one token for the step's first prompt row, and the cost and tokens left counted down."""
    import random

    from tp_engine.runtime.step_budget import StepBudget

    rng = random.Random(0)
    for _ in range(3000):
        span, cost = rng.choice([1.0, 7.0, 3840.0, 23552.0]), rng.uniform(0.5, 3000)
        tokens = rng.randrange(1, 4000)
        start, n, first = rng.randrange(0, 40000), rng.randrange(1, 5000), rng.random() < 0.5
        b = StepBudget(tokens, cost, span)
        if not first:
            b.taken = 1
        fits = [m for m in range(0, min(n, tokens) + 1) if b.chunk_cost(start, m) <= cost]
        want = max(fits[-1], 0 if not first else 1)
        assert b.take(start, n) == want, (span, cost, tokens, start, n, first)
        assert b.tokens == tokens - want and abs(b.cost - (cost - b.chunk_cost(start, want))) < 1e-6
    unbounded = StepBudget(100)
    assert unbounded.take(10 ** 6, 500) == 100 and not unbounded.open


@pytest.mark.parametrize("cost", [3, 10])
def test_prompt_work_beside_decode_rows_stays_within_the_cost_bound(cost):
    """A long prompt arrives while short requests decode: each step that has decode rows takes prompt tokens
    of at most `cost` (each at position c costing 1 + c / span), or a single token; steps without decode
    rows take up to max_prefill_tokens; the outputs equal those of unbounded steps."""
    from tp_engine.runtime.step_budget import StepBudget

    span = 8.0
    outputs = {}
    for bound in (0, cost):
        sched = Scheduler(PagePool(64, 4), 8, 64, 256, (EOS,), decode_cost=bound, attention_span=span)
        reqs = [RequestOutput(0, [3, 4], SamplingParams(max_new_tokens=40, ignore_eos=True)),
                RequestOutput(1, [5] * 2, SamplingParams(max_new_tokens=40, ignore_eos=True)),
                RequestOutput(2, list(range(1, 60)), SamplingParams(max_new_tokens=4, ignore_eos=True))]
        for r in reqs[:2]:
            sched.add(r)
        mixed = steps = 0
        while sched.has_work():
            steps += 1
            if steps == 4:  # the long prompt arrives while the others decode
                sched.add(reqs[2])
            plan = sched.schedule()
            starts = [r.num_cached for r in plan.reqs]
            decode = [n == 1 and r.decoding for r, n in zip(plan.reqs, plan.lens)]
            prompt = [(s, n) for s, n, d in zip(starts, plan.lens, decode) if not d]
            spent = sum(StepBudget(0, span=span).chunk_cost(s, n) for s, n in prompt)
            if bound and any(decode) and prompt:
                mixed += 1
                assert spent <= bound or prompt[0][1] == 1, (prompt, spent)
            issue(sched, plan)
            sched.update(plan, [next_token((r.out.output_ids or r.out.prompt_ids)[-1], s + n - 1)
                                for r, s, n in zip(plan.reqs, starts, plan.lens)])
        outputs[bound] = [r.output_ids for r in reqs]
        if bound:
            assert mixed > 5  # the long prompt was spread over many steps shared with decode rows
    assert outputs[cost] == outputs[0]


def test_graph_token_buckets_pad_a_step_by_at_most_an_eighth():
    """The token counts prompt steps are captured at (piecewise_graph.py)."""
    from tp_engine.runtime.piecewise_graph import token_buckets
    b = token_buckets(4096)
    assert b[:3] == [64, 128, 192] and b[-1] == 4096 and b == sorted(set(b))
    assert all((hi - lo) / lo <= 1 / 8 for lo, hi in zip(b, b[1:]) if lo >= 512)
    assert token_buckets(100) == [64, 100] and token_buckets(64) == [64]


def test_a_long_request_computes_each_page_key_once_in_all(monkeypatch):
    """Registering a request's pages for the prefix cache started from its first page every time (each prompt
    chunk, each page a decode row fills): O(pages) per call, O(pages**2) for a long request."""
    from tp_engine.runtime import scheduler
    walked = [0]
    real = scheduler.chain_keys

    def counting(*args, **kw):
        for key in real(*args, **kw):
            walked[0] += 1
            yield key
    monkeypatch.setattr(scheduler, "chain_keys", counting)
    sched = Scheduler(PagePool(600, 4), 4, 8, 600 * 4, (EOS,))  # a 400-token prompt in 50 chunks
    req = RequestOutput(0, list(range(1, 401)), SamplingParams(max_new_tokens=800, ignore_eos=True))
    sched.add(req)
    while sched.has_work():
        plan = sched.schedule()
        issue(sched, plan)
        sched.update(plan, [3] * len(plan.reqs))
    pages = len(req.prompt_ids + req.output_ids) // 4
    assert len(req.output_ids) == 800 and walked[0] <= 2 * pages, (walked[0], pages)


def test_requests_are_equal_only_to_themselves():
    """Finding a finished request among the running ones compared every field of each (a dataclass's __eq__):
    O(batch) tuple builds per request, which dominated steps at batch 4096."""
    p = SamplingParams()
    outs = [RequestOutput(0, [1, 2], p) for _ in range(2)]
    for a, b in (outs, [RequestState(out, 0) for out in outs]):
        assert a == a and a != b and [b].count(a) == 0
