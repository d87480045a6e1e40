"""Prompts: reading them from the config, and turning each into token ids on rank 0.

Encoding needs only the config and the checkpoint's tokenizer files, so the command line can encode (and
check a resumed output file against the ids) before any rank loads a weight. A failure in one prompt, of
whatever kind, becomes that prompt's error; the other prompts go on.
"""
from __future__ import annotations

import datetime
import difflib
import functools
import json
from array import array
from pathlib import Path
from typing import Any, Callable, Sequence

from tp_engine.base.api_args import as_ids, prompt_type_problem
from tp_engine.base.config import ConfigError
from tp_engine.base.textio import jsonl_lines, lone_surrogate, read_utf8, unique_keys
from tp_engine.frontend.openai_batch import BatchFile, is_batch_request

Prompt = Any  # str | list[int] | {"prompt": str} | {"input_ids": [...]} | {"messages": [...]}
PROMPT_KEYS = ("prompt", "input_ids", "messages")  # what a prompt object is made of: exactly one of them
# Every key a prompt object may hold: the ones above, and its own settings (prompt_sampling.py); no other.
PROMPT_OBJECT_KEYS = (*PROMPT_KEYS, "sampling")
TOKENIZE_BATCH = 1024  # texts per call of the tokenizer


class PromptError(ValueError):
    """What is wrong with one prompt; it becomes the prompt's output line with finish_reason "error"."""


def read_prompts(cfg: dict) -> list[Prompt]:
    """The config's `prompts` list, or the objects of its `prompts_file` (JSONL, UTF-8)."""
    if (cfg["prompts"] is None) == (cfg["prompts_file"] is None):
        raise ConfigError("give exactly one of 'prompts' (a list) and 'prompts_file' (a JSONL path)"
                          + ("; both are set" if cfg["prompts"] is not None else "; neither is set"))
    if cfg["prompts"] is not None:
        if not cfg["prompts"]:  # a run with nothing to do would still replace the output file
            raise ConfigError("config key 'prompts' is an empty list: nothing to generate")
        return cfg["prompts"]
    path = Path(cfg["prompts_file"])
    if not path.is_file():
        what = "not a regular file" if path.exists() else "file not found"
        raise ConfigError(f"config key 'prompts_file': {what}: {path}")
    prompts, batch = [], None  # batch: the file's first line is an OpenAI Batch API request
    for n, line in enumerate(jsonl_lines(read_utf8(path, ConfigError)), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line, object_pairs_hook=unique_keys)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} line {n}: not valid JSON ({e.msg})") from None
        except KeyError as e:
            raise ConfigError(f"{path} line {n}: key '{e.args[0]}' is given twice in one object") from None
        if batch is None:
            batch = BatchFile(path) if is_batch_request(item) else False
        if isinstance(batch, BatchFile):  # a list: empty at first
            batch.add(n, item)
            continue
        if is_batch_request(item):
            raise ConfigError(f"{path} line {n}: an OpenAI Batch API request, but the file's first line is a "
                              "prompt object; a file holds one kind of line")
        if not isinstance(item, dict) or not set(PROMPT_KEYS) & set(item):
            unknown = unknown_key(item) if isinstance(item, dict) else None
            raise ConfigError(f"{path} line {n}: expected an object with 'prompt', 'input_ids' or 'messages'"
                              + (f" ({unknown})" if unknown else ""))
        ids = as_ids(item.get("input_ids"))
        if ids is not None:  # else the prompt's error says what is wrong
            item["input_ids"] = compact(ids)
        prompts.append(item)
    prompts = batch if isinstance(batch, BatchFile) else prompts
    if not prompts:
        raise ConfigError(f"config key 'prompts_file': {path} holds no prompts: nothing to generate")
    return prompts


def compact(ids: list[int]) -> Sequence[int]:
    """Token ids at 4 bytes each, not a Python int's 36: rank 0 holds every prompt of a job at once."""
    try:
        return array("i", ids)
    except OverflowError:  # an id no vocabulary has: the prompt's error names it
        return ids


def unknown_key(prompt: dict) -> str | None:
    """What is wrong with a prompt object's first key that is not one of PROMPT_OBJECT_KEYS (a misspelt key,
    or an option given per prompt that only the run's config takes), or None."""
    for k in prompt:
        if k not in PROMPT_OBJECT_KEYS:
            close = difflib.get_close_matches(k, PROMPT_OBJECT_KEYS, n=1) if isinstance(k, str) else []
            known = ", ".join(f"'{c}'" for c in PROMPT_OBJECT_KEYS)
            meant = f"; did you mean '{close[0]}'?" if close else ""
            return f"unknown key {k!r} in a prompt object{meant} (its keys: {known})"
    return None


@functools.lru_cache(maxsize=None)
def load_tokenizer(model_dir: str):
    """The checkpoint's own tokenizer, offline, loaded once per process; (None, reason) when there is none."""
    root = Path(model_dir)
    if not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None, "no tokenizer files"
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True), None
    except Exception as e:  # a broken tokenizer should not stop token-id prompts
        return None, f"tokenizer failed to load: {e}"


def skipped_ids(tokenizer) -> frozenset[int]:
    """The ids that decoding without special tokens drops: the tokenizer's special tokens, and also the added
    tokens tokenizer.json marks special without naming them there (Qwen3's <|fim_prefix|> and others)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return frozenset(getattr(tokenizer, "all_special_ids", None) or ()) | {i for i, t in added.items()
                                                                          if getattr(t, "special", False)}


class PromptEncoder:
    """Prompt -> token ids, for the checkpoint `model_dir` with the config's chat settings."""

    def __init__(self, model_dir: str, chat: bool = False, chat_template_kwargs: dict | None = None,
                 python: bool = False) -> None:
        """`python`: the prompts come from Python code (the API), and messages name Python's types and
        arguments, not YAML's and the config's."""
        self.model_dir, self.chat, self.chat_kwargs = model_dir, chat, dict(chat_template_kwargs or {})
        self.python = python

    @classmethod
    def from_config(cls, cfg: dict, python: bool = False) -> "PromptEncoder":
        return cls(cfg["model"], cfg["chat"], cfg["chat_template_kwargs"], python)

    @property
    def tokenizer(self):
        return load_tokenizer(self.model_dir)[0]

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def check_stop_strings(self, stop: list[str]) -> None:
        """Stop strings are looked for in the decoded text: without a tokenizer there is none."""
        if stop and self.tokenizer is None:
            key = "SamplingParams." if self.python else "sampling."
            raise ValueError(f"{key}stop needs the checkpoint's tokenizer to read the output as text, and "
                             f"{self.model_dir} has none ({load_tokenizer(self.model_dir)[1]}); end requests "
                             f"with {key}stop_token_ids instead")

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids `decode` skips: they add no text."""
        return skipped_ids(self.tokenizer)

    @functools.cached_property
    def special_texts(self) -> dict[str, int]:
        """Each skipped token's text (`<|im_end|>`) and id: a stop string that is one ends at that token."""
        tok = self.tokenizer
        if tok is None:
            return {}
        return {t: i for i in sorted(self.special_ids) if (t := tok.convert_ids_to_tokens(i))}

    @functools.cached_property
    def num_tokens(self) -> int:
        """The tokenizer's ids are those below this; `decode` skips the rest."""
        return len(self.tokenizer)

    def encode_all(self, prompts: list[Prompt]) -> list[Sequence[int] | PromptError]:
        """Every prompt's ids (`compact`), or its error. Texts are tokenized in batches, which a fast
        tokenizer spreads over its threads: a job's million prompts are encoded before any weight loads."""
        out: list[Sequence[int] | PromptError] = []
        for start in range(0, len(prompts), TOKENIZE_BATCH):  # a batch at a time is held as Python ints
            got = [self._attempt(self._source, p) for p in prompts[start:start + TOKENIZE_BATCH]]
            texts = [i for i, x in enumerate(got) if isinstance(x, str)]  # else ids or an error
            try:
                batch = [got[i] for i in texts]
                ids = self.tokenizer(batch, add_special_tokens=False)["input_ids"] if texts else []
            except Exception:  # noqa: BLE001 - one text failed: find which, one at a time
                ids = [self._attempt(self._tokenize, got[i]) for i in texts]
            for i, x in zip(texts, ids):
                got[i] = x
            out += [x if isinstance(x, PromptError) else compact(x) for x in got]
        return out

    def try_encode(self, prompt: Prompt) -> list[int] | PromptError:
        """The ids of `prompt`, or the PromptError that says why it has none."""
        try:
            return self.encode(prompt)
        except PromptError as e:
            return e

    def encode(self, prompt: Prompt) -> list[int]:
        """The ids of one prompt; any failure (the tokenizer's, the chat template's) raises PromptError."""
        got = self._attempt(self._source, prompt)
        if isinstance(got, str):
            got = self._attempt(self._tokenize, got)
        if isinstance(got, PromptError):
            raise got
        return list(got)  # a copy: the caller may reuse its input_ids list meanwhile

    @staticmethod
    def _attempt(step: Callable[[Any], Any], arg: Any) -> Any:
        """step(arg), or the PromptError for whatever it raised (a template's or tokenizer's error concerns
        this prompt only)."""
        try:
            return step(arg)
        except PromptError as e:
            return e
        except Exception as e:  # noqa: BLE001
            return PromptError(f"cannot encode the prompt: {type(e).__name__}: {e}")

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _source(self, prompt: Prompt) -> str | Sequence[int]:
        """What `prompt` is made of: its token ids, or the text (chat template applied) to tokenize."""
        if isinstance(prompt, dict):
            unknown = unknown_key(prompt)
            if unknown:
                raise PromptError(unknown)
            given = [k for k in PROMPT_KEYS if k in prompt]
            if len(given) > 1:  # which one counts would be a guess
                raise PromptError(
                    f"a prompt object takes one of 'prompt', 'input_ids' and 'messages'; got {given}")
            if "input_ids" in prompt:
                ids = prompt["input_ids"]
                if isinstance(ids, array) and ids.typecode == "i":  # as read_prompts makes them: integers
                    return ids
                ids = as_ids(ids)
                if ids is None:
                    raise PromptError("input_ids must be a list of integers")
                return ids
            if "messages" in prompt:
                return self._chat_text(_checked_messages(prompt["messages"]))
            if "prompt" not in prompt:
                raise PromptError("a prompt object needs 'prompt', 'input_ids' or 'messages'; got keys "
                                  f"{sorted(map(str, prompt))}")
            prompt = prompt["prompt"]
        ids = as_ids(prompt)
        if ids is not None:
            return ids
        if not isinstance(prompt, str) and self.python:
            raise PromptError(prompt_type_problem(prompt))
        if not isinstance(prompt, str):
            # YAML 1.1 reads unquoted yes, no, on, off, 12:30 (750) or 2024-01-01 as a bool, number or date
            hint = ""
            if type(prompt) in (bool, int, float, datetime.date, datetime.datetime):
                hint = (f" ({prompt!r}: YAML reads an unquoted yes/no/on/off, number, time or date as such; "
                        "quote the prompt)")
            raise PromptError("a prompt must be a string, a list of token ids or an object; got "
                              f"{type(prompt).__name__}{hint}")
        _check_unicode(prompt, "the prompt")
        if self.chat:
            return self._chat_text([{"role": "user", "content": prompt}])
        self._need_tokenizer()
        return prompt

    def _need_tokenizer(self):
        tok, reason = load_tokenizer(self.model_dir)
        if tok is None:
            raise PromptError(f"text prompts need tokenizer files in {self.model_dir} ({reason}); "
                              "give {\"input_ids\": [...]} instead")
        return tok

    def _chat_text(self, messages: list[dict]) -> str:
        tok = self._need_tokenizer()
        if not getattr(tok, "chat_template", None):
            raise PromptError(f"chat prompts need a chat template in {self.model_dir} (chat_template.jinja, "
                              "or chat_template in tokenizer_config.json)")
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                       **self.chat_kwargs)


def _checked_messages(messages: Any) -> list[dict]:
    """A chat template indexes messages without checks: a string or a message without a role would fail inside
    it with an obscure error, or quietly render something else."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    for n, m in enumerate(messages):
        if not isinstance(m, dict):
            raise PromptError(
                f"message {n} must be an object with 'role' and 'content'; got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise PromptError(f"message {n} needs a 'role' string (user, assistant, system, ...)")
        if m.get("content") is not None and not isinstance(m["content"], str):
            raise PromptError(f"message {n}: 'content' must be a string; got {type(m['content']).__name__}")
        _check_unicode(m.get("content") or "", f"message {n}'s content")
    return messages


def _check_unicode(text: str, what: str) -> None:
    """Say where a lone surrogate is, not the tokenizer's TypeError."""
    bad = lone_surrogate(text)
    if bad:
        raise PromptError(f"{what} is not valid Unicode: {bad}")
