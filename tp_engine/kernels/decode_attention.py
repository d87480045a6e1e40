"""Decode attention over the paged KV cache inside CUDA graphs, on short contexts: one kernel, no plan. It
runs in the decode graphs (cuda_graph.py) and for the decode rows of mixed steps in the graph pieces
(piecewise_graph.py).

Each request's query (one token, all heads) attends over its pages, read through the page table its caller
fills before each replay ([indptr | last page lengths | page ids], flashinfer's layout). A program
takes one (request, KV head, split): the G query heads of that KV head against one chunk of the request's
tokens. The chunk length follows the request's length at run time (the grid is fixed in the graph), so a
short request runs in one program and a long one spreads over up to `splits` programs; when it took more
than one, the last of its programs to finish (an atomic counter) merges their partial results. At batch
1 and a few hundred tokens, flashinfer's graph decode (its kernel, plus its merge when the KV is split)
costs about 10 us a layer whatever the heads; this kernel is one launch that starts as the Q/K norm
before it ends (programmatic dependent launch, kernels/__init__.py).

Arithmetic: scores and the softmax in fp32 (base-2 exponentials of scores scaled by log2(e) / sqrt(d)),
probabilities rounded to the cache dtype for the product with V, as flashinfer's kernels do.
"""
from __future__ import annotations

import math

import torch

from tp_engine.kernels import pdl_args, triton

if triton is not None:
    import triton.language as tl

    from tp_engine.kernels import _pdl_wait, _prefetch_l2

    @triton.jit
    def _decode_kernel(q_ptr, cache_ptr, indptr_ptr, last_ptr, ids_ptr, out_ptr, part_ptr, ml_ptr, count_ptr,
                       scale_log2, min_chunk, H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr,
                       GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, SPLITS: tl.constexpr,
                       BLOCK_T: tl.constexpr, LINES: tl.constexpr, PDL: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        # Before the wait: the page table, copied from the host before the graph runs, and the first tile's
        # K and V rows into the L2 cache (LINES 128-byte lines a row). A prefetch only fills the cache: the
        # kernel reads the rows after the wait, the newest token's, which the kernel before writes, included.
        p0 = tl.load(indptr_ptr + b)
        length = (tl.load(indptr_ptr + b + 1) - p0 - 1) * PAGE + tl.load(last_ptr + b)
        chunk = tl.maximum(min_chunk, tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_T) * BLOCK_T)
        n_active = tl.cdiv(length, chunk)
        if PDL:
            if sp < n_active:
                t = tl.minimum(sp * chunk + tl.arange(0, BLOCK_T), length - 1)  # valid rows only
                page = tl.load(ids_ptr + p0 + t // PAGE).to(tl.int64)
                k_at = cache_ptr + ((page * 2 * PAGE + t % PAGE) * KVH + h) * D
                lines = k_at[:, None] + tl.arange(0, LINES)[None, :] * (D // LINES)
                _prefetch_l2(lines)
                _prefetch_l2(lines + PAGE * KVH * D)
        _pdl_wait(PDL)  # q (and the newest token's K and V) come from the kernel before
        if sp < n_active:
            g = tl.arange(0, GP)
            gmask = g < G
            d = tl.arange(0, D)
            heads = (b * H + h * G + g).to(tl.int64)
            q = tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=gmask[:, None], other=0.0)
            m = tl.full([GP], float("-inf"), dtype=tl.float32)
            l = tl.zeros([GP], dtype=tl.float32)
            acc = tl.zeros([GP, D], dtype=tl.float32)
            start = sp * chunk
            end = tl.minimum(start + chunk, length)
            for t0 in range(start, end, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                tmask = t < end
                page = tl.load(ids_ptr + p0 + t // PAGE, mask=tmask, other=0).to(tl.int64)
                k_at = cache_ptr + ((page * 2 * PAGE + t % PAGE) * KVH + h) * D  # [pages, 2, PAGE, KVH, D]
                k = tl.load(k_at[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
                v = tl.load(k_at[:, None] + PAGE * KVH * D + d[None, :], mask=tmask[:, None], other=0.0)
                s = tl.dot(q, tl.trans(k)) * scale_log2
                s = tl.where(tmask[None, :], s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                alpha = tl.exp2(m - m_new)
                p = tl.exp2(s - m_new[:, None])
                l = l * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m = m_new
            o_at = out_ptr + heads[:, None] * D + d[None, :]
            if n_active == 1:
                tl.store(o_at, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=gmask[:, None])
            else:
                pair = b * KVH + h
                part = (pair * SPLITS + sp).to(tl.int64)
                tl.store(part_ptr + (part * GP + g[:, None]) * D + d[None, :], acc)
                tl.store(ml_ptr + part * 2 * GP + g, m)
                tl.store(ml_ptr + part * 2 * GP + GP + g, l)
                tl.debug_barrier()  # every thread's partials are written before the counter moves
                done = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel", scope="gpu")
                if done == n_active - 1:  # the last program of this (request, KV head): merge
                    first = (pair * SPLITS).to(tl.int64)
                    big = tl.full([GP], float("-inf"), dtype=tl.float32)
                    for j in range(0, n_active):
                        big = tl.maximum(big, tl.load(ml_ptr + (first + j) * 2 * GP + g,
                                                      cache_modifier=".cg"))
                    total = tl.zeros([GP], dtype=tl.float32)
                    o = tl.zeros([GP, D], dtype=tl.float32)
                    for j in range(0, n_active):
                        at = (first + j) * 2 * GP
                        w = tl.exp2(tl.load(ml_ptr + at + g, cache_modifier=".cg") - big)
                        total += w * tl.load(ml_ptr + at + GP + g, cache_modifier=".cg")
                        o += w[:, None] * tl.load(part_ptr + ((first + j) * GP + g[:, None]) * D + d[None, :],
                                                  cache_modifier=".cg")
                    tl.store(o_at, (o / total[:, None]).to(out_ptr.dtype.element_ty), mask=gmask[:, None])
                    tl.store(count_ptr + pair, 0)  # ready for the next call


# Requests of at most this many tokens attend through this kernel: in CUDA-graph decode (cuda_graph.py) and as
# the decode rows of mixed steps in CUDA-graph pieces (piecewise_graph.py). At batch 1-16 on an H200 it took
# 43-63% of flashinfer's time at 128 tokens, 67-87% at 512, 86-100% at 1,024; beyond, flashinfer's is faster.
MAX_CONTEXT = 1024

# Measured on an H200 (docs/benchmarks-history.md): 128 tokens per iteration for up to 16 requests, 64
# above. A request of at most one iteration's tokens runs in one program (no partials, no merge); a longer
# one in up to MAX_SPLITS, as many as give two programs per SM
MAX_SPLITS = 32
WARPS, STAGES = 4, 3


class PagedDecode:
    """Decode attention of up to `batch` requests (one query token each) with the page table in the given
    device buffers: indptr [batch + 1], last page lengths [batch], page ids. `run` launches one kernel
    (capturable); the buffers are read when it runs, so refilling them before a replay is the plan. They are
    read before the kernel waits for the one ahead of it (programmatic dependent launch): a host copy fills
    them, never the kernel just before `run` on the stream."""

    def __init__(self, indptr: torch.Tensor, last: torch.Tensor, ids: torch.Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int, page_size: int, splits: int | None = None,
                 block_t: int | None = None, min_chunk: int | None = None) -> None:
        self.indptr, self.last, self.ids = indptr, last, ids
        self.batch = last.numel()
        self.h, self.kvh, self.d, self.page = num_heads, num_kv_heads, head_dim, page_size
        self.g = num_heads // num_kv_heads
        self.gp = max(16, triton.next_power_of_2(self.g))  # tl.dot needs 16 rows
        dev = indptr.device
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
        # enough programs for two per SM when requests are long
        self.splits = splits or max(1, min(MAX_SPLITS, -(-2 * sms // (self.batch * num_kv_heads))))
        n = self.batch * num_kv_heads
        self.part = torch.empty(n * self.splits * self.gp * head_dim, dtype=torch.float32, device=dev)
        self.ml = torch.empty(n * self.splits * 2 * self.gp, dtype=torch.float32, device=dev)
        self.count = torch.zeros(n, dtype=torch.int32, device=dev)
        self.scale_log2 = math.log2(math.e) / math.sqrt(head_dim)
        self.block_t = block_t or (128 if self.batch <= 16 else 64)
        self.min_chunk = min_chunk or self.block_t

    def run(self, q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [batch, heads, d] (contiguous), cache [pages, 2, page_size, kv_heads, d] -> out
        [batch, heads, d]."""
        assert q.shape == (self.batch, self.h, self.d) and q.is_contiguous() and cache.is_contiguous()
        out = torch.empty_like(q) if out is None else out
        _decode_kernel[(self.batch, self.kvh, self.splits)](
            q, cache, self.indptr, self.last, self.ids, out, self.part, self.ml, self.count, self.scale_log2,
            self.min_chunk, H=self.h, KVH=self.kvh, G=self.g, GP=self.gp, D=self.d, PAGE=self.page,
            SPLITS=self.splits,
            BLOCK_T=self.block_t, LINES=max(1, self.d * cache.element_size() // 128), num_warps=WARPS,
            num_stages=STAGES, **pdl_args(q.device))
        return out
