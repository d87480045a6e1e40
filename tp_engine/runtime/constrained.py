"""Output constraints in rank 0's step loop (sampling/constraints.py has the grammars and matchers).

A request's matcher lives in its `RequestState` and is fed the request's output tokens in order, once each,
so it follows `output_ids` through preemption and recompute (a recomputed request samples no token it already
has). A step's mask needs the token each of its decode rows took in the step before, which may still be on its
way to the host: `mask_step` waits for that step's copy (queued before this step's forward, so the wait
overlaps the forward on the GPU) and feeds it ahead of `Scheduler.update`.
"""
from __future__ import annotations

import time

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
    tensor when no row is constrained). `previous`: the step issued before, whose tokens are still in flight.
    A request whose prompt opens a think block is free up to its `think_end` token, constrained after it;
    one whose first output token may open a block (`think_open`) is free in it if it does."""
    rows = [i for i, (r, s) in enumerate(zip(plan.reqs, plan.sampled)) if s and has_constraint(r.out.params)]
    if not rows:
        return logits
    if grammars is None:
        raise RuntimeError("this engine was built without a grammar compiler (Grammars)")
    clock = time.perf_counter
    waited = clock()
    in_flight = None
    if any(plan.ref_rows[i] is not None for i in rows):  # a newest token is a row of the step before
        if previous.done is not None:
            previous.done.synchronize()
        in_flight = previous.tokens.tolist()
    start = clock()
    masks = grammars.masks
    buffer = masks.buffer(len(rows), len(plan.reqs), logits.is_cuda)
    active = []  # (its row of the buffer, matcher) of the rows whose next token the grammar decides
    for j, i in enumerate(rows):
        r = plan.reqs[i]
        if r.matcher is None:
            r.matcher = grammars.matcher(r.out.params, r.out.think_end, r.out.think_open)
        ref = plan.ref_rows[i]  # its newest token is row `ref` of the step before
        r.matcher.catch_up(r.out.output_ids, None if ref is None else in_flight[ref])
        if r.matcher.active:  # else free text (a think block) or a token the request drops
            active.append((j, r.matcher))
    if not active:
        return logits
    fed = clock()
    masks.fill(buffer, active)
    filled = clock()
    slots = [-1] * len(plan.reqs)
    for j, _ in active:
        slots[rows[j]] = j
    on_device, slot_rows = masks.to_device(len(rows), slots, logits.device)
    out = mask_logits(logits, on_device, slot_rows, ops)
    grammars.count(wait=start - waited, take=fed - start, fill=filled - fed, apply=clock() - filled)
    return out


def follow_tokens(sched: Scheduler, got: list[RequestState]) -> list[RequestState]:
    """After a step's tokens reached the requests: feed each constrained one, and end (finish_reason "stop")
    those whose grammar has ended, EOS ignored or not. Returns the requests so ended."""
    ended = []
    for r in got:
        if r.matcher is not None:
            r.matcher.catch_up(r.out.output_ids)
            if r.matcher.ended and not r.out.finish_reason:
                r.out.finish_reason = "stop"
                ended.append(r)
    return sched.retire(ended)


def mark_finished(r: RequestState) -> None:
    """A finished constrained request says whether its output is a whole match of its grammar."""
    if r.matcher is not None and r.out.error is None:
        r.matcher.catch_up(r.out.output_ids)
        r.out.constraint = "complete" if r.matcher.complete() else "incomplete"
