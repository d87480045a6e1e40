"""Sampling defaults from the checkpoint's generation_config.json (Qwen3: do_sample true, temperature 0.6,
top_k 20, top_p 0.95), for the `sampling` keys the config leaves unset.

They apply only when the file says do_sample: true, as in transformers, where a generation_config without
it decodes greedily (transformers' save_pretrained writes such files for any model). With do_sample: true,
a field the file leaves out takes transformers' GenerationConfig default (temperature 1.0, top_k 50,
top_p 1.0), which is what transformers would sample with.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from tp_engine.base.textio import read_json_object

HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
# Fields transformers' generate applies that this engine does not (its logits processors, beam search),
# with the value that leaves the tokens alone (null too): a file with another value gets a warning, since
# the tokens differ. All but the SAMPLING_ONLY ones act in greedy decoding too.
UNAPPLIED = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "sequence_bias": [], "bad_words_ids": [],
             "min_length": 0, "min_new_tokens": 0, "forced_bos_token_id": None, "forced_eos_token_id": None,
             "remove_invalid_values": False, "exponential_decay_length_penalty": None, "suppress_tokens": [],
             "begin_suppress_tokens": [], "guidance_scale": 1.0, "num_beams": 1, "watermarking_config": None,
             "min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None}
SAMPLING_ONLY = ("min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")
log = logging.getLogger("tp_engine")


class GenerationConfigError(ValueError):
    """generation_config.json cannot be read or has a field of the wrong type; the message names the file."""


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_CHECKS = {  # field: (is it valid, what it must be)
    "temperature": (lambda v: _number(v) and v >= 0, "a number >= 0"),
    "top_k": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer >= 0"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
}


def sampling_defaults(model_dir: str) -> dict[str, Any]:
    """{temperature, top_k, top_p} from `model_dir`/generation_config.json; {} without the file or without
    do_sample: true."""
    path, raw = _read(model_dir)
    if not raw.get("do_sample"):
        return {}
    out = {}
    for name, default in HF_DEFAULTS.items():
        v = raw.get(name)
        if v is None:
            v = default
        ok, want = _CHECKS[name]
        if not ok(v):
            raise GenerationConfigError(f"{path}: field '{name}' must be {want}, got {json.dumps(v)}")
        out[name] = v
    return out


def _read(model_dir: str) -> tuple[Path, dict]:
    """generation_config.json's path and fields ({} without the file), with `do_sample` checked."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return path, {}
    raw = read_json_object(path, GenerationConfigError)
    do_sample = raw.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise GenerationConfigError(f"{path}: field 'do_sample' must be true or false, got "
                                    f"{json.dumps(do_sample)}")
    return path, raw


def unapplied_warning(model_dir: str) -> str | None:
    """The warning for generation_config.json's fields that transformers' generate applies and this engine
    does not (UNAPPLIED), when the file holds any with another value than its neutral one; else None."""
    path, raw = _read(model_dir)
    unapplied = [f"{k} {json.dumps(raw[k])}" for k, neutral in UNAPPLIED.items()
                 if raw.get(k) not in (neutral, None) and (raw.get("do_sample") or k not in SAMPLING_ONLY)]
    if not unapplied:
        return None
    return f"{path} sets {', '.join(unapplied)}, which this engine does not apply: its tokens differ from " \
        "transformers' generate with that file"


def apply_sampling_defaults(cfg: dict, explicit: set[str]) -> None:
    """cfg's sampling keys that are not in `explicit` (dotted keys the user set) take the
    checkpoint's values."""
    applied = {k: v for k, v in sampling_defaults(cfg["model"]).items() if f"sampling.{k}" not in explicit}
    if applied:
        cfg["sampling"].update(applied)
        log.info("sampling defaults from %s/generation_config.json (keys not set in the config): %s",
                 cfg["model"], ", ".join(f"{k}={v}" for k, v in applied.items()))
