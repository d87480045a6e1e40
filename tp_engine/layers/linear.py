"""Tensor-parallel linear layers. Each owns its weight shard, loads it from a checkpoint slice,
and does its one collective (if any) in `forward`.

`weight_loader(param, src, shard_id)` receives `src`, a lazy view of the full checkpoint tensor with
`.shape` and `.narrow(dim, start, length)`, so a rank reads only the rows or columns it keeps.

`ops`: the fused kernels the engine chose (kernels.select), set on each layer once after the model is built
(Qwen3ForCausalLM.bind); None, the default, runs the torch code.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tp_engine.comm import all_reduce, get_tp


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, replicated: bool = False,
           ops=None) -> torch.Tensor:
    """F.linear; with the fused kernels `ops` a batch-1 product may go through a GEMV kernel
    (kernels/gemv.py). replicated: the weight is whole on every rank, which must all get the same bits (no
    kernel chosen by each rank's timing)."""
    if bias is None and ops is not None:
        return ops.linear(x, weight, replicated)
    return F.linear(x, weight, bias)


def check_shape(src, expected: tuple[int, ...]) -> None:
    if tuple(src.shape) != tuple(expected):
        raise ValueError(f"expected shape {list(expected)}, checkpoint has {list(src.shape)}")


class RowPart(NamedTuple):
    """Where this rank's output rows of one checkpoint tensor sit (a fused layer holds several tensors)."""
    offset: int  # first row of the part in this rank's weight
    rows: int  # rows this rank holds
    start: int  # the first of them in the checkpoint tensor
    full: int  # the checkpoint tensor's rows


class ColRange(NamedTuple):
    """This rank's input columns of a checkpoint tensor."""
    start: int  # first column in the checkpoint tensor
    cols: int  # columns this rank holds
    full: int  # the checkpoint tensor's columns


def weight_param(*shape: int, device: str | None = None) -> nn.Parameter:
    """An uninitialised weight of the default dtype, on the default device or on `device`: "meta" builds a
    placeholder that a block-FP8 model gives fp8 storage on the real device (layers/fp8.quantize_linears)
    without first allocating it in the compute dtype (Qwen3-235B-A22B at TP 2: 235 GB a rank in bf16, 118 in
    fp8)."""
    return nn.Parameter(torch.empty(*shape, device=device), requires_grad=False)


class LinearBase(nn.Module):
    # How the weight is stored and multiplied when it is not a plain float matrix (layers/fp8.py: block-FP8
    # weights with their scales); None: F.linear on `weight`.
    quant = None
    # A decode step runs a norm right before this matmul: block-FP8 tiles are timed that way (kernels/fp8.py)
    follows_norm = False
    ops = None  # the engine's fused kernels (module docstring)

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 weight_device: str | None = None) -> None:
        """weight_device: "meta" for a weight that layers/fp8.quantize_linears stores (weight_param)."""
        super().__init__()
        self.tp = get_tp()
        self.weight = weight_param(out_features, in_features, device=weight_device)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, src, shard_id=None) -> None:
        raise NotImplementedError

    def row_parts(self) -> dict[Any, RowPart]:
        """Shard id -> where this rank's output rows of that checkpoint tensor sit. Unsplit here;
        column-parallel layers split."""
        n = self.weight.shape[0]
        return {None: RowPart(0, n, 0, n)}

    def col_range(self) -> ColRange:
        """This rank's input columns. Unsplit here; row-parallel layers split."""
        k = self.weight.shape[1]
        return ColRange(0, k, k)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.apply(self, x, bias)
        return matmul(x, self.weight, bias, ops=self.ops)


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's output rows split across ranks; each rank returns its slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 weight_device: str | None = None) -> None:
        tp = get_tp()
        assert out_features % tp.size == 0, (
            f"output size {out_features} does not split across {tp.size} ranks")
        self.full_out = out_features
        super().__init__(in_features, out_features // tp.size, bias, weight_device)

    def row_parts(self) -> dict[Any, RowPart]:
        n = self.full_out // self.tp.size
        return {None: RowPart(0, n, self.tp.rank * n, self.full_out)}

    def weight_loader(self, param, src, shard_id=None) -> None:
        part = self.row_parts()[shard_id]
        check_shape(src, (part.full, *param.shape[1:]))
        param.data.narrow(0, part.offset, part.rows).copy_(src.narrow(0, part.start, part.rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up): rank r holds [gate_r | up_r]."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 weight_device: str | None = None) -> None:
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, weight_device)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [gate | up] layer through the fused kernels `ops` (the MLP on the GPU): at one
        token, matmul and activation in one kernel where that is faster (kernels/mlp.py)."""
        ops = self.ops
        if self.bias is not None or x.dim() != 2:
            return ops.silu_mul(self(x))
        q = self.quant  # a column-parallel shard starts at column 0: no column shift
        fp8 = None if q is None else (self.weight_scale_inv, self.scale_row, q.row_align, q.w8a8)
        return ops.gate_up_silu(x, self.weight, fp8)

    def row_parts(self) -> dict[Any, RowPart]:
        tp, parts, offset = self.tp, {}, 0
        for i, full in enumerate(self.out_sizes):
            n = full // tp.size
            parts[i] = RowPart(offset, n, tp.rank * n, full)
            offset += n
        return parts


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul; rank r holds [q_r | k_r | v_r].

    Query heads split evenly. KV heads split evenly when tp <= num_kv_heads; with more ranks than KV
    heads each rank holds one KV head, replicated: rank r keeps head r * num_kv_heads // tp.
    """
    follows_norm = True

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 weight_device: str | None = None) -> None:
        tp = get_tp()
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        self.q_heads = num_heads // tp.size
        self.kv_heads = max(1, num_kv_heads // tp.size)
        if tp.size > num_kv_heads:  # fewer KV heads than ranks: each is replicated
            self.kv_start = tp.rank * num_kv_heads // tp.size
        else:
            self.kv_start = tp.rank * self.kv_heads
        self.out_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        local = (self.q_heads + 2 * self.kv_heads) * head_dim
        LinearBase.__init__(self, hidden, local, bias, weight_device)

    def row_parts(self) -> dict[Any, RowPart]:
        d, q, kv = self.head_dim, self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q": RowPart(0, q, self.tp.rank * q, self.out_sizes[0]),
                "k": RowPart(q, kv, self.kv_start * d, self.out_sizes[1]),
                "v": RowPart(q + kv, kv, self.kv_start * d, self.out_sizes[2])}


class RowParallelLinear(LinearBase):
    """y = x W^T with W's input columns split across ranks; partial sums are all-reduced.

    reduce=False returns this rank's partial sum instead, for a consumer that all-reduces it itself: the
    RMSNorm after it, which fuses the all-reduce with the residual add and the norm (layers/norm.py).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce: bool = True,
                 weight_device: str | None = None) -> None:
        tp = get_tp()
        assert in_features % tp.size == 0, f"input size {in_features} does not split across {tp.size} ranks"
        self.full_in, self.reduce = in_features, reduce
        super().__init__(in_features // tp.size, out_features, bias, weight_device)
        if bias:
            self.bias.weight_loader = self.bias_loader

    def col_range(self) -> ColRange:
        n = self.full_in // self.tp.size
        return ColRange(self.tp.rank * n, n, self.full_in)

    def weight_loader(self, param, src, shard_id=None) -> None:
        cols = self.col_range()
        check_shape(src, (param.shape[0], cols.full))
        param.data.copy_(src.narrow(1, cols.start, cols.cols))

    def bias_loader(self, param, src, shard_id=None) -> None:
        check_shape(src, tuple(param.shape))
        param.data.copy_(src.narrow(0, 0, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if not self.reduce:  # the bias counts once: on rank 0's partial sum
            return y + self.bias if self.bias is not None and self.tp.rank == 0 else y
        y = all_reduce(y, self.tp)
        # The bias is added after the reduction so it counts once, not once per rank.
        return y if self.bias is None else y + self.bias
