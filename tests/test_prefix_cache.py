"""Prefix cache and chunked prefill against transformers: shared prefixes, identical prompts, a prompt that is
another's prefix, page sizes 4 and 16, a pool small enough to evict and preempt, two generate calls of one
LLM, long prompts computed in chunks while others decode; TP 1, 2 and 4."""
import json
import random

import pytest

from helpers import hf_generate, make_checkpoint, run_cli
from tp_engine.llm import LLM
from tp_engine.sampling.sampler import SamplingParams

NEW = 10
_rng = random.Random(3)
BASE = [_rng.randrange(1, 384) for _ in range(36)]  # 36 = 9 pages of 4: a page boundary
PROMPTS = [
    BASE + [5, 6, 7],
    BASE + [8, 9, 10, 11, 12],
    BASE,  # the prefix of the two above, a whole number of pages
    BASE,  # identical: fully cached but for its last token
    BASE[:21],
    [_rng.randrange(1, 384) for _ in range(19)],
    BASE[:33] + [40, 41],
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("prefix") / "m", vocab=384)


@pytest.fixture(scope="module")
def reference(ckpt):
    return hf_generate(ckpt, PROMPTS, NEW)


def generate(llm, prompts=PROMPTS):
    return llm.generate([{"input_ids": p} for p in prompts],
                        SamplingParams(max_new_tokens=NEW, ignore_eos=True))


def record_plans(llm) -> list:
    plans = []
    issue = llm.engine.issue
    llm.engine.issue = lambda sched, plan, *rest: \
        plans.append((list(plan.lens), plan.sampled[:], plan.is_prefill)) or issue(sched, plan, *rest)
    return plans


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_prefix_cache_equals_hf(ckpt, reference, page_size, prefix_cache):
    llm = LLM(model=str(ckpt), device="cpu", kv_cache={"page_size": page_size}, prefix_cache=prefix_cache)
    out = generate(llm)
    assert [o["output_token_ids"] for o in out] == reference
    cached = [o["cached_prompt_tokens"] for o in out]
    if not prefix_cache:
        assert cached == [0] * len(PROMPTS)
    else:  # all admitted in one step: the later ones share the pages the first ones write in that step
        S = page_size
        assert cached[0] == 0 and cached[1] == (36 // S) * S  # the full pages of BASE that request 0 writes
        assert cached[2] == cached[3] == (35 // S) * S  # never the page of a prompt's last token
        assert cached[4] == (20 // S) * S and cached[5] == 0 and cached[6] == 32
    # a second call of the same LLM finds the first call's pages
    again = generate(llm, PROMPTS[:1])
    assert again[0]["output_token_ids"] == reference[0]
    assert again[0]["cached_prompt_tokens"] == ((38 // page_size) * page_size if prefix_cache else 0)


def test_small_pool_evicts_and_preempts(ckpt, reference):
    """A pool of 16 pages of 4 tokens for 7 requests of up to 51 tokens: preemption, eviction of cached pages,
    re-admission with cache hits; the tokens do not change."""
    llm = LLM(model=str(ckpt), device="cpu", kv_cache={"page_size": 4, "num_pages": 16}, max_batch_size=4)
    evicted = []
    pool = llm.engine.pool
    alloc = pool.alloc
    pool.alloc = lambda n: evicted.append(max(0, n - len(pool.free))) or alloc(n)
    out = generate(llm)
    assert [o["output_token_ids"] for o in out] == reference
    assert llm.engine.num_preempted > 0 and sum(evicted) > 0
    assert sum(o["cached_prompt_tokens"] for o in out) > 0
    assert pool.num_free == pool.num_pages and not any(pool.refs)  # every reference returned



def test_max_batch_size_beyond_the_pool_runs(ckpt, reference):
    """Every running request holds a page, so at most 16 of 16 pages run: a max_batch_size of 10**12 is capped
    there, with no per-request buffers of that size, and the tokens are transformers'."""
    llm = LLM(model=str(ckpt), device="cpu", kv_cache={"page_size": 4, "num_pages": 16},
              max_batch_size=10**12)
    assert llm.engine.max_batch == 16
    assert [o["output_token_ids"] for o in generate(llm)] == reference


def test_preempted_count_is_the_latest_runs_even_when_it_fails(ckpt, reference):
    llm = LLM(model=str(ckpt), device="cpu", kv_cache={"page_size": 4, "num_pages": 16}, max_batch_size=4)
    generate(llm)
    assert llm.engine.num_preempted > 0

    def fail(out):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # the first request done ends the run, before any preemption
        llm.generate([{"input_ids": PROMPTS[5]}], SamplingParams(max_new_tokens=NEW), on_finish=fail)
    assert llm.engine.num_preempted == 0
    assert [o["output_token_ids"] for o in generate(llm)] == reference

def test_decoded_pages_are_found_by_a_later_prompt(ckpt, reference):
    """Pages filled while decoding are registered too: a second call whose prompt is a first call's prompt and
    output (a conversation's next turn) computes only past them; equal to transformers."""
    llm = LLM(model=str(ckpt), device="cpu", kv_cache={"page_size": 4})
    first = generate(llm, [PROMPTS[5]])[0]  # 19 prompt tokens + 10 outputs: pages up to token 28 are full
    assert first["output_token_ids"] == reference[5]
    turn = PROMPTS[5] + first["output_token_ids"] + [7, 8, 9]
    out = generate(llm, [turn])[0]
    assert out["output_token_ids"] == hf_generate(ckpt, [turn], NEW)[0]
    # 28 tokens: 7 full pages, all but the last output's K/V computed while decoding
    # (the last is never fed back)
    assert out["cached_prompt_tokens"] == 28


def test_blocked_request_hashes_its_pages_once(monkeypatch):
    """The head of the queue waits for pages over many steps: its page keys are computed once, not at every
    admission attempt."""
    import tp_engine.runtime.page_pool as pp
    from tp_engine.runtime.page_pool import PagePool
    from tp_engine.runtime.request import RequestOutput
    from tp_engine.runtime.scheduler import Scheduler

    calls = []
    real = pp.page_key
    monkeypatch.setattr(pp, "page_key", lambda parent, tokens: calls.append(1) or real(parent, tokens))
    sched = Scheduler(PagePool(14, 4), 8, 64, 64, (0,))
    first = list(range(1, 33))
    sched.add(RequestOutput(0, first, SamplingParams(max_new_tokens=8, ignore_eos=True)))  # 8 pages
    # its 8 pages and 6 more: they find the 8 but wait for the 6
    second = first + list(range(100, 124))
    sched.add(RequestOutput(1, second, SamplingParams(max_new_tokens=4, ignore_eos=True)))
    for _ in range(6):
        plan = sched.schedule()
        sched.commit(plan)
        sched.update(plan, [5] * len(plan.reqs))
    assert [r.out.index for r in sched.waiting] == [1]  # still waiting after six attempts
    # request 0's full pages (its prompt's 8 and the one it decoded), request 1's 8 hits and the miss: once
    assert len(calls) == 9 + 9


def test_chunked_prefill_while_others_decode(ckpt):
    """A long prompt computed in chunks of at most 8 tokens per step (decode rows included), in steps shared
    with requests that decode; equal to transformers."""
    long = [random.Random(9).randrange(1, 384) for _ in range(150)]
    prompts = [PROMPTS[5], PROMPTS[0], long, BASE + long[:30]]
    want = hf_generate(ckpt, prompts, NEW)
    for cache in (True, False):
        llm = LLM(model=str(ckpt), device="cpu", kv_cache={"page_size": 4}, max_prefill_tokens=8,
                  prefix_cache=cache)
        plans = record_plans(llm)
        out = generate(llm, prompts)
        assert [o["output_token_ids"] for o in out] == want
        assert all(sum(lens) <= 8 for lens, _, _ in plans)
        # mixed steps: decode rows next to a chunk whose sampled token is ignored
        assert any(prefill and 1 in lens and not all(samples) for lens, samples, prefill in plans)
        assert any(not prefill for _, _, prefill in plans)  # and pure decode steps


def test_long_prompt_in_cost_bounded_chunks_equals_hf(ckpt):
    """With a small max_prefill_cost_while_decoding, a long prompt among decoding requests is cut into chunks
    that shrink as its context grows (each costing at most the bound, step_budget.py); equal to
    transformers."""
    from tp_engine.runtime.step_budget import StepBudget

    long = [random.Random(11).randrange(1, 384) for _ in range(120)]
    prompts = [PROMPTS[0], PROMPTS[5], long]
    want = hf_generate(ckpt, prompts, NEW)
    # the first step admits the short prompts and the start of the long one; from the second on, they decode
    llm = LLM(model=str(ckpt), device="cpu", kv_cache={"page_size": 4}, max_prefill_cost_while_decoding=24,
              max_prefill_tokens=40)
    span = llm.engine.model_cfg.attention_span
    chunks = []
    issue = llm.engine.issue

    def record(sched, plan, *rest):
        chunks.extend((r.num_cached, n) for r, n in zip(plan.reqs, plan.lens)
                      if r.out.index == 2 and r.num_cached < len(long) and len(plan.reqs) > 1)
        return issue(sched, plan, *rest)

    llm.engine.issue = record
    out = generate(llm, prompts)
    assert [o["output_token_ids"] for o in out] == want
    assert len(chunks) >= 5 and sum(n for _, n in chunks) == len(long)
    assert all(StepBudget(0, span=span).chunk_cost(s, n) <= 24 or n == 1 for s, n in chunks)
    assert chunks[1][1] > chunks[-1][1]  # deeper chunks are shorter (the first came before any decoded)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_prefix_cache_and_chunks_equal_hf(ckpt, reference, tp, tmp_path):
    cfg = {"model": str(ckpt), "prompts": [{"input_ids": p} for p in PROMPTS], "max_prefill_tokens": 12,
           "kv_cache": {"page_size": 4, "num_pages": 20}, "max_batch_size": 5,
           "sampling": {"max_new_tokens": NEW, "ignore_eos": True}}
    proc, lines = run_cli(cfg, tmp_path, nproc=tp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line["output_token_ids"] for line in lines] == reference
    summary = json.loads(proc.stderr.split("summary: ")[1].splitlines()[0])
    assert summary["cached_prompt_tokens"] == sum(line["cached_prompt_tokens"] for line in lines) > 0


@pytest.mark.slow
def test_bench_shared_prefix_and_long_prompt_run_on_cpu(tmp_path):
    """launch/bench.py's prefix-cache and long-prompt workloads, on the demo model's shapes with small
    sizes."""
    import subprocess
    import sys

    from helpers import ROOT, assert_rate_ratio

    out = tmp_path / "bench.json"
    demo = ROOT / "configs" / "models" / "demo"
    cmd = [sys.executable, str(ROOT / "launch" / "bench.py"), "--model", str(demo),
           "--workload", "shared_prefix,long_prompt", "--engine", "ours", "--set", "device=cpu",
           "--set", "max_prefill_tokens=48", "--num-requests", "6", "--prefix-len", "40", "--suffix-min", "3",
           "--suffix-max", "9", "--shared-new-tokens", "4", "--long-len", "200", "--long-decoders", "4",
           "--prompt-len", "8", "--long-decode-tokens", "24", "--long-after", "2", "--long-costs", "16",
           "--long-spans", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    shared = res["shared_prefix"]
    assert shared["off"]["cached_prompt_tokens"] == 0 and shared["on"]["cached_prompt_tokens"] == 5 * 32
    assert shared["on"]["output_tokens"] == shared["off"]["output_tokens"] == 24
    assert_rate_ratio(shared["speedup"], shared["on"], shared["off"])  # on / off, as the docs say
    long = res["long_prompt"]
    assert long["chunked"]["max_prefill_tokens"] == 48 and long["unchunked"]["max_prefill_tokens"] == 204
    assert [long[m]["max_prefill_cost_while_decoding"] for m in ("chunked", "cost_16", "tokens_only")] == \
        [4096, 16, 0]
    assert long["cost_16"]["decode_tokens_while_prefilling"] > \
        long["tokens_only"]["decode_tokens_while_prefilling"]
    # --long-spans: the same cost with deep prompt tokens priced higher, so the prompt takes more, smaller
    # chunks
    assert long["cost_16_span_2"]["attention_span"] == 2 and long["cost_16"]["attention_span"] > 2
    assert long["cost_16_span_2"]["decode_tokens_while_prefilling"] > \
        long["cost_16"]["decode_tokens_while_prefilling"]
    # chunked: the decoders keep producing tokens in the steps that compute the long prompt
    assert long["chunked"]["decode_tokens_while_prefilling"] > \
        long["unchunked"]["decode_tokens_while_prefilling"]
