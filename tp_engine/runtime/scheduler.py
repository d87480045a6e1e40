"""Continuous batching on rank 0: decode the running requests, fill the rest of the step's token budget with
prompt chunks, retire the finished, preempt (and later recompute) the newest when pages run out.

A step is a list of rows, one per request: a decode row (one token) or a prompt chunk. The policy
(docs/architecture.md): every decoding request gets its row first, one token of `max_prefill_tokens`
each; the request still prefilling, then waiting requests in order, fill what is left, and while
requests decode, at most `max_prefill_cost_while_decoding` of prompt work (step_budget.py). Only the last
prompt row of a step may stop short of its prompt's end (at most one request is part-way through its
prompt), and such a row's sampled token is ignored. A step with a prompt row is a prefill-type forward;
a step of decode rows only is a decode step (CUDA graphs).

At admission a request takes the cached pages holding the longest prefix of its tokens (page_pool.py)
and computes only the rest; at least its last token is always computed, for its logits, so the page
holding that token is never a shared one. Pages a prompt row fills are registered when they are
allocated, so a request admitted later in the same step already shares them: in the forward every layer
writes all of the step's new K/V before it attends.

Rank 0 plans step k+1 while the GPU still runs step k, so a request's newest token may not be known on
the host yet (`pending`). The message then names it by its row in step k's sampled tokens, which stay on
the device (`ref_token`). Stops by length are known ahead, so such a request is left out of step k+1;
an EOS or stop string is seen one step late and that request's extra token is dropped.
"""
from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from tp_engine.attention.kv_cache import pages_for
from tp_engine.runtime.page_pool import PagePool, chain_keys
from tp_engine.sampling.sampler import SamplingParams
from tp_engine.runtime.step_budget import StepBudget
from tp_engine.runtime.step_message import encode_step


def ref_token(row: int) -> int:
    """A message token id meaning 'the token sampled in row `row` of the previous step' (see step_tokens.resolve)."""
    return -1 - row


@dataclass(eq=False)  # equal only to itself: finding one among thousands must not compare their fields
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
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (at the last admission)
    slot: int = -1  # the request's page table on every rank (step_message.PageTables)
    sent_pages: int = 0  # how many of `pages` the other ranks' table of this slot holds
    keys: list[bytes] = field(default_factory=list, repr=False)  # content keys of the pages it registered
    chain: list[bytes] = field(default_factory=list, repr=False)  # keys of its first full pages, kept for good
    sample: int = 0  # which of the prompt's `n` samples this request is
    logprobs: list[dict] = field(default_factory=list)  # one entry per output token, with sampling.logprobs

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens (called per request per step)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_outputs(self) -> int:
        """Output tokens including those still on the device."""
        return len(self.output_ids) + self.pending

    @property
    def todo(self) -> int:
        """Tokens whose K/V are still to be computed (the pending one included)."""
        return self.num_tokens + self.pending - self.num_cached

    @property
    def decoding(self) -> bool:
        return self.todo == 1 and self.num_cached >= len(self.prompt_ids)

    def tokens(self, start: int, n: int) -> list[int]:
        """(prompt_ids + output_ids)[start:start + n] without building that list."""
        P = len(self.prompt_ids)
        if start >= P:
            return self.output_ids[start - P:start - P + n]
        if start + n <= P:
            return self.prompt_ids[start:start + n]
        return self.prompt_ids[start:] + self.output_ids[:start + n - P]


@dataclass
class Plan:
    is_prefill: bool  # a prompt row is in the step
    reqs: list[Request]
    lens: list[int] = field(default_factory=list)  # tokens of each row
    samples: list[bool] = field(default_factory=list)  # whether each row's sampled token is kept

    def __post_init__(self) -> None:
        if not self.lens:
            self.lens, self.samples = [1] * len(self.reqs), [True] * len(self.reqs)


class Scheduler:
    def __init__(self, pool: PagePool, max_batch_size: int, max_prefill_tokens: int, max_request_len: int,
                 eos_ids: tuple[int, ...], decode_cost: int = 0, attention_span: float = 4096.0) -> None:
        self.pool, self.page_size = pool, pool.page_size
        self.max_batch, self.max_prefill = max_batch_size, max_prefill_tokens
        self.decode_cost, self.span = decode_cost, attention_span  # 0: no cost bound (step_budget.py)
        # A request never grows past what the pool holds alone, so the oldest request can always progress.
        self.max_len = max_request_len
        self.eos_ids = set(eos_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; preemption takes from the end
        self.dropped: list[int] = []  # slots whose page tables the next message deletes
        self.num_preempted = 0
        self._slots = 0
        self._source: Iterator[Request] = iter(())

    def add(self, req: Request) -> None:
        assert len(req.prompt_ids) < self.max_len, "prompt length is checked before add()"
        req.slot, self._slots = self._slots, self._slots + 1
        self.waiting.append(req)

    def feed(self, requests: Iterable[Request]) -> None:
        """Requests to add as room comes: a job of any length holds a batch of them beyond those running."""
        self._source = iter(requests)

    def has_work(self) -> bool:
        for req in itertools.islice(self._source, max(self.max_batch - len(self.waiting), 0)):
            self.add(req)
        return bool(self.waiting or self.running)

    # ---- deciding a step ----

    def schedule(self) -> Plan:
        self._grow_for_decode()
        plan = Plan(False, [], [], [])
        for r in self.running:
            if r.decoding and not self.done_by_length(r):
                self._add_row(plan, r, 1)
        bounded = self.decode_cost > 0 and plan.reqs  # requests are decoding
        budget = StepBudget(self.max_prefill - len(plan.reqs), self.decode_cost if bounded else math.inf, self.span)
        unfinished = False  # a running request's prompt does not end in this step
        for r in self.running:  # the request part-way through its prompt, if any
            if not r.decoding:
                n = self._prompt_row(plan, r, budget) if budget.open else 0
                unfinished = unfinished or n < r.todo
        while budget.open and self.waiting and len(self.running) < self.max_batch and not unfinished:
            req = self.waiting[0]
            if req.pending:  # preempted while its last token was in flight: admit once that token is here
                break
            if not self._admit(req):
                break
            self.running.append(self.waiting.popleft())
            n = self._prompt_row(plan, req, budget)
            unfinished = not plan.samples[-1] if n else True
        return plan

    def done_by_length(self, r: Request) -> bool:
        """True when the tokens already sampled (some perhaps still in flight) end `r` by length."""
        return r.num_outputs >= r.params.max_new_tokens or r.num_tokens + r.pending >= self.max_len

    def _available(self) -> int:
        """Pages a prompt may take: one per running request stays in reserve, so that taking them does not
        force a preemption at the next decode step (a preempted request recomputes its whole prefix)."""
        return self.pool.num_free - len(self.running)

    def _admit(self, req: Request) -> bool:
        """Take the cached prefix of `req`; True when the pages for the rest of its tokens are free now."""
        n, S = req.num_tokens, self.page_size
        # never the page of the last token; the keys are computed up to the first miss (none without the cache)
        req.pages = self.pool.match(chain_keys(req.chain, req.tokens, S, (n - 1) // S))
        req.keys = req.chain[:len(req.pages)]
        req.num_cached = len(req.pages) * S
        if pages_for(n, S) - len(req.pages) > self._available():
            self._free_pages(req)
            return False
        req.cached_prompt_tokens = min(req.num_cached, len(req.prompt_ids))
        return True

    def _prompt_row(self, plan: Plan, r: Request, budget: StepBudget) -> int:
        """Add the next chunk of `r`'s prompt (what `budget` grants, as pages allow); returns its length."""
        S = self.page_size
        room = (len(r.pages) + max(self._available() + 1, 0)) * S - r.num_cached  # r's own reserve page too
        n = budget.take(r.num_cached, min(r.todo, room)) if min(r.todo, room) > 0 else 0
        if n <= 0:
            return 0
        r.pages += self.pool.alloc(pages_for(r.num_cached + n, S) - len(r.pages))
        self._add_row(plan, r, n)
        plan.is_prefill = True
        self._register(r, r.num_cached + n)  # pages this row fills: findable from now on
        return n

    def _register(self, r: Request, upto: int) -> None:
        """Make `r`'s full pages before token `upto` findable by content: their K/V is in the cache or will be
        once the issued steps ran, and their tokens are known on the host."""
        if self.pool.enabled:  # from the first page not yet registered: a long request registers many times
            first = len(r.keys)
            for i, key in enumerate(chain_keys(r.chain, r.tokens, self.page_size, upto // self.page_size, first),
                                    first):
                self.pool.register(r.pages[i], key)
                r.keys.append(key)

    def _add_row(self, plan: Plan, r: Request, n: int) -> None:
        plan.reqs.append(r)
        plan.lens.append(n)
        plan.samples.append(r.num_cached + n == r.num_tokens + r.pending)

    def _grow_for_decode(self) -> None:
        """Every decoding request needs a slot for one more token; preempt the newest when pages run out."""
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if not req.decoding or self.done_by_length(req) or req.num_cached < len(req.pages) * self.page_size:
                i += 1
            elif self.pool.num_free:
                req.pages += self.pool.alloc(1)
                i += 1
            else:
                victim = self.running.pop()  # newest; may be `req` itself
                self._free_pages(victim)
                self.waiting.appendleft(victim)  # recomputed from prompt + output when pages free up
                self.num_preempted += 1

    def _free_pages(self, r: Request) -> None:
        self._register(r, min(r.num_cached, r.num_tokens))  # a finished request's last full pages too
        self.pool.release(r.pages)
        if r.sent_pages:
            self.dropped.append(r.slot)
        r.pages, r.keys, r.num_cached, r.sent_pages = [], [], 0, 0

    # ---- the step message ----

    def issue(self, plan: Plan) -> torch.Tensor:
        """The step message for `plan`; from here on the scheduler counts the step as run."""
        ids, pos, loc, seq, ext, slots, keep, new = [], [], [], [], [], [], [], []
        S = self.page_size
        for row, (r, n, sampled) in enumerate(zip(plan.reqs, plan.lens, plan.samples)):
            start = r.num_cached
            if r.pending:  # a decode row whose input is still on the device
                assert n == 1, "a request with a token in flight only decodes"
                toks = [ref_token(r.out_row)]
            else:
                toks = r.tokens(start, n)
            ids += toks
            positions = range(start, start + n)
            pos += positions
            loc += [r.pages[p // S] * S + p % S for p in positions]
            seq.append(start + n)
            ext.append(n)
            slots.append(r.slot)
            keep.append(r.sent_pages)
            new.append(r.pages[r.sent_pages:])
            r.sent_pages = len(r.pages)
            r.num_cached = start + n
            known = min(r.num_cached, r.num_tokens)  # a decode row's pages: findable once their tokens are known
            if known // S > len(r.keys):  # on the host (a token still on the device is not, yet)
                self._register(r, known)
            if sampled:
                r.out_row = row
                r.pending += 1
        dropped, self.dropped = self.dropped, []
        return encode_step(plan.is_prefill, ids, pos, loc, seq, ext, slots, keep, new, dropped)

    # ---- after sampling ----

    def update(self, plan: Plan, tokens: list[int]) -> tuple[list[Request], list[Request]]:
        """Append each request's new token from the step `plan` issued. Returns (the requests that got one,
        those that finished; their pages are freed). A request that ended before this step drops its token."""
        got, done = [], []
        for r, tok, sampled in zip(plan.reqs, tokens, plan.samples):
            if not sampled:  # a prompt chunk short of the prompt's end
                continue
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
            self._free_pages(r)
        return reqs
