"""Block-FP8 weights in the tensor-parallel linear layers (checkpoints with quant_method fp8, tp_engine/quant.py).

A quantized layer keeps its weight shard in float8_e4m3fn and, beside it, the block scales of the rows and
columns it holds, laid out so that the GPU kernels need one lookup per row and one offset per layer:

- `weight_scale_inv` [R, C] (float32): the rows of each checkpoint tensor's scale grid that this rank's rows
  touch, part after part in the local order ([q_r | k_r | v_r], [gate_r | up_r]), and the columns of the grid
  that this rank's input columns touch. A shard that starts or ends inside a 128-block keeps that block's
  scale: rank 1 of a 320-row part starts at checkpoint row 320 = 2.5 blocks, so its first scale row is the
  checkpoint's third, shared with rank 0.
- `scale_row` [N] (int32 buffer): for each local output row, its row of `weight_scale_inv`.
- `k_shift` (int): where the local column 0 sits inside its 128-block (row-parallel shards; 0 otherwise).

So the scale of local element (n, k) is weight_scale_inv[scale_row[n], (k + k_shift) // 128], whatever the
TP size, the KV-head replication or the parts. A weight and its scales may come in any order, from any files.

On CPU the weight is dequantized once after loading (`finish_loading`: weight x scale, in the compute dtype),
and the layer is then a plain float layer. On CUDA it stays in fp8 and every matmul goes through
kernels/fp8.py; without the fused kernels (advanced.fused_kernels off) the shard is dequantized for each call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tp_engine.kernels import fused_ops
from tp_engine.kernels.fp8 import dequantize
from tp_engine.layers.linear import LinearBase, check_shape
from tp_engine.quant import BLOCK, FP8, QuantConfig

DUMMY_STD = 0.02  # load_format dummy: weights like loader.init_dummy's, stored in fp8


def _blocks(start: int, length: int) -> tuple[int, int]:
    """The 128-blocks that rows (or columns) [start, start + length) touch: (first, count)."""
    first = start // BLOCK
    return first, (start + length + BLOCK - 1) // BLOCK - first


class Fp8Weight:
    """The block-FP8 storage of one linear layer's weight (the layer's `quant`): it replaces the layer's
    `weight` by an fp8 one and adds `weight_scale_inv` and `scale_row` (layout above)."""

    def __init__(self, layer: LinearBase, w8a8: bool) -> None:
        n, k = layer.weight.shape
        device, self.dtype = layer.weight.device, layer.weight.dtype  # dtype: the activations'
        self.w8a8 = w8a8
        scale_row = torch.empty(n, dtype=torch.int32)
        # shard id -> (first row here, first block row of the checkpoint's grid, block rows, the grid's rows)
        self.parts = {}
        rows = 0
        for shard, (offset, length, start, full) in layer.row_parts().items():
            first, count = _blocks(start, length)
            scale_row[offset:offset + length] = torch.arange(start, start + length) // BLOCK - first + rows
            self.parts[shard] = (rows, first, count, -(-full // BLOCK))
            rows += count
        col_start, cols, full_cols = layer.col_range()
        self.k_shift = col_start % BLOCK
        self.col_blocks = (*_blocks(col_start, cols), -(-full_cols // BLOCK))  # (first, count, the grid's)
        # The largest power of two (up to 128) at whose multiples alone the scale row changes: row tiles of
        # that height share one scale row, which the GEMV exploits.
        changes = (scale_row[1:] != scale_row[:-1]).nonzero().flatten() + 1
        self.row_align = BLOCK
        for c in changes.tolist():
            while c % self.row_align:
                self.row_align //= 2

        load_weight = layer.weight.weight_loader
        layer.weight = nn.Parameter(torch.empty(n, k, dtype=FP8, device=device), requires_grad=False)
        layer.weight.weight_loader = lambda param, src, shard=None: load_weight(param, _Fp8Source(src), shard)
        layer.weight.dummy_init = self._dummy_weight
        layer.weight_scale_inv = nn.Parameter(torch.empty(rows, self.col_blocks[1], dtype=torch.float32, device=device),
                                              requires_grad=False)
        layer.weight_scale_inv.weight_loader = self.load_scale
        layer.weight_scale_inv.dummy_init = self._dummy_scale
        layer.register_buffer("scale_row", scale_row.to(device), persistent=False)
        layer.quant = self

    def load_scale(self, param: nn.Parameter, src, shard_id=None) -> None:
        """This rank's rows and columns of a checkpoint tensor's scale grid [ceil(N/128), ceil(K/128)]."""
        rows, first, count, grid_rows = self.parts[shard_id]
        col_first, col_count, grid_cols = self.col_blocks
        check_shape(src, (grid_rows, grid_cols))
        param.data.narrow(0, rows, count).copy_(src.narrow(0, first, count).narrow(1, col_first, col_count))

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        ops = fused_ops(x.device)
        if ops is not None:
            y = ops.fp8_linear(x2, layer.weight, layer.weight_scale_inv, layer.scale_row, self.k_shift,
                               self.row_align, self.w8a8)
        else:  # the torch ops: the shard in the activation dtype, for each call
            y = F.linear(x2, self.dequantized(layer, x.dtype))
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def dequantized(self, layer: LinearBase, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(layer.weight, layer.weight_scale_inv, layer.scale_row, self.k_shift, dtype)

    def finish(self, layer: LinearBase) -> None:
        """CPU: replace the fp8 shard and its scales by weight x scale in the compute dtype, once."""
        weight = self.dequantized(layer, self.dtype)
        del layer.weight_scale_inv, layer.scale_row
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.quant = None

    def _dummy_weight(self, param: nn.Parameter, gen: torch.Generator) -> None:
        w = torch.empty(param.shape, device=param.device).normal_(0.0, DUMMY_STD, generator=gen)
        param.data.copy_((w / self._dummy_scale_value()).clamp_(-448.0, 448.0))

    def _dummy_scale(self, param: nn.Parameter, gen: torch.Generator) -> None:
        param.data.fill_(self._dummy_scale_value())

    @staticmethod
    def _dummy_scale_value() -> float:
        return 4 * DUMMY_STD / 448.0  # four standard deviations reach the largest fp8 value


class _Fp8Source:
    """A checkpoint tensor view whose slices must be float8_e4m3fn (the weight of a quantized layer)."""

    def __init__(self, src) -> None:
        self.src, self.shape = src, src.shape

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        t = self.src.narrow(dim, start, length)
        if t.dtype != FP8:
            raise ValueError(f"dtype {t.dtype} where quantization_config (fp8) needs float8_e4m3fn")
        return t


def quantize_linears(model: nn.Module, quant: QuantConfig, w8a8: bool) -> None:
    """Give every linear layer of the model block-FP8 storage, except those quantization_config's
    modules_to_not_convert names (checkpoint names: a fused layer is skipped when all its parts are)."""
    packed = getattr(model, "packed_modules", {})
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        parent, _, leaf = name.rpartition(".")
        names = [f"{parent}.{ckpt}" for ckpt, (ours, _) in packed.items() if ours == leaf] or [name]
        skipped = [quant.skips(n) for n in names]
        if all(skipped):
            continue
        if any(skipped):
            raise ValueError(f"quantization_config.modules_to_not_convert names only some of {', '.join(names)}; "
                             "they run as one matmul here and must be quantized alike")
        Fp8Weight(module, w8a8)


def finish_loading(model: nn.Module) -> None:
    """After the weights are in: on CPU, each quantized weight becomes weight x scale in the compute dtype
    (then the CPU path is the unquantized one, on the dequantized weights)."""
    for module in model.modules():
        if isinstance(module, LinearBase) and isinstance(module.quant, Fp8Weight) and not module.weight.is_cuda:
            module.quant.finish(module)
