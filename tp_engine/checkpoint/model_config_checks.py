"""Type checks of the config.json fields the engine reads, and ModelError, which every problem with the
checkpoint's config raises."""
from __future__ import annotations

import json
from typing import Any


class ModelError(ValueError):
    """A problem with the checkpoint's config.json or its fit to the TP size."""


# The config.json fields the engine reads, by type. Without these checks a wrong type ("4" for 4, null for
# a number) fails later as a TypeError that names neither the file nor the field.
_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "num_experts",
               "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step")
_DERIVED_WHEN_NULL = ("num_key_value_heads", "head_dim")  # null: from num_attention_heads and hidden_size
_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")
_BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "use_sliding_window", "norm_topk_prob")
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
    for key in _OPTIONAL_DICT_FIELDS:
        rope = raw.get(key)
        if isinstance(rope, dict) and "rope_theta" in rope:
            floats.append((f"{key}.rope_theta", rope["rope_theta"]))
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
    layers = raw.get("mlp_only_layers")
    if layers is not None and not (isinstance(layers, list) and all(_is_int(i) and i >= 0 for i in layers)):
        raise bad("mlp_only_layers", layers, "a list of layer numbers")
    window_layers = raw.get("max_window_layers")
    if window_layers is not None and not (_is_int(window_layers) and window_layers >= 0):
        raise bad("max_window_layers", window_layers, "an integer >= 0")
    for f in ("layer_types", "architectures"):
        v = raw.get(f)
        if v is not None and not (isinstance(v, list) and all(isinstance(t, str) for t in v)):
            raise bad(f, v, "a list of strings")
    check_eos(raw, where)


def check_heads_split(num_heads: int, kv: int, tp: int, lead: str = "") -> None:
    """The attention heads split across `tp` ranks, the KV heads split or replicated; else a ModelError that
    names the numbers (after `lead`, say the config file)."""
    if num_heads % tp:
        raise ModelError(f"{lead}cannot split num_attention_heads={num_heads} across tensor-parallel size "
                         f"{tp}: it must divide evenly")
    if kv % tp and tp % kv:
        raise ModelError(f"{lead}cannot split num_key_value_heads={kv} across tensor-parallel size {tp}: "
                         f"need {kv} % {tp} == 0 (split) or {tp} % {kv} == 0 (replicate)")


def check_eos(raw: dict, where: str) -> None:
    eos = raw.get("eos_token_id")
    if eos is not None and not (_is_int(eos) and eos >= 0) and \
            not (isinstance(eos, list) and all(_is_int(e) and e >= 0 for e in eos)):
        raise ModelError(f"{where}: field 'eos_token_id' must be a token id or a list of token ids, "
                         f"got {json.dumps(eos)}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
