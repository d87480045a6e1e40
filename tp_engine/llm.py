"""Python API: `LLM(model=...).generate(prompts, SamplingParams(...))`, for use inside a torchrun script.

Every rank constructs the LLM and calls `generate` with the same arguments; rank 0 returns the outputs
(one dict per prompt, in order) and the other ranks return None once rank 0 is done.
"""
from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any, Callable

from tp_engine import config as C
from tp_engine import comm as tpd
from tp_engine.engine import Engine
from tp_engine.sampler import SamplingParams
from tp_engine.scheduler import Request

log = logging.getLogger("tp_engine")

Prompt = Any  # str | list[int] | {"prompt": str} | {"input_ids": [...]} | {"messages": [...]}


def sampling_params_from(cfg: dict) -> SamplingParams:
    return SamplingParams(seed=cfg["seed"], **cfg["sampling"])


class LLM:
    def __init__(self, model: str | None = None, config: str | None = None, overrides: list[str] | None = None,
                 **options: Any) -> None:
        """Options are config keys (see docs/configuration.md), nested as keyword dicts: kv_cache={"num_pages": 64}."""
        if model is not None:
            options["model"] = model
        self.cfg = C.build_config(config, overrides, **options)
        self.engine = Engine(self.cfg)
        self.tp = self.engine.tp
        self.rank0 = self.tp.is_first
        self._tokenizer, self._tokenizer_error = None, None

    # ---- text <-> ids (rank 0 only) ----

    @property
    def tokenizer(self):
        if self._tokenizer is None and self._tokenizer_error is None:
            self._tokenizer, self._tokenizer_error = load_tokenizer(self.cfg["model"])
        return self._tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of one prompt; raises ValueError naming what is wrong with it."""
        if isinstance(prompt, dict):
            if "input_ids" in prompt:
                ids = prompt["input_ids"]
                if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                    raise ValueError("input_ids must be a list of integers")
                return ids
            if "messages" in prompt:
                return self._apply_chat(prompt["messages"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a prompt object needs 'prompt', 'input_ids' or 'messages'; got keys {sorted(prompt)}")
        if isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
            return prompt
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be a string, a list of token ids or an object; got {type(prompt).__name__}")
        if self.cfg["chat"]:
            return self._apply_chat([{"role": "user", "content": prompt}])
        return self._need_tokenizer().encode(prompt, add_special_tokens=False)

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"text prompts need tokenizer files in {self.cfg['model']} ({self._tokenizer_error}); "
                             "give {\"input_ids\": [...]} instead")
        return self._tokenizer

    def _apply_chat(self, messages: list[dict]) -> list[int]:
        tok = self._need_tokenizer()
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"chat prompts need a chat template in {self.cfg['model']}/tokenizer_config.json")
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                       **self.cfg["chat_template_kwargs"])
        return tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---- generation ----

    def generate(self, prompts: list[Prompt], sampling_params: SamplingParams | None = None,
                 on_finish: Callable[[dict], None] | None = None, skip: set[int] | frozenset = frozenset(),
                 on_token: Callable[[Request], None] | None = None) -> list[dict] | None:
        """Generate for every prompt. Rank 0 returns one output dict per prompt (not skipped), in input order;
        the other ranks follow rank 0's steps and return None. `on_finish(output)` is called on rank 0 as
        each request completes (in completion order)."""
        if not self.rank0:
            self.engine.follow()
            return None
        params = sampling_params or sampling_params_from(self.cfg)
        outputs: dict[int, dict] = {}

        def finish(req: Request) -> None:
            out = self.output(req)
            outputs[req.index] = out
            if on_finish is not None:
                on_finish(out)

        requests = []
        for i, prompt in enumerate(prompts):
            if i in skip:
                continue
            req = Request(i, [], params)
            try:
                req.prompt_ids = self.encode(prompt)
                self._check_prompt(req.prompt_ids)
            except ValueError as e:  # a bad prompt gets an error line; the others still run
                req.finish_reason, req.error = "error", str(e)
                finish(req)
                continue
            requests.append(req)
        stops = params.stop

        def check_token(req: Request) -> bool:
            if on_token is not None:
                on_token(req)
            return bool(stops) and self._hit_stop(req, stops)

        self.engine.run(requests, check_token if (stops or on_token) else None, finish)
        return [outputs[i] for i in sorted(outputs)]

    def _check_prompt(self, ids: list[int]) -> None:
        vocab = self.engine.model_cfg.vocab_size
        if not ids:
            raise ValueError("empty prompt: it has no tokens")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        limit = self.engine.max_request_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; the longest that can run is {limit - 1} "
                             f"(max_model_len {self.engine.max_model_len}, "
                             f"KV pool {self.engine.kv.num_pages * self.engine.kv.page_size} tokens)")

    def _hit_stop(self, req: Request, stops: list[str]) -> bool:
        # A stop string that ends at the newest token lies within its last few tokens (a token is at least
        # a byte): look there first, so long outputs are not decoded in full at every step.
        window = 4 * max(len(s) for s in stops) + 4
        if not any(s in (self.decode(req.output_ids[-window:]) or "") for s in stops):
            return False
        text = self.decode(req.output_ids) or ""
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        if cut >= 0:
            req.text = text[:cut]
            return True
        return False

    def output(self, req: Request) -> dict:
        out = {"index": req.index, "prompt_token_ids": req.prompt_ids, "output_token_ids": req.output_ids,
               "text": req.text if req.text is not None else self.decode(req.output_ids),
               "finish_reason": req.finish_reason}
        if req.error is not None:
            out["error"] = req.error
        return out

    def shutdown(self) -> None:
        """Leave the process group. Call on every rank at the end of a script."""
        tpd.shutdown()
        # Layers hold the group too; free them now rather than during interpreter teardown, where gloo's
        # threads can abort the process.
        self.engine = self.tp = None
        gc.collect()


def load_tokenizer(model_dir: str):
    """The checkpoint's own tokenizer, offline; (None, reason) when the directory has none."""
    root = Path(model_dir)
    if not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None, "no tokenizer files"
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True), None
    except Exception as e:  # a broken tokenizer should not stop token-id prompts
        return None, f"tokenizer failed to load: {e}"
