"""Speculative decoding in the engine (config `speculative`): the proposer, and rank 0's choice of when to
speculate and by how much.

The proposer drafts up to k tokens for each decoding request: n-gram lookup in the request's own tokens (on
rank 0's host, no weights), a draft model or an EAGLE-3 head (forwards on every rank: runtime/drafting.py).
The target verifies them in one step (runtime/spec_step.py). Each step the policy (speculative/policy.py)
chooses k from what steps of each k have gained per second at this batch size; at k = 0 the engine runs
plain steps, overlapped with the host's work as usual. A request with an output constraint does not draft:
it decodes as without speculation, in the same steps.
"""
from __future__ import annotations

import time
import weakref
from typing import Callable

import torch

from tp_engine.attention import fuses_qkv
from tp_engine.base.batch import Batch
from tp_engine.runtime.drafting import Drafting
from tp_engine.runtime.request import RequestOutput, RequestState
from tp_engine.runtime.scheduler import Scheduler
from tp_engine.runtime.spec_schedule import reserve_drafts
from tp_engine.runtime.spec_step import issue_verified, take_verified
from tp_engine.runtime.step_plan import Plan
from tp_engine.sampling.constraints import has_constraint
from tp_engine.speculative.draft_model import DraftModel
from tp_engine.speculative.eagle import Eagle3Drafter
from tp_engine.speculative.ngram import NgramIndex
from tp_engine.speculative.policy import SpecPolicy


class Speculation:
    def __init__(self, engine) -> None:
        """Load the proposer's weights (before the KV pool is sized, so the memory plan counts them)."""
        cfg = engine.cfg
        spec = self.spec = cfg["speculative"]
        self.policy = SpecPolicy(spec["num_tokens"], spec["adaptive"])
        self.proposer = self.drafting = None
        if spec["method"] == "draft":
            self.proposer = DraftModel(cfg, engine.model_cfg, engine.tp.size, engine.tp.rank, engine.dtype,
                                       engine.device)
        elif spec["method"] == "eagle3":
            self.proposer = Eagle3Drafter(cfg, engine.model_cfg, engine.model, engine.dtype, engine.device)
        self.capture = getattr(self.proposer, "capture", ())  # target layers an EAGLE head reads
        self.ngrams: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> NgramIndex
        # the latest plain step, while its time is not yet known: its issue, its decoding requests, and
        # whether it only decodes (a step with prompt tokens is not timed for the policy)
        self._plain: tuple[float, int, bool] | None = None
        self._decoding = 0  # decoding requests when `choose` last looked
        # launch/bench.py --force-accept: the mean tokens a verifying request takes per step, whatever the
        # target says (random weights accept almost nothing); never set by a config
        self.forced_length: float | None = None
        self._credit = 0.0

    def bytes_per_page(self, page_size: int) -> int:
        """What the proposer keeps per KV page (its own K/V, an EAGLE head's features)."""
        return self.proposer.bytes_per_page(page_size) if self.proposer is not None else 0

    def allocate(self, engine) -> None:
        """The proposer's caches, once the engine's KV pool is sized, and its kernels."""
        if self.proposer is None:
            return
        backend = engine.cfg["attention_backend"]
        self.proposer.bind(engine.ops, fuses_qkv(backend, engine.device, engine.ops))
        kv = engine.kv
        self.proposer.allocate(kv.num_pages, kv.page_size, backend, engine.max_batch, engine.ops)
        self.drafting = Drafting(self.proposer, engine.tp, engine.max_batch, engine.device, engine.ops)

    def capture_graphs(self, engine, max_batch: int) -> None:
        """The proposer's CUDA graphs, after the target's (runtime/engine_setup.capture_graphs)."""
        if self.drafting is not None:
            self.drafting.capture(engine, max_batch)

    def follow(self, batch: Batch) -> None:
        """Ranks other than 0: a drafting forward rank 0 sent."""
        self.drafting.follow(batch)

    def store(self, batch: Batch, aux: list[torch.Tensor]) -> None:
        """After a target forward that kept the layers' inputs (`capture`): an EAGLE head's features."""
        if aux:
            self.proposer.store_features(batch, aux)

    # ---- rank 0 ----

    def choose(self, sched: Scheduler) -> int:
        """Drafts per request for the next step (0: a plain one, as when no request decodes)."""
        self._decoding = decoding = sum(r.decoding for r in sched.running)
        return self.policy.choose(decoding) if decoding else 0

    def plain_step(self, plan: Plan) -> None:
        """A plain step `plan` is to be issued (after `choose` said 0). Steps overlap, so the time between two
        issues is one step's: the plain step before it, if any, took the time since its issue."""
        now = time.perf_counter()
        self._end_plain(now)
        self._plain = now, self._decoding, bool(plan.reqs) and all(n == 1 for n in plan.lens)
        self.policy.count(0, 0, 0)

    def _end_plain(self, now: float) -> None:
        """The latest plain step has ended by `now`: its time to the policy."""
        if self._plain is not None:
            since, decoding, pure = self._plain
            if pure:
                self.policy.record(decoding, 0, 1.0, now - since)
            self._plain = None

    def step(self, engine, sched: Scheduler, k: int, on_token: Callable[[RequestOutput], bool] | None,
             on_finish: Callable[[RequestOutput], None] | None) -> Plan | None:
        """A speculating step of up to `k` drafts a request, run to its end (no step may be in flight).
        Returns None, or, when no request drafted anything, the plan of a plain step for the engine to
        issue."""
        t0 = time.perf_counter()
        self._end_plain(t0)  # the engine has read the step before
        decoding, probing = self._decoding, self.policy.probe is not None
        with engine.shared_step():  # the ranks run the drafting and the verifying forwards together
            wants = reserve_drafts(sched, k, self._may_draft(sched, probing))
            if self.proposer is None:
                drafts, qs = {r: self._ngram(r, n) for r, n in wants}, {}
            else:
                drafts, qs = self.drafting.propose(engine, wants, engine.cfg["max_prefill_tokens"])
            drafts = {r: d for r, d in drafts.items() if d}
            # a proposer that sat out plain steps caught up on them first: a switch, not a steady step
            switching = self.drafting is not None and self.drafting.behind > self.policy.k_max + 2
            plan = sched.schedule(drafts)
            if not plan.verify:  # nothing to draft: a plain step, issued by the engine
                if switching and not probing:  # a catch-up longer than the step's budget: it goes on
                    self.policy.record_switch(decoding, k, 1.0, 0.0)
                elif not probing:  # a probe times nothing
                    self.policy.record_empty(decoding, k)
                return plan
            outcome = issue_verified(engine, sched, plan, qs)
        take_verified(engine, sched, outcome, on_token, on_finish)
        verified, V = outcome.tokens, plan.verify
        accepted = sum(len(v) - 1 for v in verified)
        if getattr(self.proposer, "keeps_drafted", False):  # its K/V of accepted drafts holds
            for r, d, v in zip(plan.reqs, plan.drafts, verified):
                r.spec_cached += min(len(v) - 1, len(d) - 1)
        self.policy.count(sum(len(d) for d in plan.drafts), accepted, V)
        if probing:  # a few requests drafted: the step times no k, only what the probe cost
            self.policy.record_probe(decoding, time.perf_counter() - t0)
            return None
        gained = (accepted + len(plan.lens)) / len(plan.lens)
        seconds = time.perf_counter() - t0
        if any(n > 1 for n in plan.lens[V:]):  # prompt rows beside the verifying ones: not timed
            seconds = 0.0
        if switching:
            self.policy.record_switch(decoding, k, gained, seconds)
        elif seconds:
            self.policy.record(decoding, k, gained, seconds)
        return None

    def _may_draft(self, sched: Scheduler, probing: bool) -> Callable[[RequestState], bool]:
        """Which decoding requests draft: those without an output constraint; in a probe, only the
        `policy.probe_rows` of them whose proposers are least behind (the cheapest catch-up), which measure
        the acceptance."""
        def free(r: RequestState) -> bool:
            return not has_constraint(r.out.params)
        if not probing:
            return free
        few = {id(r) for r in sorted((r for r in sched.running if r.decoding and free(r)),
                                     key=lambda r: r.num_tokens - r.spec_cached)[:self.policy.probe_rows]}
        return lambda r: id(r) in few

    def forced(self, drafts: list[list[int]], verified: list[list[int]]) -> list[list[int]]:
        """Each request takes its first a drafts and one more token, a chosen so that the mean of a + 1 is
        `forced_length` (where the drafts allow): measures the machinery at a given acceptance."""
        out = []
        for d, v in zip(drafts, verified):
            self._credit += self.forced_length - 1
            a = min(int(self._credit), len(d))
            self._credit -= a
            out.append((d + v[-1:])[:a + 1])
        return out

    def _ngram(self, r: RequestState, k: int) -> list[int]:
        index = self.ngrams.get(r)
        if index is None:
            index = self.ngrams[r] = NgramIndex((), self.spec["ngram_max"], self.spec["ngram_min"])
        if len(index) < r.num_tokens:
            index.extend(r.tokens(len(index), r.num_tokens - len(index)))
        return index.propose(k)
