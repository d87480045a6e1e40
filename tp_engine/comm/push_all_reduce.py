"""The push all-reduce: the sum over the ranks of a small message in one Triton kernel, and the same fused
with the residual add and RMSNorm that follow it.

Each rank stores its values, each tagged with the number of the call, straight into every rank's
symmetric-memory buffer over NVLink, then sums the slots of all ranks, in rank order, once their tags say
this call's values have arrived: no barrier before it, no flag after it. Two buffers used in turn keep a
fast rank from overwriting values a slow one has not read. comm/custom_all_reduce.py owns the buffers and
decides when this path is used.
"""
from __future__ import annotations

import torch

from tp_engine.kernels import _warps, triton

if triton is not None:
    import triton.language as tl

    from tp_engine.kernels import _round, _rsqrt

    @triton.jit
    def _push_sum(x, offs, m, call, ptrs_ptr, slot, RANK: tl.constexpr, WORLD: tl.constexpr):
        """The sum over the ranks of `x` (this program's values, at `offs` of the message), in fp32.
        `call`: the number of this all-reduce, the same on every rank (_next_call moves it on)."""
        tag = call.to(tl.int32)
        base = (call % 2) * WORLD * slot  # two buffers in turn: a slow peer may still read the last call's
        word = (call << 32) | x.to(tl.float32).to(tl.uint32, bitcast=True).to(tl.int64)  # [tag | fp32 value]
        for p in tl.static_range(WORLD):
            peer = tl.load(ptrs_ptr + p).to(tl.pointer_type(tl.int64))
            tl.store(peer + base + RANK * slot + offs, word, mask=m)
        mine = tl.load(ptrs_ptr + RANK).to(tl.pointer_type(tl.int64))
        acc = tl.zeros(x.shape, dtype=tl.float32)
        for r in tl.static_range(WORLD):  # rank order: every rank adds the same numbers in the same order
            addr = mine + base + r * slot + offs
            w = tl.load(addr, mask=m, other=0, volatile=True)
            while tl.max(tl.where(m & ((w >> 32).to(tl.int32) != tag), 1, 0), axis=0) > 0:
                w = tl.load(addr, mask=m, other=0, volatile=True)
            acc += w.to(tl.int32).to(tl.float32, bitcast=True)
        return acc

    @triton.jit
    def _next_call(state_ptr, call):
        """The last program of the kernel to get here numbers the next call (all have read this one's)."""
        if tl.atomic_add(state_ptr + 1, 1) == tl.num_programs(0) * tl.num_programs(1) - 1:
            tl.store(state_ptr + 1, 0)
            tl.store(state_ptr, call + 1)

    @triton.jit
    def _push_all_reduce_kernel(x_ptr, out_ptr, ptrs_ptr, state_ptr, n, slot, RANK: tl.constexpr,
                                WORLD: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        call = tl.load(state_ptr)
        x = tl.load(x_ptr + offs, mask=m, other=0.0)
        acc = _push_sum(x, offs, m, call, ptrs_ptr, slot, RANK, WORLD)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=m)
        _next_call(state_ptr, call)

    @triton.jit
    def _push_all_reduce_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, ptrs_ptr, state_ptr, ss_ptr,
                                        n_cols, inv_n, eps, slot, RANK: tl.constexpr, WORLD: tl.constexpr,
                                        CHUNK: tl.constexpr, NCHUNK: tl.constexpr, NCHUNK_P2: tl.constexpr):
        # grid (rows, NCHUNK): a row's chunks travel in parallel; the norm's sum of squares of the whole row
        # is then gathered from the row's programs through `ss_ptr`, tagged like the values
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        m = cols < n_cols
        offs = row * n_cols + cols
        call = tl.load(state_ptr)
        x = tl.load(x_ptr + offs, mask=m, other=0.0)
        DT = x.dtype
        s = _round(_push_sum(x, offs, m, call, ptrs_ptr, slot, RANK, WORLD), DT)  # what all_reduce returns
        # from here the arithmetic of _add_rmsnorm_kernel
        r = tl.load(res_ptr + offs, mask=m, other=0.0)
        xf = _round(s + r.to(tl.float32), DT)
        tl.store(res_out_ptr + offs, xf.to(DT), mask=m)
        ss = tl.sum(xf * xf, axis=0)
        if NCHUNK > 1:
            tag = call.to(tl.int32)
            tl.store(ss_ptr + row * NCHUNK + c, (call << 32) | ss.to(tl.uint32, bitcast=True).to(tl.int64))
            k = tl.arange(0, NCHUNK_P2)
            km = k < NCHUNK
            v = tl.load(ss_ptr + row * NCHUNK + k, mask=km, other=0, volatile=True)
            while tl.max(tl.where(km & ((v >> 32).to(tl.int32) != tag), 1, 0), axis=0) > 0:
                v = tl.load(ss_ptr + row * NCHUNK + k, mask=km, other=0, volatile=True)
            ss = tl.sum(tl.where(km, v.to(tl.int32).to(tl.float32, bitcast=True), 0.0), axis=0)
        rstd = _rsqrt(ss * inv_n + eps)
        y = _round(xf * rstd, DT)
        w = tl.load(w_ptr + cols, mask=m, other=0.0)
        tl.store(out_ptr + offs, _round(w.to(tl.float32) * y, DT).to(DT), mask=m)
        _next_call(state_ptr, call)


def push_all_reduce(x: torch.Tensor, ptrs: torch.Tensor, state: torch.Tensor, slot: int, rank: int,
                    world: int) -> torch.Tensor:
    """Sum of `x` over the ranks, for small messages (custom_all_reduce._PushAllReduce owns the buffers).

    Each rank stores its values, each tagged with the number of the call, straight into every rank's
    symmetric-memory buffer (`ptrs`: the buffer's address on each rank; `slot` values per rank), then
    sums the slots of all ranks once their tags say this call's values have arrived: one kernel, no
    barrier before it. `state` ([call number, programs done], int64 on the device) numbers the calls."""
    assert x.is_contiguous() and x.numel() <= slot
    out = torch.empty_like(x)
    n = x.numel()
    block = 512
    _push_all_reduce_kernel[(max(1, triton.cdiv(n, block)),)](x, out, ptrs, state, n, slot, RANK=rank, WORLD=world,
                                                              BLOCK=block, num_warps=4)
    return out


# values per program and row of the fused kernel (0: whole rows); launch/bench.py --push-chunk sets it to measure
PUSH_NORM_CHUNK = 512


def push_all_reduce_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                ptrs: torch.Tensor, state: torch.Tensor, ss: torch.Tensor, slot: int, rank: int,
                                world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rmsnorm(push_all_reduce(x), residual, weight, eps)` in one kernel. Each row is cut into chunks
    of PUSH_NORM_CHUNK values, one program each; `ss` (int64, zeroed, >= rows * chunks) is where a row's
    programs exchange their sums of squares."""
    n = x.shape[-1]
    assert x.is_contiguous() and residual.is_contiguous() and x.numel() <= slot
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    rows = x.numel() // n
    if rows:
        chunk = triton.next_power_of_2(n) if PUSH_NORM_CHUNK <= 0 else min(PUSH_NORM_CHUNK, triton.next_power_of_2(n))
        nchunk = triton.cdiv(n, chunk)
        assert rows * nchunk <= ss.numel()
        _push_all_reduce_rmsnorm_kernel[(rows, nchunk)](
            x, residual, weight, out, res_out, ptrs, state, ss, n, 1.0 / n, eps, slot, RANK=rank, WORLD=world,
            CHUNK=chunk, NCHUNK=nchunk, NCHUNK_P2=triton.next_power_of_2(nchunk), num_warps=_warps(chunk))
    return out, res_out
