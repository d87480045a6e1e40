"""Drafting with a model (a draft model, an EAGLE head): its forwards, on every rank, before the target
verifies.

Rank 0 sends each drafting forward as a step message of its own (DRAFT_FIRST, DRAFT_NEXT), which the other
ranks run as they run the target's steps (`Engine.follow`). The first forward catches the proposer up on what
it has not seen of each request (its prompt at first, then the tokens the target accepted since): one row per
request, of as many tokens as that takes, whose last position drafts the first token. Each next forward is one
token a request, its input the token the forward before drafted, named by its row there (step_plan.ref_token)
and resolved on the device, so drafting never waits for the host. Rank 0 draws each draft from the proposer's
logits with the request's seeded draws (sampling/speculative.draft_draw) and shares it with every rank, and
reads all drafts once, after the last forward.
"""
from __future__ import annotations

import torch

from tp_engine import comm
from tp_engine.base.batch import Batch
from tp_engine.runtime.cuda_graph import GraphRunner
from tp_engine.runtime.request import RequestState
from tp_engine.runtime.step_message import (DRAFT_FIRST, DRAFT_NEXT, StepMessage, decode_message, device_rows,
                                            on_device)
from tp_engine.runtime.step_plan import ref_token
from tp_engine.runtime.step_tokens import resolve, sampling_inputs_of
from tp_engine.sampling.sampler import GREEDY_BELOW
from tp_engine.sampling.speculative import draft_draw


class Drafting:
    """A model proposer (`proposer`: speculative/draft_model.DraftModel or eagle.Eagle3Drafter) and the tokens
    its latest forward drew, on every rank."""

    def __init__(self, proposer, tp, max_batch: int, device: torch.device, ops) -> None:
        self.proposer, self.tp, self.device, self.ops = proposer, tp, device, ops
        self.last = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.graphs: GraphRunner | None = None  # the forwards of short rows, as CUDA graphs
        self.behind = 0  # the most tokens a request of the latest `propose` had to catch up on

    def capture(self, engine, max_batch: int) -> None:
        """CUDA graphs of the proposer's forwards of one-token rows (cuda_graph.py): every next forward, and
        a catch-up of a few tokens a request."""
        self.graphs = GraphRunner(engine, max_batch, self.proposer.kv, self.proposer.attn, self._graph_step,
                                  name="drafting")

    def forward(self, batch: Batch) -> torch.Tensor | None:
        """One drafting forward (every rank); logits of each row's last position on rank 0."""
        rows = self.graphs.rows(batch) if self.graphs is not None else None
        if rows is not None:
            logits, out = self.graphs.run(rows)
            if rows is not batch:  # one-token rows: the step's are each request's last
                pick = device_rows(batch.logit_rows, self.device)
                logits = logits if logits is None else logits[pick]
                out = out if out is None else out[pick]
        else:
            batch = on_device(batch, self.device)
            refs = -1 - batch.input_ids  # DRAFT_NEXT: each row's row in the forward before
            resolve(batch.input_ids, self.last, ops=self.ops)
            self.proposer.attn.prepare(batch)
            logits, out = self.proposer.step(batch, refs)
            if out is not None and batch.is_prefill:
                out = out[batch.logit_rows]
        self.proposer.keep(out)
        return logits

    def _graph_step(self, batch: Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A forward inside a CUDA graph: the drawn tokens and the K/V rows resolved on the device."""
        refs, plan = -1 - batch.input_ids, batch.plan["flashinfer"]
        resolve(batch.input_ids, self.last, (batch.out_loc, self.proposer.kv.page_size, plan.k_rows,
                                             plan.v_rows), self.ops)
        return self.proposer.step(batch, refs)

    def share(self, tokens: torch.Tensor | None, n: int) -> None:
        out = self.last[:n]
        if tokens is not None:
            out.copy_(tokens)
        comm.broadcast(out, self.tp)

    def follow(self, batch: Batch) -> None:
        """Ranks other than 0: run a drafting forward rank 0 sent."""
        self.forward(batch)
        self.share(None, batch.size)

    # ---- rank 0 ----

    def propose(self, engine, wants: list[tuple[RequestState, int]],
                budget: int) -> tuple[dict[RequestState, list[int]], dict[RequestState, torch.Tensor | None]]:
        """Draft up to k tokens for each (request, k) of `wants`, their pages taken; returns the drafts and,
        for sampled requests, the probabilities they were drawn from ([k, vocab]; None: greedy). A request
        whose catch-up does not fit in `budget` tokens catches up part of the way and drafts nothing."""
        shift, S = self.proposer.shift, engine.kv.page_size
        first, ks = [], []
        self.behind = 0
        for r, k in wants:
            end = r.num_tokens - shift  # its positions spec_cached .. end - 1 take known tokens
            self.behind = max(self.behind, end - r.spec_cached)
            n = min(end - r.spec_cached, budget)
            if n <= 0:
                continue
            budget -= n
            first.append((r, r.spec_cached, n))
            ks.append(k if r.spec_cached + n == end else 0)
        if not first:
            return {}, {}
        logits = self._send(engine, DRAFT_FIRST, [(r, s, n, r.tokens(s + shift, n)) for r, s, n in first], S)
        for r, s, n in first:
            r.spec_cached = s + n
        live = [i for i, k in enumerate(ks) if k]
        reqs, kk = [first[i][0] for i in live], [ks[i] for i in live]
        params, seeds, steps = sampling_inputs_of(reqs, engine.cfg["seed"])
        row_of = live[:]  # each drafting request's row in the latest forward
        active, drawn = list(range(len(reqs))), []  # drawn: (the requests, their tokens, their q) per forward
        for j in range(max(kk, default=0)):
            if j:  # one token each: the one it drew in the forward before
                active = [i for i in active if kk[i] > j]
                logits = self._send(engine, DRAFT_NEXT, [
                    (reqs[i], reqs[i].spec_cached - 1 + j, 1, [ref_token(row_of[i])]) for i in active], S)
                row_of = {i: n for n, i in enumerate(active)}
            rows = [row_of[i] for i in active]
            whole = rows == list(range(len(logits)))  # every row drafts (no request caught up only)
            sel = None if whole else torch.tensor(rows, device=logits.device)
            tokens, q = draft_draw(logits if whole else logits[sel], [params[i] for i in active],
                                   [seeds[i] for i in active], [steps[i] + j for i in active], self.ops)
            every = tokens
            if not whole:
                every = torch.zeros(len(logits), dtype=torch.int64, device=logits.device)
                every[sel] = tokens
            self.share(every, len(logits))
            drawn.append((active, tokens, q))
        host = torch.cat([t for _, t, _ in drawn]).tolist() if drawn else []  # one wait for all drafts
        drafts: dict = {r: [] for r in reqs}
        probs: dict = {r: [] for r in reqs}
        o = 0
        for active, _, q in drawn:
            for n, i in enumerate(active):
                drafts[reqs[i]].append(host[o + n])
                if q is not None:  # None: every row greedy
                    probs[reqs[i]].append(q[n])
            o += len(active)
        qs = {r: torch.stack(probs[r]) if p.temperature >= GREEDY_BELOW else None
              for r, p in zip(reqs, params)}
        return drafts, qs

    def _send(self, engine, command: int, rows: list[tuple[RequestState, int, int, list[int]]],
              page_size: int) -> torch.Tensor:
        """Send a drafting forward of `rows` (request, first position, tokens, input ids) and run it."""
        S = page_size
        ids, pos, loc, seq, lens, slots, keep, appended = [], [], [], [], [], [], [], []
        for r, start, n, row_ids in rows:
            ids += row_ids
            positions = range(start, start + n)
            pos += positions
            loc += [r.pages[p // S] * S + p % S for p in positions]
            seq.append(start + n)
            lens.append(n)
            slots.append(r.slot)
            keep.append(r.sent_pages)
            appended.append(r.pages[r.sent_pages:])
            r.sent_pages = len(r.pages)
        msg = StepMessage(any(n > 1 for n in lens), ids, pos, loc, seq, lens, slots, keep, appended, [],
                          command=command)
        batch = decode_message(comm.broadcast_ints(msg.encode(), self.tp), engine.tables)
        return self.forward(batch)
