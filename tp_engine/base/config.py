"""Run configuration: the YAML schema, its defaults, `--set` overrides and validation.

Every key lives in one table (`SCHEMA`), so `--help`, validation and docs/configuration.md agree.
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tp_engine.base import config_checks as checks
from tp_engine.base.generation_config import GenerationConfigError, apply_sampling_defaults
from tp_engine.base.textio import canonical_json, load_yaml, read_utf8


class ConfigError(ValueError):
    """A problem with the user's configuration; the message names the key."""


@dataclass(frozen=True)
class Key:
    type: tuple  # accepted Python types
    default: Any
    help: str
    choices: tuple | None = None
    check: Any = None  # callable(value) -> error string or None


_INT, _FLOAT, _STR, _BOOL, _LIST, _NONE = (int,), (int, float), (str,), (bool,), (list,), (type(None),)

SCHEMA: dict[str, Key] = {
    "model": Key(_STR, None, "checkpoint directory (config.json + safetensors; tokenizer files for text prompts)"),
    "load_format": Key(_STR, "auto", "auto: safetensors from `model`; dummy: random weights from config.json alone", ("auto", "dummy")),
    "dtype": Key(_STR, "auto", "weights and activations; auto = the checkpoint's float16 or bfloat16 on CUDA (else "
                 "bfloat16), float32 on CPU", ("auto", "float32", "float16", "bfloat16")),
    "device": Key(_STR, "auto", "auto = cuda if available, else cpu", ("auto", "cpu", "cuda")),
    "seed": Key(_INT, 0, "seed for sampling and dummy weights, 0 <= seed < 2**32", check=checks.seed),
    "attention_backend": Key(_STR, "auto", "auto = flashinfer on CUDA, torch on CPU", ("auto", "flashinfer", "torch")),
    "cuda_graph": Key(_BOOL, True, "capture decode steps in CUDA graphs (CUDA only)"),
    "cuda_graph_max_batch": Key(_INT, 256, "largest decode batch captured in a CUDA graph",
                                check=checks.positive),
    "cuda_graph_max_tokens": Key(_INT, 4096, "prompt and mixed steps of up to this many tokens run as CUDA graphs "
                                 "in pieces around attention (TP 1); 0 = eager", check=checks.non_negative),
    "max_batch_size": Key(_INT, 256, "most requests in one decode batch", check=checks.positive),
    "max_prefill_tokens": Key(_INT, 8192, "most tokens in one step, decode rows (one token each) included; a longer "
                              "prompt is computed in chunks across steps while the others decode", check=checks.positive),
    "max_prefill_cost_while_decoding": Key(_INT, 4096, "while requests decode, the most prompt work in one step, in "
                                           "tokens that count their attention: a token at position c costs "
                                           "1 + c / (the model's attention span); 0 = no bound but max_prefill_tokens",
                                           check=checks.non_negative),
    "prefix_cache": Key(_BOOL, True, "share the KV pages of prompt prefixes between requests and generate calls"),
    "max_model_len": Key(_INT + _NONE, None, "longest prompt + output; default: max_position_embeddings", check=checks.positive),
    "kv_cache.page_size": Key(_INT, 16, "tokens per KV page", check=checks.positive),
    "kv_cache.num_pages": Key(_INT + _NONE, None, "KV pages; default: on CUDA what gpu_memory_utilization leaves "
                              "(the memory plan), on CPU up to 1 GiB per rank", check=checks.positive),
    "kv_cache.gpu_memory_utilization": Key(_FLOAT, 0.9, "share of the GPU's memory the engine may hold (weights, "
                                           "largest step, CUDA graphs, KV pool); the rest stays free",
                                           check=checks.fraction),
    "sampling.temperature": Key(_FLOAT, 0.0, "0 = greedy", check=checks.temperature),
    "sampling.top_k": Key(_INT, 0, "keep the k most likely tokens; 0 = off", check=checks.non_negative),
    "sampling.top_p": Key(_FLOAT, 1.0, "nucleus sampling mass, in (0, 1]", check=checks.fraction),
    "sampling.max_new_tokens": Key(_INT, 64, "most tokens generated per prompt", check=checks.positive),
    "sampling.ignore_eos": Key(_BOOL, False, "keep generating past EOS tokens"),
    "sampling.stop_token_ids": Key(_LIST, [], "extra token ids that end a request", check=checks.id_list),
    "sampling.stop": Key(_LIST, [], "strings that end a request (the text is cut before them)", check=checks.stop_strings),
    "sampling.n": Key(_INT, 1, "samples per prompt, one output line each (the prompt is encoded once)", check=checks.positive),
    "sampling.logprobs": Key(_INT, 0, "log-probabilities of each output token and of the K most likely ones, "
                             "0 <= K <= 20; 0 = off", check=checks.logprobs),
    "prompts": Key(_LIST + _NONE, None, "list of strings or {input_ids: [...]} or {messages: [...]}"),
    "prompts_file": Key(_STR + _NONE, None, "JSONL file, one {prompt: str}, {input_ids: [...]} or {messages: [...]} per line"),
    "chat": Key(_BOOL, False, "wrap prompts with the tokenizer's chat template"),
    "chat_template_kwargs": Key((dict,), {}, "extra template variables, e.g. {enable_thinking: false}",
                                check=checks.template_kwargs),
    "output": Key(_STR + _NONE, None, "JSONL results file, one line per prompt, in input order; unset or "
                  "\"-\": stdout"),
    "resume": Key(_BOOL, False, "keep `output`'s finished lines of this run's prompts and settings, run the rest"),
    "stream": Key(_BOOL, False, "print text as it is generated (a single prompt only)"),
    "progress": Key(_BOOL, True, "progress bar on a terminal, periodic log lines otherwise"),
    "fail_on_prompt_error": Key(_BOOL, False, "exit with status 3 when a prompt ends in error (false: 0, with a "
                                "warning and the count in the summary)"),
    "timeout_s": Key(_INT, 300, "longest wait in a collective before the job is declared stuck", check=checks.timeout),
    "advanced.all_reduce": Key(_STR, "auto", "all-reduce of messages up to 512 KB on CUDA: auto = at TP 2 push, else "
                               "symm, else nccl, at TP > 2 nccl; push = push, else symm, else nccl; symm = symm, "
                               "else nccl", ("auto", "push", "symm", "nccl")),
    "advanced.fused_kernels": Key(_STR, "auto", "fused Triton kernels on CUDA: auto = used when Triton imports and their "
                                  "self-test passes on every rank; on = the same, but a failure stops the start-up; "
                                  "off = torch ops", ("auto", "on", "off")),
    "advanced.fp8_gemm": Key(_STR, "weight_only", "block-FP8 checkpoints on CUDA, matmuls of several tokens: weight_only "
                             "= bf16 activations against the fp8 weights; w8a8 = activations quantized to fp8 per "
                             "token and 128 columns, fp8 x fp8", ("weight_only", "w8a8")),
    "advanced.step_channel": Key(_STR, "auto", "how rank 0 sends each step's message: shm = a shared-memory mailbox "
                                 "(ranks on one x86 host), gloo = the CPU process group; auto = shm on CUDA where "
                                 "possible, else gloo", ("auto", "shm", "gloo")),
}


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


SECTIONS = {dotted.rsplit(".", 1)[0] for dotted in SCHEMA if "." in dotted}  # sampling, kv_cache, advanced


def _flatten(d: dict, flat: dict[str, Any], written: dict[str, str], prefix: str = "") -> None:
    """Nested sections -> dotted keys, into `flat` over what it holds; a key `d` writes twice is refused (`written`).
    A mapping key (chat_template_kwargs) is given whole, or one entry at a time (`chat_template_kwargs.x`)."""
    for k, v in d.items():
        name = f"{prefix}{k}"
        parent, _, entry = name.partition(".")
        how = f"'{k}' in section '{prefix[:-1]}'" if prefix else f"'{k}'"
        if name not in SECTIONS and written.setdefault(name, how) != how:
            raise ConfigError(f"config key '{name}' is given twice: as {written[name]} and as {how}")
        if name in SECTIONS:
            if v is not None and not isinstance(v, dict):  # null: a section whose keys are all commented out
                first = next(s for s in SCHEMA if s.startswith(name + "."))
                raise ConfigError(f"config key '{name}' must be a mapping of its keys (such as '{first}'); got {v!r}")
            _flatten(v or {}, flat, written, name + ".")
        elif name not in SCHEMA and parent in SCHEMA and SCHEMA[parent].type == (dict,):
            flat[parent] = {**(flat.get(parent) if isinstance(flat.get(parent), dict) else {}), entry: v}
        else:
            flat[name] = v


def _apply_layer(layer: list[dict], flat: dict) -> None:
    """One layer (the file, keyword values, all --set) over the ones before; a layer that gives one of `prompts`
    and `prompts_file` drops the other from earlier layers: they are one choice."""
    given = {k for d in layer for k, v in d.items() if k in ("prompts", "prompts_file") and v is not None}
    if len(given) == 1:
        flat.pop(({"prompts", "prompts_file"} - given).pop(), None)
    for d in layer:
        _flatten(d, flat, {})


def _unknown(name: str, value: Any = None) -> ConfigError:
    """Naming the key meant: one written without its section (`top_p`), a misspelt section (`sample:`), or the closest."""
    bare = {d.rsplit(".", 1)[-1]: d for d in SCHEMA if "." in d}
    sections = difflib.get_close_matches(name, sorted(SECTIONS), n=1, cutoff=0.6) if isinstance(value, dict) else []
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
    """Defaults <- the checkpoint's generation_config.json (sampling keys) <- YAML file <- keyword values <- `--set`
    overrides, then validated. Returns a nested dict of the effective values."""
    flat: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {'is not a regular file' if p.exists() else 'not found'}: {path}")
        try:
            data = load_yaml(read_utf8(p, ConfigError)) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of keys, got {type(data).__name__}")
        _apply_layer([data], flat)
        base = p.parent
        # Relative paths in a config file are relative to the file's folder when that is where they exist.
        for k in ("model", "prompts_file"):
            v = flat.get(k)
            if isinstance(v, str) and not Path(v).is_absolute() and not Path(v).exists() and (base / v).exists():
                flat[k] = str(base / v)
    _apply_layer([values], flat)
    _apply_layer([dict([parse_override(text)]) for text in overrides or []], flat)
    cfg = defaults()
    for k, v in flat.items():
        if k not in SCHEMA:
            raise _unknown(k, v)
        if isinstance(v, bool) and SCHEMA[k].choices and "off" in SCHEMA[k].choices:
            v = "on" if v else "off"  # YAML 1.1 reads a bare on / off as true / false
        if k in ("model", "prompts_file", "output") and isinstance(v, str) and v.startswith("~"):
            v = os.path.expanduser(v)  # as a shell would: not a folder named "~" in the working directory
        if k == "output" and v == "-":
            v = None  # stdout, as without `output`
        _set_dotted(cfg, k, v)
    validate(cfg)
    try:  # the sampling keys nobody set take the checkpoint's values (`--set sampling.temperature=0` stays greedy)
        apply_sampling_defaults(cfg, set(flat))
    except GenerationConfigError as e:
        raise ConfigError(str(e)) from None
    return cfg


def get(cfg: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = cfg[part]
    return cfg


def check_value(name: str, key: Key, v: Any) -> None:
    """One value against its key's type, choices and range. `name` starts the message: "config key 'seed'" for
    the config, "SamplingParams.seed" for the Python API, so both say the same thing about the same value."""
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
    model = Path(cfg["model"])
    if model.is_file():
        raise ConfigError(f"config key 'model': {cfg['model']} is a file; give the checkpoint's folder (config.json, *.safetensors)")
    if not model.is_dir():
        where = "" if model.is_absolute() else f" (looked for from {os.getcwd()}; a path in the config file also from its folder)"
        raise ConfigError(f"config key 'model': directory not found: {cfg['model']}{where}")
    if cfg["output"] == "":  # not stdout unsaid: a path left empty by mistake, say by a shell variable
        raise ConfigError("config key 'output' is an empty string: give a file path, or \"-\" (or no "
                          "'output') for stdout")
    if cfg["resume"] and not cfg["output"]:
        raise ConfigError("config key 'resume' needs 'output': the results file to resume")


def _type_name(types: tuple) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
             dict: "a mapping", type(None): "null"}
    return " or ".join(dict.fromkeys(names[t] for t in types if not (t is int and float in types)))  # 1 is a number


def fingerprint(cfg: dict) -> str:
    """A short hash every rank compares at start-up, so ranks never run different configs."""
    return hashlib.sha256(canonical_json(cfg).encode()).hexdigest()[:16]
