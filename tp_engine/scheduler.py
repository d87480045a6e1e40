"""Continuous batching on rank 0: admit requests as KV pages allow, decode the running ones, retire the
finished, preempt (and later recompute) the newest when pages run out.

Each step is encoded as one int64 message that rank 0 broadcasts; every rank decodes the same `Batch`
from it, so the batch order is identical everywhere and the other ranks need no scheduler state.

Rank 0 plans step k+1 while the GPU still runs step k, so a request's newest token may not be known on
the host yet (`pending`). The message then names it by its row in step k's sampled tokens, which stay on
the device (`ref_token`). Stops by length are known ahead, so such a request is left out of step k+1;
an EOS or stop string is seen one step late and that request's extra token is dropped.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from tp_engine.context import Batch
from tp_engine.kv_cache import PageAllocator, pages_for
from tp_engine.sampler import SamplingParams

STOP, STEP = 0, 1


def ref_token(row: int) -> int:
    """A message token id meaning 'the token sampled in row `row` of the previous step' (see Engine.resolve)."""
    return -1 - row


@dataclass
class Request:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache, or will be once the issued steps ran
    pending: int = 0  # tokens sampled by issued steps but not yet appended to output_ids
    out_row: int = 0  # row of this request in the newest issued step's sampled tokens
    finish_reason: str | None = None  # "stop" | "length" | "error"
    error: str | None = None
    text: str | None = None
    pages_cache: tuple | None = field(default=None, repr=False)  # see _page_array
    sample: int = 0  # which of the prompt's `n` samples this request is
    logprobs: list[dict] = field(default_factory=list)  # one entry per output token, with sampling.logprobs

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """len(all_ids) without building the list (called per request per step)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_outputs(self) -> int:
        """Output tokens including those still on the device."""
        return len(self.output_ids) + self.pending


@dataclass
class Plan:
    is_prefill: bool
    reqs: list[Request]


class Scheduler:
    def __init__(self, num_pages: int, page_size: int, max_batch_size: int, max_prefill_tokens: int,
                 max_request_len: int, eos_ids: tuple[int, ...]) -> None:
        self.alloc = PageAllocator(num_pages)
        self.page_size, self.max_batch, self.max_prefill = page_size, max_batch_size, max_prefill_tokens
        # A request never grows past what the pool holds alone, so the oldest request can always progress.
        self.max_len = max_request_len
        self.eos_ids = set(eos_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; preemption takes from the end
        self.num_preempted = 0

    def add(self, req: Request) -> None:
        assert len(req.prompt_ids) < self.max_len, "prompt length is checked before add()"
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- deciding a step ----

    def schedule(self) -> Plan:
        admitted, budget = [], self.max_prefill
        while self.waiting and len(self.running) + len(admitted) < self.max_batch:
            req = self.waiting[0]
            if req.pending:  # preempted while its last token was in flight: admit once that token is here
                break
            n = len(req.all_ids)
            if admitted and n > budget:
                break
            # Keep a page per running request in reserve, so admitting this one does not force a
            # preemption at the next decode step (a preempted request recomputes its whole prefix).
            need = pages_for(n, self.page_size)
            if need > self.alloc.num_free - len(self.running) - len(admitted):
                break
            req.pages = self.alloc.alloc(need)
            admitted.append(self.waiting.popleft())
            budget -= n
        if admitted:
            self.running.extend(admitted)
            return Plan(True, admitted)
        self._grow_for_decode()
        return Plan(False, [r for r in self.running if not self.done_by_length(r)])

    def done_by_length(self, r: Request) -> bool:
        """True when the tokens already sampled (some perhaps still in flight) end `r` by length."""
        return r.num_outputs >= r.params.max_new_tokens or r.num_tokens + r.pending >= self.max_len

    def _grow_for_decode(self) -> None:
        """Every running request needs a slot for one more token; preempt the newest when pages run out."""
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if self.done_by_length(req) or req.num_cached < len(req.pages) * self.page_size:
                i += 1
            elif self.alloc.num_free:
                req.pages += self.alloc.alloc(1)
                i += 1
            else:
                victim = self.running.pop()  # newest; may be `req` itself
                self.alloc.release(victim.pages)
                victim.pages, victim.num_cached = [], 0
                self.waiting.appendleft(victim)  # recomputed from prompt + output when pages free up
                self.num_preempted += 1

    # ---- the step message ----

    def issue(self, plan: Plan) -> torch.Tensor:
        """The step message for `plan`; from here on the scheduler counts the step as run."""
        ids, pos, loc, seq, ext, npages, pages = [], [], [], [], [], [], []
        S = self.page_size
        for row, r in enumerate(plan.reqs):
            if plan.is_prefill:
                assert not r.pending, "a request is admitted only once its tokens are all known"
                toks = r.all_ids[r.num_cached:]
            else:
                toks = [ref_token(r.out_row)] if r.pending else [r.output_ids[-1]]  # decoding: it has an output
            start = r.num_cached
            ids += toks
            positions = range(start, start + len(toks))
            pos += positions
            loc += [r.pages[p // S] * S + p % S for p in positions]
            seq.append(start + len(toks))
            ext.append(len(toks))
            npages.append(len(r.pages))
            pages.append(_page_array(r))
            r.num_cached, r.out_row = start + len(toks), row
            r.pending += 1
        head = np.array([STEP, int(plan.is_prefill), len(plan.reqs), len(ids)] + ids + pos + loc + seq + ext + npages,
                        dtype=np.int64)
        # the page tables are most of the message: joined from per-request arrays, not converted int by int
        return torch.from_numpy(np.concatenate([head, *pages]))

    # ---- after sampling ----

    def update(self, plan: Plan, tokens: list[int]) -> tuple[list[Request], list[Request]]:
        """Append each request's new token from the step `plan` issued. Returns (the requests that got one,
        those that finished; their pages are freed). A request that ended before this step drops its token."""
        got, done = [], []
        for r, tok in zip(plan.reqs, tokens):
            r.pending -= 1
            if r.finish_reason:
                continue
            r.output_ids.append(tok)
            got.append(r)
            p = r.params
            if (not p.ignore_eos and tok in self.eos_ids) or tok in p.stop_token_ids:
                r.finish_reason = "stop"
            elif len(r.output_ids) >= p.max_new_tokens or r.num_tokens >= self.max_len:
                r.finish_reason = "length"
            if r.finish_reason:
                done.append(r)
        return got, self.retire(done)

    def retire(self, reqs: list[Request]) -> list[Request]:
        for r in reqs:
            if r in self.running:
                self.running.remove(r)
            elif r in self.waiting:  # preempted while its last token was in flight
                self.waiting.remove(r)
            self.alloc.release(r.pages)
            r.pages = []
        return reqs


def _page_array(r: Request) -> np.ndarray:
    """r.pages as an int64 array, rebuilt only when the list changed (it grows one page per page_size steps).
    The cache keeps the list object itself, so a new list can never be mistaken for it."""
    cached = r.pages_cache
    if cached is None or cached[0] is not r.pages or cached[1] != len(r.pages):
        cached = r.pages_cache = (r.pages, len(r.pages), np.array(r.pages, dtype=np.int64))
    return cached[2]


def decode_message(msg: torch.Tensor, device: torch.device) -> Batch | None:
    """The inverse of `Scheduler.issue`, run on every rank; None for STOP."""
    cmd, is_prefill, B, N = msg[:4].tolist()
    if cmd == STOP:
        return None
    vals = msg[4:]
    ids, pos, loc = vals[:N], vals[N:2 * N], vals[2 * N:3 * N]
    rest = vals[3 * N:].tolist()
    seq, ext, npages, flat = rest[:B], rest[B:2 * B], rest[2 * B:3 * B], rest[3 * B:]
    tables, o = [], 0
    for n in npages:
        tables.append(flat[o:o + n])
        o += n
    if device.type == "cpu":
        last = torch.tensor(ext).cumsum(0) - 1
    else:  # one host-to-device copy instead of four
        host = np.empty(3 * N + B, dtype=np.int64)
        host[:3 * N] = vals[:3 * N].numpy()
        np.cumsum(ext, out=host[3 * N:])
        host[3 * N:] -= 1
        # from pinned memory, so the copy queues behind the GPU's work instead of waiting for it
        dev = torch.from_numpy(host).pin_memory().to(device, non_blocking=True)
        ids, pos, loc, last = dev[:N], dev[N:2 * N], dev[2 * N:3 * N], dev[3 * N:]
    return Batch(bool(is_prefill), ids, pos, loc, seq, ext, tables, last, page_ids=vals[3 * N + 3 * B:])


def stop_message() -> torch.Tensor:
    return torch.tensor([STOP, 0, 0, 0], dtype=torch.int64)
