"""Block-FP8 weights in the tensor-parallel linear layers (checkpoints with quant_method fp8,
tp_engine/checkpoint/quant.py).

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
The experts of a Qwen3-MoE layer (layers/moe.py) load the same way, scales per expert; on CUDA they stay in
fp8 (kernels/moe.py dequantizes them in registers), on CPU they are dequantized once.
"""
from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tp_engine.kernels.fp8 import dequantize
from tp_engine.kernels.moe_grouped import ExpertScales
from tp_engine.layers.linear import ColRange, LinearBase, RowPart, check_shape
from tp_engine.layers.moe import FusedMoE
from tp_engine.checkpoint.quant import BLOCK, FP8, QuantConfig

log = logging.getLogger("tp_engine")

DUMMY_STD = 0.02  # load_format dummy: weights like loader.init_dummy's, stored in fp8
DUMMY_SCALE = 4 * DUMMY_STD / 448.0  # four standard deviations reach the largest fp8 value


def _blocks(start: int, length: int) -> tuple[int, int]:
    """The 128-blocks that rows (or columns) [start, start + length) touch: (first, count)."""
    first = start // BLOCK
    return first, (start + length + BLOCK - 1) // BLOCK - first


class ScaleRows(NamedTuple):
    """Where one part's rows of a checkpoint tensor's scale grid go in `weight_scale_inv`."""
    at: int  # first row of `weight_scale_inv` they fill
    first: int  # first block row of the grid that the part's rows touch
    count: int  # block rows they touch
    grid: int  # the grid's block rows


class BlockSpan(NamedTuple):
    """The block columns of a checkpoint tensor's scale grid that a shard's input columns touch."""
    first: int
    count: int
    grid: int  # the grid's block columns


class ScaleLayout:
    """Which block scales one weight shard needs and where each of its elements finds its own (the module
    docstring), from the shard's `row_parts` and `col_range` (layers/linear.py)."""

    def __init__(self, row_parts: dict[Any, RowPart], col_range: ColRange) -> None:
        self.scale_row = torch.empty(sum(part.rows for part in row_parts.values()), dtype=torch.int32)
        self.parts: dict[Any, ScaleRows] = {}  # shard id -> its rows of the scale grid
        self.rows = 0
        for shard, part in row_parts.items():
            first, count = _blocks(part.start, part.rows)
            rows = torch.arange(part.start, part.start + part.rows)
            self.scale_row[part.offset:part.offset + part.rows] = rows // BLOCK - first + self.rows
            self.parts[shard] = ScaleRows(self.rows, first, count, -(-part.full // BLOCK))
            self.rows += count
        self.k_shift = col_range.start % BLOCK
        self.col_blocks = BlockSpan(*_blocks(col_range.start, col_range.cols), -(-col_range.full // BLOCK))
        # The largest power of two (up to 128) at whose multiples alone the scale row changes: row tiles of
        # that height share one scale row, which the GEMV exploits.
        changes = (self.scale_row[1:] != self.scale_row[:-1]).nonzero().flatten() + 1
        self.row_align = BLOCK
        for c in changes.tolist():
            while c % self.row_align:
                self.row_align //= 2

    def empty(self, *lead: int, device: torch.device) -> nn.Parameter:
        return nn.Parameter(torch.empty(*lead, self.rows, self.col_blocks.count, dtype=torch.float32,
                                        device=device), requires_grad=False)

    def load(self, dst: torch.Tensor, src, shard_id) -> None:
        """This shard's rows and columns of a checkpoint tensor's scale grid [ceil(N/128), ceil(K/128)]."""
        rows, cols = self.parts[shard_id], self.col_blocks
        check_shape(src, (rows.grid, cols.grid))
        part = src.narrow(0, rows.first, rows.count).narrow(1, cols.first, cols.count)
        dst.narrow(0, rows.at, rows.count).copy_(part)

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(weight, scale, self.scale_row.to(weight.device), self.k_shift, dtype)


def _fp8_param(old: nn.Parameter, device: torch.device) -> nn.Parameter:
    """An fp8 parameter on `device` in place of `old`: same shape and loader, which now insists on fp8
    tensors."""
    new = nn.Parameter(torch.empty(old.shape, dtype=FP8, device=device), requires_grad=False)
    load = old.weight_loader
    new.weight_loader = lambda param, src, shard=None: load(param, _Fp8Source(src), shard)
    new.dummy_init = _dummy_weight
    if hasattr(old, "checkpoint_parts"):
        new.checkpoint_parts = old.checkpoint_parts
    return new


def _dummy_weight(param: nn.Parameter, gen: torch.Generator) -> None:
    w = torch.empty(param.shape, device=param.device).normal_(0.0, DUMMY_STD, generator=gen)
    param.data.copy_((w / DUMMY_SCALE).clamp_(-448.0, 448.0))


def _dummy_scale(param: nn.Parameter, gen: torch.Generator) -> None:
    param.data.fill_(DUMMY_SCALE)


class Fp8Weight:
    """The block-FP8 storage of one linear layer's weight (the layer's `quant`): it replaces the layer's
    `weight` by an fp8 one and adds `weight_scale_inv` and `scale_row` (layout above)."""

    def __init__(self, layer: LinearBase, w8a8: bool, device: torch.device | None = None) -> None:
        device, self.dtype = device or layer.weight.device, layer.weight.dtype  # dtype: the activations'
        self.w8a8 = w8a8
        self.layout = layout = ScaleLayout(layer.row_parts(), layer.col_range())
        self.k_shift, self.row_align = layout.k_shift, layout.row_align
        layer.weight = _fp8_param(layer.weight, device)
        layer.weight_scale_inv = layout.empty(device=device)
        layer.weight_scale_inv.weight_loader = (
            lambda param, src, shard=None: layout.load(param.data, src, shard))
        layer.weight_scale_inv.dummy_init = _dummy_scale
        layer.register_buffer("scale_row", layout.scale_row.to(device), persistent=False)
        layer.quant = self

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        ops = layer.ops
        if ops is not None:
            y = ops.fp8_linear(x2, layer.weight, layer.weight_scale_inv, layer.scale_row, self.k_shift,
                               self.row_align, self.w8a8, after_norm=layer.follows_norm)
        else:  # the torch ops: the shard in the activation dtype, for each call
            y = F.linear(x2, self.layout.dequantize(layer.weight, layer.weight_scale_inv, x.dtype))
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def finish(self, layer: LinearBase) -> None:
        """CPU: replace the fp8 shard and its scales by weight x scale in the compute dtype, once."""
        weight = self.layout.dequantize(layer.weight, layer.weight_scale_inv, self.dtype)
        del layer.weight_scale_inv, layer.scale_row
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.quant = None


class Fp8Experts:
    """Block-FP8 experts of a FusedMoE (per-expert tensors and scales, `{e}.gate_proj.weight_scale_inv`, ...):
    loaded in fp8 with their scales like the dense layers. On CUDA with the fused kernels they stay in fp8 and
    the MoE kernels dequantize them in registers (`scales`, kernels/moe.fused_moe); elsewhere they are
    dequantized once to the compute dtype."""

    def __init__(self, moe: FusedMoE, device: torch.device | None = None) -> None:
        n, hidden, inter, r = moe.inter, moe.hidden, moe.full_inter, moe.tp.rank
        self.dtype, device = moe.gate_up_proj.dtype, device or moe.gate_up_proj.device
        gate_up = {"gate": RowPart(0, n, r * n, inter), "up": RowPart(n, n, r * n, inter)}
        down = {"down": RowPart(0, hidden, 0, hidden)}
        self.layouts = {"gate_up_proj": ScaleLayout(gate_up, ColRange(0, hidden, hidden)),
                        "down_proj": ScaleLayout(down, ColRange(r * n, n, inter))}
        for name, layout in self.layouts.items():
            weight = _fp8_param(getattr(moe, name), device)
            setattr(moe, name, weight)
            scale = layout.empty(moe.num_experts, device=weight.device)
            scale.checkpoint_parts = [(rel + "_scale_inv", shard) for rel, shard in weight.checkpoint_parts]
            scale.weight_loader = lambda p, src, shard, lay=layout: lay.load(p.data[shard[0]], src, shard[1])
            scale.dummy_init = _dummy_scale
            setattr(moe, name + "_scale_inv", scale)
        moe.quant = self

    def keep(self, moe: FusedMoE) -> None:
        """Stay in fp8: the MoE layer passes these scales to the fused kernels."""
        gu, dn = self.layouts["gate_up_proj"], self.layouts["down_proj"]
        dev = moe.gate_up_proj.device
        moe.scales = ExpertScales(moe.gate_up_proj_scale_inv.data, gu.scale_row.to(dev),
                                  moe.down_proj_scale_inv.data, dn.scale_row.to(dev), dn.k_shift,
                                  gu.row_align)

    def finish(self, moe: FusedMoE) -> None:
        for name, layout in self.layouts.items():
            w, s = getattr(moe, name), getattr(moe, name + "_scale_inv")
            dense = torch.stack([layout.dequantize(w[e], s[e], self.dtype) for e in range(w.shape[0])])
            delattr(moe, name + "_scale_inv")
            setattr(moe, name, nn.Parameter(dense, requires_grad=False))
        moe.quant = None


class _Fp8Source:
    """A checkpoint tensor view whose slices must be float8_e4m3fn (the weight of a quantized layer)."""

    def __init__(self, src) -> None:
        self.src, self.shape = src, src.shape

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        t = self.src.narrow(dim, start, length)
        if t.dtype != FP8:
            raise ValueError(f"dtype {t.dtype} where quantization_config (fp8) needs float8_e4m3fn")
        return t


def quantize_linears(model: nn.Module, quant: QuantConfig, w8a8: bool,
                     device: torch.device | None = None) -> None:
    """Give every linear layer of the model, and the experts of a MoE, block-FP8 storage on `device`
    (default: where each weight is), except what quantization_config's modules_to_not_convert names
    (checkpoint names: a fused layer, or a MoE layer's experts, is skipped when all its parts are). Weights
    built on the meta device (`weight_param`) that stay unquantized are then allocated on `device`."""
    packed = getattr(model, "packed_modules", {})
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):  # one matmul of all its experts' projections, named alike
            parts = [f"{name}.{rel.rsplit('.', 1)[0]}" for p in (module.gate_up_proj, module.down_proj)
                     for rel, _ in p.checkpoint_parts]
            names = [name] if quant.skips(name) else parts
        elif isinstance(module, LinearBase):
            parent, _, leaf = name.rpartition(".")
            names = [f"{parent}.{ckpt}" for ckpt, (ours, _) in packed.items() if ours == leaf] or [name]
        else:
            continue
        skipped = [quant.skips(n) for n in names]
        if all(skipped):
            continue
        experts = isinstance(module, FusedMoE)
        if any(skipped):
            some = f"the experts of {name}" if experts else ", ".join(names)
            raise ValueError(f"quantization_config.modules_to_not_convert names only some of {some}; "
                             "they run as one matmul here and must be quantized alike")
        if experts:
            Fp8Experts(module, device)
        else:
            Fp8Weight(module, w8a8, device)
    if device is not None:
        _materialize(model, device)


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Each parameter still on the meta device: an uninitialised one on `device`, with the same attributes
    (its loader, checkpoint names)."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=False)
                new.__dict__.update(p.__dict__)
                module._parameters[name] = new


def finish_loading(model: nn.Module) -> None:
    """After the weights are in: on CPU each quantized weight and expert becomes weight x scale in the compute
    dtype (then the CPU path is the unquantized one, on the dequantized weights). CUDA: `settle_experts`."""
    for module in model.modules():
        quant = getattr(module, "quant", None)
        if isinstance(quant, (Fp8Weight, Fp8Experts)) and not next(module.parameters()).is_cuda:
            quant.finish(module)


def settle_experts(model: nn.Module, fused: bool) -> None:
    """On CUDA, once the engine has chosen its kernels: FP8 experts stay in fp8 when the fused kernels run
    (they alone read fp8 experts), else they are dequantized once."""
    experts = [m for m in model.modules() if isinstance(getattr(m, "quant", None), Fp8Experts)]
    if experts and fused:
        from tp_engine.kernels.moe import self_test_fp8
        try:
            self_test_fp8(experts[0].gate_up_proj.device)
        except Exception as e:  # a broken kernel must not give wrong outputs: the bf16 path still works
            log.warning("FP8 experts dequantized to the compute dtype "
                        "(their kernels failed a self-test: %s)", e)
            fused = False
    for module in experts:
        if fused:
            module.quant.keep(module)
        else:
            module.quant.finish(module)
