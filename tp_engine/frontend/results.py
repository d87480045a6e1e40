"""Rank 0's results: what the output lines were produced from, and writing them (resume.py reads them back).

Every line carries `run`, a short hash of the settings that decide its tokens (`run_settings`); the settings
themselves are kept next to the output in `<output>.run.json`, so that a refused resume can say what changed.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Callable, Iterable

from tp_engine.base.config import SCHEMA
from tp_engine.base.config_checks import CONSTRAINT_KEYS
from tp_engine.base.sampling_keys import over_constraint
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
    # output constraints only when set, for the same reason
    settings.update({f"sampling.{k}": v for k, v in cfg["sampling"].items() if k != "n"
                     and not (k == "logprobs" and v == 0) and not (k in CONSTRAINT_KEYS and v is None)})
    # fp8 activations change tokens; only when on, so that older lines keep their `run`
    if fp8 and cfg["advanced"]["fp8_gemm"] != "weight_only":
        settings["advanced.fp8_gemm"] = cfg["advanced"]["fp8_gemm"]
    if cfg["load_format"] == "dummy":
        settings["tp_size"] = tp_size  # dummy weights are drawn per rank
    return _as_floats(settings)


def _as_floats(settings: dict) -> dict:
    """`temperature: 0` and `temperature: 0.0` are one setting."""
    for k, v in settings.items():
        if k in SCHEMA and float in SCHEMA[k].type and isinstance(v, int) and not isinstance(v, bool):
            settings[k] = float(v)
    return settings


def prompt_settings(settings: dict, own: dict) -> dict:
    """The settings behind the lines of a prompt with its own `sampling` (checked, by SamplingParams field):
    the run's `settings` with those over them; `n` and `logprobs: 0` left out as run_settings leaves them."""
    out = dict(settings)
    for k, v in over_constraint(own).items():  # its own output constraint replaces the run's
        if k in CONSTRAINT_KEYS and v is None:
            out.pop(f"sampling.{k}", None)
        elif k != "n":
            out["seed" if k == "seed" else f"sampling.{k}"] = v
    if out.get("sampling.logprobs") == 0:
        del out["sampling.logprobs"]
    return _as_floats(out)


class LineRuns:
    """Each prompt's settings and `run`: the run's, or for a prompt with its own `sampling` (`own`, by prompt
    index) the run's with those over them. A job's prompts without their own share one record."""

    def __init__(self, settings: dict, own: dict[int, dict] | None = None) -> None:
        self.settings, self.own, self.base = settings, own or {}, run_id(settings)

    def of(self, index: int) -> dict:
        own = self.own.get(index)
        return self.settings if own is None else prompt_settings(self.settings, own)

    def run(self, index: int) -> str:
        return self.base if index not in self.own else run_id(self.of(index))

    def samples(self, index: int, n: int) -> int:
        """The prompt's sampling.n, `n` being the run's."""
        return self.own.get(index, {}).get("n", n)


def run_id(settings: dict) -> str:
    return hashlib.sha256(canonical_json(settings).encode()).hexdigest()[:12]


def settings_path(target: Path) -> Path:
    return target.with_name(target.name + SETTINGS_SUFFIX)


Key = tuple[int, int]  # (prompt index, sample)


def key(out: dict) -> Key:
    """A line's place: (prompt index, sample); lines without `sample` (n = 1) are sample 0."""
    return out["index"], out.get("sample", 0)


class ResultSink:
    """Rank 0's results. With an output file, the file is left as it is until this run's first result exists;
    then it is replaced by the lines kept for resume plus that result, and each later result is appended and
    flushed the moment its request finishes (a crash loses only requests in flight). At the end the file is
    rewritten in input order. What stays in memory is where each line is, not the line: a job's size is
    bounded by its disk, not by rank 0's memory. Without a file the lines are kept (as JSON text) to be
    printed in input order at the end."""

    def __init__(self, target: Path | None, shown: str | None, settings: dict,
                 done: dict[Key, Span] | None = None, retry: list[tuple[Key, Span]] | None = None,
                 decode: Callable[[list[int]], str | None] | None = None,
                 own: dict[int, dict] | None = None) -> None:
        """`own`: the prompts' own `sampling` settings, by index (their lines' `run` hashes those too)."""
        self.target, self.shown, self.settings, self.decode = target, shown, settings, decode
        self.runs = LineRuns(settings, own)
        self.run = self.runs.base
        self.spans: dict[Key, Span] = dict(done or {})  # each result's line in the output file
        self.done_keys = set(self.spans)  # (index, sample) of the lines kept from an earlier run
        self.retry = list(retry or [])
        self.lines: dict[Key, str] = {}  # without an output file
        self.new = 0
        self.file = None
        self.printing = self.printed = False  # close() is printing the results to stdout; has printed them

    @property
    def skip(self) -> set[Key]:
        """The (index, sample) pairs of the lines kept from an earlier run: generate() skips them."""
        return self.done_keys

    def line(self, out: dict) -> str:
        """The output line of a finished request."""
        return json.dumps({**out, "run": self.runs.run(out["index"])})

    def add(self, out: dict) -> None:
        line = self.line(out)
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
