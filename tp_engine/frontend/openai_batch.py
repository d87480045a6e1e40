"""OpenAI Batch API request files as prompts: each line `{"custom_id", "method": "POST", "url":
"/v1/chat/completions" or "/v1/completions", "body": {...}}` becomes a prompt object with its own `sampling`,
and what its output line needs (openai_batch_output.py) is kept beside it. A line the engine cannot run gets
its error, and an error line in the output; the others run."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from tp_engine.base.config import ConfigError

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# body fields -> the `sampling` key they set (the rest of the applied ones are read below)
SAMPLING = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
            "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "n": "n", "seed": "seed",
            "stop": "stop", "guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
            "guided_grammar": "grammar"}
APPLIED = {*SAMPLING, "model", "messages", "prompt", "logprobs", "top_logprobs", "response_format"}


def is_batch_request(item: Any) -> bool:
    """Whether a line of a prompts file is a Batch API request (the file's first line decides its kind)."""
    return isinstance(item, dict) and "custom_id" in item and "body" in item


class BatchFile(list):
    """The prompts of a Batch API file, in its order; `requests[i]` is what line i's output needs: its
    custom_id, endpoint, model, logprobs asked for, and the error that keeps it from running (or None)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.requests: list[dict] = []
        self.lines: dict[str, int] = {}  # custom_id -> its line number
        self.ignored: Counter = Counter()  # body fields the engine does not apply, by lines that give them

    def add(self, n: int, item: Any) -> None:
        """Line `n` of the file, parsed: its prompt and request, or a refusal of the file (a line of another
        kind, a custom_id that is not a string or is given twice)."""
        if not is_batch_request(item):
            raise ConfigError(f"{self.path} line {n}: not an OpenAI Batch API request (no 'custom_id' and "
                              "'body'); the file's first line is one, and a file holds one kind of line")
        cid = item["custom_id"]
        if not isinstance(cid, str):
            raise ConfigError(f"{self.path} line {n}: custom_id must be a string; got {type(cid).__name__}")
        if cid in self.lines:
            raise ConfigError(f"{self.path}: custom_id {cid!r} is given twice, on lines {self.lines[cid]} "
                              f"and {n}; each request needs its own")
        self.lines[cid] = n
        request = {"custom_id": cid, "url": item.get("url"), "model": None, "error": None}
        try:
            prompt = self._prompt(item, request)
        except ValueError as e:
            request["error"] = str(e)
            prompt = {"input_ids": [0]}  # never runs: its error is its output line
        self.append(prompt)
        self.requests.append(request)

    def _prompt(self, item: dict, request: dict) -> dict:
        """The prompt object of one request; ValueError says why the engine cannot run it."""
        body, url = item["body"], item.get("url")
        if item.get("method", "POST") != "POST":
            raise ValueError(f"method must be POST; got {item.get('method')!r}")
        if url not in (CHAT, COMPLETIONS):
            raise ValueError(f"url must be {CHAT} or {COMPLETIONS}; got {url!r}")
        if not isinstance(body, dict):
            raise ValueError(f"body must be an object; got {type(body).__name__}")
        self.ignored.update(k for k in body if k not in APPLIED)
        request["model"] = body.get("model")
        # null: the default, as OpenAI reads it
        sampling = {SAMPLING[k]: v for k, v in body.items() if k in SAMPLING and v is not None}
        if body.get("max_completion_tokens") is not None:
            sampling["max_new_tokens"] = body["max_completion_tokens"]  # the newer name wins over max_tokens
        if isinstance(sampling.get("json_schema"), str):  # vLLM's guided_json may be the schema's JSON text
            sampling["json_schema"] = _json(sampling["json_schema"], "body.guided_json")
        sampling.update(_response_format(body.get("response_format")))
        if sampling.get("top_k") == -1:  # vLLM's "off"
            sampling["top_k"] = 0
        top = self._logprobs(body, url)
        request["logprobs"] = top
        if top is not None:
            sampling["logprobs"] = max(top, 1)  # the engine's 0 is off; the line shows `top` of them
        if url == CHAT:
            messages = body.get("messages")
            if not isinstance(messages, list):
                raise ValueError("body.messages must be a list of messages")
            prompt = {"messages": [_message(m, i) for i, m in enumerate(messages)]}
        else:
            text = body.get("prompt")
            if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
                text = text[0]
            if isinstance(text, str):
                prompt = {"prompt": text}
            elif isinstance(text, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in text):
                prompt = {"input_ids": text}
            else:
                raise ValueError("body.prompt must be a string or a list of token ids")
        return {**prompt, "sampling": sampling} if sampling else prompt

    @staticmethod
    def _logprobs(body: dict, url: str) -> int | None:
        """How many top tokens the line's logprobs show, or None without logprobs."""
        if url == COMPLETIONS:
            k = body.get("logprobs")
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 20):
                raise ValueError(f"body.logprobs must be an integer from 0 to 20 or null; got {k!r}")
            return k
        on, k = body.get("logprobs"), body.get("top_logprobs")
        if on not in (None, True, False):
            raise ValueError(f"body.logprobs must be true or false; got {on!r}")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 20):
            raise ValueError(f"body.top_logprobs must be an integer from 0 to 20; got {k!r}")
        if k is not None and not on:
            raise ValueError("body.top_logprobs needs body.logprobs: true")
        return (k or 0) if on else None

    def warning(self) -> str | None:
        """One line naming the body fields that were given and are not applied, with how many lines gave
        each; None when there are none."""
        if not self.ignored:
            return None
        said = ", ".join(f"{k} ({c} line{'s' if c > 1 else ''})" for k, c in sorted(self.ignored.items()))
        return f"{self.path}: body fields this engine does not apply are ignored: {said}"

    def mark_errors(self, encoded: list, error: type[Exception]) -> None:
        """Each line that cannot run gets its reason in `encoded` (the prompts' ids, or their errors) as an
        `error`, the prompts' error class: its output line is an error line."""
        for i, request in enumerate(self.requests):
            if request["error"] is not None:
                encoded[i] = error(request["error"])


def _message(m: Any, i: int) -> Any:
    """A chat message with its content as text: OpenAI's list of text parts joined."""
    content = m.get("content") if isinstance(m, dict) else None
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ValueError(f"message {i}: only text content parts are supported")
        return {**m, "content": "".join(p["text"] for p in content)}
    return m


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{where} is not valid JSON: {e}") from None


def _response_format(fmt: Any) -> dict:
    """The `sampling` constraint of a body's response_format: json_object is any JSON object, json_schema its
    `json_schema.schema`, text (or none) no constraint."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": True}
    schema = fmt.get("json_schema", {}).get("schema") if isinstance(fmt.get("json_schema"), dict) else None
    if kind == "json_schema" and isinstance(schema, dict):
        return {"json_schema": schema}
    if kind == "json_schema":
        raise ValueError("body.response_format.json_schema.schema must be a JSON schema object")
    raise ValueError(f"body.response_format.type must be text, json_object or json_schema; got {fmt!r}")
