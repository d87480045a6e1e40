"""Block-FP8 checkpoints (Qwen's `*-FP8` releases): their `quantization_config` and the quantization itself.

Each quantized linear weight [N, K] is stored as `weight` (float8_e4m3fn, [N, K]) and `weight_scale_inv`
(float32, [ceil(N / 128), ceil(K / 128)]): the real value of an element is its fp8 value times the scale of
its 128 x 128 block. Embeddings, norms and the LM head stay in the checkpoint's float dtype.

This module is the format only (no layers, no kernels): config.json's reader (model_config.py) and the
quantizer (launch/quantize_fp8.py) use it; layers/fp8.py and kernels/fp8.py run such weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
BLOCK = 128  # weight_block_size, both dimensions: the kernels' k-loop and activation groups assume it

# What Qwen's FP8 checkpoints carry, and what launch/quantize_fp8.py writes.
QWEN_FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                   "weight_block_size": [BLOCK, BLOCK]}


@dataclass(frozen=True)
class QuantConfig:
    """config.json's `quantization_config`, once checked: block-FP8 weights (e4m3, 128 x 128 blocks,
    dynamic activations). `modules_to_not_convert`: module names (checkpoint naming) whose linears stay
    unquantized."""

    block: tuple[int, int] = (BLOCK, BLOCK)
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, raw) -> "QuantConfig | None":
        """None without a quantization_config; ValueError naming the key for anything else than block FP8."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ValueError(f"quantization_config must be a mapping, got {raw!r}")
        method = raw.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization_config.quant_method {method!r} is not supported; this engine "
                             "loads block-quantized FP8 checkpoints (quant_method fp8, as Qwen's *-FP8 "
                             "releases)")
        fmt = raw.get("fmt", "e4m3")  # transformers' own FP8 config has no fmt: its weights are e4m3
        if fmt != "e4m3":
            raise ValueError(
                f"quantization_config.fmt {fmt!r} is not supported (only e4m3: float8_e4m3fn weights)")
        scheme = raw.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"quantization_config.activation_scheme {scheme!r} is not supported "
                             "(only dynamic: no activation scales in the checkpoint)")
        block = raw.get("weight_block_size")
        if block is None:
            raise ValueError("quantization_config.weight_block_size is missing: only block-quantized FP8 "
                             f"(weight_block_size [{BLOCK}, {BLOCK}]) is supported, not per-tensor scales")
        if not isinstance(block, list) or block != [BLOCK, BLOCK]:
            raise ValueError(f"quantization_config.weight_block_size {block!r} is not supported (only "
                             f"[{BLOCK}, {BLOCK}])")
        skip = raw.get("modules_to_not_convert") or ()
        if not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) for s in skip):
            raise ValueError("quantization_config.modules_to_not_convert must be a list of module names, "
                             f"got {skip!r}")
        return cls(modules_to_not_convert=tuple(skip))

    def skips(self, module: str) -> bool:
        """Whether the checkpoint module `module` (e.g. model.layers.0.mlp.gate_proj) stays unquantized: an
        entry names it, one of its parents, or its last components (`lm_head`, `mlp.gate_proj`)."""
        return any(module == s or module.startswith(s + ".") or module.endswith("." + s)
                   for s in self.modules_to_not_convert)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (float8_e4m3fn [N, K], float32 scales [ceil(N/128), ceil(K/128)]): per 128 x 128 block,
    scale = the block's largest magnitude / 448 and weight / scale rounded to the nearest fp8 value, as the
    reference quantizer does. An all-zero block gets the scale 1/448."""
    n, k = weight.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    w = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=weight.device)
    w[:n, :k] = weight
    blocks = w.view(nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax, torch.ones_like(amax)) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(nb * BLOCK, kb * BLOCK)[:n, :k].contiguous(), scale


def is_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """The tensors Qwen's FP8 checkpoints quantize: the 2-D projection weights of the decoder layers
    (q/k/v/o, gate/up/down, also each expert's); not embeddings, norms, the LM head or the MoE router."""
    return len(shape) == 2 and name.startswith("model.layers.") and name.endswith("_proj.weight")
