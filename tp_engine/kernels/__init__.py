"""Fused GPU kernels (Triton) for the decode hot path, each equal in arithmetic to the torch code it replaces.

Every kernel repeats the rounding steps of the torch reference (compute in fp32, round to the model dtype
where torch would), so swapping one for the other changes results only through the order of a sum:

- kernels/norm.py: `add_rmsnorm` (residual add + RMSNorm, layers/norm.py), `qk_norm_rope_store` (per-head
  RMSNorm of Q and K, rotate-half RoPE and the write of K and V into the paged cache, in one kernel) and
  `silu_mul` (silu(gate) * up of the MLP).
- kernels/gemv.py: `linear`, a batch-1 matmul through a GEMV kernel for the weight shapes where that
  measures faster than cuBLAS (the choice is made once per shape, by timing both).
- kernels/mlp.py: `gate_up_silu`, the MLP's gate/up matmul and silu * up in one kernel at one token, where
  that measures faster than the two.
- kernels/sampling.py: `argmax` (greedy) and `gumbel_argmax` (the sampler's temperature + hashed Gumbel
  noise + argmax), each one launch reading the logits once, `topk_candidates` and `draw_among` (top-k /
  top-p sampling: each row's top-k ids from two reads of its logits, then the draw among them) and
  `resolve_tokens` (the previous step's sampled tokens into the step's input ids, and each token's K/V
  cache rows).
- kernels/moe.py (with kernels/moe_grouped.py): `moe_topk_softmax` (the router's softmax and top-k) and
  `fused_moe` (each token's k experts and their weighted sum, layers/moe.py).
- kernels/fp8.py (with kernels/fp8_gemm.py): `fp8_linear`, the matmul with block-FP8 weights (layers/fp8.py):
  a GEMV at one token, GEMMs for more, chosen per weight shape by timing.
- kernels/decode_attention.py: `PagedDecode`, attention of one-token queries over the paged KV cache inside
  CUDA graphs on short contexts (cuda_graph.py, and mixed steps' decode rows in piecewise_graph.py).

The push all-reduce (comm/push_all_reduce.py) is built on the helpers here too. This module holds the
start-up choice of them (`select`: the engine calls it once, the ranks agree on it, and the engine hands the
result to its layers, sampler and attention backend; nothing here remembers it), their start-up check
(`self_test`) and the Triton helpers the kernels share. It imports nothing else of the engine.
"""
from __future__ import annotations

import functools
import logging
import os
from types import SimpleNamespace

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = tl = None

log = logging.getLogger("tp_engine")

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
    """Whether Triton can be imported."""
    return triton is not None


# ---- the choice ----

def _ops() -> SimpleNamespace:
    # the kernel modules import the helpers below from this one
    from . import fp8, gemv, grammar_mask, mlp, moe, norm, sampling

    return SimpleNamespace(add_rmsnorm=norm.add_rmsnorm, qk_norm_rope_store=norm.qk_norm_rope_store,
                           silu_mul=norm.silu_mul, gate_up_silu=mlp.gate_up_silu, linear=gemv.linear,
                           argmax=sampling.argmax, gumbel_argmax=sampling.gumbel_argmax,
                           resolve_tokens=sampling.resolve_tokens,
                           topk_candidates=sampling.topk_candidates, draw_among=sampling.draw_among,
                           mask_logits=grammar_mask.mask_logits, wait_for_host=grammar_mask.wait_for_host,
                           moe_topk_softmax=moe.topk_softmax,
                           fused_moe=moe.fused_moe, fp8_linear=fp8.linear)


def select(device: torch.device, mode: str = "auto", fp8: bool = False) -> SimpleNamespace | None:
    """What this rank can use under `mode` (config key advanced.fused_kernels): the kernels, or None (the
    torch code). The kernels: an object with add_rmsnorm, qk_norm_rope_store, silu_mul, gate_up_silu, linear,
    argmax, gumbel_argmax, resolve_tokens, topk_candidates, draw_among, mask_logits, wait_for_host,
    moe_topk_softmax, fused_moe and fp8_linear.

    auto: the kernels on CUDA when Triton imports and the self-test passes, else None (with a warning);
    on: the same, but a missing Triton or a failed self-test raises ValueError; off: None. fp8: the model has
    block-FP8 weights, so the self-test covers the FP8 matmuls too (they compile only then)."""
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return None
    if device.type != "cuda":
        raise ValueError("advanced.fused_kernels is on, but the fused Triton kernels run on CUDA only; "
                         "set it to auto or off on CPU")
    if not available():
        if mode == "on":
            raise ValueError("advanced.fused_kernels is on, but Triton cannot be imported")
        log.warning("fused Triton kernels disabled (Triton cannot be imported)")
        return None
    failure = self_test(device, fp8)
    if failure is None:
        return _ops()
    if mode == "on":
        raise ValueError(f"advanced.fused_kernels is on, but the fused Triton kernels failed their "
                         f"self-test: {failure}")
    log.warning("fused Triton kernels disabled (self-test failed: %s)", failure)
    return None


def self_test(device: torch.device, fp8: bool = False) -> str | None:
    """Compile and run each kernel once on small inputs against the torch ops: None if all agree, else what
    went wrong (`select` then falls back to the torch code, or stops the start-up under `on`)."""
    try:
        ops = _ops()
        g = torch.Generator(device=device).manual_seed(0)
        dt = torch.bfloat16
        x = torch.randn(3, 256, device=device, generator=g).to(dt)
        r = torch.randn(3, 256, device=device, generator=g).to(dt)
        w = torch.randn(256, device=device, generator=g).to(dt)
        out, res = ops.add_rmsnorm(x, r, w, 1e-6)
        h = (x + r).float()
        ref = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt)
        tol = dict(atol=5e-2, rtol=5e-2)  # catches broken kernels; the tests check exactness
        torch.testing.assert_close(out, ref, **tol)
        a, b = x.chunk(2, dim=-1)
        torch.testing.assert_close(ops.silu_mul(x), torch.nn.functional.silu(a) * b, **tol)
        logits = torch.randn(2, 5000, device=device, generator=g)
        got = ops.gumbel_argmax(logits, torch.tensor([1], device=device), torch.tensor([1.0], device=device),
                                torch.tensor([12345], device=device))
        assert 0 <= int(got[0]) < 5000
        assert torch.equal(ops.argmax(logits), logits.argmax(dim=-1))
        rows2, temps2 = torch.tensor([0, 1], device=device), torch.tensor([0.5, 2.0], device=device)
        top = ops.topk_candidates(logits, rows2, temps2, 7)
        assert torch.equal(top, logits.topk(7, dim=-1).indices)  # no ties in random normals
        ones = torch.ones(2, dtype=torch.int64, device=device)
        picked = ops.draw_among(logits, rows2, temps2, top, ones, ones.float(), ones)  # top_k 1: the largest
        assert torch.equal(picked, top[:, 0])
        masks = torch.tensor([[0] * 155 + [1 << 4] + [0] * 1], dtype=torch.int32, device=device)  # token 4964
        masked = ops.mask_logits(logits, masks, torch.tensor([-1, 0], dtype=torch.int32, device=device))
        assert torch.equal(masked[0], logits[0]) and masked[1].argmax() == 4964
        assert masked[1].isinf().sum() == 4999
        last = torch.arange(10, 15, device=device)
        ids = torch.tensor([-1, 7, -5], device=device)
        assert ops.resolve_tokens(ids.clone(), last).tolist() == [10, 7, 14]  # both variants: the only two
        k_rows, v_rows = torch.empty_like(ids), torch.empty_like(ids)
        ops.resolve_tokens(ids, last, (torch.tensor([0, 17, 40], device=device), 16, k_rows, v_rows))
        assert ids.tolist() == [10, 7, 14] and k_rows.tolist() == [0, 33, 72]
        assert v_rows.tolist() == [16, 49, 88]
        flag = torch.ones(1, dtype=torch.int32, pin_memory=True)
        ops.wait_for_host(flag, 1)  # raised already: returns (compiled here, never while a stream waits)
        cache = torch.zeros(2, 2, 4, 1, 128, device=device, dtype=dt)
        qkv = torch.randn(2, 3 * 128, device=device, generator=g).to(dt)
        cos = torch.ones(8, 128, device=device)
        sin = torch.zeros(8, 128, device=device)
        ones = torch.ones(128, device=device, dtype=dt)
        rows = torch.tensor([0, 9], device=device)  # slots 0 (page 0) and 5 (page 1, offset 1)
        q = ops.qk_norm_rope_store(qkv, ones, ones, 1e-6, cos, sin, torch.tensor([0, 1], device=device), rows,
                                   cache, 1, 1, 128, 4)
        qf = qkv[:, :128].float()
        torch.testing.assert_close(
            q[:, 0], (qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt), **tol)
        assert torch.equal(cache[1, 1, 1, 0], qkv[1, 256:])
        if fp8:
            from . import fp8 as fp8_kernels
            fp8_kernels.self_test(device)
        torch.cuda.synchronize(device)
        return None
    except Exception as e:  # a broken kernel must not take the engine down: the torch ops still work
        return f"{type(e).__name__}: {e}"


# ---- helpers shared by the kernels ----

def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


# Programmatic dependent launch (sm_90 and later): a kernel of the decode path may start while the one before
# it on the stream finishes. It first loads what no kernel writes (its weights; the graphs' decode attention
# also its page table, copied from the host before the graph runs) and may prefetch what it will read into the
# L2 cache (a prefetch only fills the cache), then `_pdl_wait` blocks until the kernel before it has finished
# and its writes are visible; it reads no activation and writes nothing before that, so results are the same
# bits with it on or off. The GPU sits idle less between the ~10 kernels of a layer, and each matmul's first
# loads overlap the tail of the kernel before it.
# launch/bench.py --no-pdl turns it off, to measure.
PDL = True


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl(device: torch.device) -> bool:
    """Whether the kernels launched on `device` use programmatic dependent launch."""
    return PDL and not _INTERPRET and device.type == "cuda" and _pdl_capable(
        torch.cuda.current_device() if device.index is None else device.index)


def pdl_args(device: torch.device) -> dict:
    """The launch arguments of a kernel with a `PDL` constexpr (it calls `_pdl_wait(PDL)`) on `device`."""
    on = pdl(device)
    return {"PDL": on, "launch_pdl": on}


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
    def _pdl_wait(ON: tl.constexpr):
        """Wait for the kernel before this one (see `pdl`), then let the next one start."""
        if ON:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _prefetch_l2(ptrs):
        """Start loading the lines at `ptrs` (valid addresses) into the L2 cache; no register holds them."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)

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
    def _silu_mul(g, u, DT: tl.constexpr):
        """silu(g) * u from fp32 sums, rounding where torch does: g, u, silu(g) and the product."""
        g = _round(g, DT)
        s = _round(tl.math.div_rn(g, 1.0 + _exp(-g)), DT)
        return _round(s * _round(u, DT), DT)
