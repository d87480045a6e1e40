"""A speculating step on rank 0: drafts proposed, verified by the target in one forward, the accepted tokens
into the requests.

It runs with no step in flight (the engine reads the step before it first): each request's newest token is
on the host, so the proposer can read it and the step's outcome, a variable number of tokens per request, is
known before the next step is planned. The step's rows: one per drafting request, its newest token and its
drafts (the target's logits at every one of them), then the other decoding requests and prompt chunks as in
any step. Rank 0 accepts each request's drafts by rejection sampling (sampling/speculative.verify: greedy
output is the target's own, sampled output keeps the target's distribution), samples the other rows as
plain steps do, and shares every row's last token with the other ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from tp_engine import comm
from tp_engine.runtime.constrained import mark_finished, mask_step
from tp_engine.runtime.request import RequestOutput, RequestState
from tp_engine.runtime.scheduler import Scheduler
from tp_engine.runtime.spec_schedule import update_verified
from tp_engine.runtime.step_message import decode_message
from tp_engine.runtime.step_plan import Plan, step_message
from tp_engine.runtime.step_tokens import Issued, sampling_inputs
from tp_engine.sampling.sampler import sample, token_logprobs
from tp_engine.sampling.speculative import verify


def tail(plan: Plan, start: int) -> Plan:
    """The rows of `plan` from `start` on, as a plan of their own (for the plain rows of a verifying step)."""
    return replace(plan, reqs=plan.reqs[start:], starts=plan.starts[start:], lens=plan.lens[start:],
                   sampled=plan.sampled[start:], keep=plan.keep[start:], ref_rows=plan.ref_rows[start:],
                   verify=0, drafts=[])


@dataclass
class Verified:
    """A verifying step's outcome on rank 0, before the requests take it."""
    plan: Plan
    tokens: list[list[int]]  # each verifying row's: its accepted drafts, then the target's token
    logprobs: list[list[dict]] | None  # their entries, for the requests that asked
    rest: Issued  # the plain rows, as a plain step's (their tokens and logprobs on the host)


def issue_verified(engine, sched: Scheduler, plan: Plan,
                   qs: dict[RequestState, torch.Tensor | None]) -> Verified:
    """Run `plan` (its first `plan.verify` rows verify drafts) on every rank and decide its tokens: the work
    the ranks share. `qs`: the probabilities each sampled request's drafts were drawn from."""
    V = plan.verify
    params, seeds, steps = sampling_inputs(plan, engine.cfg["seed"])  # before commit counts the step
    message = step_message(plan, sched.page_size)
    sched.commit(plan)
    batch = decode_message(comm.broadcast_ints(message.encode(), engine.tp), engine.tables)
    logits = engine.forward(batch)
    R = sum(plan.lens[:V])
    ops = engine.ops
    verified = verify(logits[:R], plan.lens[:V], plan.drafts, [qs.get(r) for r in plan.reqs[:V]],
                      params[:V], seeds[:V], steps[:V], ops)
    if engine.spec.forced_length is not None:  # launch/bench.py --force-accept: timing only, not the tokens
        verified = engine.spec.forced(plan.drafts, verified)
    rest, plain = tail(plan, V), logits[R:]
    tokens = torch.zeros(0, dtype=torch.int64, device=logits.device)
    logprobs: tuple = ()
    if rest.reqs:
        allowed = mask_step(plain, rest, None, engine.grammars, ops)
        tokens = sample(allowed, params[V:], seeds[V:], steps[V:], ops)
        k = max(p.logprobs for p in params[V:])
        logprobs = token_logprobs(plain, tokens, k, ops) if k else ()
    last = torch.tensor([t[-1] for t in verified], dtype=torch.int64, device=logits.device)
    engine.share_tokens(torch.cat([last, tokens]), len(plan.reqs))  # each row's newest token
    entries = _verified_logprobs(plan, logits, verified, params, ops)
    rest_step = Issued(rest, tokens.cpu(), None, tuple(t.cpu() for t in logprobs))
    return Verified(plan, verified, entries, rest_step)


def take_verified(engine, sched: Scheduler, v: Verified, on_token: Callable[[RequestOutput], bool] | None,
                  on_finish: Callable[[RequestOutput], None] | None) -> None:
    """Give a verifying step's tokens to the requests and the callbacks (rank 0's host alone)."""
    _, done = update_verified(sched, v.plan, v.tokens, on_token, v.logprobs)
    for r in done:
        mark_finished(r, engine.grammars)
        if on_finish is not None:
            on_finish(r.out)
    if v.rest.plan.reqs:
        engine.take_tokens(sched, v.rest, on_token, on_finish)


def _verified_logprobs(plan: Plan, logits: torch.Tensor, verified: list[list[int]], params: list,
                       ops) -> list[list[dict]] | None:
    """For each verifying row, a logprobs entry per token it verified (from the target's logits at that
    token's row), for the requests that asked for them; None when none did."""
    V = plan.verify
    k = max((p.logprobs for p in params[:V]), default=0)
    if not k:
        return None
    rows, toks, row = [], [], 0
    for i in range(V):
        rows += range(row, row + len(verified[i]))
        toks += verified[i]
        row += plan.lens[i]
    dev = logits.device
    chosen, ids, vals = (t.tolist() for t in token_logprobs(
        logits[torch.tensor(rows, device=dev)], torch.tensor(toks, device=dev), k, ops))
    entries, o = [], 0
    for i in range(V):
        want, n = params[i].logprobs, len(verified[i])
        entries.append([{"token": toks[o + j], "logprob": chosen[o + j],
                         "top": [[a, b] for a, b in zip(ids[o + j][:want], vals[o + j][:want])]}
                        for j in range(n)] if want else [])
        o += n
    return entries
