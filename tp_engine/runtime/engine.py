"""The engine on each rank: builds the sharded model and KV pool, then runs steps.

Rank 0 schedules, broadcasts each step's message, samples from the gathered logits and keeps the request
state; the other ranks decode the same message and run the same forward (`follow`). Rank 0 broadcasts
the sampled tokens on the device, where the next step reads them, so it can issue step k+1 before step
k's tokens reach the host: the host's work for one step overlaps the GPU's work for the previous one.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterable

import torch

from tp_engine import comm, kernels
from tp_engine.attention import fuses_qkv
from tp_engine.base.config import fingerprint
from tp_engine.base.batch import Batch, forward_context
from tp_engine.runtime.memory_plan import is_oom, step_oom
from tp_engine.layers.fp8 import settle_experts
from tp_engine.runtime.engine_setup import agree_on_kernels, capture_graphs, setup_cache, setup_model
from tp_engine.runtime.constrained import follow_tokens, mark_finished, mask_step
from tp_engine.runtime.page_pool import PagePool
from tp_engine.sampling.sampler import sample, token_logprobs
from tp_engine.runtime.request import RequestOutput
from tp_engine.runtime.scheduler import Scheduler
from tp_engine.runtime.speculation import Speculation
from tp_engine.runtime.step_message import (PageTables, decode_message, device_rows, on_device,
                                            stop_message)
from tp_engine.runtime.step_plan import Plan, step_message
from tp_engine.runtime.step_tokens import Issued, add_logprobs, resolve, sampling_inputs, to_host

log = logging.getLogger("tp_engine")


class Engine:
    def __init__(self, cfg: dict, preflight: Callable[[torch.device], None] | None = None) -> None:
        """`preflight(device)` runs on rank 0 before any rank loads weights; see LLM."""
        self.cfg, self.broken = cfg, None  # broken: why the ranks may be out of step (see check_usable)
        try:  # a missing device, a TP size that does not divide the world: the same on every rank, each
            # exits and rank 0 says why
            device = comm.pick_device(cfg["device"])
            self.tp = comm.init_distributed(device, cfg["timeout_s"], cfg["advanced"]["step_channel"],
                                            cfg["tensor_parallel_size"])
        except ValueError as e:
            raise comm.StartupError(str(e)) from None
        self.device = device
        error, ops = None, None
        if preflight is not None and self.tp.is_first:
            try:
                preflight(device)
            except (ValueError, OSError) as e:  # the output file, the prompts, resume: nothing loaded yet
                error = e
        comm.check_startup(error, fingerprint(cfg), self.tp)  # every rank learns rank 0's verdict
        try:
            setup_model(self)
            fp8 = self.model_cfg.quant is not None
            ops = kernels.select(device, cfg["advanced"]["fused_kernels"], fp8=fp8)
        except (ValueError, OSError) as e:  # config.json, TP split, dtype, checkpoint: reported below
            error = e
        comm.check_startup(error, fingerprint(cfg), self.tp)
        # this engine's fused kernels, handed to whatever runs them
        self.ops = agree_on_kernels(self, ops)
        self.model.bind(self.ops, fuses_qkv(cfg["attention_backend"], device, self.ops))
        settle_experts(self.model, self.ops is not None)  # FP8 experts: fp8 or dequantized
        self.spec = None  # speculative decoding's proposer and policy (runtime/speculation.py)
        try:  # its weights before the KV pool is sized
            self.spec = Speculation(self) if cfg["speculative"]["method"] else None
        except (ValueError, OSError) as e:  # its checkpoint: config.json, tokenizer, shapes
            error = e
        comm.check_startup(error, fingerprint(cfg), self.tp)
        self.capture = self.spec.capture if self.spec is not None else ()
        # the all-reduce of small messages on this engine's group, the same with CUDA graphs or without
        self.all_reduce_kind = comm.enable_fast_all_reduce(
            self.tp, self.dtype, self.ops is not None, cfg["advanced"]["all_reduce"], cfg["timeout_s"])

        graphs = setup_cache(self)  # the KV pool, sized by the memory plan, and the attention backend
        page_size = self.kv.page_size
        # the tokens sampled in the latest step, on every rank: the next step's input reads them from here
        self.last_tokens = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        if self.spec is not None:
            self.spec.allocate(self)
        self.tables = PageTables()  # every running request's pages, kept in step by the step messages
        # rank 0 owns the pages and the prefix cache, which lasts as long as the engine (across runs)
        self.pool = None
        if self.tp.is_first:
            self.pool = PagePool(self.kv.num_pages, page_size, cfg["prefix_cache"])
        self.graphs = self.pieces = None  # decode steps; prompt and mixed steps
        self.graph_bytes = 0  # what their memory pools hold
        self.sched: Scheduler | None = None  # the latest run's
        self.grammars = None  # output constraints' compiled grammars (set by LLM, which has the tokenizer)
        if graphs:
            capture_graphs(self)

    # ---- what the engine holds ----

    @property
    def max_request_len(self) -> int:
        """Most tokens (prompt + output) one request may hold: the context, or the whole KV pool."""
        return min(self.max_model_len, self.kv.num_pages * self.kv.page_size)

    @property
    def num_preempted(self) -> int:
        """Requests of the latest run recomputed after their pages were taken (so far, if it failed)."""
        return self.sched.num_preempted if self.sched is not None else 0

    def spec_summary(self) -> dict | None:
        """Speculative decoding's counts since the engine started (speculative/policy.py), or None: off."""
        return self.spec.policy.counts.summary() if self.spec is not None else None

    def weight_bytes(self) -> int:
        """Bytes of weights this rank holds (the tied LM head counted once)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    # ---- one step, on every rank ----

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor | None:
        rows = self.graphs.rows(batch) if self.graphs is not None else None
        if rows is not None:  # one copy into the graph's inputs; the references resolved inside
            logits = self.graphs.run(rows)
            if rows is batch or logits is None:
                return logits
            return logits[device_rows(batch.logit_rows, self.device)]  # one-token rows: the step's rows
        batch = on_device(batch, self.device)  # decode_message's token rows are on the host
        if lead := batch.decode_rows:  # the references to the previous step's tokens are in these rows
            resolve(batch.input_ids[:lead], self.last_tokens, ops=self.ops)  # in place
        if self.pieces is not None and self.pieces.can_run(batch):
            # short decode rows attend inside the pieces
            self.attn.prepare(batch, self.pieces.decode_capacity)
            return self.pieces.run(batch)
        self.attn.prepare(batch)
        try:
            with forward_context(batch, self.kv, self.attn, self.capture) as ctx:
                logits = self.model(batch.input_ids)
                if ctx.aux:  # what an EAGLE head reads of this step
                    self.spec.store(batch, ctx.aux)
                return logits
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError too
            if not is_oom(e):
                raise
            raise RuntimeError(step_oom(self, batch, e)) from None

    @torch.inference_mode()
    def share_tokens(self, tokens: torch.Tensor | None, n: int) -> torch.Tensor:
        """Rank 0 passes the `n` tokens it sampled, the others None: all end with them in `last_tokens`."""
        out = self.last_tokens[:n]
        if tokens is not None:
            out.copy_(tokens)
        return comm.broadcast(out, self.tp)

    def follow(self) -> None:
        """Ranks other than 0: run the steps rank 0 broadcasts until it says stop."""
        self.tables.clear()
        with self.shared_step():
            while (batch := decode_message(comm.broadcast_ints(None, self.tp), self.tables)) is not None:
                if batch.draft:  # a proposer's forward (runtime/drafting.py)
                    self.spec.follow(batch)
                    continue
                self.forward(batch)
                self.share_tokens(None, batch.size)

    # ---- keeping the ranks in step across failures ----

    def check_usable(self) -> None:
        if self.broken is not None:
            raise RuntimeError(f"this engine cannot run again: an earlier call failed inside a step the "
                               f"ranks share ({self.broken}), so the ranks may be out of step; "
                               "start a new job")

    @contextlib.contextmanager
    def shared_step(self):
        """Work that involves the other ranks: a failure inside it leaves them in an unknown state."""
        try:
            yield
        except BaseException as e:  # a lone rank (TP 1) cannot be out of step: its next run starts afresh
            if self.tp.size > 1:
                self.broken = self.broken or comm.mark_out_of_step(
                    f"rank {self.tp.rank}: {type(e).__name__}: {e}")
            raise

    # ---- the generation loop, on rank 0 ----

    def new_scheduler(self) -> Scheduler:
        if self.cfg["max_prefill_tokens"] > self.step_tokens:
            raise ValueError(f"max_prefill_tokens {self.cfg['max_prefill_tokens']} is larger than the "
                             f"{self.step_tokens} this engine measured its memory for at start-up")
        self.pool.reset_refs()  # a run that ended early may have left references behind
        self.tables.clear()
        return Scheduler(self.pool, self.max_batch, self.cfg["max_prefill_tokens"], self.max_request_len,
                         self.model_cfg.eos_token_ids, self.cfg["max_prefill_cost_while_decoding"],
                         self.model_cfg.attention_span)

    def run(self, requests: Iterable[RequestOutput],
            on_token: Callable[[RequestOutput], bool] | None = None,
            on_finish: Callable[[RequestOutput], None] | None = None) -> None:
        """Rank 0: generate for all requests, calling `on_finish` as each completes; then release the others.
        The scheduler takes `requests` as it has room for them: a generator makes each only then.

        `on_token(req)` may return True to end a request early (stop strings).
        """
        try:
            sched = self.sched = self.new_scheduler()
            sched.feed(requests)
            inflight: Issued | None = None
            while sched.has_work():
                plan = None
                k = self.spec.choose(sched) if self.spec is not None else 0
                if k:  # a speculating step reads every token before it, and runs to its end
                    if inflight is not None:
                        self.take_tokens(sched, inflight, on_token, on_finish)
                        inflight = None
                        if not sched.has_work():
                            break
                    plan = self.spec.step(self, sched, k, on_token, on_finish)
                    if plan is None:
                        continue
                elif self.spec is not None:
                    plan = sched.schedule()
                    self.spec.plain_step(plan)
                plan = plan or sched.schedule()
                if not plan.reqs and inflight is None:
                    # a bug, not a user error: never spin
                    raise RuntimeError("scheduler found no step to run")
                issued = None
                if plan.reqs:
                    with self.shared_step():
                        issued = self.issue(sched, plan, inflight)
                if inflight is not None:  # the GPU runs `issued` while the host takes in the step before it
                    self.take_tokens(sched, inflight, on_token, on_finish)
                inflight = issued
            if self.grammars is not None:
                self.grammars.masks.wait()  # the mask thread is done with this run's requests
        except BaseException:
            # Raised between steps (a callback, the scheduler): the other ranks are done with every step
            # issued so far, so the stop message brings all of them back, in step, before this one re-raises.
            if self.grammars is not None:
                self.grammars.masks.wait(quiet=True)  # done with the run's matchers, error or not
            self.pool.clear()  # a step planned but never issued would leave pages registered but unwritten
            if self.broken is None:
                self.release_followers()
            raise
        self.release_followers()

    def release_followers(self) -> None:
        if self.tp.size > 1:
            with self.shared_step():
                comm.broadcast_ints(stop_message(), self.tp)

    def issue(self, sched: Scheduler, plan: Plan, previous: Issued | None = None) -> Issued:
        """Send one step to every rank and queue its forward, sampling and the tokens' copy to the host;
        returns without waiting for the GPU (but for `previous`'s tokens, the step before, when a constrained
        request needs its last one)."""
        params, seeds, steps = sampling_inputs(plan, self.cfg["seed"])  # before commit counts its tokens
        message = step_message(plan, sched.page_size)
        sched.commit(plan)  # from here the scheduler counts the step as issued
        batch = decode_message(comm.broadcast_ints(message.encode(), self.tp), self.tables)
        logits = self.forward(batch)[: len(params)]
        allowed = mask_step(logits, plan, previous, self.grammars, self.ops)  # before any filter
        sampled = sample(allowed, params, seeds, steps, self.ops)
        k = max(p.logprobs for p in params)
        logprobs = token_logprobs(logits, sampled, k, self.ops) if k else ()  # before temperature and filters
        self.share_tokens(sampled, len(params))
        return to_host(plan, sampled, logprobs)  # not last_tokens, which the next step overwrites

    def take_tokens(self, sched: Scheduler, step: Issued, on_token: Callable[[RequestOutput], bool] | None,
                    on_finish: Callable[[RequestOutput], None] | None) -> None:
        """Wait for a step's tokens; give them to the scheduler, the requests' outputs to the callbacks."""
        got, done = sched.update(step.plan, step.host_tokens())
        add_logprobs(step, got)
        done += follow_tokens(sched, got, self.grammars)  # a grammar that has ended ends its request
        if on_token is not None:
            hit = [r for r in got if on_token(r.out)]
            for r in hit:  # a stop string wins over the length limit reached on the same token
                r.out.finish_reason = "stop"
            done += sched.retire([r for r in hit if r not in done])
        for r in done:
            mark_finished(r, self.grammars)
            if on_finish is not None:
                on_finish(r.out)
