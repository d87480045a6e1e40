"""The decoders: Qwen3 (dense) and Qwen3-MoE, picked by the checkpoint's config.json."""
from __future__ import annotations

import torch

from tp_engine.layers.fp8 import finish_loading, quantize_linears
from tp_engine.checkpoint.loader import init_dummy, load_checkpoint
from tp_engine.checkpoint.model_config import ModelConfig
from tp_engine.models.qwen3 import Qwen3ForCausalLM
from tp_engine.models.qwen3_moe import Qwen3MoeForCausalLM


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def compute_dtype(name: str, mc: ModelConfig, device: torch.device) -> torch.dtype:
    """The dtype of weights and activations (config key dtype; auto: ModelConfig.auto_dtype), where `device`
    has it."""
    dtype = DTYPES[name if name != "auto" else mc.auto_dtype(device.type)]
    if device.type == "cpu" and dtype == torch.float16:
        raise ValueError("dtype float16 is not supported on CPU; use float32 or bfloat16")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"dtype bfloat16 is not supported on {name}; use float16")
    return dtype


def build_model(cfg: ModelConfig) -> Qwen3ForCausalLM:
    """The model `cfg` describes, sharded for this rank (on the default device and dtype; a block-FP8 model's
    linear weights as meta placeholders: qwen3.weight_device), running the torch code until `bind`."""
    return Qwen3MoeForCausalLM(cfg) if cfg.moe is not None else Qwen3ForCausalLM(cfg)


def load_model(mc: ModelConfig, cfg: dict, dtype: torch.dtype, device: torch.device,
               rank: int) -> Qwen3ForCausalLM:
    """The model built on `device` and its weights loaded: this rank's shards from `cfg["model"]`, or random
    ones with `load_format: dummy`."""
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
