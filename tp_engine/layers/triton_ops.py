"""Fused GPU kernels (Triton) for the decode hot path, each equal in arithmetic to the torch code it replaces.

Every kernel repeats the rounding steps of the torch reference (compute in fp32, round to the model dtype
where torch would), so swapping one for the other changes results only through the order of a sum:

- `add_rmsnorm`: residual add + RMSNorm (layers/norm.py), one kernel instead of nine.
- `qk_norm_rope_store`: per-head RMSNorm of Q and K, rotate-half RoPE, and the write of K and V into the
  paged cache, one kernel for all heads of all tokens (Qwen3Attention before attention).
- `silu_mul`: silu(gate) * up of the MLP.
- `gumbel_argmax`: the sampler's temperature + hashed Gumbel noise + argmax (sampler.py), reading the
  logits once instead of materialising [B, vocab] int64 noise.
- `linear`: a batch-1 matmul through a GEMV kernel for the weight shapes where that measures faster
  than cuBLAS (the choice is made once per shape, by timing both).
- `push_all_reduce`: the all-reduce of small messages over symmetric memory (distributed.py), and
  `push_all_reduce_add_rmsnorm`, the same fused with the residual add and RMSNorm that follow it.
- `resolve_tokens`: puts the tokens sampled in the previous step into the step's input ids.

Only imported on CUDA; `available()` says whether Triton can be used (TP_ENGINE_TRITON=0 turns it off).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

_INTERPRET = bool(os.environ.get("TRITON_INTERPRET"))
_libdevice = None
if triton is not None and not _INTERPRET:
    try:
        from triton.language.extra.cuda import libdevice as _libdevice
    except ImportError:
        try:
            from triton.language.extra import libdevice as _libdevice
        except ImportError:
            _libdevice = None
# libdevice's expf/logf/rsqrtf are the functions torch's CUDA kernels call; Triton's own tl.exp etc.
# are faster approximations. The interpreter (CPU tests) has no libdevice.
PRECISE = _libdevice is not None


def available() -> bool:
    return triton is not None and os.environ.get("TP_ENGINE_TRITON", "1") != "0"


def self_test(device: torch.device) -> bool:
    """Compile and run each kernel once on small inputs against the torch ops; False (and a warning) if any
    fails, so the engine falls back to the torch code instead of failing."""
    import logging

    try:
        g = torch.Generator(device=device).manual_seed(0)
        dt = torch.bfloat16
        x = torch.randn(3, 256, device=device, generator=g).to(dt)
        r = torch.randn(3, 256, device=device, generator=g).to(dt)
        w = torch.randn(256, device=device, generator=g).to(dt)
        out, res = add_rmsnorm(x, r, w, 1e-6)
        h = (x + r).float()
        ref = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt)
        tol = dict(atol=5e-2, rtol=5e-2)  # catches broken kernels; the tests check exactness
        torch.testing.assert_close(out, ref, **tol)
        a, b = x.chunk(2, dim=-1)
        torch.testing.assert_close(silu_mul(x), torch.nn.functional.silu(a) * b, **tol)
        logits = torch.randn(2, 5000, device=device, generator=g)
        got = gumbel_argmax(logits, torch.tensor([1], device=device), torch.tensor([1.0], device=device),
                            torch.tensor([12345], device=device))
        assert 0 <= int(got[0]) < 5000
        cache = torch.zeros(2, 2, 4, 1, 128, device=device, dtype=dt)
        qkv = torch.randn(2, 3 * 128, device=device, generator=g).to(dt)
        cos = torch.ones(8, 128, device=device)
        sin = torch.zeros(8, 128, device=device)
        ones = torch.ones(128, device=device, dtype=dt)
        rows = torch.tensor([0, 9], device=device)  # slots 0 (page 0) and 5 (page 1, offset 1)
        q = qk_norm_rope_store(qkv, ones, ones, 1e-6, cos, sin, torch.tensor([0, 1], device=device), rows, cache,
                               1, 1, 128, 4)
        qf = qkv[:, :128].float()
        torch.testing.assert_close(q[:, 0], (qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt), **tol)
        assert torch.equal(cache[1, 1, 1, 0], qkv[1, 256:])
        torch.cuda.synchronize(device)
        return True
    except Exception as e:  # a broken kernel must not take the engine down: the torch ops still work
        logging.getLogger("tp_engine").warning("fused Triton kernels disabled (self-test failed: %s: %s)",
                                               type(e).__name__, e)
        return False


if triton is not None:
    if PRECISE:
        @triton.jit
        def _exp(x):
            return _libdevice.exp(x)

        @triton.jit
        def _log(x):
            return _libdevice.log(x)

        @triton.jit
        def _rsqrt(x):
            return _libdevice.rsqrt(x)
    else:
        @triton.jit
        def _exp(x):
            return tl.exp(x)

        @triton.jit
        def _log(x):
            return tl.log(x)

        @triton.jit
        def _rsqrt(x):
            return 1.0 / tl.sqrt(x)

    @triton.jit
    def _round(x, DT: tl.constexpr):
        """fp32 -> the nearest DT value (ties to even), still held in fp32: a rounding step of the torch
        reference. Done on the bits for bf16, so the compiler cannot drop it as a no-op round trip."""
        if DT == tl.bfloat16:
            b = x.to(tl.uint32, bitcast=True)
            b = (b + (0x7FFF + ((b >> 16) & 1))) & 0xFFFF0000
            return b.to(tl.float32, bitcast=True)
        elif DT == tl.float32:
            return x
        else:
            return x.to(DT).to(tl.float32)

    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, inv_n, eps,
                            x_stride, res_stride, out_stride, res_out_stride,
                            HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        DT = x.dtype
        xf = x.to(tl.float32)
        if HAS_RES:
            r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
            xf = _round(xf + r.to(tl.float32), DT)
            tl.store(res_out_ptr + row * res_out_stride + cols, xf.to(DT), mask=mask)
        rstd = _rsqrt(tl.sum(xf * xf, axis=0) * inv_n + eps)
        y = _round(xf * rstd, DT)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = _round(w.to(tl.float32) * y, DT).to(DT)
        tl.store(out_ptr + row * out_stride + cols, out, mask=mask)

    @triton.jit
    def _qk_norm_rope_store_kernel(qkv_ptr, qkv_stride, q_out_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr,
                                   rows_ptr, cache_ptr, eps, inv_d,
                                   H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        hd = tl.program_id(1)
        HALF: tl.constexpr = D // 2
        i = tl.arange(0, HALF)
        src = qkv_ptr + t * qkv_stride + hd * D
        a = tl.load(src + i)
        b = tl.load(src + HALF + i)
        DT = a.dtype
        if hd < H + KVH:
            if hd < H:
                w1 = tl.load(qw_ptr + i).to(tl.float32)
                w2 = tl.load(qw_ptr + HALF + i).to(tl.float32)
            else:
                w1 = tl.load(kw_ptr + i).to(tl.float32)
                w2 = tl.load(kw_ptr + HALF + i).to(tl.float32)
            x1 = a.to(tl.float32)
            x2 = b.to(tl.float32)
            rstd = _rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) * inv_d + eps)
            # RMSNorm: normalise in fp32, round, scale by the weight, round (as layers/norm.py)
            y1 = _round(w1 * _round(x1 * rstd, DT), DT)
            y2 = _round(w2 * _round(x2 * rstd, DT), DT)
            # RoPE, rotate-half form, each product and the sum rounded (as layers/rotary.py)
            pos = tl.load(pos_ptr + t)
            c = _round(tl.load(cos_ptr + pos * D + i), DT)
            s = _round(tl.load(sin_ptr + pos * D + i), DT)
            o1 = _round(_round(y1 * c, DT) + _round(-y2 * s, DT), DT).to(DT)
            o2 = _round(_round(y2 * c, DT) + _round(y1 * s, DT), DT).to(DT)
            if hd < H:
                dst = q_out_ptr + (t * H + hd) * D
            else:
                row = tl.load(rows_ptr + t)
                dst = cache_ptr + (row * KVH + (hd - H)) * D
            tl.store(dst + i, o1)
            tl.store(dst + HALF + i, o2)
        else:
            row = tl.load(rows_ptr + t) + PAGE  # V of a slot sits one page-size of rows after its K
            dst = cache_ptr + (row * KVH + (hd - H - KVH)) * D
            tl.store(dst + i, a)
            tl.store(dst + HALF + i, b)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, n, x_stride, out_stride, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g = tl.load(x_ptr + t * x_stride + cols, mask=mask, other=0.0)
        u = tl.load(x_ptr + t * x_stride + n + cols, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        s = _round(tl.math.div_rn(gf, 1.0 + _exp(-gf)), g.dtype)
        out = _round(s * u.to(tl.float32), g.dtype).to(g.dtype)
        tl.store(out_ptr + t * out_stride + cols, out, mask=mask)

    @triton.jit
    def _gumbel_argmax_kernel(logits_ptr, stride, rows_ptr, temp_ptr, hash_ptr, val_ptr, idx_ptr, vocab,
                              num_chunks, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        chunk = tl.program_id(1)
        row = tl.load(rows_ptr + r).to(tl.int64)
        temp = tl.load(temp_ptr + r)
        h = tl.load(hash_ptr + r).to(tl.uint32)
        ids = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = ids < vocab
        x = tl.load(logits_ptr + row * stride + ids, mask=mask, other=0.0)
        x = tl.math.div_rn(x, temp)
        # the 32-bit hash of sampler.uniform_noise; uint32 arithmetic wraps exactly like its `& 0xFFFFFFFF`
        v = h + ids.to(tl.uint32) * 0x9E3779B1
        v = ((v >> 16) ^ v) * 0x45D9F3B
        v = ((v >> 16) ^ v) * 0x45D9F3B
        v = (v >> 16) ^ v
        u = ((v >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        g = x - _log(-_log(u))
        g = tl.where(mask, g, float("-inf"))
        best, arg = tl.max(g, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(val_ptr + r * num_chunks + chunk, best)
        tl.store(idx_ptr + r * num_chunks + chunk, (chunk * BLOCK + arg).to(tl.int64))


    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, w_stride, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        base = w_ptr + rows[:, None].to(tl.int64) * w_stride
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cmask = cols < K
            x = tl.load(x_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            # each weight is read once per step: keep it from pushing activations out of the L2 cache
            w = tl.load(base + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0,
                        eviction_policy="evict_first")
            acc += w.to(tl.float32) * x[None, :]
        tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=rmask)

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

    @triton.jit
    def _resolve_tokens_kernel(ids_ptr, last_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        m = offs < n
        ids = tl.load(ids_ptr + offs, mask=m, other=0)
        ref = ids < 0
        tok = tl.load(last_ptr + tl.where(ref, -1 - ids, 0), mask=m & ref, other=0)
        tl.store(ids_ptr + offs, tl.where(ref, tok, ids), mask=m)


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual) for 2-D x; the first call of a model passes no residual."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if residual is None:
        res_in, res_out = x2, x2
    else:
        res_in = residual.reshape(-1, n)
        if res_in.stride(-1) != 1:
            res_in = res_in.contiguous()
        res_out = torch.empty_like(out)
    if rows:
        block = triton.next_power_of_2(n)
        _add_rmsnorm_kernel[(rows,)](x2, res_in, weight, out, res_out, n, 1.0 / n, eps,
                                     x2.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0),
                                     HAS_RES=residual is not None, BLOCK=block, num_warps=_warps(block))
    shape = x.shape
    return out.view(shape), (x if residual is None else res_out.view(shape))


def qk_norm_rope_store(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_rows: torch.Tensor,
                       cache: torch.Tensor, heads: int, kv_heads: int, head_dim: int, page_size: int) -> torch.Tensor:
    """qkv: [N, (heads + 2 kv_heads) * head_dim] -> q [N, heads, head_dim], normalised and rotated.

    K (normalised, rotated) and V go straight into `cache` (one layer, [pages, 2, page_size, kv_heads,
    head_dim]): K of token t to row k_rows[t] of the cache viewed as [rows, kv_heads, head_dim], V to
    row k_rows[t] + page_size.
    """
    n = qkv.shape[0]
    assert qkv.stride(-1) == 1 and cache.is_contiguous() and head_dim % 2 == 0
    q = torch.empty((n, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if n:
        _qk_norm_rope_store_kernel[(n, heads + 2 * kv_heads)](
            qkv, qkv.stride(0), q, q_weight, k_weight, cos, sin, positions, k_rows, cache, eps, 1.0 / head_dim,
            H=heads, KVH=kv_heads, D=head_dim, PAGE=page_size, num_warps=1)
    return q


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [N, 2 I] = [gate | up] -> silu(gate) * up, [N, I]."""
    rows, two_n = x.shape
    n = two_n // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](x, out, n, x.stride(0), out.stride(0), BLOCK=block,
                                                        num_warps=_warps(block))
    return out


GUMBEL_BLOCK = 4096


def gumbel_argmax(logits: torch.Tensor, rows: torch.Tensor, temperatures: torch.Tensor,
                  row_hash: torch.Tensor) -> torch.Tensor:
    """argmax over the vocab of logits[rows] / T + Gumbel noise from the sampler's hash; returns [R] int64.

    rows: [R] int64 row indices into logits ([B, vocab] fp32); temperatures: [R] fp32; row_hash: [R] int64,
    the per-row hash `sampler.uniform_noise` starts from.
    """
    vocab = logits.shape[-1]
    assert logits.stride(-1) == 1 and logits.dtype == torch.float32
    r = rows.numel()
    chunks = triton.cdiv(vocab, GUMBEL_BLOCK)
    vals = torch.empty((r, chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((r, chunks), dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(r, chunks)](logits, logits.stride(0), rows, temperatures, row_hash, vals, idx, vocab,
                                       chunks, BLOCK=GUMBEL_BLOCK, num_warps=8)
    # the first chunk holding the maximum has the lowest ids: the same tie-break as torch.argmax
    return idx.gather(1, vals.argmax(dim=1, keepdim=True)).squeeze(1)


# ---- batch-1 matmul ----
# cuBLAS reads small weight matrices at one token far below the memory bandwidth (its tiles launch too few
# blocks); a plain GEMV kernel does better on some shapes. Each weight shape picks the faster of the two
# once, on first use, by timing both (never inside a CUDA-graph capture: GraphRunner warms every bucket up
# before capturing it, so the choice is made by then).

GEMV_CONFIGS = [(2, 1024, 4), (4, 512, 4), (4, 1024, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 8),
                (32, 256, 8)]  # (rows per program, columns per iteration, warps)
_GEMV_CHOICE: dict = {}


def _gemv(x: torch.Tensor, w: torch.Tensor, cfg) -> torch.Tensor:
    bn, bk, warps = cfg
    n, k = w.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, bn),)](x, w, out, n, k, w.stride(0), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
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


def _choose(x: torch.Tensor, w: torch.Tensor):
    import torch.nn.functional as F
    l2 = getattr(torch.cuda.get_device_properties(w.device), "L2_cache_size", 64 << 20)
    n_copies = min(64, max(1, -(-3 * l2 // (w.numel() * w.element_size()))))
    weights = [w] + [w.clone() for _ in range(n_copies - 1)]
    best, best_t = "torch", _time(lambda m: F.linear(x, m), weights)
    for cfg in GEMV_CONFIGS:
        try:
            t = _time(lambda m: _gemv(x, m, cfg), weights)
        except Exception:  # a config this shape or GPU cannot run
            continue
        if t < best_t * 0.95:
            best, best_t = cfg, t
    return best


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T for x [M, K], w [N, K]; at M == 1 through whichever of cuBLAS and the GEMV kernel is faster."""
    import torch.nn.functional as F
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype != w.dtype or not x.is_contiguous() or w.stride(1) != 1:
        return F.linear(x, w)
    key = (tuple(w.shape), w.dtype, x.device.index)
    cfg = _GEMV_CHOICE.get(key)
    if cfg is None:
        if torch.cuda.is_current_stream_capturing():
            return F.linear(x, w)
        cfg = _GEMV_CHOICE[key] = _choose(x, w)
    return F.linear(x, w) if cfg == "torch" else _gemv(x, w, cfg)


def push_all_reduce(x: torch.Tensor, ptrs: torch.Tensor, state: torch.Tensor, slot: int, rank: int,
                    world: int) -> torch.Tensor:
    """Sum of `x` over the ranks, for small messages (distributed._PushAllReduce owns the buffers).

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


PUSH_NORM_CHUNK = int(os.environ.get("TP_ENGINE_PUSH_CHUNK", "512"))  # values per program and row (0: whole rows)


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


def resolve_tokens(ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """In place: each id < 0 becomes last[-1 - id] (Engine.resolve), in one kernel."""
    n = ids.numel()
    if n:
        _resolve_tokens_kernel[(1,)](ids, last, n, BLOCK=triton.next_power_of_2(n))
    return ids
