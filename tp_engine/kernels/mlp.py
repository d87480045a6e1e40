"""silu(gate) * up of a dense MLP at one token, in one kernel: the experts' gate/up kernel (kernels/moe.py)
run as a single expert, or, with block-FP8 weights, the FP8 GEMV (kernels/fp8.py) taking rows of gate and up
in pairs. Against the matmul and then `silu_mul`, it saves a kernel per layer and the write and read of
[gate | up]. Each weight shape keeps the fastest of these, timed once on first use (as kernels/gemv.py does;
never inside a CUDA-graph capture: GraphRunner warms every batch size up first).

Both round where the torch MLP rounds (the gate and up products, silu, the product); the fused kernel sums
each product in another order than the matmul.
"""
from __future__ import annotations

import torch

from tp_engine.kernels import pdl_args, triton

# (rows of gate and of up per program, reduction step, warps): the expert tiles, and wider ones for the
# dense MLPs' longer rows
TILES = [(1, 512, 2), (1, 1024, 4), (2, 512, 4), (2, 1024, 4), (4, 256, 4), (4, 512, 4), (8, 128, 8),
         (8, 512, 2)]
_CHOICE: dict = {}  # measured choices by shape and device: a cache (as kernels/gemv.py's), not a switch
_ZERO: dict = {}  # device -> the fixed expert id 0


def fused(x: torch.Tensor, w: torch.Tensor, tile: tuple, fp8: tuple | None = None) -> torch.Tensor:
    """x [1, K], w [2I, K] = [gate | up] -> silu(gate) * up [1, I] through the fused kernel at `tile`. fp8:
    (scale, scale_row, ...) of a block-FP8 w (layers/fp8.py; column 0 at the start of its block)."""
    from tp_engine.kernels.moe import _gemv_gate_up_kernel

    two_i, k = w.shape
    i, (bn, bk, warps) = two_i // 2, tile
    bk = min(bk, triton.next_power_of_2(k))
    ids = _ZERO.get(x.device)
    if ids is None:
        ids = _ZERO[x.device] = torch.zeros(1, dtype=torch.int32, device=x.device)
    scale, scale_row = fp8[:2] if fp8 is not None else (x, x)
    act = torch.empty((1, i), dtype=x.dtype, device=x.device)
    _gemv_gate_up_kernel[(1, triton.cdiv(i, bn))](
        x, w, ids, act, k, i, x.stride(0), 0, w.stride(0), act.stride(0), scale, scale_row, 0,
        scale.stride(0) if fp8 is not None else 0, TOP_K=1, BN=bn, BK=bk, FP8=fp8 is not None, ROUTED=False,
        LINES=max(1, bk * w.element_size() // 128), num_warps=warps, **pdl_args(x.device))
    return act


def paired(x: torch.Tensor, w: torch.Tensor, cfg: tuple, fp8: tuple) -> torch.Tensor:
    """The same through the FP8 GEMV (kernels/fp8.py) at tile `cfg`, taking rows of gate and up in pairs."""
    from tp_engine.kernels import fp8 as fp8_kernels

    scale, scale_row, row_align, _ = fp8
    return fp8_kernels.gemv(x, w, scale, scale_row, 0, row_align, cfg, pair=True)


def split(x: torch.Tensor, w: torch.Tensor, fp8: tuple | None = None) -> torch.Tensor:
    """The same as two kernels: the batch-1 matmul (kernels/gemv.py or kernels/fp8.py), then silu_mul."""
    from tp_engine.kernels import fp8 as fp8_kernels
    from tp_engine.kernels import gemv, norm

    if fp8 is None:
        return norm.silu_mul(gemv.linear(x, w))
    scale, scale_row, row_align, w8a8 = fp8
    return norm.silu_mul(fp8_kernels.linear(x, w, scale, scale_row, 0, row_align, w8a8))


def tiles(fp8: tuple | None) -> list[tuple]:
    """The tiles that may run: with FP8 weights, a tile's rows must share a scale row."""
    return TILES if fp8 is None else [t for t in TILES if fp8[2] % t[0] == 0]


def candidates(fp8: tuple | None) -> list[tuple]:
    """("split", None), then ("fused", tile) and, with FP8 weights, ("paired", FP8 GEMV tile) for each
    tile."""
    from tp_engine.kernels.fp8 import GEMV_CONFIGS

    pairs = [] if fp8 is None else [("paired", c) for c in GEMV_CONFIGS if c[0] > 1]
    return [("split", None)] + [("fused", t) for t in tiles(fp8)] + pairs


def run(choice: tuple, x: torch.Tensor, w: torch.Tensor, fp8: tuple | None) -> torch.Tensor:
    """silu(gate) * up through one of `candidates`."""
    kind, tile = choice
    if kind == "split":
        return split(x, w, fp8)
    return fused(x, w, tile, fp8) if kind == "fused" else paired(x, w, tile, fp8)


def _choose(x: torch.Tensor, w: torch.Tensor, fp8: tuple | None) -> tuple:
    from tp_engine.kernels.gemv import _time, cold_copies

    weights = cold_copies(w)
    best, best_t = ("split", None), float("inf")
    for choice in candidates(fp8):
        try:
            t = _time(lambda m: run(choice, x, m, fp8), weights)
        except Exception:  # a tile this shape or GPU cannot run
            if choice[0] == "split":
                raise
            continue
        if t < best_t:
            best, best_t = choice, t
    return best


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, fp8: tuple | None = None) -> torch.Tensor:
    """silu(gate) * up for x [M, K] and w [2I, K] = [gate | up] on the GPU -> [M, I]. At one token through the
    faster of the fused kernel and `split`; otherwise `split`. fp8: (scale, scale_row, row_align, w8a8) of a
    block-FP8 w, as layers/fp8.py lays them out (a column-parallel shard: no column shift)."""
    if x.shape[0] != 1 or not x.is_contiguous() or (fp8 is None and x.dtype != w.dtype):
        return split(x, w, fp8)
    key = (tuple(w.shape), w.dtype, x.dtype, None if fp8 is None else fp8[2:], x.device.index)
    choice = _CHOICE.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():
            return split(x, w, fp8)
        choice = _CHOICE[key] = _choose(x, w, fp8)
    return run(choice, x, w, fp8)
