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

A step goes through three calls: `schedule` chooses its rows (a `step_plan.Plan`) and takes the pages they
need (admitting, sharing cached pages, preempting: each choice depends on the pages the ones before it
took); `step_plan.step_message` turns the plan into the message; `commit` counts the step as issued. The
scheduler keeps one `RequestState` per request (request.py), which points at the `RequestOutput` the
caller sees.

Rank 0 plans step k+1 while the GPU still runs step k, so a request's newest token may not be known on
the host yet (`pending`). The message then names it by its row in step k's sampled tokens, which stay on
the device (`step_plan.ref_token`). Stops by length are known ahead, so such a request is left out of step
k+1; an EOS or stop string is seen one step late and that request's extra token is dropped.
"""
from __future__ import annotations

import itertools
import math
from collections import deque
from typing import Callable, Iterable, Iterator

from tp_engine.attention.kv_cache import pages_for
from tp_engine.runtime.page_pool import PagePool, chain_keys
from tp_engine.runtime.request import RequestOutput, RequestState
from tp_engine.runtime.step_budget import StepBudget
from tp_engine.runtime.step_plan import Plan


class Scheduler:
    def __init__(self, pool: PagePool, max_batch_size: int, max_prefill_tokens: int, max_request_len: int,
                 eos_ids: tuple[int, ...], decode_cost: int = 0, attention_span: float = 4096.0) -> None:
        self.pool, self.page_size = pool, pool.page_size
        self.max_batch, self.max_prefill = max_batch_size, max_prefill_tokens
        self.decode_cost, self.span = decode_cost, attention_span  # 0: no cost bound (step_budget.py)
        # A request never grows past what the pool holds alone, so the oldest request can always progress.
        self.max_len = max_request_len
        self.eos_ids = set(eos_ids)
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []  # in admission order; preemption takes from the end
        self.dropped: list[int] = []  # slots whose page tables the next message deletes
        self.num_preempted = 0
        self._slots = 0
        self._source: Iterator[RequestOutput] = iter(())
        self._take: Callable[[int], Iterable[RequestOutput]] | None = None  # a replica's share, see feed()

    def add(self, out: RequestOutput) -> RequestState:
        """Queue a request; returns the scheduler's state of it."""
        assert len(out.prompt_ids) < self.max_len, "prompt length is checked before add()"
        req = RequestState(out, self._slots)
        self._slots += 1
        self.waiting.append(req)
        return req

    def feed(self, requests: Iterable[RequestOutput]) -> None:
        """Requests to add as room comes: a job of any length holds a batch of them beyond those running.

        A source with a `take(n)` method (a data-parallel replica's share of the job, runtime/replicas.py) is
        asked every step, for as many as can start soon (none while some wait), and gives what it has."""
        self._take = getattr(requests, "take", None)
        self._source = iter(()) if self._take is not None else iter(requests)

    def has_work(self) -> bool:
        if self._take is not None:
            room = 0 if self.waiting else self.max_batch - len(self.running)
            for out in self._take(room):
                self.add(out)
        for out in itertools.islice(self._source, max(self.max_batch - len(self.waiting), 0)):
            self.add(out)
        return bool(self.waiting or self.running)

    # ---- deciding a step ----

    def schedule(self, drafts: dict[RequestState, list[int]] | None = None) -> Plan:
        """The next step's rows. The pages they need are taken here (admission, prefix-cache hits, new pages,
        preemption); the step counts as issued only at `commit`. `drafts`: tokens proposed for decoding
        requests (their pages taken by spec_schedule.reserve_drafts), verified in rows that come first."""
        decoding = self._grow_for_decode()
        plan = Plan()
        drafts = drafts or {}  # each request's drafts, never empty lists
        if drafts:
            for r, d in zip(self.running, decoding):
                if d and r in drafts and not self.done_by_length(r):
                    plan.add_row(r, 1 + len(drafts[r]), drafts[r])
        for r, d in zip(self.running, decoding):
            if d and r not in drafts and not self.done_by_length(r):
                plan.add_row(r, 1)
        bounded = self.decode_cost > 0 and plan.reqs  # requests are decoding
        decode_cost = self.decode_cost if bounded else math.inf
        budget = StepBudget(self.max_prefill - sum(plan.lens), decode_cost, self.span)
        unfinished = False  # a running request's prompt does not end in this step
        for r, d in zip(self.running, decoding):  # the request part-way through its prompt, if any
            if not d:
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
            unfinished = not plan.sampled[-1] if n else True
        plan.dropped = self.dropped[:]  # preempted ones included
        return plan

    def done_by_length(self, r: RequestState) -> bool:
        """True when the tokens already sampled (some perhaps still in flight) end `r` by length."""
        return r.num_outputs >= r.out.params.max_new_tokens or r.num_tokens + r.pending >= self.max_len

    def _available(self) -> int:
        """Pages a prompt may take: one per running request stays in reserve, so that taking them does not
        force a preemption at the next decode step (a preempted request recomputes its whole prefix)."""
        return self.pool.num_free - len(self.running)

    def _admit(self, req: RequestState) -> bool:
        """Take the cached prefix of `req`; True when the pages for the rest of its tokens are free now."""
        n, S = req.num_tokens, self.page_size
        # never the page of the last token; the keys are computed up to the first miss (none without the
        # cache)
        req.pages = self.pool.match(chain_keys(req.chain, req.tokens, S, (n - 1) // S))
        req.keys = req.chain[:len(req.pages)]
        req.num_cached = len(req.pages) * S
        if pages_for(n, S) - len(req.pages) > self._available():
            self._free_pages(req)
            return False
        req.out.cached_prompt_tokens = min(req.num_cached, len(req.out.prompt_ids))
        return True

    def _prompt_row(self, plan: Plan, r: RequestState, budget: StepBudget) -> int:
        """Add the next chunk of `r`'s prompt (what `budget` grants, as pages allow); returns its length."""
        S = self.page_size
        room = (len(r.pages) + max(self._available() + 1, 0)) * S - r.num_cached  # r's own reserve page too
        n = budget.take(r.num_cached, min(r.todo, room)) if min(r.todo, room) > 0 else 0
        if n <= 0:
            return 0
        r.pages += self.pool.alloc(pages_for(r.num_cached + n, S) - len(r.pages))
        plan.add_row(r, n)
        plan.is_prefill = True
        self._register(r, r.num_cached + n)  # pages this row fills: findable from now on
        return n

    def _register(self, r: RequestState, upto: int) -> None:
        """Make `r`'s full pages before token `upto` findable by content: their K/V is in the cache or will be
        once the issued steps ran, and their tokens are known on the host."""
        if self.pool.enabled:  # from the first page not yet registered: a long request registers many times
            first = len(r.keys)
            unregistered = chain_keys(r.chain, r.tokens, self.page_size, upto // self.page_size, first)
            for i, key in enumerate(unregistered, first):
                self.pool.register(r.pages[i], key)
                r.keys.append(key)

    def _grow_for_decode(self) -> list[bool]:
        """Every decoding request needs a slot for one more token; preempt the newest when pages run out.
        Returns whether each running request decodes (rather than computes its prompt)."""
        i, decoding = 0, []
        while i < len(self.running):
            req = self.running[i]
            d = req.decoding
            if d and not self.done_by_length(req) and req.num_cached >= len(req.pages) * self.page_size:
                if not self.pool.num_free:  # its last page is full and no page is free
                    victim = self.running.pop()  # newest; may be `req` itself
                    self._free_pages(victim)
                    self.waiting.appendleft(victim)  # recomputed from prompt + output when pages free up
                    self.num_preempted += 1
                    continue
                req.pages += self.pool.alloc(1)
            decoding.append(d)
            i += 1
        return decoding

    def _free_pages(self, r: RequestState) -> None:
        self._register(r, min(r.num_cached, r.num_tokens))  # a finished request's last full pages too
        self.pool.release(r.pages)
        if r.sent_pages:
            self.dropped.append(r.slot)
        r.pages, r.keys, r.num_cached, r.sent_pages, r.spec_cached = [], [], 0, 0, 0

    # ---- counting it as issued ----

    def commit(self, plan: Plan) -> None:
        """Count `plan`'s step as issued: its rows' tokens as computed (their K/V is written when it
        runs), their pages as sent to the other ranks, their sampled tokens as pending; its dropped tables as
        gone."""
        S = self.page_size
        for row, (r, start, n, sampled) in enumerate(zip(plan.reqs, plan.starts, plan.lens, plan.sampled)):
            r.sent_pages = len(r.pages)
            r.num_cached = start + n
            # a decode row's pages: findable once their tokens are known
            known = min(r.num_cached, r.num_tokens)
            if known // S > len(r.keys):  # on the host (a token still on the device is not, yet)
                self._register(r, known)
            if sampled:
                r.out_row = row
                r.pending += 1
        del self.dropped[:len(plan.dropped)]

    # ---- after sampling ----

    def update(self, plan: Plan, tokens: list[int]) -> tuple[list[RequestState], list[RequestState]]:
        """Append each request's new token from the step `plan` issued. Returns (the requests that got one,
        those that finished; their pages are freed). A request that ended before this step drops its token."""
        got, done = [], []
        for r, tok, sampled in zip(plan.reqs, tokens, plan.sampled):
            if not sampled:  # a prompt chunk short of the prompt's end
                continue
            r.pending -= 1
            if r.out.finish_reason:
                continue
            got.append(r)
            if self.take_token(r, tok):
                done.append(r)
        return got, self.retire(done)

    def take_token(self, r: RequestState, tok: int) -> bool:
        """Append `tok` to `r`'s output; True when it ends `r` (its finish_reason set)."""
        out = r.out
        out.output_ids.append(tok)
        p = out.params
        if (not p.ignore_eos and tok in self.eos_ids) or tok in p.stop_token_ids:
            out.finish_reason = "stop"
        elif len(out.output_ids) >= p.max_new_tokens or r.num_tokens >= self.max_len:
            out.finish_reason = "length"
        return out.finish_reason is not None

    def retire(self, reqs: list[RequestState]) -> list[RequestState]:
        for r in reqs:
            if r in self.running:
                self.running.remove(r)
            elif r in self.waiting:  # preempted while its last token was in flight
                self.waiting.remove(r)
            self._free_pages(r)
        return reqs
