"""Run configuration: the YAML schema, its defaults, `--set` overrides and validation.

Every key lives in one table (`SCHEMA`), so `--help`, validation and docs/configuration.md agree.
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tp_engine.textio import decode_utf8


class ConfigError(ValueError):
    """A problem with the user's configuration; the message names the key."""


@dataclass(frozen=True)
class Key:
    type: tuple  # accepted Python types
    default: Any
    help: str
    choices: tuple | None = None
    check: Any = None  # callable(value) -> error string or None


def _positive(v):
    return None if v >= 1 else "must be >= 1"


def _non_negative(v):
    return None if v >= 0 else "must be >= 0"


def _top_p(v):
    return None if 0 < v <= 1 else "must be in (0, 1]"


def _fraction(v):
    return None if 0 < v <= 1 else "must be in (0, 1]"


def _seed(v):
    return None if 0 <= v < SEED_LIMIT else "must be in [0, 2**32)"


def _id_list(v):
    return None if all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v) else "must be a list of non-negative integers"


def _str_list(v):
    return None if all(isinstance(x, str) and x for x in v) else "must be a list of non-empty strings"


SEED_LIMIT = 2**32  # the engine draws with seed * 1_000_003 + index in int64: far from overflow below this
_INT, _FLOAT, _STR, _BOOL, _LIST, _NONE = (int,), (int, float), (str,), (bool,), (list,), (type(None),)

SCHEMA: dict[str, Key] = {
    "model": Key(_STR, None, "checkpoint directory (config.json + safetensors; tokenizer files for text prompts)"),
    "load_format": Key(_STR, "auto", "auto: safetensors from `model`; dummy: random weights from config.json alone", ("auto", "dummy")),
    "dtype": Key(_STR, "auto", "weights and activations; auto = bfloat16 on CUDA, float32 on CPU", ("auto", "float32", "float16", "bfloat16")),
    "device": Key(_STR, "auto", "auto = cuda if available, else cpu", ("auto", "cpu", "cuda")),
    "seed": Key(_INT, 0, "seed for sampling and dummy weights, 0 <= seed < 2**32", check=_seed),
    "attention_backend": Key(_STR, "auto", "auto = flashinfer on CUDA, torch on CPU", ("auto", "flashinfer", "torch")),
    "cuda_graph": Key(_BOOL, True, "capture decode steps in CUDA graphs (CUDA only)"),
    "cuda_graph_max_batch": Key(_INT, 256, "largest decode batch captured in a CUDA graph", check=_positive),
    "max_batch_size": Key(_INT, 256, "most requests in one decode batch", check=_positive),
    "max_prefill_tokens": Key(_INT, 8192, "most prompt tokens in one prefill batch (a longer prompt runs alone)", check=_positive),
    "max_model_len": Key(_INT + _NONE, None, "longest prompt + output; default: max_position_embeddings", check=_positive),
    "kv_cache.page_size": Key(_INT, 16, "tokens per KV page", check=_positive),
    "kv_cache.num_pages": Key(_INT + _NONE, None, "KV pages; default: from free GPU memory on CUDA, on CPU up to 1 GiB per rank", check=_positive),
    "kv_cache.gpu_memory_utilization": Key(_FLOAT, 0.9, "fraction of free GPU memory (after weights) the KV pool takes", check=_fraction),
    "sampling.temperature": Key(_FLOAT, 0.0, "0 = greedy", check=_non_negative),
    "sampling.top_k": Key(_INT, 0, "keep the k most likely tokens; 0 = off", check=_non_negative),
    "sampling.top_p": Key(_FLOAT, 1.0, "nucleus sampling mass, in (0, 1]", check=_top_p),
    "sampling.max_new_tokens": Key(_INT, 64, "most tokens generated per prompt", check=_positive),
    "sampling.ignore_eos": Key(_BOOL, False, "keep generating past EOS tokens"),
    "sampling.stop_token_ids": Key(_LIST, [], "extra token ids that end a request", check=_id_list),
    "sampling.stop": Key(_LIST, [], "strings that end a request (the text is cut before them)", check=_str_list),
    "prompts": Key(_LIST + _NONE, None, "list of strings or {input_ids: [...]} or {messages: [...]}"),
    "prompts_file": Key(_STR + _NONE, None, "JSONL file, one {prompt: str}, {input_ids: [...]} or {messages: [...]} per line"),
    "chat": Key(_BOOL, False, "wrap prompts with the tokenizer's chat template"),
    "chat_template_kwargs": Key((dict,), {}, "extra template variables, e.g. {enable_thinking: false}"),
    "output": Key(_STR + _NONE, None, "JSONL results file, one line per prompt, in input order; unset: stdout"),
    "resume": Key(_BOOL, False, "skip prompts whose index is already in `output`"),
    "stream": Key(_BOOL, False, "print text as it is generated (a single prompt only)"),
    "progress": Key(_BOOL, True, "progress bar on a terminal, periodic log lines otherwise"),
    "timeout_s": Key(_INT, 300, "longest wait in a collective before the job is declared stuck", check=_positive),
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


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and any(s.startswith(name + ".") for s in SCHEMA):
            flat.update(_flatten(v, name + "."))
        else:
            flat[name] = v
    return flat


def _unknown(name: str) -> ConfigError:
    close = difflib.get_close_matches(name, list(SCHEMA), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown config key '{name}'{hint}")


def parse_override(text: str) -> tuple[str, Any]:
    """`sampling.temperature=0.7` -> ("sampling.temperature", 0.7); the value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set expects dotted.key=value, got '{text}'")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key}: cannot parse value '{raw}': {e}") from None
    return key.strip(), value


def build_config(path: str | None = None, overrides: list[str] | None = None, **values: Any) -> dict:
    """Defaults <- YAML file <- keyword values <- `--set` overrides, then validated. Returns a nested dict."""
    flat: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = yaml.safe_load(decode_utf8(p.read_bytes(), str(p), ConfigError)) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of keys, got {type(data).__name__}")
        flat.update(_flatten(data))
        base = p.parent
        # Relative paths in a config file are relative to the file's folder when that is where they exist.
        for k in ("model", "prompts_file"):
            v = flat.get(k)
            if isinstance(v, str) and not Path(v).is_absolute() and not Path(v).exists() and (base / v).exists():
                flat[k] = str(base / v)
    flat.update(_flatten(values))
    for text in overrides or []:
        k, v = parse_override(text)
        flat[k] = v
    cfg = defaults()
    for k, v in flat.items():
        if k not in SCHEMA:
            raise _unknown(k)
        _set_dotted(cfg, k, v)
    validate(cfg)
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
    for dotted, key in SCHEMA.items():
        check_value(f"config key '{dotted}'", key, get(cfg, dotted))
    if not cfg["model"]:
        raise ConfigError("config key 'model' is required: the checkpoint directory")
    if not Path(cfg["model"]).is_dir():
        raise ConfigError(f"config key 'model': directory not found: {cfg['model']}")


def _type_name(types: tuple) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
             dict: "a mapping", type(None): "null"}
    return " or ".join(dict.fromkeys(names[t] for t in types))


def fingerprint(cfg: dict) -> str:
    """A short hash every rank compares at start-up, so ranks never run different configs."""
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]


def describe() -> str:
    """Every key with its default, for `--help`."""
    lines = []
    for dotted, key in SCHEMA.items():
        choices = f" [{'|'.join(key.choices)}]" if key.choices else ""
        lines.append(f"  {dotted} = {json.dumps(key.default)}{choices}\n      {key.help}")
    return "\n".join(lines)


class ModelError(ValueError):
    """A problem with the checkpoint's config.json or its fit to the TP size."""


@dataclass(frozen=True)
class ModelConfig:
    """The Qwen3 fields the engine reads from config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None

    @classmethod
    def from_dir(cls, model_dir: str) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelError(f"{path} not found: the model directory needs a config.json")
        return cls.from_dict(_read_json(path), str(path), _generation_eos(Path(model_dir)))

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json", extra_eos: tuple[int, ...] = ()) -> "ModelConfig":
        check_field_types(raw, where)
        arch = raw.get("architectures") or []
        if raw.get("model_type") not in (None, "qwen3") or (arch and arch[0] != "Qwen3ForCausalLM"):
            raise ModelError(f"{where}: unsupported architecture {arch or raw.get('model_type')!r}; "
                             "this engine runs Qwen3ForCausalLM (model_type qwen3)")
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if k not in raw]
        if missing:
            raise ModelError(f"{where} is missing required field(s): {', '.join(missing)}")
        if raw.get("use_sliding_window"):
            raise ModelError(f"{where}: use_sliding_window=true is not supported")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelError(f"{where}: hidden_act {act!r} is not supported (only silu)")
        heads = raw["num_attention_heads"]
        # transformers 4.x writes rope_theta/rope_scaling at the top level, 5.x nests them in rope_parameters.
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or {}
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise ModelError(f"{where}: rope scaling type {rope_type!r} is not supported (only default RoPE)")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            eos_token_ids=tuple(dict.fromkeys(eos_ids + extra_eos)),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )

    def check_tp(self, tp: int) -> None:
        """Fail early, naming the numbers, when the heads cannot be split across `tp` ranks."""
        if self.num_heads % tp:
            raise ModelError(f"cannot split num_attention_heads={self.num_heads} across tensor-parallel size {tp}: "
                             "it must divide evenly")
        kv = self.num_kv_heads
        if kv % tp and tp % kv:
            raise ModelError(f"cannot split num_key_value_heads={kv} across tensor-parallel size {tp}: "
                             f"need {kv} % {tp} == 0 (split) or {tp} % {kv} == 0 (replicate)")
        if self.intermediate_size % tp:
            raise ModelError(f"cannot split intermediate_size={self.intermediate_size} across tensor-parallel "
                             f"size {tp}: it must divide evenly")


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    raw = _read_json(path)
    _check_eos(raw, str(path))
    eos = raw.get("eos_token_id")
    return tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])


def _read_json(path: Path) -> dict:
    try:
        raw = json.loads(decode_utf8(path.read_bytes(), str(path), ModelError))
    except json.JSONDecodeError as e:
        raise ModelError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


# The config.json fields the engine reads, by type. Without these checks a wrong type ("4" for 4, null for a
# number) fails later as a TypeError that names neither the file nor the field.
_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings")
_DERIVED_WHEN_NULL = ("num_key_value_heads", "head_dim")  # null: from num_attention_heads and hidden_size
_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")
_BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "use_sliding_window")
_OPTIONAL_STR_FIELDS = ("model_type", "hidden_act", "dtype", "torch_dtype")
_OPTIONAL_DICT_FIELDS = ("rope_parameters", "rope_scaling")


def check_field_types(raw: Any, where: str) -> None:
    """Raise ModelError naming `where` (config.json) and the field when a field the engine reads has the
    wrong type or an impossible value."""
    if not isinstance(raw, dict):
        raise ModelError(f"{where} must hold a JSON object, got {type(raw).__name__}")

    def bad(field: str, value: Any, want: str) -> ModelError:
        return ModelError(f"{where}: field '{field}' must be {want}, got {json.dumps(value)}")

    for f in _INT_FIELDS:
        v = raw.get(f)
        if f in raw and not (v is None and f in _DERIVED_WHEN_NULL) and not (_is_int(v) and v >= 1):
            raise bad(f, v, "an integer >= 1")
    floats = [(f, raw[f]) for f in _FLOAT_FIELDS if f in raw]
    rope = raw.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        floats.append(("rope_parameters.rope_theta", rope["rope_theta"]))
    for f, v in floats:
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")):
            raise bad(f, v, "a positive number")
    for f in _BOOL_FIELDS:
        if f in raw and not isinstance(raw[f], bool):
            raise bad(f, raw[f], "true or false")
    for f in _OPTIONAL_STR_FIELDS:
        if raw.get(f) is not None and not isinstance(raw[f], str):
            raise bad(f, raw[f], "a string")
    for f in _OPTIONAL_DICT_FIELDS:
        if raw.get(f) is not None and not isinstance(raw[f], dict):
            raise bad(f, raw[f], "an object")
    arch = raw.get("architectures")
    if arch is not None and not (isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
        raise bad("architectures", arch, "a list of strings")
    _check_eos(raw, where)


def _check_eos(raw: dict, where: str) -> None:
    eos = raw.get("eos_token_id")
    if eos is not None and not (_is_int(eos) and eos >= 0) and \
            not (isinstance(eos, list) and all(_is_int(e) and e >= 0 for e in eos)):
        raise ModelError(f"{where}: field 'eos_token_id' must be a token id or a list of token ids, "
                         f"got {json.dumps(eos)}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
