"""The block-FP8 GPU kernels (tp_engine/kernels/fp8.py, fp8_gemm.py), checked without a GPU:

- numerically, in Triton's interpreter (TRITON_INTERPRET=1, CPU tensors), against torch references: the GEMV
  (both bodies), the GEMM with the activations handled inside (weight-only and w8a8, swapped or not), the
  GEMM after `prepare_activations`, and the dequantization for cuBLAS, on a shard with ragged sizes, a k
  offset (a row-parallel shard that starts inside a block) and scale rows that change inside a tile;
- compiled for the H200 (sm_90): each structural variant must pass ptxas without register spills, within
  an SM's shared memory, and the GEMM's k-loop must be pipelined (asynchronous copies); the GEMV's k-loop
  must sum nothing across threads.

Triton is optional (CUDA builds of torch bring it); without it these tests skip. tests/test_gpu_fp8.py runs
the kernels on a GPU.
"""
import pytest

triton = pytest.importorskip("triton")

from sm90 import MAX_SHARED, compile_sm90, loop_body, spills  # noqa: E402
from triton_interpreter import run_script  # noqa: E402


INTERPRETER_SCRIPT = r'''
import numpy as np
import torch
import torch.nn.functional as F
import triton.language as tl
import triton_interpreter  # noqa: F401  (its fixes of the interpreter)

from tp_engine.kernels import fp8, fp8_gemm
from tp_engine.kernels.fp8_gemm import GEMM_CONFIGS, PRE_CONFIGS, dequantize_weight

FP8 = torch.float8_e4m3fn
PREPARED = {}


def prepare_activations(x, shift, w8a8, run=fp8_gemm.prepare_activations):
    """The kernel's result for these activations, run once: checked below, then taken by every "pre" GEMM that
    asks for the same (19 rows of it cost the interpreter more than a GEMM)."""
    key = (id(x), shift, w8a8)
    if key not in PREPARED or PREPARED[key][0] is not x:
        PREPARED[key] = (x, run(x, shift, w8a8))
    return PREPARED[key][1]


fp8_gemm.prepare_activations = prepare_activations  # what fp8_gemm.gemm(pre=True) calls


def group_quant(x, shift):
    """The reference's per-token-group quantization, the groups on the weight's k-blocks."""
    m, k = x.shape
    nb = -(-(k + shift) // 128)
    xp = torch.zeros(m, nb * 128)
    xp[:, shift:shift + k] = x.float()
    xb = xp.view(m, nb, 128)
    s = xb.abs().amax(-1).clamp(min=1e-10) / 448
    q = (xb / s[..., None]).clamp(-448, 448).to(FP8)
    return q.view(m, -1)[:, shift:shift + k], s


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


g = torch.Generator().manual_seed(0)
cases = [(200, 300, 32, 40), (96, 256, 0, 0), (130, 200, 96, 64)]  # (N, K, k_shift, offset of the scale rows)
for n, k, shift, offset in cases:
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8)
    scale_row = ((torch.arange(n) + offset) // 128).to(torch.int32)
    scale = torch.rand((n - 1 + offset) // 128 + 1, -(-(k + shift) // 128), generator=g) / 400 + 1e-4
    align = 128
    for c in (scale_row[1:] != scale_row[:-1]).nonzero().flatten().add(1).tolist():
        while c % align:
            align //= 2
    ref_w = fp8.dequantize(w, scale, scale_row, shift, torch.float32)
    assert torch.equal(dequantize_weight(w, scale, scale_row, shift, torch.float32), ref_w), "dequant"
    for m in (1, 19):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        ref = F.linear(x.float(), ref_w)
        xq, xs = group_quant(x, shift)
        ref8 = F.linear(xq.float() * xs.repeat_interleave(128, 1)[:, shift:shift + k], ref_w)
        # prepared activations: fp8 as the reference rounds them (x times 1/scale: a rare last-bit
        # difference), fp16 exact after the power-of-two scaling
        q, s = prepare_activations(x, shift, True)
        torch.testing.assert_close(s, xs, rtol=0, atol=0)
        assert (q.float() == xq.float()).float().mean() > 0.99
        q, s = prepare_activations(x, shift, False)
        assert torch.equal(q.float() * s.repeat_interleave(128, 1)[:, shift:shift + k], x.float())
        tiles = [GEMM_CONFIGS[16][2], GEMM_CONFIGS[16][4], GEMM_CONFIGS[64][-1]]  # swapped, plain, larger
        runs = [("gemm", c, a8) for c in tiles for a8 in (False, True)]
        runs += [("pre", c, a8) for c in (PRE_CONFIGS[0], GEMM_CONFIGS[16][2]) for a8 in (False, True)]
        runs += [("dequant", None, False)]
        if m == 1:
            runs += [("gemv", c, False) for c in fp8.GEMV_CONFIGS[:3]]
        for kind, cfg, a8 in runs:
            out = fp8._run((kind, cfg), x, w, scale, scale_row, shift, align, a8)
            assert out.shape == (m, n) and out.dtype == torch.bfloat16
            # bf16 output rounding (the interpreter truncates to bf16: ~2^-8); w8a8 against its own reference
            err = rel(out, ref8 if a8 else ref)
            assert err < 6e-3, (n, k, shift, m, kind, cfg, a8, err)
        if m == 1:  # the GEMV's general body, whatever the alignment
            assert rel(fp8.gemv(x, w, scale, scale_row, shift, 1, (16, 2, 4)), ref) < 6e-3
print("interpreter ok")
'''


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_kernels_match_reference_in_interpreter(tmp_path):
    run_script(INTERPRETER_SCRIPT, tmp_path)


# ---- compiled for sm_90 ----

SIZES = ("N", "M", "n_kb")  # not specialised as multiples of 16 (K is, as in every public shape)


def _variants():
    """One compile per structural variant (the tile sizes of a variant share its code)."""
    from tp_engine.kernels import fp8, fp8_gemm as g

    gemv_types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                  "srow_ptr": "*i32", "out_ptr": "*bf16"}
    out = [(fp8._fp8_gemv_kernel, gemv_types, dict(BLOCK_N=bn, KB=kb, UNIFORM=u, PAIR=p, PDL=True), w, 3)
           for (bn, kb, w), u, p in ((fp8.GEMV_CONFIGS[0], True, False), (fp8.GEMV_CONFIGS[-1], True, False),
                                     (fp8.GEMV_CONFIGS[-1], False, False),
                                     (fp8.GEMV_CONFIGS[-1], False, True))]
    gemm_types = {"a_ptr": "*bf16", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                  "srow_ptr": "*i32", "c_ptr": "*bf16"}
    tiles = [(False, c) for c in (g.GEMM_CONFIGS[16][0], g.GEMM_CONFIGS[16][3], g.GEMM_CONFIGS[16][4],
                                  g.GEMM_CONFIGS[64][-1])]
    tiles += [(True, c) for c in (g.PRE_CONFIGS[0], g.GEMM_CONFIGS[16][3])]
    for pre, (bm, bn, warps, stages, swap) in tiles:
        for a8 in (False, True):
            types = dict(gemm_types, a_ptr="*fp8e4nv" if a8 else "*fp16") if pre else gemm_types
            out.append((g._fp8_gemm_kernel, types, dict(W8A8=a8, PRE=pre, SWAP=swap, BLOCK_M=bm, BLOCK_N=bn,
                                                         GROUP_M=8), warps, stages))
    for a8 in (False, True):
        out.append((g._act_quant_kernel,
                    {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv" if a8 else "*fp16", "s_ptr": "*fp32"},
                    dict(W8A8=a8, GROUPS=4), 1, 1))
    out.append((g._dequant_kernel,
                {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "srow_ptr": "*i32", "out_ptr": "*bf16"},
                dict(BLOCK_N=16, BLOCK=256), 4, 1))
    return out


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_kernels_compile_for_sm90():
    from tp_engine.kernels import fp8_gemm

    for fn, types, consts, warps, stages in _variants():
        k = compile_sm90(fn, types, consts, warps, stages, unaligned=SIZES)
        what = f"{fn.__name__} {consts} warps={warps} stages={stages}"
        assert k.metadata.shared <= MAX_SHARED, f"{what}: {k.metadata.shared} bytes of shared memory"
        used = spills(k)
        assert used in (None, "STACK:0 LOCAL:0"), f"{what}: {used}"
        if fn is fp8_gemm._fp8_gemm_kernel:
            assert "async_copy" in k.asm["ttgir"], f"{what}: the k-loop is not pipelined"
            if consts["SWAP"] and consts["BLOCK_N"] >= 64:  # the weight rows fill Hopper's wgmma
                assert "warp_group_dot" in k.asm["ttgir"], what


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("uniform, pair", [(True, False), (False, False), (True, True)])
def test_fp8_gemv_loop_sums_nothing_across_threads(uniform, pair):
    """The FP8 GEMV's k-loop sums no products across threads (12-48 warp shuffles an iteration, and barriers
    with them, otherwise), loads the weights 16 bytes at a time, and issues those loads before its first
    barrier, so they do not wait every iteration for the activations' trip to the L2 cache (4.8% of a Qwen3-8B
    FP8 decode step on an H200). pair: the MLP's gate and up rows in pairs (kernels/mlp.py), the same loop."""
    from tp_engine.kernels import fp8

    types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "srow_ptr": "*i32", "out_ptr": "*bf16"}
    for bn, kb, warps in fp8.GEMV_CONFIGS:
        consts = dict(BLOCK_N=bn, KB=kb, UNIFORM=uniform, PAIR=pair, PDL=True)
        k = compile_sm90(fp8._fp8_gemv_kernel, types, consts, warps, 3, unaligned=SIZES)
        ops = loop_body(k.asm["cubin"])
        if ops is None:
            pytest.skip("this Triton build has no nvdisasm")
        what = f"tile {(bn, kb, warps)}, uniform={uniform}, pair={pair}"
        assert not [op for op in ops if op.startswith("SHFL")], what
        weights = [i for i, op in enumerate(ops) if op.startswith("LDG.E.EF.128")]
        assert len(weights) == bn * kb * 128 // (16 * 32 * warps), what
        first_barrier = next(i for i, op in enumerate(ops) if op.startswith("BAR"))
        assert max(weights) < first_barrier, f"{what}: a weight load after the loop's first barrier"


def test_fp32_activations_never_take_the_fp16_operand_gemms():
    """The GEMMs hold their operands in fp16, exact for bf16 and fp16 activations only: with dtype float32 a
    matmul of several tokens rounded each activation to 11 bits (2e-4 relative error). fp32 takes the GEMV or
    the dequantized weight. No rows: an empty result, not a GEMV launch for one row."""
    import torch

    from tp_engine.kernels import fp8

    for bucket in (0, *fp8.BUCKETS):
        for w8a8 in (False, True):
            kinds = {kind for kind, _ in fp8._candidates(bucket, w8a8, fp32=True)}
            assert kinds == ({"gemv"} if bucket == 1 else {"dequant"}), (bucket, w8a8, kinds)
    w = torch.zeros(40, 96, dtype=torch.float8_e4m3fn)
    out = fp8.linear(torch.zeros(0, 96), w, torch.ones(1, 1), torch.zeros(40, dtype=torch.int32), 0, 8, False)
    assert out.shape == (0, 40)
