"""Output constraints in rank 0's step loop (sampling/constraints.py has the grammars and matchers,
sampling/grammar_masks.py the mask thread).

A request's matcher lives in its `RequestState` and is fed the request's output tokens in order, once each,
so it follows `output_ids` through preemption and recompute (a recomputed request samples no token it already
has). A step's mask needs the token each of its decode rows took in the step before, which may still be on its
way to the host: `mask_step` hands the rows to the mask thread, which waits for that step's copy and feeds
the token, while the main thread takes in the step before (`Scheduler.update`, after `wait_fed`).
"""
from __future__ import annotations

import torch

from tp_engine.runtime.request import RequestState
from tp_engine.runtime.scheduler import Scheduler
from tp_engine.runtime.step_plan import Plan
from tp_engine.runtime.step_tokens import Issued
from tp_engine.sampling.constraints import Grammars, has_constraint
from tp_engine.sampling.grammar_masks import mask_logits


def mask_step(logits: torch.Tensor, plan: Plan, previous: Issued | None, grammars: Grammars | None,
              ops=None) -> torch.Tensor:
    """The step's logits [B, V] with the tokens each constrained row's grammar forbids set to -inf (the same
    tensor when no row is constrained), in stream order: on CUDA with the fused kernels the host does not
    wait for the masks. `previous`: the step issued before, whose tokens are still in flight.
    A request whose prompt opens a think block is free up to its `think_end` token, constrained after it;
    one whose first output token may open a block (`think_open`) is free in it if it does."""
    rows = [i for i, (r, s) in enumerate(zip(plan.reqs, plan.sampled)) if s and has_constraint(r.out.params)]
    if not rows:
        return logits
    if grammars is None:
        raise RuntimeError("this engine was built without a grammar compiler (Grammars)")
    masks = grammars.masks
    masks.wait_fed()  # the matchers' `fed` is the main thread's again
    feeds, slots = [], [-1] * len(plan.reqs)
    for j, i in enumerate(rows):
        r = plan.reqs[i]
        if r.matcher is None:
            r.matcher = grammars.matcher(r.out.params, r.out.think_end, r.out.think_open)
        toks, wants_next = r.matcher.behind(r.out.output_ids)
        ref = plan.ref_rows[i]  # its newest token is row `ref` of the step before
        feeds.append((r.matcher, toks, ref if wants_next else None))
        slots[i] = j
    in_flight = None
    if any(ref is not None for _, _, ref in feeds):
        in_flight = previous.host_tokens
    on_device, slot_rows = masks.submit(feeds, slots, in_flight, logits.device, ops)
    return mask_logits(logits, on_device, slot_rows, ops)


def follow_tokens(sched: Scheduler, got: list[RequestState], grammars: Grammars | None) -> list[RequestState]:
    """After a step's tokens reached the requests: feed each constrained one, and end (finish_reason "stop")
    those whose grammar has ended, EOS ignored or not. Returns the requests so ended. A matcher the mask
    thread is still feeding has ended only if its newest token may end it: only then is the mask thread
    waited for."""
    ended = []
    for r in got:
        m = r.matcher
        if m is None:
            continue
        if grammars.masks.feeding(m):
            if not m.may_end(r.out.output_ids[-1]):
                continue
            grammars.masks.wait_fed()
        m.catch_up(r.out.output_ids)
        if m.ended and not r.out.finish_reason:
            r.out.finish_reason = "stop"
            ended.append(r)
    return sched.retire(ended)


def mark_finished(r: RequestState, grammars: Grammars | None) -> None:
    """A finished constrained request says whether its output is a whole match of its grammar."""
    if r.matcher is not None and r.out.error is None:
        grammars.masks.settle(r.matcher)  # the mask thread may be filling its mask for a step it drops
        r.matcher.catch_up(r.out.output_ids)
        r.out.constraint = "complete" if r.matcher.complete() else "incomplete"
