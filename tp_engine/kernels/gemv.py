"""The batch-1 matmul: cuBLAS or a GEMV kernel, whichever is faster for each weight shape."""
from __future__ import annotations

import torch

from tp_engine.kernels import pdl_args, triton

if triton is not None:
    import triton.language as tl

    from tp_engine.kernels import _pdl_wait

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, w_stride, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        base = w_ptr + rows[:, None].to(tl.int64) * w_stride
        # each weight is read once per step: evict_first keeps it from pushing activations out of the L2
        # cache. Each iteration loads the next tile: the first is loaded before waiting for x (PDL)
        cols = tl.arange(0, BLOCK_K)
        w = tl.load(base + cols[None, :], mask=rmask[:, None] & (cols < K)[None, :], other=0.0,
                    eviction_policy="evict_first")
        _pdl_wait(PDL)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
            nxt = cols + BLOCK_K
            w = tl.load(base + nxt[None, :], mask=rmask[:, None] & (nxt < K)[None, :], other=0.0,
                        eviction_policy="evict_first")
        tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=rmask)


# cuBLAS reads small weight matrices at one token far below the memory bandwidth (its tiles launch too few
# blocks); a plain GEMV kernel does better on some shapes. Each weight shape picks the faster of the two
# once, on first use, by timing both (never inside a CUDA-graph capture: GraphRunner warms every bucket up
# before capturing it, so the choice is made by then).

# (rows per program, columns per iteration, warps)
GEMV_CONFIGS = [(2, 1024, 4), (4, 512, 4), (4, 1024, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4),
                (16, 512, 8), (32, 256, 8)]
# (weight shape, dtype, device) -> the tile timed fastest: a cache of measurements that every engine of the
# process shares, not a switch (each engine chooses whether to run these kernels at all: kernels.select)
_GEMV_CHOICE: dict = {}


def _gemv(x: torch.Tensor, w: torch.Tensor, cfg) -> torch.Tensor:
    bn, bk, warps = cfg
    n, k = w.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, bn),)](x, w, out, n, k, w.stride(0), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                        **pdl_args(x.device))
    return out


def _time(fn, weights: list[torch.Tensor], reps: int = 24) -> float:
    """GPU time of one call in ms, from a CUDA graph of `reps` calls that cycle through `weights`.

    A graph, because eagerly launched calls this small measure the host's launch rate, not the kernel; the
    copies of the weight, because a step reads each weight from HBM once, while a matrix timed over and
    over would sit in the L2 cache."""
    for w in weights[:2]:
        fn(w)  # compile, let cuBLAS pick its kernel
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        for i in range(reps):
            fn(weights[i % len(weights)])
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def cold_copies(w: torch.Tensor) -> list[torch.Tensor]:
    """w and copies of it, three L2 caches' worth in all (at most 64 matrices), for `_time` to cycle
    through."""
    l2 = getattr(torch.cuda.get_device_properties(w.device), "L2_cache_size", 64 << 20)
    return [w] + [w.clone()
                  for _ in range(min(64, max(1, -(-3 * l2 // (w.numel() * w.element_size())))) - 1)]


def _choose(x: torch.Tensor, w: torch.Tensor):
    import torch.nn.functional as F
    weights = cold_copies(w)
    best, best_t = "torch", _time(lambda m: F.linear(x, m), weights)
    for cfg in GEMV_CONFIGS:
        try:
            t = _time(lambda m: _gemv(x, m, cfg), weights)
        except Exception:  # a config this shape or GPU cannot run
            continue
        if t < best_t * 0.95:
            best, best_t = cfg, t
    return best


# A replicated weight (the MoE router) must give the same bits on every rank, so the kernel cannot be chosen
# by each rank's own timing: this tile, the one the timing picks on an H200 for the routers of Qwen3-30B-A3B
# and Qwen3-235B-A22B ([128, 2048], [128, 4096]: 1.7 and 2.5 us, cuBLAS 4.6 and 5.4 us).
REPLICATED_CONFIG = (2, 1024, 4)


def linear(x: torch.Tensor, w: torch.Tensor, replicated: bool = False) -> torch.Tensor:
    """x @ w.T for x [M, K], w [N, K]; at M == 1 through whichever of cuBLAS and the GEMV kernel is faster, or
    with `replicated` (every rank holds the whole weight) through one fixed GEMV tile."""
    import torch.nn.functional as F
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype != w.dtype or not x.is_contiguous() or w.stride(1) != 1:
        return F.linear(x, w)
    if replicated:
        return _gemv(x, w, REPLICATED_CONFIG)
    key = (tuple(w.shape), w.dtype, x.device.index)
    cfg = _GEMV_CHOICE.get(key)
    if cfg is None:
        if torch.cuda.is_current_stream_capturing():
            return F.linear(x, w)
        cfg = _GEMV_CHOICE[key] = _choose(x, w)
    return F.linear(x, w) if cfg == "torch" else _gemv(x, w, cfg)
