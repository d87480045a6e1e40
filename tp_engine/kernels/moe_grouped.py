"""The many-token path of kernels/moe.fused_moe: token slots sorted by expert, then grouped GEMMs.

A token slot is one (token, j-th chosen expert) pair, slot s = token * k + j. The slots are laid out by
expert, each expert's run padded up to a multiple of BM rows, so every block of BM rows belongs to one expert:

1. `_count_kernel`: each slot's rank among the slots of its expert (an atomic add per slot on the
   expert's counter; the order it gives is arbitrary, which changes no result: every row of a GEMM
   below is computed on its own);
2. `_offsets_kernel` (one program): where each expert's run starts, the expert of every block, the
   padded total, and the sentinel (N * k) in every row, which the padding rows keep;
3. `_scatter_kernel`: slot s goes to row start[expert] + rank.

Buffers are sized for the worst case, N * k + min(N * k, E) * (BM - 1) rows, and the GEMM grids cover
it; blocks past the padded total return at once. Nothing is read back on the host.

`_gate_up_kernel` multiplies each block's tokens by its expert's gate and up rows (two accumulators,
tl.dot) and stores silu(gate) * up by sorted row; `_down_kernel` multiplies those by the expert's down
matrix, scales each row by its routing weight and stores it by slot; the sum over each token's k slots
is one torch sum.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from tp_engine.kernels import triton

if triton is not None:
    import triton.language as tl

    from tp_engine.kernels import _round, _silu_mul

    @triton.jit
    def _count_kernel(ids_ptr, counts_ptr, ranks_ptr, S, BLOCK: tl.constexpr):
        s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = s < S
        e = tl.load(ids_ptr + s, mask=mask, other=0)
        rank = tl.atomic_add(counts_ptr + e, 1, mask=mask)
        tl.store(ranks_ptr + s, rank, mask=mask)

    @triton.jit
    def _offsets_kernel(counts_ptr, starts_ptr, total_ptr, block_expert_ptr, sorted_ptr, S, E, num_blocks,
                        num_rows, BM: tl.constexpr, E_P2: tl.constexpr, BB: tl.constexpr, FILL: tl.constexpr):
        e = tl.arange(0, E_P2)
        counts = tl.load(counts_ptr + e, mask=e < E, other=0)
        padded = (counts + BM - 1) // BM * BM
        ends = tl.cumsum(padded, axis=0)
        tl.store(starts_ptr + e, ends - padded, mask=e < E)
        tl.store(total_ptr, tl.sum(padded, axis=0))
        for b0 in range(0, num_blocks, BB):
            b = b0 + tl.arange(0, BB)
            # the expert of block b: how many experts' runs end at or before its first row
            owner = tl.sum((ends[None, :] <= (b * BM)[:, None]).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + b, owner, mask=b < num_blocks)
        for r0 in range(0, num_rows, FILL):
            r = r0 + tl.arange(0, FILL)
            tl.store(sorted_ptr + r, tl.zeros([FILL], dtype=tl.int32) + S, mask=r < num_rows)

    @triton.jit
    def _scatter_kernel(ids_ptr, ranks_ptr, starts_ptr, sorted_ptr, S, BLOCK: tl.constexpr):
        s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = s < S
        e = tl.load(ids_ptr + s, mask=mask, other=0)
        row = tl.load(starts_ptr + e, mask=mask, other=0) + tl.load(ranks_ptr + s, mask=mask, other=0)
        tl.store(sorted_ptr + row, s, mask=mask)

    @triton.jit
    def _dequantized(w, sc, DT: tl.constexpr):
        """A [BK, BN] tile of FP8 weights times their block scales `sc` (broadcast to it), rounded to DT: the
        values of layers/fp8.py's dequantized weights (kernels/fp8.dequantize)."""
        return _round(w.to(tl.float32) * sc, DT).to(DT)  # _round: to nearest in the interpreter too

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_ptr, block_expert_ptr, total_ptr, S, K, I, x_stride,
                        w_se, w_sn, act_stride, s_ptr, srow_ptr, s_se, s_sr, TOP_K: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        if pid_m * BM >= tl.load(total_ptr):
            return
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        rows = pid_m * BM + tl.arange(0, BM)
        slot = tl.load(sorted_ptr + rows)
        valid = slot < S
        x_rows = x_ptr + (slot // TOP_K).to(tl.int64)[:, None] * x_stride
        n = pid_n * BN + tl.arange(0, BN)
        nmask = n < I
        gate = w_ptr + e * w_se + n[None, :].to(tl.int64) * w_sn  # [BK, BN] tiles of W^T: k down, n across
        up = gate + I * w_sn
        if FP8:
            srow_g = tl.load(srow_ptr + n, mask=nmask, other=0)
            srow_u = tl.load(srow_ptr + I + n, mask=nmask, other=0)
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            kmask = k < K
            a = tl.load(x_rows + k[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
            wmask = kmask[:, None] & nmask[None, :]
            g = tl.load(gate + k[:, None], mask=wmask, other=0.0)
            u = tl.load(up + k[:, None], mask=wmask, other=0.0)
            if FP8:  # BK divides 128, so the tile's columns share one k-block
                g = _dequantized(g,
                                 tl.load(s_ptr + e * s_se + srow_g * s_sr + k0 // 128, mask=nmask)[None, :],
                                 a.dtype)
                u = _dequantized(u,
                                 tl.load(s_ptr + e * s_se + srow_u * s_sr + k0 // 128, mask=nmask)[None, :],
                                 a.dtype)
            # "ieee": float32 models multiply in float32, not TF32, as torch's matmul (half types ignore it)
            acc_g = tl.dot(a, g, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
        DT: tl.constexpr = act_ptr.dtype.element_ty
        out = _silu_mul(acc_g, acc_u, DT).to(DT)
        tl.store(act_ptr + rows.to(tl.int64)[:, None] * act_stride + n[None, :], out,
                 mask=valid[:, None] & nmask[None, :])

    @triton.jit
    def _down_kernel(act_ptr, w_ptr, wts_ptr, out_ptr, sorted_ptr, block_expert_ptr, total_ptr, S, K, H,
                     act_stride, w_se, w_sn, out_stride, s_ptr, srow_ptr, s_se, s_sr, k_shift,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        if pid_m * BM >= tl.load(total_ptr):
            return
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        rows = pid_m * BM + tl.arange(0, BM)
        slot = tl.load(sorted_ptr + rows)
        valid = slot < S
        a_rows = act_ptr + rows.to(tl.int64)[:, None] * act_stride
        n = pid_n * BN + tl.arange(0, BN)
        nmask = n < H
        w = w_ptr + e * w_se + n[None, :].to(tl.int64) * w_sn
        if FP8:
            srow = tl.load(srow_ptr + n, mask=nmask, other=0)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            kmask = k < K
            a = tl.load(a_rows + k[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
            b = tl.load(w + k[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
            if FP8:  # a shard's columns may start inside a k-block (k_shift): a scale per element
                sc = tl.load(s_ptr + e * s_se + srow[None, :] * s_sr + ((k + k_shift) // 128)[:, None],
                             mask=kmask[:, None] & nmask[None, :], other=0.0)
                b = _dequantized(b, sc, a.dtype)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        DT: tl.constexpr = out_ptr.dtype.element_ty
        wt = tl.load(wts_ptr + slot, mask=valid, other=0.0).to(tl.float32)
        y = _round(_round(acc, DT) * wt[:, None], DT)
        tl.store(out_ptr + slot.to(tl.int64)[:, None] * out_stride + n[None, :], y.to(DT),
                 mask=valid[:, None] & nmask[None, :])


class ExpertScales(NamedTuple):
    """The block scales of FP8 experts (layers/fp8.py's layout, a grid per expert): element (n, k) of expert
    e's gate_up has the scale gate_up[e, gate_up_row[n], k // 128]; of its down, down[e, down_row[n],
    (k + down_shift) // 128]."""

    gate_up: torch.Tensor  # [E, R, C] float32
    gate_up_row: torch.Tensor  # [2I] int32
    down: torch.Tensor  # [E, R, C] float32
    down_row: torch.Tensor  # [H] int32
    down_shift: int
    row_align: int  # gate_up_row changes only at multiples of this power of two (at most 128)


def scale_args(scales: ExpertScales | None, down: bool, like: torch.Tensor) -> tuple:
    """(scale, scale row, its two strides, column shift) for a kernel's FP8 arguments; unused stand-ins
    (`like`) for bf16 experts."""
    if scales is None:
        return like, like, 0, 0, 0
    s, row = (scales.down, scales.down_row) if down else (scales.gate_up, scales.gate_up_row)
    return s, row, s.stride(0), s.stride(1), scales.down_shift if down else 0


@dataclass(frozen=True)
class GemmConfig:
    BM: int  # slots per block (one expert's)
    BN: int  # output columns per program
    BK: int  # reduction step
    num_warps: int
    num_stages: int


# Few slots per expert (decode batches): 16-row blocks, little padding. Many (prefill): 64-row blocks. BK
# divides 128 (the FP8 block), which the FP8 gate/up kernel relies on.
SMALL = GemmConfig(16, 64, 128, 4, 3)
LARGE = GemmConfig(64, 128, 64, 8, 3)


def choose(slots: int, experts: int) -> GemmConfig:
    return SMALL if slots <= 4 * experts else LARGE


@dataclass
class Sorted:
    """The token slots laid out by expert (module docstring)."""
    rows: torch.Tensor  # [num_blocks * BM] int32: the slot in each row, or S in a padding row
    block_expert: torch.Tensor  # [num_blocks] int32
    total: torch.Tensor  # [1] int32: rows in use (the padded total)
    num_blocks: int


def sort_by_expert(ids: torch.Tensor, experts: int, bm: int) -> Sorted:
    flat = ids.reshape(-1).to(torch.int32)
    s = flat.numel()
    num_blocks = triton.cdiv(s + min(s, experts) * (bm - 1), bm)
    ints = torch.zeros(2 * experts + 1, dtype=torch.int32, device=ids.device)  # counts | starts | total
    counts, starts, total = ints[:experts], ints[experts:2 * experts], ints[2 * experts:]
    ranks = torch.empty(s, dtype=torch.int32, device=ids.device)
    rows = torch.empty(num_blocks * bm, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
    block = 1024
    _count_kernel[(triton.cdiv(s, block),)](flat, counts, ranks, s, BLOCK=block, num_warps=4)
    _offsets_kernel[(1,)](counts, starts, total, block_expert, rows, s, experts, num_blocks, rows.numel(),
                          BM=bm, E_P2=triton.next_power_of_2(experts), BB=64, FILL=1024, num_warps=4)
    _scatter_kernel[(triton.cdiv(s, block),)](flat, ranks, starts, rows, s, BLOCK=block, num_warps=4)
    return Sorted(rows, block_expert, total, num_blocks)


def moe_grouped(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor, cfg: GemmConfig | None = None,
                scales: ExpertScales | None = None) -> torch.Tensor:
    """`scales`: FP8 experts, each weight tile dequantized in registers to the values of the dequantized
    weights, then the same GEMMs."""

    n, k = ids.shape
    experts, two_i, h = gate_up.shape
    i, s = two_i // 2, n * k
    cfg = cfg or choose(s, experts)
    srt = sort_by_expert(ids, experts, cfg.BM)
    act = torch.empty((srt.rows.numel(), i), dtype=x.dtype, device=x.device)
    launch = dict(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _gate_up_kernel[(triton.cdiv(i, cfg.BN), srt.num_blocks)](
        x, gate_up, act, srt.rows, srt.block_expert, srt.total, s, h, i, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), act.stride(0), *scale_args(scales, False, x)[:4], TOP_K=k, FP8=scales is not None,
        **launch)
    y = torch.empty((s, h), dtype=x.dtype, device=x.device)
    _down_kernel[(triton.cdiv(h, cfg.BN), srt.num_blocks)](
        act, down, weights.reshape(-1).contiguous(), y, srt.rows, srt.block_expert, srt.total, s, i, h,
        act.stride(0), down.stride(0), down.stride(1), y.stride(0), *scale_args(scales, True, act),
        FP8=scales is not None, **launch)
    return y.view(n, k, h).sum(dim=1)
