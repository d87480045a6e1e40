"""What one step runs (`Plan`), as the scheduler decides it, and its step message (`step_message`).

A plan holds everything its message needs, fixed when the scheduler made it: each row's first position and
token count, how many pages of its table the other ranks keep, and, for a decode row whose input is still on
the device, that token's row in the previous step. So the message is a function of the plan (and of its
requests' tokens and pages, which only grow while they run), before or after the scheduler counts the step
as issued (`Scheduler.commit`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tp_engine.runtime.request import RequestState
from tp_engine.runtime.step_message import StepMessage


def ref_token(row: int) -> int:
    """A message token id: 'the token sampled in row `row` of the previous step' (step_tokens.resolve)."""
    return -1 - row


@dataclass
class Plan:
    """One step: a row per request, decode rows first, as parallel lists. A plan lives until its tokens are
    read (two steps): an object per row would be thousands a step at large batches that the garbage
    collector promotes to its oldest generation, and each full collection scans the whole process.

    `ref_rows`: for a row whose input token is still on the device, that token's row in the previous step."""
    reqs: list[RequestState] = field(default_factory=list)  # each row's request
    starts: list[int] = field(default_factory=list)  # its first position (the tokens before it are computed)
    lens: list[int] = field(default_factory=list)  # tokens it computes in the step
    sampled: list[bool] = field(default_factory=list)  # its sampled token is kept (not a chunk cut short)
    keep: list[int] = field(default_factory=list)  # pages of its table the other ranks hold already
    ref_rows: list[int | None] = field(default_factory=list)  # None: its tokens are on the host
    is_prefill: bool = False  # a prompt row is in the step: a prefill-type forward
    # the first `verify` rows verify drafts: each computes its newest token and `drafts[row]` after it
    verify: int = 0
    drafts: list[list[int]] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)  # page tables deleted first: requests ended or preempted

    def add_row(self, req: RequestState, n: int, drafts: list[int] | None = None) -> None:
        """`req` computes its next `n` tokens in this step (its pages for them are taken); with `drafts`, a
        row that verifies them: its newest token, then the drafts (n = 1 + len(drafts)), before any other."""
        start, sent = req.num_cached, req.sent_pages
        if drafts is not None:
            assert self.verify == len(self.reqs) and n == 1 + len(drafts), "verifying rows come first"
            self.verify += 1
            self.drafts.append(drafts)
            self.is_prefill = True  # rows of several tokens
        self.reqs.append(req)
        self.starts.append(start)
        self.lens.append(n)
        self.sampled.append(start + n - len(drafts or ()) == req.num_tokens + req.pending)  # its last token
        self.keep.append(sent)
        self.ref_rows.append(req.out_row if req.pending else None)


def step_message(plan: Plan, page_size: int) -> StepMessage:
    """The message of `plan`'s step."""
    S = page_size
    ids, pos, loc = [], [], []
    for row, (r, start, n, ref) in enumerate(zip(plan.reqs, plan.starts, plan.lens, plan.ref_rows)):
        if ref is not None:  # a decode row whose input is still on the device
            assert n == 1, "a request with a token in flight only decodes"
            ids.append(ref_token(ref))
        elif row < plan.verify:  # its newest token, then its drafts
            ids += r.tokens(start, 1) + plan.drafts[row]
        else:
            ids += r.tokens(start, n)
        positions = range(start, start + n)
        pos += positions
        pages = r.pages
        loc += [pages[p // S] * S + p % S for p in positions]
    return StepMessage(plan.is_prefill, ids, pos, loc, [s + n for s, n in zip(plan.starts, plan.lens)],
                       plan.lens, [r.slot for r in plan.reqs], plan.keep,
                       [r.pages[k:] for r, k in zip(plan.reqs, plan.keep)], plan.dropped, plan.verify)
