"""OpenAI Batch API output lines: one per request of the input file (its n choices in one line), in its order,
as `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`; and reading them
back for resume, by custom_id."""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from tp_engine.base.config import ConfigError
from tp_engine.frontend.openai_batch import CHAT, BatchFile
from tp_engine.frontend.output_file import Span
from tp_engine.frontend.results import Key, LineRuns, ResultSink

log = logging.getLogger("tp_engine")


def prepare_batch(prompts: list, encoded: list, error: type[Exception]) -> None:
    """For a Batch API file: each line that cannot run gets its reason as its prompt's `error` in `encoded`,
    and the body fields that are not applied are named in one warning."""
    if isinstance(prompts, BatchFile):
        prompts.mark_errors(encoded, error)
        if prompts.warning():
            log.warning("%s", prompts.warning())


def line_key(custom_id: str, run: str, ids: Sequence[int]) -> str:
    """What a line was produced from: its request's custom_id, settings (`run`) and prompt ids, hashed."""
    return hashlib.sha256(json.dumps([custom_id, run, list(ids)]).encode()).hexdigest()[:24]


def response_line(request: dict, outs: list[dict], run: str, model: str, created: int,
                  token: Callable[[int], str]) -> dict:
    """The output line of one request from its samples' output dicts (in sample order); `token`: a token
    id's text."""
    key = line_key(request["custom_id"], run, outs[0]["prompt_token_ids"])
    errors = [o["error"] for o in outs if o["finish_reason"] == "error"]
    if errors:
        status = 400
        body: dict = {"error": {"message": errors[0], "type": "invalid_request_error", "param": None,
                                "code": None}}
    else:
        status, chat, k = 200, request["url"] == CHAT, request["logprobs"]
        choices = []
        for o in outs:
            lp = None if k is None else (_chat_logprobs if chat else _completion_logprobs)(o, k, token)
            if chat:
                message = {"role": "assistant", "content": o["text"], "reasoning_content": o.get("reasoning")}
                choice = {"index": o["sample"], "message": message}
            else:
                choice = {"index": o["sample"], "text": o["text"]}
            choices.append({**choice, "logprobs": lp, "finish_reason": o["finish_reason"]})
        prompt, output = len(outs[0]["prompt_token_ids"]), sum(len(o["output_token_ids"]) for o in outs)
        usage = {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}
        body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{key}",
                "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": request["model"] or model, "choices": choices, "usage": usage}
    return {"id": f"batch_req_{key}", "custom_id": request["custom_id"],
            "response": {"status_code": status, "request_id": f"req_{key}", "body": body}, "error": None}


def _chat_logprobs(out: dict, k: int, token: Callable[[int], str]) -> dict:
    def entry(i: int, lp: float) -> dict:
        t = token(i)
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "surrogatepass"))}
    return {"content": [{**entry(e["token"], e["logprob"]),
                         "top_logprobs": [entry(i, lp) for i, lp in e["top"][:k]]} for e in out["logprobs"]]}


def _completion_logprobs(out: dict, k: int, token: Callable[[int], str]) -> dict:
    tokens = [token(e["token"]) for e in out["logprobs"]]
    offsets = [sum(map(len, tokens[:n])) for n in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in out["logprobs"]],
            "top_logprobs": [{token(i): lp for i, lp in e["top"][:k]} for e in out["logprobs"]],
            "text_offset": offsets}


class BatchSink(ResultSink):
    """A ResultSink whose lines are Batch API output lines: the samples of a request are gathered, and its
    line is written once the last of them finishes. Lines are kept (for resume) by request: (index, 0)."""

    def __init__(self, batch: BatchFile, n: int, model: str, token: Callable[[int], str], *args: Any,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batch, self.n, self.model, self.token = batch, n, model, token
        self.created = int(time.time())
        self.gathered: dict[int, list[dict]] = {}  # the finished samples of requests still running

    @property
    def skip(self) -> set[Key]:
        return {(i, j) for i, _ in self.done_keys for j in range(self.runs.samples(i, self.n))}

    def add(self, out: dict) -> None:
        i = out["index"]
        got = self.gathered.setdefault(i, [])
        got.append(out)
        if len(got) == self.runs.samples(i, self.n):
            del self.gathered[i]
            super().add({"index": i, "sample": 0, "samples": sorted(got, key=lambda o: o["sample"])})

    def line(self, out: dict) -> str:
        i = out["index"]
        return json.dumps(response_line(self.batch.requests[i], out["samples"], self.runs.run(i), self.model,
                                        self.created, self.token))


def read_batch_resume(target: Path, shown: str, batch: BatchFile, encoded: list,
                      runs: LineRuns) -> tuple[dict[Key, Span], list[tuple[Key, Span]]]:
    """(lines to keep, by (index, 0); error lines, run again) of an existing Batch API output, by custom_id:
    a line is kept when its custom_id is in the file now and it was produced from that request as it is now
    (its prompt's ids and settings); any other line refuses the run, as resume.read_for_resume does."""
    index = {r["custom_id"]: i for i, r in enumerate(batch.requests)}
    done: dict[Key, Span] = {}
    retry: list[tuple[Key, Span]] = []
    problems: list[str] = []
    with open(target, "rb") as f:
        end = 0
        for n, raw in enumerate(f, 1):
            span, end = (end, len(raw.removesuffix(b"\n").removesuffix(b"\r"))), end + len(raw)
            if not raw.strip():
                continue
            try:
                line = json.loads(raw.decode("utf-8"))
            except ValueError:
                if raw.endswith(b"\n"):  # else a last line cut short by a crash
                    problems.append(f"line {n} is not a Batch API output line")
                continue
            cid = line.get("custom_id") if isinstance(line, dict) else None
            i = index.get(cid) if isinstance(cid, str) else None
            if not isinstance(cid, str) or not isinstance(line.get("response"), dict):
                problems.append(f"line {n} is not a Batch API output line")
            elif i is None:
                problems.append(f"line {n}: custom_id {cid!r} is not in the prompts file now")
            elif line["response"].get("status_code") != 200:
                retry.append(((i, 0), span))
            elif isinstance(encoded[i], Exception):
                problems.append(f"line {n}: custom_id {cid!r} cannot run now ({encoded[i]})")
            elif line.get("id") != f"batch_req_{line_key(cid, runs.run(i), encoded[i])}":
                problems.append(f"line {n}: custom_id {cid!r} was produced from another request or other "
                                "settings")
            else:
                done[i, 0] = span
    if problems:
        count = f"{len(problems)} of {len(problems) + len(done) + len(retry)} lines differ"
        raise ConfigError(f"resume: {shown}: {problems[0]} ({count}); nothing was changed. Use a new output, "
                          "or resume: false to replace it")
    return done, [r for r in retry if r[0] not in done]
