"""The decoders: Qwen3 (dense) and Qwen3-MoE, picked by the checkpoint's config.json."""
from __future__ import annotations

from tp_engine.model_config import ModelConfig
from tp_engine.models.qwen3 import Qwen3ForCausalLM
from tp_engine.models.qwen3_moe import Qwen3MoeForCausalLM


def build_model(cfg: ModelConfig) -> Qwen3ForCausalLM:
    """The model `cfg` describes, sharded for this rank (on the default device and dtype)."""
    return Qwen3MoeForCausalLM(cfg) if cfg.moe is not None else Qwen3ForCausalLM(cfg)
