"""The checkpoint's config.json (and generation_config.json): the Qwen3 fields the engine reads (the dense
model's, and the experts' of Qwen3-MoE), and checks that the model is one this engine runs and that it splits
across the TP size."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tp_engine.base.textio import read_json_object

from tp_engine.checkpoint.model_config_checks import (ModelError, check_eos, check_field_types,
                                                     check_heads_split)
from tp_engine.checkpoint.quant import QuantConfig


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
        return cls.from_dict(_read_json(path), str(path), _generation_eos(Path(model_dir)))

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json",
                  extra_eos: tuple[int, ...] = ()) -> "ModelConfig":
        check_field_types(raw, where)
        arch = raw.get("architectures") or []
        kind_of_arch = {v: k for k, v in ARCHITECTURES.items()}
        kind = raw.get("model_type") or kind_of_arch.get(arch[0] if arch else None, "qwen3")
        runs = ("this engine runs Qwen3ForCausalLM (model_type qwen3) and Qwen3MoeForCausalLM "
                "(model_type qwen3_moe)")
        if arch and arch[0] not in ARCHITECTURES.values():
            raise ModelError(f"{where}: unsupported architecture {arch!r}; {runs}")
        if kind not in ARCHITECTURES:
            raise ModelError(f"{where}: unsupported model_type {kind!r}; {runs}")
        if arch and arch[0] != ARCHITECTURES[kind]:
            raise ModelError(
                f"{where}: model_type {kind!r} does not match architectures {arch!r}; {runs}")
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"]
        missing = [k for k in required if k not in raw]
        if missing:
            raise ModelError(f"{where} is missing required field(s): {', '.join(missing)}")
        sliding = _first_sliding_layer(raw, kind)
        if sliding is not None:
            raise ModelError(f"{where}: sliding-window attention is not supported (use_sliding_window=true "
                             f"with sliding_window={raw.get('sliding_window', 4096)} makes layer {sliding} "
                             "use it)")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelError(f"{where}: hidden_act {act!r} is not supported (only silu)")
        heads = raw["num_attention_heads"]
        # transformers 4.x writes rope_theta/rope_scaling at the top level, 5.x nests them in
        # rope_parameters. A rope_scaling beside rope_parameters (YaRN added as Qwen's model cards say)
        # replaces it in both versions.
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type != "default":
            raise ModelError(
                f"{where}: rope scaling type {rope_type!r} is not supported (only default RoPE)")
        try:
            quant = QuantConfig.from_dict(raw.get("quantization_config"))
        except ValueError as e:
            raise ModelError(f"{where}: {e}") from None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        # absent: transformers' default for the model type; null: derived from the heads, as there
        kv = raw.get("num_key_value_heads", 4 if kind == "qwen3_moe" else 32) or heads
        head_dim = raw.get("head_dim", None if kind == "qwen3_moe" else 128) or raw["hidden_size"] // heads
        if heads % kv:  # each KV head serves a whole group of query heads
            raise ModelError(
                f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
        if head_dim % 2:
            raise ModelError(
                f"{where}: head_dim={head_dim} must be even (RoPE rotates pairs of dimensions)")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
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

    @property
    def attention_span(self) -> float:
        """The context length at which a token's attention (4 x heads x head_dim FLOPs per layer and earlier
        token) costs as much as its matmuls (2 FLOPs per weight; the experts it runs, for MoE): about 3,840
        for Qwen3-0.6B, 23,600 for Qwen3-8B. The scheduler's exchange rate for deep prompt tokens."""
        h, d = self.hidden_size, self.head_dim
        inner = self.moe.top_k * self.moe.intermediate_size if self.moe else self.intermediate_size
        weights = h * d * 2 * (self.num_heads + self.num_kv_heads) + 3 * h * inner
        return 2 * weights / (4 * self.num_heads * d)

    def auto_dtype(self, device_type: str) -> str:
        """dtype `auto`: float32 on CPU; on CUDA the checkpoint's own half-precision dtype, else bfloat16."""
        half = self.torch_dtype if self.torch_dtype in ("float16", "bfloat16") else "bfloat16"
        return "float32" if device_type == "cpu" else half

    def check_tp(self, tp: int) -> None:
        """Fail early, naming the numbers, when the heads cannot be split across `tp` ranks."""
        check_heads_split(self.num_heads, self.num_kv_heads, tp)
        # each inner size must split only where a layer uses it (transformers runs the others as it does)
        sparse = [self.moe is not None and self.moe.is_sparse(i) for i in range(self.num_layers)]
        if not all(sparse) and self.intermediate_size % tp:
            raise ModelError(f"cannot split intermediate_size={self.intermediate_size} across "
                             f"tensor-parallel size {tp}: it must divide evenly")
        if any(sparse):
            self.moe.check_tp(tp)

    def too_big(self, error: Exception, device: Any, tp: int, itemsize: int) -> str:
        """What to say when the model ran out of memory as it was built (torch's `error`): config.json's
        sizes and about what they weigh."""
        # torch's CPU and CUDA wording
        asked = re.search(r"ried to allocate (\d[\d.]* ?[A-Za-z]+)", str(error))
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        inner = [self.moe.num_experts * self.moe.intermediate_size
                 if self.moe is not None and self.moe.is_sparse(i) else self.intermediate_size
                 for i in range(self.num_layers)]
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        lin = self.num_layers * h * (2 * q + 2 * kv) + 3 * h * sum(inner)  # one byte each in block-FP8
        params = emb + lin
        weight_bytes = emb * itemsize + lin * (1 if self.quant is not None else itemsize)
        at_once = f" (it asked for {asked[1]} at once)" if asked else ""
        return (f"the model does not fit in {device} memory{at_once}: "
                f"vocab_size {self.vocab_size}, hidden_size {h}, intermediate_size {self.intermediate_size} "
                f"and num_hidden_layers {self.num_layers} make about {params / 1e9:.3g}B parameters, "
                f"{weight_bytes / tp / 2**30:.3g} GiB a rank at TP {tp}; use more ranks or FP8 weights, "
                "or check those sizes")


def _first_sliding_layer(raw: dict, kind: str) -> int | None:
    """The first layer transformers runs with sliding-window attention, if any. None without both
    use_sliding_window and a sliding_window (Qwen3's configs have sliding_window null); else every layer of
    Qwen3-MoE, and the dense model's layers that `layer_types` marks, or without it those from
    max_window_layers (default 28) on."""
    # sliding_window absent: transformers' 4096
    if not raw.get("use_sliding_window") or raw.get("sliding_window", 4096) is None:
        return None
    if kind == "qwen3_moe":
        return 0
    types = raw.get("layer_types")
    if types is not None:
        return next((i for i, t in enumerate(types) if t == "sliding_attention"), None)
    start = 28 if raw.get("max_window_layers") is None else raw["max_window_layers"]
    return start if start < raw["num_hidden_layers"] else None


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    raw = _read_json(path)
    check_eos(raw, str(path))
    eos = raw.get("eos_token_id")
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
        required = (("num_experts", experts),
                    ("num_experts_per_tok", raw.get("num_experts_per_tok")),
                    ("moe_intermediate_size", raw.get("moe_intermediate_size")))
        missing = [k for k, v in required if v is None]
        if missing:
            raise ModelError(f"{where} is missing required field(s): {', '.join(missing)}")
        moe = cls(num_experts=experts, top_k=raw["num_experts_per_tok"],
                  intermediate_size=raw["moe_intermediate_size"],
                  norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                  decoder_sparse_step=raw.get("decoder_sparse_step", 1),
                  mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()))
        if experts and not 1 <= moe.top_k <= experts:
            raise ModelError(
                f"{where}: num_experts_per_tok={moe.top_k} must be between 1 and num_experts={experts}")
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
            raise ModelError(f"cannot split moe_intermediate_size={self.intermediate_size} across "
                             f"tensor-parallel size {tp}: it must divide evenly")


def _read_json(path: Path) -> dict:
    return read_json_object(path, ModelError)
