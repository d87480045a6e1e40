"""The decoders: Qwen3 (dense) and Qwen3-MoE, picked by the checkpoint's config.json."""
from __future__ import annotations

import torch

from tp_engine.layers.fp8 import finish_loading, quantize_linears
from tp_engine.checkpoint.loader import init_dummy, load_checkpoint
from tp_engine.checkpoint.model_config import ModelConfig
from tp_engine.models.qwen3 import Qwen3ForCausalLM
from tp_engine.models.qwen3_moe import Qwen3MoeForCausalLM


def build_model(cfg: ModelConfig) -> Qwen3ForCausalLM:
    """The model `cfg` describes, sharded for this rank (on the default device and dtype; a block-FP8 model's
    linear weights as meta placeholders: qwen3.weight_device)."""
    return Qwen3MoeForCausalLM(cfg) if cfg.moe is not None else Qwen3ForCausalLM(cfg)


def load_model(mc: ModelConfig, cfg: dict, dtype: torch.dtype, device: torch.device, rank: int) -> Qwen3ForCausalLM:
    """The model built on `device` and its weights loaded: this rank's shards from `cfg["model"]`, or random ones
    with `load_format: dummy`."""
    torch.set_default_dtype(dtype)
    try:  # block-FP8: the linear weights never exist in the compute dtype (qwen3.weight_device)
        with torch.device(device):
            model = build_model(mc)
    finally:
        torch.set_default_dtype(torch.float32)
    if mc.quant is not None:  # fp8 shards and their scales, on the device
        quantize_linears(model, mc.quant, cfg["advanced"]["fp8_gemm"] == "w8a8", device)
    if cfg["load_format"] == "dummy":
        init_dummy(model, cfg["seed"], rank)
    else:
        load_checkpoint(model, cfg["model"])
    finish_loading(model)  # CPU: FP8 weights dequantized here, once
    return model.eval()
