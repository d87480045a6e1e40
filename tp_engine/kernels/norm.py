"""Norms and the MLP's activation, fused: residual add + RMSNorm, Q/K norm + RoPE + the K/V write,
silu * up."""
from __future__ import annotations

import torch

from tp_engine.kernels import _warps, pdl_args, triton

if triton is not None:
    import triton.language as tl

    from tp_engine.kernels import _exp, _pdl_wait, _round, _rsqrt

    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, inv_n, eps,
                            x_stride, res_stride, out_stride, res_out_stride,
                            HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        _pdl_wait(PDL)
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        DT = x.dtype
        xf = x.to(tl.float32)
        if HAS_RES:
            r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
            xf = _round(xf + r.to(tl.float32), DT)
            tl.store(res_out_ptr + row * res_out_stride + cols, xf.to(DT), mask=mask)
        rstd = _rsqrt(tl.sum(xf * xf, axis=0) * inv_n + eps)
        y = _round(xf * rstd, DT)
        out = _round(w.to(tl.float32) * y, DT).to(DT)
        tl.store(out_ptr + row * out_stride + cols, out, mask=mask)

    # a token's position and cache row are read one at a time: no compile per alignment of a view
    @triton.jit(do_not_specialize=["pos_ptr", "rows_ptr"])
    def _qk_norm_rope_store_kernel(qkv_ptr, qkv_stride, q_out_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr,
                                   rows_ptr, cache_ptr, eps, inv_d,
                                   H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                                   PDL: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        hd = tl.program_id(1)
        HALF: tl.constexpr = D // 2
        i = tl.arange(0, HALF)
        is_q = hd < H  # the weights, which no kernel writes, before the wait
        w1 = tl.where(is_q, tl.load(qw_ptr + i), tl.load(kw_ptr + i)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(qw_ptr + HALF + i), tl.load(kw_ptr + HALF + i)).to(tl.float32)
        _pdl_wait(PDL)
        src = qkv_ptr + t * qkv_stride + hd * D
        a = tl.load(src + i)
        b = tl.load(src + HALF + i)
        DT = a.dtype
        if hd < H + KVH:
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
    def _silu_mul_kernel(x_ptr, out_ptr, n, x_stride, out_stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
        _pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g = tl.load(x_ptr + t * x_stride + cols, mask=mask, other=0.0)
        u = tl.load(x_ptr + t * x_stride + n + cols, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        s = _round(tl.math.div_rn(gf, 1.0 + _exp(-gf)), g.dtype)
        out = _round(s * u.to(tl.float32), g.dtype).to(g.dtype)
        tl.store(out_ptr + t * out_stride + cols, out, mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual) for 2-D x; the first call of a model passes no
    residual."""
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
                                     HAS_RES=residual is not None, BLOCK=block, num_warps=_warps(block),
                                     **pdl_args(x.device))
    shape = x.shape
    return out.view(shape), (x if residual is None else res_out.view(shape))


def qk_norm_rope_store(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_rows: torch.Tensor,
                       cache: torch.Tensor, heads: int, kv_heads: int, head_dim: int, page_size: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """qkv: [N, (heads + 2 kv_heads) * head_dim] -> q [N, heads, head_dim], normalised and rotated (into
    `out` when given, contiguous).

    K (normalised, rotated) and V go straight into `cache` (one layer, [pages, 2, page_size, kv_heads,
    head_dim]): K of token t to row k_rows[t] of the cache viewed as [rows, kv_heads, head_dim], V to
    row k_rows[t] + page_size.
    """
    n = qkv.shape[0]
    assert qkv.stride(-1) == 1 and cache.is_contiguous() and head_dim % 2 == 0
    q = torch.empty((n, heads, head_dim), dtype=qkv.dtype, device=qkv.device) if out is None else out
    assert q.shape == (n, heads, head_dim) and q.is_contiguous()
    if n:
        _qk_norm_rope_store_kernel[(n, heads + 2 * kv_heads)](
            qkv, qkv.stride(0), q, q_weight, k_weight, cos, sin, positions, k_rows, cache, eps,
            1.0 / head_dim, H=heads, KVH=kv_heads, D=head_dim, PAGE=page_size, num_warps=1,
            **pdl_args(qkv.device))
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
                                                        num_warps=_warps(block), **pdl_args(x.device))
    return out
