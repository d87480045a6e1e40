"""Resuming a run: which lines of an existing output file it keeps, which it runs again, and what it refuses
(lines produced from other prompts or settings), reading the file a line at a time."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from tp_engine.base.config import SCHEMA, ConfigError
from tp_engine.frontend.openai_batch import BatchFile
from tp_engine.frontend.openai_batch_output import BatchSink, read_batch_resume
from tp_engine.frontend.output_file import Span
from tp_engine.frontend.prompts import PromptEncoder
from tp_engine.frontend.results import Key, LineRuns, ResultSink, key, run_id, settings_path

log = logging.getLogger("tp_engine")


def open_results(cfg: dict, target: Path | None, shown: str | None, prompts: list, encoded: list,
                 settings: dict, own: dict[int, dict], encoder: PromptEncoder) -> ResultSink:
    """The run's ResultSink, holding (with `resume` and an existing output) the lines it keeps and those it
    runs again; for an OpenAI Batch API file, a BatchSink, whose lines are that API's output lines."""
    batch = prompts if isinstance(prompts, BatchFile) else None
    n, done, retry = cfg["sampling"]["n"], {}, []
    if target is not None and cfg["resume"] and target.exists():
        if batch is not None:
            done, retry = read_batch_resume(target, shown, batch, encoded, LineRuns(settings, own))
        else:
            done, retry = read_for_resume(target, shown, encoded, settings, n, own)
    elif target is not None and cfg["resume"]:  # a relative output, say, from another working directory
        log.warning("resume: %s does not exist%s: nothing to resume, every prompt runs", shown,
                    f" ({target})" if str(target) != shown else "")
    if batch is None:
        return ResultSink(target, shown, settings, done, retry, encoder.decode if encoder.tokenizer else None,
                          own)
    tok = encoder.tokenizer  # a token's text, special tokens shown
    token = (lambda i: tok.decode([i])) if tok is not None else (lambda i: f"token_id:{i}")
    return BatchSink(batch, n, Path(cfg["model"]).name, token, target, shown, settings, done, retry, own=own)


def read_for_resume(target: Path, shown: str, encoded: list, settings: dict, samples: int = 1,
                    own: dict[int, dict] | None = None) -> tuple[dict[Key, Span], list[tuple[Key, Span]]]:
    """(finished lines to keep, by (index, sample); error lines, kept until their prompt has run again), as
    where they are in the file: a file of any size is read a line at a time.

    A finished line is kept only if this run would write it: its index is in the prompt list, its sample below
    `samples` (sampling.n), its prompt_token_ids are the prompt's ids now, and its `run` is this run's (for a
    prompt with its own `sampling`, `own` by index: the run's settings with those over them). Error
    lines are always retried, and so are lines cut by the request limit (`length` before max_new_tokens).
    Any other line (besides a last line cut short by a crash) refuses the run: nothing is deleted."""
    done: dict[Key, Span] = {}
    retry: list[tuple[Key, Span]] = []
    problems: list[str] = []
    runs, saved = LineRuns(settings, own), _saved_settings(target)
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
            n_i = runs.samples(i, samples)
            if out.get("finish_reason") == "error":
                if 0 <= i < len(encoded) and 0 <= j < n_i:
                    retry.append(((i, j), span))
            elif not 0 <= i < len(encoded):
                problems.append(
                    f"line {n} is the result of prompt {i}, but there are {len(encoded)} prompts now")
            elif not 0 <= j < n_i:
                problems.append(f"line {n} is sample {j} of prompt {i}, but its sampling.n is {n_i} now"
                                if i in runs.own else
                                f"line {n} is sample {j} of prompt {i}, but sampling.n is {samples} now")
            elif out.get("run") != runs.run(i):
                problems.append(_settings_change(saved, out.get("run"), runs, i, n))
            elif isinstance(encoded[i], Exception):
                problems.append(f"line {n}: prompt {i} cannot be encoded now ({encoded[i]})")
            elif out["prompt_token_ids"] != list(encoded[i]):
                problems.append(
                    f"line {n}: prompt {i} is not the prompt it was produced from (other token ids)")
            elif out.get("finish_reason") == "length" and \
                    len(out.get("output_token_ids") or ()) < runs.of(i).get("sampling.max_new_tokens", 0):
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


def _settings_change(saved: dict, line_run, runs: LineRuns, i: int, n: int) -> str:
    """What differs between the settings `line_run` was produced with (`saved`, from <output>.run.json) and
    prompt i's now, by key."""
    settings = runs.of(i)
    if line_run is None:
        return f"line {n} has no run record (written by an older version)"
    if saved.get("run") != line_run or not isinstance(saved.get("settings"), dict):
        own = f"; the run's settings are the same: prompt {i}'s own sampling differs" \
            if saved.get("run") == runs.base else ""
        return f"line {n} was produced with other settings (run {line_run}, now {run_id(settings)}){own}"
    old = saved["settings"]
    changes = [_weights_change(old.get(k) or [], settings.get(k) or []) if k == "weights" else
               f"{k}={_shown(old, k)}, now {_shown(settings, k)}"
               for k in sorted(set(old) | set(settings)) if old.get(k) != settings.get(k)]
    what = f"line {n}: prompt {i}, with its own sampling, was" if i in runs.own else "it was"
    return f"{what} produced with " + "; ".join(changes)


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
