"""The step message as a typed value (StepMessage: encode, decode, applied to the page tables), and the
scheduler's plan: made by schedule(), made a message by step_message(), counted as issued by commit()."""
import numpy as np
import torch

from tp_engine.runtime.page_pool import PagePool
from tp_engine.runtime.request import RequestOutput
from tp_engine.runtime.scheduler import Scheduler
from tp_engine.runtime.step_message import HEAD, PageTables, StepMessage, stop_message
from tp_engine.runtime.step_plan import ref_token, step_message
from tp_engine.sampling.sampler import SamplingParams


def as_lists(m: StepMessage) -> dict:
    """Every field of `m` as plain Python values, tensors and arrays included."""
    plain = lambda v: v.tolist() if isinstance(v, (torch.Tensor, np.ndarray)) else v  # noqa: E731
    return {k: ([plain(a) for a in v] if k == "appended" else plain(v)) for k, v in vars(m).items()}


def test_step_message_round_trip_with_dropped_slots_and_appended_pages():
    """A prompt chunk, a decode row reading the previous step's token and one starting a page, with two page
    tables dropped: decode(encode(m)) gives back every field, in O(B + D + P) ints beyond the token rows, and
    to_batch drops the tables, keeps each row's first pages and appends the new ones."""
    m = StepMessage(True, ids=[10, 11, 12, ref_token(0), ref_token(1)], positions=[0, 1, 2, 9, 12],
                    kv_slots=[44, 45, 46, 37, 20], seq_lens=[3, 10, 13], new_lens=[3, 1, 1], slots=[4, 2, 7],
                    keep=[0, 2, 3], appended=[[11], [], [5]], dropped=[1, 3])
    wire = m.encode()
    assert wire.dtype == torch.int64 and wire.numel() == HEAD + 3 * 5 + 5 * 3 + 2 + 2
    back = StepMessage.decode(wire)
    assert as_lists(back) == as_lists(m)
    assert StepMessage.decode(stop_message()) is None

    tables = PageTables()
    for slot, pages in {1: [0], 3: [6], 2: [8, 9], 7: [1, 2, 3, 4]}.items():
        tables.update(slot, 0, np.array(pages, dtype=np.int32))
    batch = back.to_batch(tables)
    assert len(tables) == 3 and [t.tolist() for t in batch.page_tables] == [[11], [8, 9], [1, 2, 3, 5]]
    assert batch.is_prefill and batch.input_ids.tolist() == [10, 11, 12, -1, -2]
    assert batch.seq_lens == [3, 10, 13] and batch.logit_rows.tolist() == [2, 3, 4]


def request_counts(sched: Scheduler) -> list[tuple]:
    return [(r.num_cached, r.pending, r.sent_pages, r.out_row, len(r.pages)) for r in sched.running]


def test_only_commit_counts_a_step_and_its_message_is_the_plans_alone():
    """schedule() takes the rows' pages but counts none of the step's tokens as computed, sampled or sent; the
    message built from the plan changes nothing and is the same before and after commit(), which advances each
    request by its row (a decode row's input names the previous step's sampled token, not yet read)."""
    sched = Scheduler(PagePool(16, 4), 4, 64, 64, ())
    for i, prompt in enumerate([[1, 2, 3, 4, 5], [6, 7]]):
        sched.add(RequestOutput(i, prompt, SamplingParams(max_new_tokens=8)))
    for step in range(3):
        before = request_counts(sched)
        plan = sched.schedule()
        if step:  # running requests: only a decode row's new page, if any, is taken before commit
            assert [c[:4] for c in request_counts(sched)] == [c[:4] for c in before]
        assert [(r.num_cached, r.sent_pages) for r in plan.reqs] == list(zip(plan.starts, plan.keep))
        counts, dropped = request_counts(sched), list(sched.dropped)
        message = step_message(plan, sched.page_size).encode()
        assert request_counts(sched) == counts and sched.dropped == dropped
        sched.commit(plan)
        assert torch.equal(step_message(plan, sched.page_size).encode(), message)
        for row, r in enumerate(plan.reqs):
            assert (r.num_cached, r.pending, r.sent_pages, r.out_row) == \
                (plan.starts[row] + plan.lens[row], step + 1, len(r.pages), row)
        decoded = StepMessage.decode(message)
        assert decoded.is_prefill == (step == 0) and decoded.seq_lens == [5 + step, 2 + step]
        if step:
            assert decoded.ids.tolist() == [ref_token(0), ref_token(1)]


def test_callbacks_get_each_requests_output_not_the_schedulers_state(tmp_path):
    """Engine.run hands on_token and on_finish the request's RequestOutput (prompt, tokens, result), never the
    scheduler's bookkeeping of it (pages, computed tokens)."""
    from helpers import make_checkpoint
    from tp_engine.llm import LLM

    llm = LLM(model=str(make_checkpoint(tmp_path / "m", vocab=256)), device="cpu")
    req, seen = RequestOutput(0, [5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True)), []
    llm.engine.run([req], on_token=lambda out: seen.append(out) and False, on_finish=seen.append)
    assert len(seen) == 4 and all(out is req for out in seen)
    assert len(req.output_ids) == 3 and req.finish_reason == "length"
