"""Block-FP8 matmuls of several tokens (decode batches, prefill).

The weight is one rank's shard in the layout of layers/fp8.py: `scale_row[n]` is the row of `scale` holding
output row n's block scales, and column k of the shard lies at `k + k_shift` in its k-block grid. Every
k-loop here walks the checkpoint's 128-wide k-blocks (the first and last may be partial) and never splits
one, so each dot of one k-block gets its scales once, after the dot.

`gemm` (decode batches): one kernel that reads the bf16 activations and the fp8 weights and handles each
activation tile in registers, in one of two flavours:
- weight-only: fp16 operands, exact: each token's 128-column group is scaled by a power of two that puts its
  largest value in [2^14, 2^15), where fp16 holds every bf16 value, and e4m3 converts to fp16 exactly with
  one instruction per two values; the dot of each k-block is scaled by both factors;
- w8a8: each token's 128-column group is quantized to fp8 with scale max|x| / 448 and rounded to nearest,
  as the reference implementation's per-token-group quantization; fp8 x fp8 dot, scaled by both scales.
SWAP computes the transposed product (weight rows as the MMA's M dimension, tokens as its N), which suits a
few tokens: the MMA needs M >= 64 on Hopper (16 on older GPUs) but takes N down to 8 (16 in Triton).

With more tokens, redoing that work on the activations for every weight tile costs more than a pass of its
own: `prepare_activations` stores the operand and its factors once, and the kernel (PRE) reads them.
Weight-only can also dequantize the shard into the activation dtype (`dequantize_weight`) for cuBLAS.
"""
from __future__ import annotations

import torch

from tp_engine.kernels import triton

FP8_MAX = 448.0
BLOCK_K = 128  # the checkpoint's weight_block_size: one k-block per iteration

if triton is not None:
    import triton.language as tl

    _BK = tl.constexpr(BLOCK_K)  # what a jit function may read from the module
    _FP8_MAX = tl.constexpr(FP8_MAX)

    @triton.jit
    def _prepare(a, W8A8: tl.constexpr):
        """A tile of activations [tokens, 128] (one k-block) -> (the dot operand, one factor per token).

        w8a8: fp8 values with scale max|x| / 448, rounded to nearest (x times the scale's reciprocal: equal to
        the reference's x / scale up to one fp32 rounding). Weight-only: fp16 values scaled by a power of two
        that puts the largest in [2^14, 2^15), where fp16 holds every bf16 value exactly."""
        af = a.to(tl.float32)
        amax = tl.max(tl.abs(af), axis=1)
        if W8A8:
            a_s = tl.maximum(amax, 1e-10) / _FP8_MAX
            aq = tl.clamp(af * (1.0 / a_s)[:, None], -_FP8_MAX, _FP8_MAX).to(tl.float8e4nv)
        else:
            e = tl.minimum(tl.maximum(amax.to(tl.int32, bitcast=True) >> 23, 15), 253)  # biased exponent
            a_s = ((e - 14) << 23).to(tl.float32, bitcast=True)  # 2^(e - 141)
            aq = (af * ((268 - e) << 23).to(tl.float32, bitcast=True)[:, None]).to(tl.float16)
        return aq, a_s

    @triton.jit
    def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, s_ptr, srow_ptr, c_ptr, M, N, K, a_stride, as_stride, w_stride,
                         s_stride, c_stride, k_shift, n_kb, W8A8: tl.constexpr, PRE: tl.constexpr,
                         SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         GROUP_M: tl.constexpr):
        """PRE: `a` and its factors `as` [M, n_kb] come from prepare_activations; else `a` is bf16/fp16."""
        pid = tl.program_id(0)
        num_m = (M + BLOCK_M - 1) // BLOCK_M
        num_n = (N + BLOCK_N - 1) // BLOCK_N
        # GROUP_M row tiles walk the weight's column tiles together: each weight tile comes from HBM once
        # per group, from the L2 cache for the others
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mmask = rm < M
        nmask = rn < N
        s_rows = s_ptr + tl.load(srow_ptr + rn, mask=nmask, other=0) * s_stride
        a_rows = a_ptr + rm[:, None].to(tl.int64) * a_stride
        w_rows = w_ptr + rn[:, None].to(tl.int64) * w_stride
        kk = tl.arange(0, _BK)
        if SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, n_kb):  # n_kb = ceil((K + k_shift) / 128), from the host
            cols = kb * _BK - k_shift + kk
            kmask = (cols >= 0) & (cols < K)
            a = tl.load(a_rows + cols[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            ws = tl.load(s_rows + kb)
            if PRE:
                a_s = tl.load(as_ptr + rm * as_stride + kb, mask=mmask, other=0.0)
                aq = a
            else:
                aq, a_s = _prepare(a, W8A8)
            wq = w if W8A8 else w.to(tl.float16)  # e4m3 -> fp16 is exact, one instruction per two values
            if SWAP:
                acc += tl.dot(wq, tl.trans(aq)) * (ws[:, None] * a_s[None, :])
            else:
                acc += tl.dot(aq, tl.trans(wq)) * (a_s[:, None] * ws[None, :])
        out = acc.to(c_ptr.dtype.element_ty)
        if SWAP:
            tl.store(c_ptr + rm[None, :].to(tl.int64) * c_stride + rn[:, None], out,
                     mask=mmask[None, :] & nmask[:, None])
        else:
            tl.store(c_ptr + rm[:, None].to(tl.int64) * c_stride + rn[None, :], out,
                     mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, x_stride, q_stride, s_stride, k_shift, n_kb,
                          W8A8: tl.constexpr, GROUPS: tl.constexpr):
        """`_prepare` for GROUPS k-blocks of one token, stored: values in x's layout, factors [M, n_kb]."""
        row = tl.program_id(0).to(tl.int64)
        for g in tl.static_range(GROUPS):
            b = tl.program_id(1) * GROUPS + g
            cols = b * _BK - k_shift + tl.arange(0, _BK)
            mask = (cols >= 0) & (cols < K)
            x = tl.load(x_ptr + row * x_stride + cols[None, :], mask=mask[None, :], other=0.0)
            q, s = _prepare(x, W8A8)
            tl.store(q_ptr + row * q_stride + cols[None, :], q, mask=mask[None, :])
            tl.store(s_ptr + row * s_stride + b + tl.arange(0, 1), s, mask=b < n_kb)

    @triton.jit
    def _dequant_kernel(w_ptr, s_ptr, srow_ptr, out_ptr, N, K, w_stride, s_stride, out_stride, k_shift,
                        BLOCK_N: tl.constexpr, BLOCK: tl.constexpr):
        """weight x its block's scale, rounded once to out's dtype (as the CPU path's dequantization)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = (rows < N)[:, None] & (cols < K)[None, :]
        srow = tl.load(srow_ptr + rows, mask=rows < N, other=0)
        s = tl.load(s_ptr + srow[:, None] * s_stride + ((cols + k_shift) // _BK)[None, :], mask=mask,
                    other=0.0)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * w_stride + cols[None, :], mask=mask, other=0.0)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :],
                 (w.to(tl.float32) * s).to(out_ptr.dtype.element_ty), mask=mask)


# (BLOCK_M, BLOCK_N, warps, stages, SWAP), by the largest token count they are timed for (the narrow swapped
# tiles keep enough programs in flight for one token: N / 16 of them). Each runs with the activations handled
# inside the kernel ("gemm") or prepared by a pass of their own ("pre"); the timing keeps the faster.
GEMM_CONFIGS = {
    16: [(16, 16, 1, 4, True), (16, 32, 2, 4, True), (16, 64, 4, 4, True), (16, 128, 4, 4, True),
         (16, 64, 4, 4, False)],
    32: [(32, 32, 2, 4, True), (32, 64, 4, 4, True), (32, 128, 4, 4, True), (32, 64, 4, 4, False)],
    64: [(64, 64, 4, 4, True), (64, 64, 4, 4, False), (64, 128, 4, 3, False)],
}
# more tokens: "pre" only
PRE_CONFIGS = [(64, 128, 4, 4, False), (64, 128, 4, 3, False), (64, 64, 4, 4, False)]


def gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor, k_shift: int,
         w8a8: bool, cfg: tuple, pre: bool = False) -> torch.Tensor:
    """x [M, K] (bf16/fp16, contiguous) @ dequantized(weight [N, K]).T -> [M, N] in x's dtype. pre: the
    activations go through `prepare_activations` first instead of inside the kernel."""
    bm, bn, warps, stages, swap = cfg
    m, k = x.shape
    n = weight.shape[0]
    n_kb = triton.cdiv(k + k_shift, BLOCK_K)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    a, a_s = prepare_activations(x, k_shift, w8a8) if pre else (x, scale)  # scale: any pointer, unread
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _fp8_gemm_kernel[grid](a, a_s, weight, scale, scale_row, out, m, n, k, a.stride(0), a_s.stride(0),
                           weight.stride(0), scale.stride(0), out.stride(0), k_shift, n_kb, W8A8=w8a8,
                           PRE=pre, SWAP=swap, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, num_warps=warps,
                           num_stages=stages)
    return out


def prepare_activations(x: torch.Tensor, k_shift: int, w8a8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 (w8a8) or scaled fp16 values [M, K], float32 factors [M, ceil((K + k_shift) / 128)]),
    per token and weight k-block."""
    m, k = x.shape
    n_kb = triton.cdiv(k + k_shift, BLOCK_K)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn if w8a8 else torch.float16, device=x.device)
    s = torch.empty((m, n_kb), dtype=torch.float32, device=x.device)
    groups = 4
    _act_quant_kernel[(m, triton.cdiv(n_kb, groups))](x, q, s, k, x.stride(0), q.stride(0), s.stride(0),
                                                      k_shift, n_kb, W8A8=w8a8, GROUPS=groups, num_warps=1)
    return q, s


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor, k_shift: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """The whole shard in `dtype` (a transient buffer for cuBLAS at prefill sizes)."""
    n, k = weight.shape
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    bn, block = 16, 256
    _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, block))](
        weight, scale, scale_row, out, n, k, weight.stride(0), scale.stride(0), out.stride(0), k_shift,
        BLOCK_N=bn, BLOCK=block, num_warps=4)
    return out
