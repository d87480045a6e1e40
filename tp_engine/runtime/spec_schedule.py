"""The scheduler's side of speculative decoding: pages for the drafts before they are proposed, and the
verified tokens into the requests after.

A speculating step runs with every token of the step before it on the host (the engine reads them first), so
a decoding request's newest token is known and nothing of it is pending. Before the proposer drafts,
`reserve_drafts` takes each request's pages for its newest token and up to k drafts, without preempting
anyone: where pages are short a request drafts fewer, or none. The proposer writes its own K/V at those
positions (the draft model's, the EAGLE head's), the target then writes its K/V there in the verifying row.
After the target's verdict, `update_verified` appends each request's accepted drafts and the target's own
token one at a time, as plain decoding would, and gives back the pages past its newest token: the K/V of
rejected drafts is never read, and is overwritten when those positions are computed again.
"""
from __future__ import annotations

from typing import Callable

from tp_engine.attention.kv_cache import pages_for
from tp_engine.runtime.request import RequestOutput, RequestState
from tp_engine.runtime.scheduler import Scheduler
from tp_engine.runtime.step_plan import Plan


def reserve_drafts(sched: Scheduler, k: int,
                   may_draft: Callable[[RequestState], bool]) -> list[tuple[RequestState, int]]:
    """The decoding requests that may draft this step and how many tokens each (1 .. k), their pages taken.
    A request drafts no more than it may still output beyond the target's own token, nor past the longest
    request, nor into pages that are not free (one page per running request stays in reserve)."""
    S, out = sched.page_size, []
    spare = sched.pool.num_free - len(sched.running)
    for r in sched.running:
        if not r.decoding or r.pending or sched.done_by_length(r) or not may_draft(r):
            continue
        room = min(k, r.out.params.max_new_tokens - r.num_outputs - 1, sched.max_len - r.num_tokens - 1)
        if room <= 0:
            continue
        have = len(r.pages) * S - r.num_cached  # slots already held past the computed tokens
        need = pages_for(r.num_cached + 1 + room, S) - len(r.pages)
        if need > spare:  # as many drafts as the free pages hold
            room = min(room, have + spare * S - 1)
            need = max(pages_for(r.num_cached + 1 + room, S) - len(r.pages), 0)
        if room <= 0:
            continue
        if need > 0:
            r.pages += sched.pool.alloc(need)
            spare -= need
        out.append((r, room))
    return out


def update_verified(sched: Scheduler, plan: Plan, verified: list[list[int]],
                    on_token: Callable[[RequestOutput], bool] | None,
                    logprobs: list[list[dict]] | None = None) -> tuple[list, list]:
    """Append each verifying row's tokens (its accepted drafts, then the target's token) one by one, ending
    the request where plain decoding would (EOS, a stop id, the length, a stop string: `on_token` returns
    True); then count its computed tokens (its newest and the accepted drafts) and give back the pages past
    its newest token. `logprobs`: each row's entries, one per token, for the requests that asked (else
    empty). Returns (the requests that got tokens, those that finished; their pages are freed)."""
    got, done, S = [], [], sched.page_size
    for row, (r, start, tokens) in enumerate(zip(plan.reqs, plan.starts, verified)):
        r.pending -= 1
        out = r.out
        if out.finish_reason:
            continue
        got.append(r)
        entries = logprobs[row] if logprobs else ()
        for j, tok in enumerate(tokens):
            sched.take_token(r, tok)
            if entries:
                out.logprobs.append(entries[j])
            if on_token is not None and on_token(out):
                out.finish_reason = "stop"  # a stop string wins over the length limit reached on this token
            if out.finish_reason:
                done.append(r)
                break
        r.num_cached = min(start + len(tokens), r.num_tokens)  # the newest, then the accepted drafts
        if not out.finish_reason:
            keep = pages_for(r.num_tokens, S)
            sched.pool.release(r.pages[keep:])
            del r.pages[keep:]
            r.sent_pages = min(r.sent_pages, keep)
    return got, sched.retire(done)
