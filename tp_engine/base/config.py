"""Run configuration: its defaults, the YAML file, `--set` overrides and validation.

Every key lives in one table (`SCHEMA`, in config_schema.py), so `--help`, validation and
docs/configuration.md agree.
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import os
from pathlib import Path
from typing import Any

import yaml

from tp_engine.base.config_checks import constraint_clash
from tp_engine.base.config_schema import SCHEMA, Key
from tp_engine.base.generation_config import GenerationConfigError, apply_sampling_defaults
from tp_engine.base.textio import canonical_json, load_yaml, read_utf8


class ConfigError(ValueError):
    """A problem with the user's configuration; the message names the key."""


def defaults() -> dict:
    out: dict = {}
    for dotted, key in SCHEMA.items():
        _set_dotted(out, dotted, copy.deepcopy(key.default))
    return out


def _set_dotted(d: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[leaf] = value


PATH_KEYS = ("model", "prompts_file", "output", "speculative.model")  # a leading ~ is the home folder
# the sections: sampling, kv_cache, advanced
SECTIONS = {dotted.rsplit(".", 1)[0] for dotted in SCHEMA if "." in dotted}


def _flatten(d: dict, flat: dict[str, Any], written: dict[str, str], prefix: str = "") -> None:
    """Nested sections -> dotted keys, into `flat` over what it holds; a key `d` writes twice is
    refused (`written`). A mapping key (chat_template_kwargs) is given whole, or one entry at a
    time (`chat_template_kwargs.x`)."""
    for k, v in d.items():
        name = f"{prefix}{k}"
        parent, _, entry = name.partition(".")
        how = f"'{k}' in section '{prefix[:-1]}'" if prefix else f"'{k}'"
        if name not in SECTIONS and written.setdefault(name, how) != how:
            raise ConfigError(f"config key '{name}' is given twice: as {written[name]} and as {how}")
        if name in SECTIONS:
            if v is not None and not isinstance(v, dict):  # null: a section whose keys are all commented out
                first = next(s for s in SCHEMA if s.startswith(name + "."))
                raise ConfigError(
                    f"config key '{name}' must be a mapping of its keys (such as '{first}'); got {v!r}")
            _flatten(v or {}, flat, written, name + ".")
        elif name not in SCHEMA and parent in SCHEMA and SCHEMA[parent].type == (dict,):
            earlier = flat.get(parent) if isinstance(flat.get(parent), dict) else {}
            flat[parent] = {**earlier, entry: v}
        else:
            flat[name] = v


def _apply_layer(layer: list[dict], flat: dict) -> None:
    """One layer (the file, keyword values, all --set) over the ones before; a layer that gives one of
    `prompts` and `prompts_file` drops the other from earlier layers: they are one choice."""
    given = {k for d in layer for k, v in d.items() if k in ("prompts", "prompts_file") and v is not None}
    if len(given) == 1:
        flat.pop(({"prompts", "prompts_file"} - given).pop(), None)
    for d in layer:
        _flatten(d, flat, {})


def _unknown(name: str, value: Any = None) -> ConfigError:
    """Naming the key meant: one written without its section (`top_p`), a misspelt section (`sample:`),
    or the closest."""
    bare = {d.rsplit(".", 1)[-1]: d for d in SCHEMA if "." in d}
    sections = []
    if isinstance(value, dict):
        sections = difflib.get_close_matches(name, sorted(SECTIONS), n=1, cutoff=0.6)
    # a bare name must be nearer (0.8): short ones sit within 0.6 of many typos ('tp' of 'stop')
    ratio = {c: difflib.SequenceMatcher(None, c, name).ratio() for c in [*SCHEMA, *bare]}
    near = [(r, c) for c, r in ratio.items() if r >= (0.8 if c in bare else 0.6)]
    close = sections or ([max(near)[1]] if near else [])
    hint = f"; did you mean '{bare.get(close[0], close[0])}'?" if close else ""
    return ConfigError(f"unknown config key '{name}'{hint}")


def parse_override(text: str) -> tuple[str, Any]:
    """`sampling.temperature=0.7` -> ("sampling.temperature", 0.7); the value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set expects dotted.key=value, got '{text}'")
    key, raw = text.split("=", 1)
    try:
        value = raw if raw in ("", "-") else load_yaml(raw)  # "-": stdout (`output`), not YAML's [null]
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key}: cannot parse value '{raw}': {e}") from None
    return key.strip(), value


def build_config(path: str | None = None, overrides: list[str] | None = None, **values: Any) -> dict:
    """Defaults <- the checkpoint's generation_config.json (sampling keys) <- YAML file <- keyword values
    <- `--set` overrides, then validated. Returns a nested dict of the effective values."""
    flat: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            what = "is not a regular file" if p.exists() else "not found"
            raise ConfigError(f"config file {what}: {path}")
        try:
            data = load_yaml(read_utf8(p, ConfigError)) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of keys, got {type(data).__name__}")
        _apply_layer([data], flat)
        base = p.parent
        # Relative paths in a config file are relative to the file's folder when that is where they exist.
        for k in ("model", "prompts_file", "speculative.model"):
            v = flat.get(k)
            relative = isinstance(v, str) and not Path(v).is_absolute()
            if relative and not Path(v).exists() and (base / v).exists():
                flat[k] = str(base / v)
    _apply_layer([values], flat)
    _apply_layer([dict([parse_override(text)]) for text in overrides or []], flat)
    cfg = defaults()
    for k, v in flat.items():
        if k not in SCHEMA:
            raise _unknown(k, v)
        if isinstance(v, bool) and SCHEMA[k].choices and "off" in SCHEMA[k].choices:
            v = "on" if v else "off"  # YAML 1.1 reads a bare on / off as true / false
        if k in PATH_KEYS and isinstance(v, str) and v.startswith("~"):
            v = os.path.expanduser(v)  # as a shell would: not a folder named "~" in the working directory
        if k == "output" and v == "-":
            v = None  # stdout, as without `output`
        _set_dotted(cfg, k, v)
    validate(cfg)
    # the sampling keys nobody set take the checkpoint's values (`--set sampling.temperature=0` stays greedy)
    try:
        apply_sampling_defaults(cfg, set(flat))
    except GenerationConfigError as e:
        raise ConfigError(str(e)) from None
    return cfg


def get(cfg: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = cfg[part]
    return cfg


def check_value(name: str, key: Key, v: Any) -> None:
    """One value against its key's type, choices and range. `name` starts the message:
    "config key 'seed'" for the config, "SamplingParams.seed" for the Python API, so both say the
    same thing about the same value."""
    if isinstance(v, bool) and bool not in key.type:
        raise ConfigError(f"{name} must be {_type_name(key.type)}, got {v!r}")
    if not isinstance(v, key.type):
        raise ConfigError(f"{name} must be {_type_name(key.type)}, got {v!r} ({type(v).__name__})")
    if key.choices and v not in key.choices:
        raise ConfigError(f"{name} must be one of {', '.join(key.choices)}; got {v!r}")
    if key.check and v is not None:
        err = key.check(v)
        if err:
            raise ConfigError(f"{name} {err}; got {v!r}")


def validate(cfg: dict) -> None:
    if not cfg["model"]:  # before the type checks, which would call a missing model "not a string"
        raise ConfigError("config key 'model' is required: the checkpoint directory")
    for dotted, key in SCHEMA.items():
        check_value(f"config key '{dotted}'", key, get(cfg, dotted))
    check_one_constraint(cfg["sampling"], "'sampling.", "'", lead="config keys ")
    model = Path(cfg["model"])
    if model.is_file():
        raise ConfigError(f"config key 'model': {cfg['model']} is a file; "
                          "give the checkpoint's folder (config.json, *.safetensors)")
    if not model.is_dir():
        where = ""
        if not model.is_absolute():
            where = f" (looked for from {os.getcwd()}; a path in the config file also from its folder)"
        raise ConfigError(f"config key 'model': directory not found: {cfg['model']}{where}")
    if cfg["output"] == "":  # not stdout unsaid: a path left empty by mistake, say by a shell variable
        raise ConfigError("config key 'output' is an empty string: give a file path, or \"-\" (or no "
                          "'output') for stdout")
    check_speculative(cfg["speculative"])
    if cfg["resume"] and not cfg["output"]:
        raise ConfigError("config key 'resume' needs 'output': the results file to resume")


def check_speculative(spec: dict) -> None:
    """The `speculative` keys together: a model for the methods that run one, a sane n-gram range."""
    method, model = spec["method"], spec["model"]
    if method in ("eagle3", "draft"):
        if not model:
            raise ConfigError(f"config key 'speculative.model' is required with speculative.method {method}: "
                              "the checkpoint directory of the " + ("EAGLE-3 head" if method == "eagle3"
                                                                    else "draft model"))
        if not Path(model).is_dir():
            raise ConfigError(f"config key 'speculative.model': directory not found: {model}")
    if spec["ngram_min"] > spec["ngram_max"]:
        raise ConfigError(f"config key 'speculative.ngram_min' ({spec['ngram_min']}) is larger than "
                          f"'speculative.ngram_max' ({spec['ngram_max']})")


def check_one_constraint(values: dict, prefix: str, suffix: str = "", lead: str = "") -> None:
    """At most one of the constraint keys (json_schema, regex, choice, grammar) in sampling settings `values`;
    the message names them as prefix + name + suffix, after `lead`."""
    both = constraint_clash(values)
    if len(both) > 1:
        names = lead + " and ".join(f"{prefix}{k}{suffix}" for k in both)
        raise ConfigError(f"{names} are {'both' if len(both) == 2 else 'all'} set: a request takes one "
                          "output constraint at most")


def _type_name(types: tuple) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
             dict: "a mapping", type(None): "null"}
    # int beside float says "a number" once: 1 is a number
    return " or ".join(dict.fromkeys(names[t] for t in types if not (t is int and float in types)))


def fingerprint(cfg: dict) -> str:
    """A short hash every rank compares at start-up, so ranks never run different configs."""
    return hashlib.sha256(canonical_json(cfg).encode()).hexdigest()[:16]
