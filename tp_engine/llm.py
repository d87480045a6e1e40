"""Python API: `LLM(model=...).generate(prompts, SamplingParams(...))`, for use inside a torchrun script.

Every rank constructs the LLM and calls `generate` with the same arguments; rank 0 returns the outputs
(one dict per prompt and sample, in order) and the other ranks return None once rank 0 is done.
"""
from __future__ import annotations

import atexit
import functools
import gc
import logging
import os
import sys
import weakref
from typing import Any, Callable, Iterator, Sequence

from tp_engine.base import config as C
from tp_engine import comm as tpd
from tp_engine.base.api_args import as_list
from tp_engine.runtime.engine import Engine
from tp_engine.base.generation_config import unapplied_warning
from tp_engine.frontend.lifeline import exit_with_launcher
from tp_engine.frontend.prompt_sampling import has_stop_strings, params_for
from tp_engine.frontend.prompts import Prompt, PromptEncoder, PromptError, load_tokenizer
from tp_engine.frontend.reasoning import ThinkEnds, opens_thinking, split_reasoning, think_tags
from tp_engine.sampling.sampler import SamplingParams
from tp_engine.runtime.replicas import follow_share, release, run_job, run_share
from tp_engine.runtime.request import RequestOutput
from tp_engine.runtime.request_checks import constraint_problem, prompt_problem
from tp_engine.sampling.constraints import Grammars
from tp_engine.sampling.grammar_masks import default_threads
from tp_engine.frontend.stop_strings import RequestStops, StopStrings
from tp_engine.frontend.token_stream import TextStreams, TokenUpdate

log = logging.getLogger("tp_engine")


_OPEN = [0]  # LLMs made in this process and not shut down: the last one to go leaves the process group


def _leave_group(tp: tpd.TPGroup) -> None:
    """One LLM fewer; the last one (of group `tp`) leaves the process group (an earlier one would pull it from
    the others). An LLM dropped without shutdown() counts until the process exits."""
    _OPEN[0] -= 1
    if _OPEN[0] == 0:
        tpd.shutdown(tp)  # not when an engine broke inside a step: the ranks would never meet (comm.shutdown)


def _shutdown_at_exit(ref, tp: tpd.TPGroup) -> None:
    """A script that ends without shutdown() could abort in gloo's teardown after its results were out. Not
    after an uncaught exception: the other ranks may never reach shutdown's barrier."""
    if getattr(sys, "last_value", None) is not None:
        return
    llm = ref()
    if llm is not None:
        llm.shutdown()
    else:  # dropped without shutdown(): it still counted as one of the group's users
        _leave_group(tp)


def sampling_params_from(cfg: dict) -> SamplingParams:
    return SamplingParams(seed=cfg["seed"], **cfg["sampling"])


class LLM:
    def __init__(self, model: str | None = None, config: str | None = None,
                 overrides: list[str] | None = None, preflight: Callable[[Any], None] | None = None,
                 **options: Any) -> None:
        """Options are config keys (see docs/configuration.md), nested as keyword dicts:
        kv_cache={"num_pages": 64}.

        `preflight(device)`, if given, runs on rank 0 before any rank loads weights (the command line checks
        its output file and prompts there); a ValueError or OSError from it stops every rank at start-up."""
        if model is not None:
            options["model"] = os.fspath(model) if isinstance(model, os.PathLike) else model
        if isinstance(overrides, str):  # its characters would be read as one override each
            raise TypeError(
                f"overrides must be a list of 'key=value' strings; got the string {overrides!r}")
        self.cfg = C.build_config(config, overrides, **options)
        exit_with_launcher()
        # An engine dropped by the caller keeps its memory (weights, KV cache, CUDA graphs) in
        # reference cycles until the collector runs: free it before this one loads and sizes its
        # KV pool from the free memory.
        gc.collect()
        self.engine = Engine(self.cfg, preflight)
        _OPEN[0] += 1
        # see shutdown()
        self._at_exit = functools.partial(_shutdown_at_exit, weakref.ref(self), self.engine.tp)
        atexit.register(self._at_exit)
        self.tp = self.engine.tp
        self.rank0 = self.tp.world_rank == 0  # the job's first rank: with several replicas, their coordinator
        self.prompts = PromptEncoder.from_config(self.cfg, python=True)
        mc = self.engine.model_cfg  # output constraints compile with the checkpoint's tokenizer, once each
        self.engine.grammars = Grammars(functools.partial(load_tokenizer, self.cfg["model"]), mc.vocab_size,
                                        mc.eos_token_ids, default_threads(self.tp.size))
        bad = constraint_problem(self.engine, sampling_params_from(self.cfg))  # the same on every rank
        if bad:
            raise tpd.StartupError(f"config key {bad}")  # a config error: status 2 from the command line
        self._think: tuple | None = None  # (the think tags' ids or None), found on first use on rank 0
        self._generating = False  # rank 0, inside generate(): a callback may not start another run
        cli_keys = ("prompts", "prompts_file", "output", "resume", "stream", "fail_on_prompt_error")
        cli_only = [k for k in cli_keys if self.cfg[k]]
        if self.rank0 and preflight is None and cli_only:  # a config file shared with the command line, say
            log.warning("config keys %s are read by the command line only: LLM ignores them",
                        ", ".join(cli_only))
        unapplied = unapplied_warning(self.cfg["model"]) if self.rank0 else None
        if unapplied:  # here, not where the config is built: every rank builds it, the command line twice
            log.warning("%s", unapplied)
        # e.g. a config written with eos_token_id null
        if self.rank0 and not self.engine.model_cfg.eos_token_ids:
            eos = getattr(self.tokenizer, "eos_token", None)
            log.warning("%s/config.json and generation_config.json name no eos_token_id: requests end only "
                        "at max_new_tokens, a stop string or stop_token_ids%s", self.cfg["model"],
                        f" (the tokenizer's eos_token is {eos!r})" if eos else "")

    # ---- text <-> ids (rank 0 only) ----

    @property
    def tokenizer(self):
        return self.prompts.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of one prompt; raises PromptError (a ValueError) naming what is wrong with it."""
        return self.prompts.encode(prompt)

    def decode(self, ids: list[int]) -> str | None:
        return self.prompts.decode(ids)

    # ---- generation ----

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 on_finish: Callable[[dict], None] | None = None, skip: set | frozenset = frozenset(),
                 on_token: Callable[[TokenUpdate], None] | None = None,
                 encoded: list[Sequence[int] | PromptError] | None = None,
                 return_outputs: bool = True) -> list[dict] | None:
        """Generate for one prompt or a list of prompts. Rank 0 returns one output dict per prompt and
        sample (not skipped; `skip` holds prompt indices or (index, sample) pairs), in (index, sample) order;
        the other ranks follow rank 0's steps and return None. `sampling_params`: one for every prompt, or a
        list of one per prompt (None: the config's settings); a prompt object's own `sampling` mapping goes
        over it. Requests with different settings share batches. `on_finish(output)` is called on rank 0 as
        each request completes (in completion order), `on_token(update)` as each request gets a token (a
        TokenUpdate: its index, sample, token ids and text so far). `encoded` (rank 0): the prompts' ids or
        errors, already computed (the command line encodes before the weights load); `prompts` is then the
        list they came from, item for item (`[5, 6, 7]` is three prompts there, not one of token ids).
        `return_outputs=False`: rank 0 returns None too and keeps no output once `on_finish` has had it, so
        that a job of any length holds only the requests in flight.

        If an exception ends the call on rank 0 between steps (a callback raised, say), every rank leaves
        the call and the engine stays usable. One inside a step that the ranks share leaves them out of
        step: the engine then refuses every later call."""
        # Checks that can fail run on every rank before any collective, so all ranks fail alike.
        if self._generating:  # from a callback: a second run would take the pages and tables of the first
            raise RuntimeError("generate() was called from a callback of a generate() call that is still "
                               "running; call it after that one returns")
        if self.engine is None:
            raise RuntimeError("this LLM was shut down; create a new LLM to generate again")
        self.engine.check_usable()
        prompts = list(prompts if encoded is not None else as_list(prompts))  # the caller may change its list
        params = self._sampling_params(sampling_params, len(prompts))
        dp = self.tp.dp  # several replicas: rank 0 hands out requests, each replica's first rank runs some
        if not self.tp.is_first:
            self.engine.follow() if dp is None else follow_share(self.engine, dp)
            return None
        try:  # the other ranks already wait for the first step: a failure here must release them
            if encoded is not None and len(encoded) != len(prompts):
                raise ValueError(f"encoded holds {len(encoded)} entries for {len(prompts)} prompts")
            for p in params if isinstance(params, list) else [params]:
                self.prompts.check_stop_strings(p.stop)
        except BaseException:
            release(self.engine, dp)
            raise
        enc = self.prompts
        stops = RequestStops(lambda stop: StopStrings(stop, enc.decode, enc.special_ids, enc.num_tokens,
                                                      enc.special_texts))  # each request's own
        if not self.rank0:  # another replica's first rank: its requests come with their own settings
            run_share(self.engine, dp, stops.hit)
            return None
        if dp is not None and encoded is None:  # here, not on the coordinator's thread (the tokenizer's)
            encoded = [self.prompts.try_encode(p) for p in prompts]
        outputs: dict[tuple[int, int], dict] = {}
        texts = TextStreams(enc.decode, stops.texts)
        # `messages` go through the chat template whatever `chat` says: their outputs may think too
        chats = {i for i, p in enumerate(prompts) if isinstance(p, dict) and "messages" in p}
        think_ends = ThinkEnds(self._think_tags, self.decode, lambda i: self.cfg["chat"] or i in chats)
        if dp is not None:  # here: the coordinator's thread, which makes the requests, uses no tokenizer
            think_ends.find_all(encoded)

        def finish(req: RequestOutput) -> None:
            out = self.output(req, self.cfg["chat"] or req.index in chats)
            if return_outputs:
                outputs[req.index, req.sample] = out
            if on_finish is not None:
                on_finish(out)

        def requests() -> Iterator[RequestOutput]:
            """Made as the scheduler has room for them: a finished one is dropped, not kept to the end."""
            for i, prompt in enumerate(prompts):
                given = params[i] if isinstance(params, list) else params
                own = params_for(prompt, given, self.prompts)  # its own `sampling` over it, or its error
                p = own if isinstance(own, SamplingParams) else given
                samples = [j for j in range(p.n) if i not in skip and (i, j) not in skip]
                if not samples:
                    continue
                got = encoded[i] if encoded is not None else self.prompts.try_encode(prompt)
                bad = got if isinstance(got, PromptError) else own if isinstance(own, PromptError) else None
                error = str(bad) if bad is not None else prompt_problem(self.engine, got) or \
                    constraint_problem(self.engine, p)
                ids = [] if isinstance(got, PromptError) else list(got)  # one list for the n samples
                think_open, think_end = think_ends(i, ids)
                for j in samples:
                    req = RequestOutput(i, ids, p, sample=j, think_open=think_open, think_end=think_end)
                    if error is not None:  # a bad prompt gets an error line per sample; the others still run
                        req.finish_reason, req.error = "error", error
                    if error is None or dp is not None:  # the coordinator passes an error on to on_remote
                        yield req
                    else:
                        finish(req)

        def check_token(req: RequestOutput) -> bool:
            hit = stops.hit(req)
            if on_token is not None:
                on_token(texts.update(req, "stop" if hit else req.finish_reason))
            return hit

        def on_remote(req: RequestOutput) -> None:
            """Another replica's result (or an error one): its tokens' updates at once, then its end."""
            n = len(req.output_ids)
            for k in range(1, n + 1) if on_token is not None else ():
                reason = req.finish_reason if k == n else None
                on_token(TokenUpdate(req.index, req.sample, k, reason, texts, req))
            finish(req)

        made = requests()
        self._generating = True
        try:
            stopping = has_stop_strings(prompts, params if isinstance(params, list) else [params])
            check = check_token if (stopping or on_token) else None
            if dp is None:
                self.engine.run(made, check, finish)
            else:
                run_job(self.engine, dp, made, check, finish, on_remote)
        finally:
            self._generating = False
            made.close()  # after a failure the scheduler still holds it: keep nothing of this call
        return [outputs[i] for i in sorted(outputs)] if return_outputs else None

    def _sampling_params(self, given: Any, count: int) -> SamplingParams | list[SamplingParams]:
        """generate()'s `sampling_params`, checked on every rank: one SamplingParams, or a list of one per
        prompt (`count` of them)."""
        if given is None:
            return sampling_params_from(self.cfg)
        for p in given if isinstance(given, list) else [given]:
            if not isinstance(p, SamplingParams):
                raise TypeError("sampling_params must be a SamplingParams or a list of one per prompt, got "
                                f"{'a list holding ' if isinstance(given, list) else ''}{type(p).__name__}")
            p.validate()
        if isinstance(given, list) and len(given) != count:
            raise ValueError(f"sampling_params is a list of {len(given)} SamplingParams for {count} prompts; "
                             "give one per prompt, or one SamplingParams for all")
        return given

    def output(self, req: RequestOutput, chat: bool = False) -> dict:
        """The output dict of a finished request; `chat`: its prompt went through the chat template (so its
        output may hold a think block to split off as `reasoning`)."""
        out = {"index": req.index, "sample": req.sample,
               "prompt_token_ids": list(req.prompt_ids),  # its own list
               "output_token_ids": req.output_ids,
               "text": req.text if req.text is not None else self.decode(req.output_ids),
               "finish_reason": req.finish_reason, "cached_prompt_tokens": req.cached_prompt_tokens}
        if req.params.logprobs and req.error is None:
            out["logprobs"] = req.logprobs
        if req.constraint is not None:
            out["constraint"] = req.constraint
        tags = self._think_tags() if chat else None
        if tags is not None and req.error is None:
            opens = opens_thinking(req.prompt_ids, tags, self.decode)
            out["reasoning"], out["text"] = split_reasoning(out["text"] or "", opens)
        if req.error is not None:
            out["error"] = req.error
        return out

    def _think_tags(self) -> tuple[int, int] | None:
        if self._think is None:
            self._think = (think_tags(self.tokenizer),)
        return self._think[0]

    def shutdown(self) -> None:
        """Leave the process group (once every LLM of the process is shut down). Call on every rank at the end
        of a script."""
        if self.engine is not None:
            atexit.unregister(self._at_exit)
            _leave_group(self.engine.tp)
        # Layers hold the group too; free them now rather than during interpreter teardown, where gloo's
        # threads can abort the process.
        self.engine = self.tp = None
        gc.collect()
