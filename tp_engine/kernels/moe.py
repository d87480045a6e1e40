"""Mixture-of-experts on the GPU: the router's top-k, and the experts' SwiGLU MLPs over each token's k
experts.

`fused_moe` computes, for each token t, sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) with
expert_e(x) = down_e(silu(gate_e x) * up_e x), without a host synchronisation (all buffer sizes follow from
the shapes), so a CUDA graph can hold it. Two paths, chosen by the number of tokens:

- few tokens (batch-1 decode): GEMV kernels that read only the k chosen experts' weights: gate and up in
  one program per (token slot, block of output rows), ending in silu(gate) * up; the down projection in
  one program per (token, block of output rows) over all k of its slots, so the weighted combine happens
  in registers.
- more tokens: the token slots are sorted by expert (kernels/moe_grouped.py) and grouped GEMMs run over
  blocks of slots that all belong to one expert.

Both round where the torch reference (layers/moe.py, `experts_reference`) rounds to the model dtype: the
gate and up products, silu, the product, the down product and its weighting. The sums inside each product run
in another order, and the k weighted outputs are added in fp32 and rounded once (the reference adds them one
expert at a time in the model dtype).
"""
from __future__ import annotations

import torch

from tp_engine.kernels import moe_grouped, pdl_args, triton
from tp_engine.kernels.moe_grouped import ExpertScales, scale_args

GEMV_MAX_TOKENS = 4  # up to this many tokens, the GEMV path; the grouped GEMMs above (to be tuned on the GPU)

if triton is not None:
    import triton.language as tl

    from tp_engine.kernels import _exp, _pdl_wait, _prefetch_l2, _round, _silu_mul

    @triton.jit
    def _topk_softmax_kernel(logits_ptr, w_ptr, ids_ptr, E, stride, K: tl.constexpr, K_P2: tl.constexpr,
                             RENORM: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
        _pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        logits = tl.load(logits_ptr + t * stride + e, mask=e < E, other=float("-inf"))
        x = logits.to(tl.float32)
        p = _exp(x - tl.max(x, axis=0))
        p = tl.math.div_rn(p, tl.sum(p, axis=0))  # softmax over all experts in fp32, as transformers
        j = tl.arange(0, K_P2)
        vals = tl.zeros([K_P2], dtype=tl.float32)
        ids = tl.zeros([K_P2], dtype=tl.int32)
        for i in tl.static_range(K):  # the k largest, largest first; the lower id wins a tie
            v, arg = tl.max(p, axis=0, return_indices=True, return_indices_tie_break_left=True)
            vals = tl.where(j == i, v, vals)
            ids = tl.where(j == i, arg, ids)
            p = tl.where(e == arg, -1.0, p)
        if RENORM:
            vals = tl.math.div_rn(vals, tl.sum(vals, axis=0))
        tl.store(w_ptr + t * K + j, vals.to(logits.dtype), mask=j < K)
        tl.store(ids_ptr + t * K + j, ids, mask=j < K)

    @triton.jit
    def _gemv_gate_up_kernel(x_ptr, w_ptr, ids_ptr, act_ptr, K, I, x_stride, w_se, w_sn, act_stride, s_ptr,
                             srow_ptr, s_se, s_sr, TOP_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                             FP8: tl.constexpr, ROUTED: tl.constexpr, LINES: tl.constexpr,
                             PDL: tl.constexpr):
        """FP8: the BN rows share a scale row (BN divides the layout's row_align), so the block scales
        multiply the activations, one per column, not the weights. ROUTED: the expert ids come from the
        kernel before; otherwise (a dense MLP, kernels/mlp.gate_up_silu) they are fixed, and the first weight
        tile is on its way to the L2 cache before the wait for x."""
        if ROUTED:
            _pdl_wait(PDL)
        s = tl.program_id(0)
        first = tl.program_id(1) * BN
        n = first + tl.arange(0, BN)
        nmask = n < I
        e = tl.load(ids_ptr + s).to(tl.int64)
        x_row = x_ptr + (s // TOP_K).to(tl.int64) * x_stride
        gate = w_ptr + e * w_se + n[:, None].to(tl.int64) * w_sn  # rows n of expert e's gate, then of its up
        up = gate + I * w_sn
        if FP8:
            s_gate = s_ptr + e * s_se + tl.load(srow_ptr + first) * s_sr
            s_up = s_ptr + e * s_se + tl.load(srow_ptr + I + first) * s_sr
        if not ROUTED:
            if PDL:  # one address per 128-byte line of each row's first tile (LINES of them)
                lines = w_ptr + tl.minimum(n, I - 1)[:, None].to(tl.int64) * w_sn + tl.minimum(
                    tl.arange(0, LINES) * (BK // LINES), K - 1)[None, :]
                _prefetch_l2(lines)
                _prefetch_l2(lines + I * w_sn)
            _pdl_wait(PDL)
        acc_g = tl.zeros([BN, BK], dtype=tl.float32)
        acc_u = tl.zeros([BN, BK], dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            kmask = k < K
            xv = tl.load(x_row + k, mask=kmask, other=0.0).to(tl.float32)
            xg = xv
            xu = xv
            if FP8:
                xg = xv * tl.load(s_gate + k // 128, mask=kmask, other=0.0)
                xu = xv * tl.load(s_up + k // 128, mask=kmask, other=0.0)
            m = nmask[:, None] & kmask[None, :]
            acc_g += tl.load(gate + k[None, :], mask=m, other=0.0).to(tl.float32) * xg[None, :]
            acc_u += tl.load(up + k[None, :], mask=m, other=0.0).to(tl.float32) * xu[None, :]
        DT: tl.constexpr = act_ptr.dtype.element_ty
        out = _silu_mul(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), DT)
        tl.store(act_ptr + s.to(tl.int64) * act_stride + n, out.to(DT), mask=nmask)

    @triton.jit
    def _gemv_down_kernel(act_ptr, w_ptr, ids_ptr, wts_ptr, out_ptr, I, H, act_stride, w_se, w_sn, out_stride,
                          s_ptr, srow_ptr, s_se, s_sr, k_shift, TOP_K: tl.constexpr, K_P2: tl.constexpr,
                          BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
        """Rows n of token t's output: its k experts' down rows in one [k, BN, BK] tile, so the loads of all
        k experts are in flight at once (one after the other, each waited for, they read at half the
        bandwidth), then weighted and combined in registers: no second pass. FP8: as in the gate/up kernel,
        the scales multiply the activations (the BN rows, at most 128 and aligned, share a scale row)."""
        _pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        first = tl.program_id(1) * BN
        n = first + tl.arange(0, BN)
        nmask = n < H
        j = tl.arange(0, K_P2)
        jmask = j < TOP_K
        s = t * TOP_K + j
        e = tl.load(ids_ptr + s, mask=jmask, other=0).to(tl.int64)
        rows = w_ptr + e[:, None, None] * w_se + n[None, :, None].to(tl.int64) * w_sn
        wmask = jmask[:, None, None] & nmask[None, :, None]
        if FP8:
            s_rows = s_ptr + e[:, None] * s_se + tl.load(srow_ptr + first) * s_sr  # [k, 1]: each expert's
        acc = tl.zeros([K_P2, BN, BK], dtype=tl.float32)
        for k0 in range(0, I, BK):
            k = k0 + tl.arange(0, BK)
            kmask = k < I
            amask = jmask[:, None] & kmask[None, :]
            # the weights first: with FP8, the activations' scaling goes through shared memory, and a load
            # issued after its barrier would wait for that round trip
            w = tl.load(rows + k[None, None, :], mask=wmask & kmask[None, None, :], other=0.0)
            a = tl.load(act_ptr + s[:, None] * act_stride + k[None, :], mask=amask, other=0.0).to(tl.float32)
            if FP8:
                a = a * tl.load(s_rows + ((k + k_shift) // 128)[None, :], mask=amask, other=0.0)
            acc += w.to(tl.float32) * a[:, None, :]
        DT: tl.constexpr = out_ptr.dtype.element_ty
        # [k, BN]: each expert's output, rounded as the reference rounds it
        y = _round(tl.sum(acc, axis=2), DT)
        y = _round(y * tl.load(wts_ptr + s, mask=jmask, other=0.0).to(tl.float32)[:, None], DT)
        total = tl.sum(tl.where(jmask[:, None], y, 0.0), axis=0)
        tl.store(out_ptr + t * out_stride + n, _round(total, DT).to(DT), mask=nmask)


def topk_softmax(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, k] in the logits' dtype, expert ids [N, k] int32), largest first:
    softmax over the experts in fp32, the top k, divided by their sum when `renormalize`."""
    n, e = logits.shape
    weights = torch.empty((n, k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((n, k), dtype=torch.int32, device=logits.device)
    if n:
        block = triton.next_power_of_2(e)
        _topk_softmax_kernel[(n,)](logits, weights, ids, e, logits.stride(0), K=k,
                                   K_P2=triton.next_power_of_2(k), RENORM=renormalize, BLOCK_E=block,
                                   num_warps=max(1, min(4, block // 128)), **pdl_args(logits.device))
    return weights, ids


# (output rows per program, reduction step, warps) of the few-token path, the best of a sweep of 55 and 32
# tiles on Qwen3-30B-A3B's experts (docs/benchmarks-history.md). The fp32 partial sums stay in registers
# without spills (compiled for sm_90 in tests/test_moe_kernels.py; the down kernel holds k = 8 times rows x
# step). Each shape times them once on the GPU, outside any CUDA-graph capture, and keeps the fastest (as
# kernels/gemv.py does).
GEMV_TILES = [(1, 512, 2), (1, 1024, 4), (8, 128, 8), (8, 512, 2), (1, 256, 2), (2, 1024, 4)]
DOWN_TILES = [(1, 128, 4), (4, 256, 4), (8, 256, 4), (1, 256, 2), (2, 128, 4), (1, 512, 4)]
_DEFAULT = ((1, 1024, 4), (1, 512, 4))  # (gate_up, down) when there is no time to choose (a capture)
_CHOICE: dict = {}  # measured choices by shape and device: a cache (as kernels/gemv.py's), not a switch


def _gate_up(x, gate_up, ids, tile, scales: ExpertScales | None = None) -> torch.Tensor:
    n, k = ids.shape
    _, two_i, h = gate_up.shape
    i = two_i // 2
    bn, bk, warps = tile
    act = torch.empty((n * k, i), dtype=x.dtype, device=x.device)
    _gemv_gate_up_kernel[(n * k, triton.cdiv(i, bn))](
        x, gate_up, ids, act, h, i, x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        *scale_args(scales, False, x)[:4], TOP_K=k, BN=bn, BK=min(bk, triton.next_power_of_2(h)),
        FP8=scales is not None, ROUTED=True, LINES=1, num_warps=warps, **pdl_args(x.device))
    return act


def _down(act, down, ids, weights, tile, scales: ExpertScales | None = None) -> torch.Tensor:
    n, k = ids.shape
    _, h, i = down.shape
    bn, bk, warps = tile
    out = torch.empty((n, h), dtype=act.dtype, device=act.device)
    _gemv_down_kernel[(n, triton.cdiv(h, bn))](
        act, down, ids, weights, out, i, h, act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        *scale_args(scales, True, act), TOP_K=k, K_P2=triton.next_power_of_2(k), BN=bn,
        BK=min(bk, triton.next_power_of_2(i)), FP8=scales is not None, num_warps=warps,
        **pdl_args(act.device))
    return out


def _tiles(scales: ExpertScales | None) -> tuple[list, list]:
    """The tiles that may run: with FP8 experts, a gate/up tile's rows must share a scale row."""
    if scales is None:
        return GEMV_TILES, DOWN_TILES
    return [t for t in GEMV_TILES if scales.row_align % t[0] == 0] or [(1, 1024, 4)], DOWN_TILES


def _choose(x, gate_up, down, weights, ids, scales) -> tuple:
    """The fastest tile of each kernel for these shapes, timed over routings to random experts, so that the
    weights come from HBM as they do in a step, not from the L2 cache."""
    from tp_engine.kernels.gemv import _time
    n, k = ids.shape
    e = gate_up.shape[0]
    routes = [torch.stack([torch.randperm(e, device=x.device)[:k] for _ in range(n)]).to(ids.dtype)
              for _ in range(8)]
    gate_up_tiles, down_tiles = _tiles(scales)
    act = _gate_up(x, gate_up, ids, gate_up_tiles[0], scales)
    best = []
    for run, tiles in ((lambda r, t: _gate_up(x, gate_up, r, t, scales), gate_up_tiles),
                       (lambda r, t: _down(act, down, r, weights, t, scales), down_tiles)):
        times = {t: _time(lambda r: run(r, t), routes) for t in tiles}
        best.append(min(times, key=times.get))
    return tuple(best)


def moe_gemv(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
             ids: torch.Tensor, scales: ExpertScales | None = None) -> torch.Tensor:
    """The few-token path of `fused_moe`: reads only the chosen experts' weights."""
    ids, weights = ids.contiguous(), weights.contiguous()
    key = (tuple(ids.shape), tuple(gate_up.shape), x.dtype, gate_up.dtype, x.device.index)
    tiles = _CHOICE.get(key)
    if tiles is None:
        if not x.is_cuda or torch.cuda.is_current_stream_capturing():
            tiles = _tiles(scales)[0][0], _DEFAULT[1]
        else:
            tiles = _CHOICE[key] = _choose(x, gate_up, down, weights, ids, scales)
    return _down(_gate_up(x, gate_up, ids, tiles[0], scales), down, ids, weights, tiles[1], scales)


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, scales: ExpertScales | None = None) -> torch.Tensor:
    """x [N, H]; gate_up [E, 2I, H] (each expert's [gate | up] rows), down [E, H, I]; weights and ids [N, k]
    from `topk_softmax`. Returns sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) as [N, H] in x's dtype.
    With `scales` the experts are float8_e4m3fn, dequantized in registers (weight-only)."""
    assert x.stride(-1) == 1 and gate_up.is_contiguous() and down.is_contiguous()
    if ids.shape[0] == 0:
        return torch.zeros_like(x)
    if ids.shape[0] <= GEMV_MAX_TOKENS:
        return moe_gemv(x, gate_up, down, weights, ids, scales)
    return moe_grouped.moe_grouped(x, gate_up, down, weights, ids, scales=scales)


def self_test_fp8(device: torch.device) -> None:
    """fused_moe over FP8 experts (both paths) against the dequantized experts in float32, on small shapes
    with a column shift; raises on a mismatch. Run before the engine keeps FP8 experts (layers/fp8.py)."""
    from tp_engine.kernels.fp8 import dequantize
    g = torch.Generator(device=device).manual_seed(0)
    e, h, i, k = 4, 128, 192, 2

    def rows(n: int) -> torch.Tensor:  # the scale row of each of n unsharded rows
        return (torch.arange(n, device=device) // 128).to(torch.int32)

    gu = (torch.randn(e, 2 * i, h, device=device, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    dn = (torch.randn(e, h, i, device=device, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    gu_s = torch.rand(e, 2 * i // 128, h // 128, device=device, generator=g) / 600 + 1e-4
    # columns start 64 into a block
    dn_s = torch.rand(e, h // 128, 2, device=device, generator=g) / 600 + 1e-4
    scales = ExpertScales(gu_s, rows(2 * i), dn_s, rows(h), 64, 128)
    gu_f = torch.stack([dequantize(gu[j], gu_s[j], rows(2 * i), 0, torch.bfloat16) for j in range(e)]).float()
    dn_f = torch.stack([dequantize(dn[j], dn_s[j], rows(h), 64, torch.bfloat16) for j in range(e)]).float()
    for n in (1, 8):
        x = torch.randn(n, h, device=device, generator=g).to(torch.bfloat16)
        weights, ids = topk_softmax(torch.randn(n, e, device=device, generator=g).to(torch.bfloat16), k, True)
        got = fused_moe(x, gu, dn, weights, ids, scales).float()
        ref = torch.zeros(n, h, device=device)
        for t in range(n):
            for j in range(k):
                gate, up = (gu_f[ids[t, j]] @ x[t].float()).chunk(2)
                ref[t] += weights[t, j].float() * (dn_f[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
        err = float((got - ref).norm() / ref.norm())
        assert err < 0.05, f"fused_moe with FP8 experts at {n} tokens: relative error {err:.3f}"
