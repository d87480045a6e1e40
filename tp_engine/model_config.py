"""The checkpoint's config.json (and generation_config.json): the Qwen3 fields the engine reads (the dense
model's, and the experts' of Qwen3-MoE), and checks that the model is one this engine runs and that it splits
across the TP size."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tp_engine.quant import QuantConfig


class ModelError(ValueError):
    """A problem with the checkpoint's config.json or its fit to the TP size."""


ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}  # model_type -> class name


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
    moe: MoeConfig | None = None  # Qwen3-MoE (model_type qwen3_moe): the experts; None for the dense model
    quant: QuantConfig | None = None  # block-FP8 weights (quantization_config); None: unquantized

    @classmethod
    def from_dir(cls, model_dir: str) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelError(f"{path} not found: the model directory needs a config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(raw, str(path), _generation_eos(Path(model_dir)))

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json", extra_eos: tuple[int, ...] = ()) -> "ModelConfig":
        arch = raw.get("architectures") or []
        kind = raw.get("model_type") or {v: k for k, v in ARCHITECTURES.items()}.get(arch[0] if arch else None, "qwen3")
        if kind not in ARCHITECTURES or (arch and arch[0] != ARCHITECTURES[kind]):
            raise ModelError(f"{where}: unsupported architecture {arch or raw.get('model_type')!r}; "
                             "this engine runs Qwen3ForCausalLM (model_type qwen3) and Qwen3MoeForCausalLM "
                             "(model_type qwen3_moe)")
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
        try:
            quant = QuantConfig.from_dict(raw.get("quantization_config"))
        except ValueError as e:
            raise ModelError(f"{where}: {e}") from None
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
            moe=MoeConfig.from_dict(raw, where) if kind == "qwen3_moe" else None,
            quant=quant,
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
        dense_layers = self.moe is None or any(not self.moe.is_sparse(i) for i in range(self.num_layers))
        if dense_layers and self.intermediate_size % tp:
            raise ModelError(f"cannot split intermediate_size={self.intermediate_size} across tensor-parallel "
                             f"size {tp}: it must divide evenly")
        if self.moe is not None:
            self.moe.check_tp(tp)


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except json.JSONDecodeError as e:
        raise ModelError(f"{path} is not valid JSON: {e}") from None
    return tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])


@dataclass(frozen=True)
class MoeConfig:
    """The experts of Qwen3-MoE, under transformers' config.json names."""

    num_experts: int  # num_experts (transformers 5.x writes num_local_experts)
    top_k: int  # num_experts_per_tok: experts each token runs
    intermediate_size: int  # moe_intermediate_size: the inner width of each expert
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    decoder_sparse_step: int  # every this-many-th layer is sparse ...
    mlp_only_layers: tuple[int, ...]  # ... except these, which keep a dense MLP of intermediate_size

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> "MoeConfig":
        experts = raw.get("num_experts", raw.get("num_local_experts"))
        missing = [k for k, v in (("num_experts", experts), ("num_experts_per_tok", raw.get("num_experts_per_tok")),
                                  ("moe_intermediate_size", raw.get("moe_intermediate_size"))) if v is None]
        if missing:
            raise ModelError(f"{where} is missing required field(s): {', '.join(missing)}")
        moe = cls(num_experts=experts, top_k=raw["num_experts_per_tok"],
                  intermediate_size=raw["moe_intermediate_size"], norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                  decoder_sparse_step=raw.get("decoder_sparse_step", 1),
                  mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()))
        if experts and not 1 <= moe.top_k <= experts:
            raise ModelError(f"{where}: num_experts_per_tok={moe.top_k} must be between 1 and num_experts={experts}")
        if moe.decoder_sparse_step < 1:
            raise ModelError(f"{where}: decoder_sparse_step={moe.decoder_sparse_step} must be >= 1")
        return moe

    def is_sparse(self, layer_id: int) -> bool:
        """Whether layer `layer_id` routes to experts (the rule of transformers' Qwen3MoeDecoderLayer)."""
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    def check_tp(self, tp: int) -> None:
        # every rank holds a slice of every expert's inner dimension (docs/tensor-parallelism.md)
        if self.intermediate_size % tp:
            raise ModelError(f"cannot split moe_intermediate_size={self.intermediate_size} across tensor-parallel "
                             f"size {tp}: it must divide evenly")
