"""Fused GPU kernels (Triton) for the decode hot path, each equal in arithmetic to the torch code it replaces.

Every kernel repeats the rounding steps of the torch reference (compute in fp32, round to the model dtype
where torch would), so swapping one for the other changes results only through the order of a sum:

- `add_rmsnorm`: residual add + RMSNorm (layers/norm.py), one kernel instead of nine.
- `qk_norm_rope_store`: per-head RMSNorm of Q and K, rotate-half RoPE, and the write of K and V into the
  paged cache, one kernel for all heads of all tokens (Qwen3Attention before attention).
- `silu_mul`: silu(gate) * up of the MLP.
- `gumbel_argmax`: the sampler's temperature + hashed Gumbel noise + argmax (sampler.py), reading the
  logits once instead of materialising [B, vocab] int64 noise.

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
    def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, inv_n, eps,
                            x_stride, res_stride, out_stride, res_out_stride,
                            HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = _rsqrt(tl.sum(xf * xf, axis=0) * inv_n + eps)
        y = (xf * rstd).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
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
        dt = a.dtype
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
            y1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            y2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            # RoPE, rotate-half form, each product and the sum rounded (as layers/rotary.py)
            pos = tl.load(pos_ptr + t)
            c = tl.load(cos_ptr + pos * D + i).to(dt).to(tl.float32)
            s = tl.load(sin_ptr + pos * D + i).to(dt).to(tl.float32)
            o1 = ((y1 * c).to(dt).to(tl.float32) + (-y2 * s).to(dt).to(tl.float32)).to(dt)
            o2 = ((y2 * c).to(dt).to(tl.float32) + (y1 * s).to(dt).to(tl.float32)).to(dt)
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
        s = tl.math.div_rn(gf, 1.0 + _exp(-gf)).to(g.dtype)
        out = (s.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty)
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
