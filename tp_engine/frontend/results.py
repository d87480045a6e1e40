"""Rank 0's results: what the output lines were produced from, resuming from them, and writing them.

Every line carries `run`, a short hash of the settings that decide its tokens (`run_settings`); the settings
themselves are kept next to the output in `<output>.run.json`, so that a refused resume can say what changed.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

from tp_engine.base.config import SCHEMA, ConfigError
from tp_engine.frontend.output_file import SETTINGS_SUFFIX, Span, replace_text, rewrite_lines
from tp_engine.base.textio import canonical_json

TOKEN_SETTINGS = ("load_format", "seed", "chat", "chat_template_kwargs", "max_model_len")


def run_settings(cfg: dict, dtype: str, tp_size: int, max_positions: int | None = None,
                 fp8: bool = False) -> dict:
    """Everything that decides a prompt's output tokens. `dtype` is the one in use (`auto` resolved);
    `max_positions` the model's max_position_embeddings, which `max_model_len: null` stands for; `fp8`: the
    checkpoint has block-FP8 weights."""
    model = Path(cfg["model"]).resolve()
    settings = {"model": str(model), "dtype": dtype}
    for name in ("config.json", "generation_config.json"):
        f = model / name
        settings[name] = hashlib.sha256(f.read_bytes()).hexdigest()[:16] if f.is_file() else None
    if cfg["load_format"] != "dummy":  # weights written again in place (a new export): their size and time
        stats = [(f.name, f.stat()) for f in sorted(model.glob("*.safetensors")) if f.is_file()]
        settings["weights"] = [[name, st.st_size, st.st_mtime_ns] for name, st in stats]
    settings.update({k: cfg[k] for k in TOKEN_SETTINGS})
    if settings["max_model_len"] == max_positions:  # the default written out is the default
        settings["max_model_len"] = None
    # Not `n`: sample j's tokens do not depend on it, so a resume may ask for more samples. `logprobs` only
    # when on, so that lines written before the key existed keep their `run`.
    settings.update({f"sampling.{k}": v for k, v in cfg["sampling"].items()
                     if k != "n" and not (k == "logprobs" and v == 0)})
    # fp8 activations change tokens; only when on, so that older lines keep their `run`
    if fp8 and cfg["advanced"]["fp8_gemm"] != "weight_only":
        settings["advanced.fp8_gemm"] = cfg["advanced"]["fp8_gemm"]
    for k, v in settings.items():  # `temperature: 0` and `temperature: 0.0` are one setting
        if k in SCHEMA and float in SCHEMA[k].type and isinstance(v, int) and not isinstance(v, bool):
            settings[k] = float(v)
    if cfg["load_format"] == "dummy":
        settings["tp_size"] = tp_size  # dummy weights are drawn per rank
    return settings


def run_id(settings: dict) -> str:
    return hashlib.sha256(canonical_json(settings).encode()).hexdigest()[:12]


def settings_path(target: Path) -> Path:
    return target.with_name(target.name + SETTINGS_SUFFIX)


Key = tuple[int, int]  # (prompt index, sample)


def key(out: dict) -> Key:
    """A line's place: (prompt index, sample); lines without `sample` (n = 1) are sample 0."""
    return out["index"], out.get("sample", 0)


def read_for_resume(target: Path, shown: str, encoded: list, settings: dict,
                    samples: int = 1) -> tuple[dict[Key, Span], list[tuple[Key, Span]]]:
    """(finished lines to keep, by (index, sample); error lines, kept until their prompt has run again), as
    where they are in the file: a file of any size is read a line at a time.

    A finished line is kept only if this run would write it: its index is in the prompt list, its sample below
    `samples` (sampling.n), its prompt_token_ids are the prompt's ids now, and its `run` is this run's. Error
    lines are always retried, and so are lines cut by the request limit (`length` before max_new_tokens).
    Any other line (besides a last line cut short by a crash) refuses the run: nothing is deleted."""
    done: dict[Key, Span] = {}
    retry: list[tuple[Key, Span]] = []
    problems: list[str] = []
    this_run, saved = run_id(settings), _saved_settings(target)
    max_new = settings.get("sampling.max_new_tokens", 0)
    with open(target, "rb") as f:
        end = 0
        for n, raw in enumerate(f, 1):
            # the span ends before the line break, LF or CRLF
            span, end = (end, len(raw.removesuffix(b"\n").removesuffix(b"\r"))), end + len(raw)
            # an empty line, or a last line cut short by a crash (a whole one is checked like the rest)
            if not raw.strip() or not (raw.endswith(b"\n") or _parses(raw)):
                continue
            out = _parsed(raw)
            if out is None:
                problems.append(f"line {n} is not a result line")
                continue
            i, j = key(out)
            if out.get("finish_reason") == "error":
                if 0 <= i < len(encoded) and 0 <= j < samples:
                    retry.append(((i, j), span))
            elif not 0 <= i < len(encoded):
                problems.append(
                    f"line {n} is the result of prompt {i}, but there are {len(encoded)} prompts now")
            elif not 0 <= j < samples:
                problems.append(f"line {n} is sample {j} of prompt {i}, but sampling.n is {samples} now")
            elif out.get("run") != this_run:
                problems.append(_settings_change(saved, out.get("run"), settings, n))
            elif isinstance(encoded[i], Exception):
                problems.append(f"line {n}: prompt {i} cannot be encoded now ({encoded[i]})")
            elif out["prompt_token_ids"] != list(encoded[i]):
                problems.append(
                    f"line {n}: prompt {i} is not the prompt it was produced from (other token ids)")
            elif out.get("finish_reason") == "length" and len(out.get("output_token_ids") or ()) < max_new:
                retry.append(((i, j), span))  # cut by the request limit, which depends on the KV pool: rerun
            else:
                done[i, j] = span
    if problems:
        count = f"{len(problems)} of {len(problems) + len(done) + len(retry)} lines differ"
        raise ConfigError(f"resume: {shown}: {problems[0]} ({count}); nothing was changed. Use a new output, "
                          "or resume: false to replace it")
    return done, [r for r in retry if r[0] not in done]


def _parses(raw: bytes) -> bool:
    try:
        json.loads(raw.decode("utf-8"))
    except ValueError:  # not UTF-8, or not JSON
        return False
    return bool(raw.strip())


def _parsed(raw: bytes) -> dict | None:
    """A result line's object, or None for anything else."""
    try:
        out = json.loads(raw.decode("utf-8"))
    except ValueError:
        return None
    if (isinstance(out, dict) and isinstance(out.get("index"), int)
            and isinstance(out.get("prompt_token_ids"), list) and isinstance(out.get("sample", 0), int)
            and isinstance(out.get("output_token_ids", []), list)):
        return out
    return None


def _saved_settings(target: Path) -> dict:
    try:
        saved = json.loads(settings_path(target).read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _settings_change(saved: dict, line_run, settings: dict, n: int) -> str:
    """What differs between the settings `line_run` was produced with (`saved`, from <output>.run.json) and
    the current ones, by key."""
    if line_run is None:
        return f"line {n} has no run record (written by an older version)"
    if saved.get("run") != line_run or not isinstance(saved.get("settings"), dict):
        return f"line {n} was produced with other settings (run {line_run}, now {run_id(settings)})"
    old = saved["settings"]
    changes = [_weights_change(old.get(k) or [], settings.get(k) or []) if k == "weights" else
               f"{k}={_shown(old, k)}, now {_shown(settings, k)}"
               for k in sorted(set(old) | set(settings)) if old.get(k) != settings.get(k)]
    return "it was produced with " + "; ".join(changes)


def _shown(settings: dict, k: str) -> str:
    """A setting's value; a key the record leaves out (logprobs off) has its default."""
    return json.dumps(settings[k] if k in settings or k not in SCHEMA else SCHEMA[k].default)


def _weights_change(old: list, new: list) -> str:
    """The weight files' changes in words: [name, size, mtime_ns] each."""
    def when(ns):
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))
    was, now = {f[0]: f[1:] for f in old}, {f[0]: f[1:] for f in new}
    said = []
    for name in sorted(set(was) | set(now)):
        a, b = was.get(name), now.get(name)
        if a is None or b is None:
            said.append(f"{name} {'added' if a is None else 'gone'}")
        elif a[0] != b[0]:
            said.append(f"{name} size {a[0]:,} -> {b[0]:,} bytes")
        elif a != b:
            said.append(f"{name} written again ({when(a[1])} -> {when(b[1])}, the same size)")
    return "other weights: " + ", ".join(said)


class ResultSink:
    """Rank 0's results. With an output file, the file is left as it is until this run's first result exists;
    then it is replaced by the lines kept for resume plus that result, and each later result is appended and
    flushed the moment its request finishes (a crash loses only requests in flight). At the end the file is
    rewritten in input order. What stays in memory is where each line is, not the line: a job's size is
    bounded by its disk, not by rank 0's memory. Without a file the lines are kept (as JSON text) to be
    printed in input order at the end."""

    def __init__(self, target: Path | None, shown: str | None, settings: dict,
                 done: dict[Key, Span] | None = None, retry: list[tuple[Key, Span]] | None = None,
                 decode: Callable[[list[int]], str | None] | None = None) -> None:
        self.target, self.shown, self.settings, self.decode = target, shown, settings, decode
        self.run = run_id(settings)
        self.spans: dict[Key, Span] = dict(done or {})  # each result's line in the output file
        self.done_keys = set(self.spans)  # (index, sample) of the lines kept from an earlier run
        self.retry = list(retry or [])
        self.lines: dict[Key, str] = {}  # without an output file
        self.new = 0
        self.file = None
        self.printing = self.printed = False  # close() is printing the results to stdout; has printed them

    def add(self, out: dict) -> None:
        line = json.dumps({**out, "run": self.run})
        if self.target is None:
            self.lines[key(out)] = line
            self.new += 1
            return
        data = line.encode("utf-8")
        if self.file is None:  # the first result of this run: only now may the old file go
            write_settings(self.target, self.run, self.settings)
            kept = sorted(self.done_keys)
            spans = [self.spans[k] for k in kept] + [span for _, span in self.retry]
            starts = rewrite_lines(self.target, spans, data + b"\n")
            self.new += 1  # in the file from here on
            self.spans = {k: (start, length) for k, start, (_, length) in zip(kept, starts, spans)}
            self.file = self.target.open("ab")
            self.spans[key(out)] = (self.file.tell() - len(data) - 1, len(data))
        else:
            self.spans[key(out)] = (self.file.tell(), len(data))
            self.file.write(data + b"\n")
            self.file.flush()
            self.new += 1  # written: a result that could not be is not counted as kept

    def close(self) -> None:
        if self.target is not None:
            if not self.spans:
                return  # no result, none kept: the file stays as it was
            if self.file is not None:
                self.file.close()
            else:
                write_settings(self.target, self.run, self.settings)
            rewrite_lines(self.target, [self.spans[k] for k in sorted(self.spans)])
        elif sys.stdout.isatty() and self.decode is not None:  # a person is watching: show the text
            self.printing = True
            for k in sorted(self.lines):
                out = json.loads(self.lines[k])
                place = f"{out['index']}.{out['sample']}" if out.get("sample") else out["index"]
                head = f"[{place}] {out['finish_reason']}, {len(out['output_token_ids'])} tokens"
                # the thinking (dim) before the answer (bold): cut inside it, the answer is empty
                thinking = f"\033[2m{out['reasoning']}\033[0m\n\n" if out.get("reasoning") else ""
                body = out.get("error") or \
                    f"{self.decode(out['prompt_token_ids'])}{thinking}\033[1m{out['text']}\033[0m"
                print(f"\033[2m{head}\033[0m\n{body}\n")
            self.printed = True
        else:
            self.printing = True
            print_lines(self.lines[k] for k in sorted(self.lines))
            self.printed = True

    def on_stop(self) -> str:
        """The run is being stopped by a signal: keep what finished, and say where it is."""
        if self.target is not None:
            if self.new == 0 and not self.done_keys:
                return f"no result had finished; {self.shown} was left as it was"
            return f"finished results are in {self.shown}; run again with resume: true to continue"
        if self.printed:
            return "the results were printed to stdout"
        if self.printing:  # a second signal while close() printed them: stdout may end in a partial line
            return "stopped while the results were printed to stdout; the last line may be cut short"
        print_lines(self.lines[k] for k in sorted(self.lines))
        return f"{len(self.lines)} finished results were printed to stdout" if self.lines else \
            "no result had finished"


def write_settings(target: Path, run: str, settings: dict) -> None:
    text = json.dumps({"run": run, "settings": settings}, indent=1, default=str) + "\n"
    replace_text(settings_path(target), text)


def print_lines(lines: Iterable[str]) -> None:
    """Each line to stdout whole. Python's unbuffered stdout (PYTHONUNBUFFERED=1, common in job scripts) drops
    the rest of a write to a full pipe that a signal cuts short; here the bytes written are counted."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # stdout replaced by an object without a file
        sys.stdout.writelines(line + "\n" for line in lines)
        sys.stdout.flush()
        return
    for line in lines:
        data = memoryview((line + "\n").encode("utf-8"))
        while data:
            data = data[os.write(fd, data):]
