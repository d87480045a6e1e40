"""Block-FP8 matmuls: a batch-1 GEMV that dequantizes in registers, the GEMM of kernels/fp8_gemm.py for more
tokens, the choice between them per weight shape, and the torch reference every kernel is checked against.

A weight shard is float8_e4m3fn [N, K] with float32 block scales in the layout of layers/fp8.py: `scale_row`
[N] (int32) gives the row of `scale` [R, C] holding output row n's scales; column k of the shard lies at
`k + k_shift` in its k-block grid, so its scale is scale[scale_row[n], (k + k_shift) // 128].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tp_engine.kernels import pdl_args, triton
from tp_engine.kernels.fp8_gemm import BLOCK_K, GEMM_CONFIGS, PRE_CONFIGS, dequantize_weight, gemm

FP8 = torch.float8_e4m3fn


def dequantize(weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor, k_shift: int,
               dtype: torch.dtype) -> torch.Tensor:
    """weight x its block's scale, in `dtype`: the CPU path's weights (once, after loading), the GPU fallback
    without the Triton kernels, and the reference of the kernels."""
    n, k = weight.shape
    s = (scale.float().index_select(0, scale_row.long())
         .repeat_interleave(BLOCK_K, dim=1)[:, k_shift:k_shift + k])
    return (weight.float() * s).to(dtype)


if triton is not None:
    import triton.language as tl

    from tp_engine.kernels import _pdl_wait, _prefetch_l2, _silu_mul

    @triton.jit
    def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, srow_ptr, out_ptr, N, K, w_stride, s_stride, k_shift, n_kb,
                         BLOCK_N: tl.constexpr, KB: tl.constexpr, UNIFORM: tl.constexpr, PAIR: tl.constexpr,
                         PDL: tl.constexpr):
        """One program: BLOCK_N output rows, KB whole k-blocks (128 columns each) per iteration; n_kb =
        ceil((K + k_shift) / 128), from the host.

        The loop sums nothing across threads (that took warp shuffles and barriers every iteration). A thread
        sums its own 16 columns of each row (one 16-byte load a row, within one k-block), scales that partial
        dot by the k-block's scale, and keeps it; the sums over threads happen once, after the loop. UNIFORM:
        the program's rows share one scale row (every tile of the public shapes), so one scale per thread and
        k-block. PAIR: w is an MLP's [gate | up] (2N rows) and the program takes BLOCK_N // 2 rows of each,
        interleaved, for silu(gate) * up [N] (kernels/mlp.py): the weights stream as in the plain GEMV, and
        the [gate | up] vector is never written; UNIFORM then holds for each half."""
        R: tl.constexpr = BLOCK_N // 2 if PAIR else BLOCK_N  # outputs per program
        first = tl.program_id(0) * R
        r = tl.arange(0, BLOCK_N)
        rows = first + r // 2 + (r % 2) * N if PAIR else first + r
        rmask = (first + r // 2 < N) if PAIR else rows < N
        BK: tl.constexpr = KB * 128
        G: tl.constexpr = BK // 16  # groups of 16 columns, each inside one k-block
        kk = tl.arange(0, BK)
        g = tl.arange(0, G)
        w_rows = w_ptr + rows[:, None].to(tl.int64) * w_stride
        if UNIFORM:
            s_rows = s_ptr + tl.load(srow_ptr + first) * s_stride
            if PAIR:
                s_up = s_ptr + tl.load(srow_ptr + N + first) * s_stride
        else:
            s_rows = s_ptr + tl.load(srow_ptr + rows, mask=rmask, other=0)[:, None] * s_stride
        acc = tl.zeros([BLOCK_N, G], dtype=tl.float32)
        if PDL:  # the first tile into the L2 cache before waiting for x; one address per 128-byte line
            lines = tl.minimum(tl.maximum(tl.arange(0, KB) * 128 - k_shift, 0), K - 1)
            _prefetch_l2(w_ptr + tl.where(rmask, rows, 0)[:, None].to(tl.int64) * w_stride + lines[None, :])
        _pdl_wait(PDL)
        for b0 in range(0, n_kb, KB):
            cols = b0 * 128 - k_shift + kk
            cmask = (cols >= 0) & (cols < K)
            # The weights and their scales first: the activations meet them through shared memory, behind a
            # barrier, and a load after that barrier would wait for x's trip to the L2 cache, every iteration.
            # Each weight is read once per step: evict_first keeps it from pushing activations out of the L2.
            w = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0,
                        eviction_policy="evict_first")
            b = b0 + g // 8
            if UNIFORM:
                s = tl.load(s_rows + b, mask=b < n_kb, other=0.0)[None, :]
                if PAIR:
                    s = tl.where((r % 2 == 0)[:, None], s,
                                 tl.load(s_up + b, mask=b < n_kb, other=0.0)[None, :])
            else:
                s = tl.load(s_rows + b[None, :], mask=rmask[:, None] & (b < n_kb)[None, :], other=0.0)
            x = tl.load(x_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            acc += tl.sum(tl.reshape(w.to(tl.float32) * x[None, :], (BLOCK_N, G, 16)), axis=2) * s
        DT: tl.constexpr = out_ptr.dtype.element_ty
        if PAIR:
            gate, up = tl.split(tl.reshape(tl.sum(acc, axis=1), (R, 2)))
            n = first + tl.arange(0, R)
            tl.store(out_ptr + n, _silu_mul(gate, up, DT).to(DT), mask=n < N)
        else:
            tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(DT), mask=rmask)


# (rows per program, k-blocks of 128 per iteration, warps): the fastest inside a decode step on an H200 for
# the shapes of Qwen3-8B and Qwen3-0.6B, and neighbours (the timing picks per shape). Tiles of 8 warps time
# faster alone on some shapes and make the step slower, so none is offered.
GEMV_CONFIGS = [(4, 4, 2), (8, 8, 2), (8, 16, 4), (4, 16, 4), (2, 32, 4), (8, 8, 4), (4, 8, 2), (16, 4, 4)]


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor, k_shift: int,
         row_align: int, cfg: tuple, pair: bool = False) -> torch.Tensor:
    """x [1, K] @ dequantized(weight).T -> [1, N]. row_align: the scale row changes only at multiples of it.
    pair: weight is [gate | up] and the result silu(gate) * up, [1, N / 2] (cfg's rows: both halves')."""
    bn, kb, warps = cfg
    n, k = weight.shape
    n, rows = (n // 2, bn // 2) if pair else (n, bn)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, rows),)](x, weight, scale, scale_row, out, n, k, weight.stride(0),
                                              scale.stride(0), k_shift, triton.cdiv(k + k_shift, 128),
                                              BLOCK_N=bn, KB=kb, UNIFORM=row_align % rows == 0, PAIR=pair,
                                              num_warps=warps, **pdl_args(x.device))
    return out


# Which kernel and tile each (weight shape, token-count bucket) runs: decided once, on first use, by timing
# the candidates as kernels/gemv.py does (never inside a CUDA-graph capture: GraphRunner warms every batch
# size up before capturing it). At one token the GEMV races the small-batch GEMM tiles. Beyond 256 tokens
# (prefill, compute-bound, where timing in the middle of a run would cost more than it saves) the choice is
# fixed: weight-only dequantizes the shard for cuBLAS, w8a8 prepares the activations in a pass of their own.
_CHOICE: dict = {}  # measured choices by shape and device: a cache (as kernels/gemv.py's), not a switch
BUCKETS = (1, 16, 32, 64, 128, 256)


def _bucket(m: int) -> int:
    return next((b for b in BUCKETS if m <= b), 0)


def _candidates(bucket: int, w8a8: bool, fp32: bool = False) -> list[tuple]:
    if fp32:  # the GEMMs' fp16 operands hold bf16 and fp16 activations exactly, not fp32 ones
        return [("gemv", c) for c in GEMV_CONFIGS] if bucket == 1 else [("dequant", None)]
    if bucket == 0:
        return [("pre", PRE_CONFIGS[0])] if w8a8 else [("dequant", None)]
    if bucket == 1:
        return [("gemv", c) for c in GEMV_CONFIGS] + [("gemm", c) for c in GEMM_CONFIGS[16]]
    if bucket in GEMM_CONFIGS:
        return [(kind, c) for kind in ("gemm", "pre") for c in GEMM_CONFIGS[bucket]]
    return [("pre", c) for c in PRE_CONFIGS] + ([] if w8a8 else [("dequant", None)])


def _run(choice, x, weight, scale, scale_row, k_shift, row_align, w8a8) -> torch.Tensor:
    kind, cfg = choice
    if kind == "gemv":
        return gemv(x, weight, scale, scale_row, k_shift, row_align, cfg)
    if kind == "dequant":
        return F.linear(x, dequantize_weight(weight, scale, scale_row, k_shift, x.dtype))
    return gemm(x, weight, scale, scale_row, k_shift, w8a8, cfg, pre=kind == "pre")


def _choose(x, weight, scale, scale_row, k_shift, row_align, w8a8, bucket, after_norm) -> tuple:
    from tp_engine.kernels.gemv import _time, cold_copies
    from tp_engine.kernels.norm import add_rmsnorm

    xs = torch.randn(bucket, x.shape[1], device=x.device, dtype=x.dtype)  # the bucket's largest batch
    inputs = lambda: xs  # noqa: E731
    if after_norm and bucket == 1:
        # As in a decode step: each call reads a norm's output, and its first tile is prefetched while the
        # short norm runs. Timed back to back instead, that prefetch overlaps the call before, which favours
        # tiles with a large first tile; for Qwen3-8B's Q/K/V those were 0.7% slower in the step
        # (docs/benchmarks-history.md).
        res, norm_w = torch.randn_like(xs), torch.ones(x.shape[1], device=x.device, dtype=x.dtype)
        inputs = lambda: add_rmsnorm(xs, res, norm_w, 1e-6)[0]  # noqa: E731
    weights = cold_copies(weight)
    best, best_t = None, float("inf")
    for choice in _candidates(bucket, w8a8, x.dtype == torch.float32):
        try:
            t = _time(lambda w: _run(choice, inputs(), w, scale, scale_row, k_shift, row_align, w8a8),
                      weights)
        except Exception:  # a tile this shape or GPU cannot run (shared memory, registers)
            continue
        if t < best_t:
            best, best_t = choice, t
    if best is None:
        raise RuntimeError(f"no FP8 kernel runs for weight {list(weight.shape)} at {bucket} tokens")
    return best


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor, k_shift: int,
           row_align: int, w8a8: bool, after_norm: bool = False) -> torch.Tensor:
    """x [M, K] @ dequantized(weight [N, K]).T -> [M, N] in x's dtype, through the kernel chosen for this
    weight shape and token count. row_align: a power of two (at most 128) at whose multiples alone the scale
    row changes (layers/fp8.py). w8a8 (config key advanced.fp8_gemm): the GEMMs quantize the activations to
    fp8 per token and k-block; the GEMV is weight-only in both cases. after_norm: a decode step runs a norm
    just before this call; the one-token kernel is then chosen by timing each candidate after one."""
    x = x.contiguous()
    if x.shape[0] == 0:
        return x.new_empty((0, weight.shape[0]))
    bucket = _bucket(x.shape[0])
    key = (tuple(weight.shape), k_shift, row_align, bucket, w8a8, x.dtype, x.device.index, after_norm)
    choice = _CHOICE.get(key)
    if choice is None:
        if bucket == 0 or torch.cuda.is_current_stream_capturing():
            choice = _candidates(bucket, w8a8, x.dtype == torch.float32)[0]
        else:
            choice = _CHOICE[key] = _choose(x, weight, scale, scale_row, k_shift, row_align, w8a8, bucket,
                                            after_norm)
    return _run(choice, x, weight, scale, scale_row, k_shift, row_align, w8a8)


def self_test(device: torch.device) -> None:
    """Each kernel flavour once on a shard with partial blocks, a k offset and scale rows that change
    inside a tile, against `dequantize` + F.linear; raises on a mismatch (kernels.self_test reports it)."""
    g = torch.Generator(device=device).manual_seed(0)
    n, k, shift = 200, 300, 32
    w = (torch.randn(n, k, device=device, generator=g) * 100).clamp(-448, 448).to(FP8)
    scale_row = ((torch.arange(n, device=device) + 40) // 128).to(torch.int32)
    scale = (torch.rand((n - 1 + 40) // 128 + 1, -(-(k + shift) // 128), device=device, generator=g)
             / 400 + 1e-4)
    ref_w = dequantize(w, scale, scale_row, shift, torch.float32)
    for m in (1, 5):
        x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
        ref = F.linear(x.float(), ref_w)
        runs = [("gemm", GEMM_CONFIGS[16][0]), ("gemm", GEMM_CONFIGS[64][-1]), ("pre", PRE_CONFIGS[0]),
                ("dequant", None)] + ([("gemv", GEMV_CONFIGS[0]), ("gemv", (16, 4, 4))]  # both bodies
                                      if m == 1 else [])
        for a8 in (False, True):
            for choice in runs:
                if choice[0] in ("gemv", "dequant") and a8:  # weight-only whatever the flag
                    continue
                out = _run(choice, x, w, scale, scale_row, shift, 8, a8)
                err = float((out.float() - ref).norm() / ref.norm())
                # bf16 rounding of the output; with w8a8 also the fp8 rounding of the activations, ~3% of each
                # product
                assert err < (0.06 if a8 else 0.01), (
                    f"FP8 matmul {choice}, w8a8={a8}: relative error {err:.3f}")
