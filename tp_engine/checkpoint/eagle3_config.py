"""The config.json of an EAGLE-3 draft head in the SpecForge / SGLang layout (architectures
["LlamaForCausalLMEagle3"]), checked against the target model it drafts for.

Fields read (transformers' Llama names):
  architectures               ["LlamaForCausalLMEagle3"] (required)
  num_hidden_layers           1 (required: one decoder layer, `midlayer`)
  hidden_size, intermediate_size, num_attention_heads (required); num_key_value_heads (default: the heads),
  head_dim (default: hidden_size / heads), rms_norm_eps (1e-6), max_position_embeddings
  rope_theta (10000), or rope_parameters.rope_theta; rope_scaling / rope_parameters of type default only
  vocab_size                  the target's vocabulary (required, must equal the target's)
  draft_vocab_size            rows of lm_head (default: vocab_size); d2t maps them to target ids
  target_hidden_size          the target's hidden size, fc takes 3 x it (default: hidden_size)
  eagle_config.eagle_aux_hidden_state_layer_ids
                              three target layers, SpecForge's and SGLang's convention: id j is the output
                              of target layer j (0-based), i.e. the residual stream entering layer j + 1
                              (SGLang's set_eagle3_layers_to_capture adds 1; SpecForge's trainer reads
                              transformers' hidden_states[j + 1]). Default: the streams entering layers 2,
                              L // 2 and L - 3 of an L-layer target (SGLang's and vLLM's default).
  eagle_config.use_aux_hidden_state  true (default)
  torch_dtype / dtype         the dtype the head was saved in (informational)
Refused, by name: other architectures (the speculators layout, Eagle3Speculator, included), more than one
layer, a bias anywhere (attention_bias, mlp_bias, bias), tie_word_embeddings, an activation other than silu,
norm_before_residual, RoPE scaling, a top-level eagle_aux_hidden_state_layer_ids (the speculators / vLLM
layout, where id j is the input of layer j). Other fields (model_type, bos/eos ids, ...) are ignored.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tp_engine.base.textio import read_json_object
from tp_engine.checkpoint.model_config import ModelConfig
from tp_engine.checkpoint.model_config_checks import ModelError, check_field_types, check_heads_split

ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYER_IDS = "eagle_config.eagle_aux_hidden_state_layer_ids"


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # covers the target's positions too: default RoPE needs no more
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]  # target layers whose input residual stream the head reads (0-based)
    torch_dtype: str | None
    source: str  # the config.json, for messages

    @classmethod
    def from_dir(cls, path: str, target: ModelConfig) -> "Eagle3Config":
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ModelError(f"{file} not found: the EAGLE-3 head directory needs a config.json")
        return cls.from_dict(read_json_object(file, ModelError), target, str(file))

    @classmethod
    def from_dict(cls, raw: dict, target: ModelConfig, where: str = "config.json") -> "Eagle3Config":
        check_field_types(raw, where)
        _check_supported(raw, where)
        heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
        kv = raw.get("num_key_value_heads") or heads
        head_dim = raw.get("head_dim") or hidden // heads
        if heads % kv:
            raise ModelError(
                f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
        if head_dim % 2:
            raise ModelError(f"{where}: head_dim={head_dim} must be even (RoPE rotates pairs of dimensions)")
        vocab = raw["vocab_size"]
        if vocab != target.vocab_size:
            raise ModelError(f"{where}: vocab_size={vocab} differs from the target's vocab_size="
                             f"{target.vocab_size}: the head belongs to another model")
        draft_vocab = _optional_int(raw, "draft_vocab_size", where) or vocab
        if draft_vocab > vocab:
            raise ModelError(f"{where}: draft_vocab_size={draft_vocab} is larger than vocab_size={vocab}")
        key = "target_hidden_size" if raw.get("target_hidden_size") is not None else "hidden_size"
        fc_in = _optional_int(raw, "target_hidden_size", where) or hidden
        if fc_in != target.hidden_size:
            raise ModelError(f"{where}: the head's fc takes 3 x {key}={fc_in} inputs, but the target's "
                             f"hidden_size is {target.hidden_size}: the head belongs to another model")
        rope = raw.get("rope_parameters") or {}
        return cls(hidden_size=hidden, intermediate_size=raw["intermediate_size"], num_heads=heads,
                   num_kv_heads=kv, head_dim=head_dim, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                   rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
                   max_position_embeddings=max(raw.get("max_position_embeddings") or 0,
                                               target.max_position_embeddings),
                   vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=fc_in,
                   aux_layers=_aux_layers(raw, target.num_layers, where),
                   torch_dtype=raw.get("dtype") or raw.get("torch_dtype"), source=where)

    def check_tp(self, tp: int) -> None:
        """Fail early, naming the numbers, when the head's layer cannot be split across `tp` ranks."""
        check_heads_split(self.num_heads, self.num_kv_heads, tp, f"{self.source}: ")
        if self.intermediate_size % tp:
            raise ModelError(f"{self.source}: cannot split intermediate_size={self.intermediate_size} across "
                             f"tensor-parallel size {tp}: it must divide evenly")


def _check_supported(raw: dict, where: str) -> None:
    """Refuse, naming the key, what the head implementation here does not compute."""
    arch = raw.get("architectures")
    if arch != [ARCHITECTURE]:
        hint = (" (the speculators layout; this engine reads the SpecForge / SGLang layout: midlayer.* "
                "tensors, a flat config.json)"
                if "Eagle3Speculator" in (arch or []) or "speculators_model_type" in raw else "")
        raise ModelError(f"{where}: architectures {json.dumps(arch)} is not an EAGLE-3 head this engine "
                         f"runs; it needs [\"{ARCHITECTURE}\"]{hint}")
    missing = [k for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                           "vocab_size") if k not in raw]
    if missing:
        raise ModelError(f"{where} is missing required field(s): {', '.join(missing)}")
    if raw["num_hidden_layers"] != 1:
        raise ModelError(f"{where}: num_hidden_layers={raw['num_hidden_layers']} is not supported "
                         "(an EAGLE-3 head here has exactly one decoder layer)")
    for key in ("attention_bias", "mlp_bias", "bias", "qkv_bias", "tie_word_embeddings",
                "norm_before_residual"):
        if raw.get(key):
            raise ModelError(f"{where}: {key}={json.dumps(raw[key])} is not supported (only false)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
    for key in ("rope_scaling", "rope_parameters"):
        rope = raw.get(key) or {}
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if kind != "default":
            raise ModelError(f"{where}: {key} of type {kind!r} is not supported (only default RoPE)")
    if "eagle_aux_hidden_state_layer_ids" in raw:
        raise ModelError(f"{where}: a top-level eagle_aux_hidden_state_layer_ids is the speculators / vLLM "
                         "layout (id j: the input of target layer j); this engine reads "
                         f"{LAYER_IDS} (SpecForge / SGLang: id j is the output of target layer j)")
    eagle = raw.get("eagle_config")
    if eagle is not None and not isinstance(eagle, dict):
        raise ModelError(f"{where}: field 'eagle_config' must be an object, got {json.dumps(eagle)}")
    if eagle is not None and eagle.get("use_aux_hidden_state", True) is not True:
        raise ModelError(f"{where}: eagle_config.use_aux_hidden_state="
                         f"{json.dumps(eagle['use_aux_hidden_state'])} is not supported (only true)")


def _optional_int(raw: dict, key: str, where: str) -> int | None:
    v = raw.get(key)
    if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise ModelError(f"{where}: field '{key}' must be an integer >= 1, got {json.dumps(v)}")
    return v


def _aux_layers(raw: dict, layers: int, where: str) -> tuple[int, ...]:
    """The target layers (0-based) whose input residual stream the head reads, in this engine's convention."""
    ids: Any = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        aux = (2, layers // 2, layers - 3)
        if not all(1 <= i < layers for i in aux) or not aux[0] < aux[1] < aux[2]:
            raise ModelError(f"{where}: the target has {layers} layers, too few for the default auxiliary "
                             f"layers; set {LAYER_IDS}")
        return aux
    ok = isinstance(ids, list) and len(ids) == 3 and all(isinstance(i, int) and not isinstance(i, bool)
                                                         for i in ids)
    if not ok or not all(0 <= i <= layers - 2 for i in ids) or not ids[0] < ids[1] < ids[2]:
        # ascending: the target gives its layers' outputs in order, the head reads them in the list's
        raise ModelError(f"{where}: {LAYER_IDS} must list 3 target layers in ascending order, each the "
                         f"output of a layer from 0 to {layers - 2} of the target's {layers}; got "
                         f"{json.dumps(ids)}")
    return tuple(i + 1 for i in ids)  # the output of layer j is the stream entering layer j + 1
