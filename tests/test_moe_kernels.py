"""The GPU mixture-of-experts kernels (tp_engine/kernels/moe.py, moe_grouped.py), checked without a GPU:

- numerically, in Triton's interpreter (TRITON_INTERPRET=1, CPU tensors), against the torch reference
  `layers.moe.experts_reference`: the router's top-k, the GEMV path and both block configurations of the
  sorted, grouped path, in float32 and bfloat16, on shapes that are not multiples of the tiles;
- by compiling each kernel for the H200 (sm_90) at the tile sizes the engine picks for Qwen3-30B-A3B and
  Qwen3-235B-A22B: ptxas must accept it, with no register spills and within the shared memory of an SM.

Triton is an optional dependency (it comes with CUDA builds of torch; .ci/run installs it on the CPU); without
it these tests skip. The GPU itself is exercised by tests/test_gpu_moe.py.
"""
import pytest

triton = pytest.importorskip("triton")

from sm90 import MAX_SHARED, compile_sm90, loop_body, spills  # noqa: E402
from triton_interpreter import run_script  # noqa: E402


HEAD = r'''
import numpy as np
import torch
import triton
import triton.language as tl
import triton_interpreter  # noqa: F401  (its fixes of the interpreter)

from tp_engine.kernels import moe, moe_grouped
from tp_engine.layers.moe import experts_reference

torch.manual_seed(0)


def gate_up_once(acts, x, w, ids, tile, scales=None):
    """moe._gate_up at `tile`, once for the tiles the interpreter runs alike: it has no warps, and the
    kernel's reduction step is clamped to the next power of two of the row. `acts`: the results for this x."""
    key = (tile[0], min(tile[1], triton.next_power_of_2(x.shape[1])))
    if key not in acts:
        acts[key] = moe._gate_up(x, w, ids, tile, scales)
    return acts[key]
'''

FLOAT_EXPERTS = r'''
E, H, I = 8, 48, 24  # H and I below every tile size: the masks are exercised
for dt in (torch.float32, torch.bfloat16):
    gate_up = (torch.randn(E, 2 * I, H) * 0.2).to(dt)
    down = (torch.randn(E, H, I) * 0.2).to(dt)
    # k = 3, a partial tile of experts, in float32: in bfloat16 the reference rounds after each expert it adds
    cases = ((1, True, 2), (3, False, 3), (6, True, 2)) if dt == torch.float32 else \
        ((1, True, 2), (6, False, 2))
    for n, renorm, K in cases:
        x = torch.randn(n, H).to(dt)
        logits = (torch.randn(n, E) * 2).to(dt)
        weights, ids = moe.topk_softmax(logits, K, renorm)
        probs = torch.softmax(logits, -1, dtype=torch.float32)
        ref_w, ref_ids = probs.topk(K, dim=-1)
        if renorm:
            ref_w = ref_w / ref_w.sum(-1, keepdim=True)
        assert torch.equal(ids.long(), ref_ids), (ids, ref_ids)
        torch.testing.assert_close(weights, ref_w.to(dt))
        ref = experts_reference(x, gate_up, down, weights, ids)
        paths, acts = {}, {}
        if n <= moe.GEMV_MAX_TOKENS:
            paths["gemv"] = lambda: moe.moe_gemv(x, gate_up, down, weights, ids)
            # for one token (the GPU's case), where float32's tolerance is tight: the four pairs of tiles that
            # the FP8 experts below take too (gate/up of 1 and 8 rows a program, down of 1, 2, 4 and 8)
            for i in range(1, 5) if n == 1 and dt == torch.float32 else ():
                t, d = moe.GEMV_TILES[i % len(moe.GEMV_TILES)], moe.DOWN_TILES[i % len(moe.DOWN_TILES)]
                paths[f"gemv {t} {d}"] = \
                    lambda t=t, d=d: moe._down(gate_up_once(acts, x, gate_up, ids, t), down, ids, weights, d)
        for cfg in (moe_grouped.SMALL, moe_grouped.LARGE):
            paths[f"grouped BM={cfg.BM}"] = \
                lambda cfg=cfg: moe_grouped.moe_grouped(x, gate_up, down, weights, ids, cfg)
        for name, run in paths.items():
            got = run()
            torch.testing.assert_close(got, ref, msg=f"{dt} n={n} {name}")
            # the same roundings as the reference; only sums run in another order
            same = (got == ref).float().mean().item()
            assert dt == torch.float32 or same > 0.98, (dt, n, name, same)
        # the layout of the sorted slots: every slot once, each block's rows of one expert, padding marked
        srt = moe_grouped.sort_by_expert(ids, E, 16)
        rows, total = srt.rows[: int(srt.total)], int(srt.total)
        real = rows[rows < n * K].long()
        assert sorted(real.tolist()) == list(range(n * K))
        owner = srt.block_expert[: total // 16].repeat_interleave(16)
        assert torch.equal(owner[rows < n * K].long(), ids.reshape(-1).long()[real])
        counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
        assert total == int(((counts + 15) // 16 * 16).sum())
'''

FP8_EXPERTS = r'''
# FP8 experts: rank 1 of 2 of a 320-wide expert, so the gate/up rows change scale row inside a part and the
# down columns start 32 into a block; every path against the reference on the dequantized experts
from tp_engine.kernels.moe_grouped import ExpertScales
from tp_engine.layers.fp8 import ScaleLayout
from tp_engine.layers.linear import ColRange, RowPart

E, H, FULL, r = 8, 200, 320, 1
I = FULL // 2
gu_lay = ScaleLayout({"gate": RowPart(0, I, r * I, FULL), "up": RowPart(I, I, r * I, FULL)},
                     ColRange(0, H, H))
dn_lay = ScaleLayout({"down": RowPart(0, H, 0, H)}, ColRange(r * I, I, FULL))
assert dn_lay.k_shift == 32 and gu_lay.row_align == 32
fp8 = torch.float8_e4m3fn
gu_w = (torch.randn(E, 2 * I, H) * 60).clamp(-448, 448).to(fp8)
dn_w = (torch.randn(E, H, I) * 60).clamp(-448, 448).to(fp8)
gu_s = torch.rand(E, gu_lay.rows, gu_lay.col_blocks[1]) / 600 + 1e-4
dn_s = torch.rand(E, dn_lay.rows, dn_lay.col_blocks[1]) / 600 + 1e-4
scales = ExpertScales(gu_s, gu_lay.scale_row, dn_s, dn_lay.scale_row, dn_lay.k_shift, gu_lay.row_align)
for dt in DTYPES:
    gu_deq = torch.stack([gu_lay.dequantize(gu_w[e], gu_s[e], dt) for e in range(E)])
    dn_deq = torch.stack([dn_lay.dequantize(dn_w[e], dn_s[e], dt) for e in range(E)])
    for n in (1, 6):
        x = torch.randn(n, H).to(dt)
        weights, ids = moe.topk_softmax((torch.randn(n, E) * 2).to(dt), 2, True)
        ref = experts_reference(x, gu_deq, dn_deq, weights, ids)
        paths, acts = {}, {}
        if n <= moe.GEMV_MAX_TOKENS:  # float32, where the tolerance is tight: four pairs of tiles (gate/up of
            # 1 and 8 rows a program, down of 1, 2, 4 and 8; one or two k-steps on these shapes); bfloat16 one
            gate_up_tiles, down_tiles = moe._tiles(scales)
            pairs = list(zip(gate_up_tiles, down_tiles))
            for t, d in pairs[1:5] if dt == torch.float32 else pairs[-1:]:
                paths[f"gemv {t} {d}"] = lambda t=t, d=d: moe._down(
                    gate_up_once(acts, x, gu_w, ids, t, scales), dn_w, ids, weights, d, scales)
        for cfg in (moe_grouped.SMALL, moe_grouped.LARGE):
            paths[f"grouped BM={cfg.BM}"] = \
                lambda cfg=cfg: moe_grouped.moe_grouped(x, gu_w, dn_w, weights, ids, cfg, scales)
        for name, run in paths.items():
            got = run()
            if name.startswith("grouped") and dt == torch.float32:  # the reference's values, sums reordered
                torch.testing.assert_close(got, ref, msg=f"fp8 {dt} n={n} {name}")
            elif name.startswith("grouped"):
                # bf16: the reference rounds after each expert it adds, the kernel once, where outputs cancel
                # too; both against the same experts in float64, no worse than it
                exact = experts_reference(x.double(), gu_deq.double(), dn_deq.double(), weights.double(), ids)
                err, ref_err = (got.double() - exact).abs(), (ref.double() - exact).abs()
                assert err.max() <= 2 * ref_err.max() + 1e-6, (n, name, err.max().item(),
                                                                ref_err.max().item())
                assert err.mean() <= 1.5 * ref_err.mean() + 1e-7, (n, name, err.mean().item(),
                                                                    ref_err.mean().item())
            else:
                # the scales multiply the activations instead, so the weights skip the reference's rounding to
                # bf16 (2**-9 of each), through two matmuls: 0.7% of the norm of the output here (2e-7 in
                # float32)
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                assert err < (1e-5 if dt == torch.float32 else 0.02), (dt, n, name, err)
if torch.bfloat16 in DTYPES:  # the check runs bfloat16 activations; the float32 run sweeps the tiles
    moe.self_test_fp8(torch.device("cpu"))  # the start-up check must pass on kernels that are right
'''


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
# processes the suite runs side by side
@pytest.mark.parametrize("experts", ["float", "fp8 float32", "fp8 bfloat16"])
def test_kernels_match_reference_in_interpreter(tmp_path, experts):
    body = FLOAT_EXPERTS if experts == "float" else f"DTYPES = (torch.{experts.split()[1]},)\n" + FP8_EXPERTS
    run_script(HEAD + body + 'print("interpreter ok")\n', tmp_path)


# ---- compiled for sm_90 ----

SIZES = ("S", "E", "num_blocks", "num_rows")  # not specialised as multiples of 16


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_kernels_compile_for_sm90():
    from tp_engine.kernels import mlp, moe, moe_grouped as g

    bf16 = {name: "*bf16" for name in ("x_ptr", "w_ptr", "act_ptr", "out_ptr", "wts_ptr", "logits_ptr")}
    ints = {name: "*i32" for name in ("ids_ptr", "counts_ptr", "ranks_ptr", "starts_ptr", "total_ptr",
                                      "block_expert_ptr", "sorted_ptr")}
    types = {**bf16, **ints}
    kernels = [(moe._topk_softmax_kernel, dict(K=8, K_P2=8, RENORM=True, BLOCK_E=128, PDL=True), 1, 1),
               (g._count_kernel, dict(BLOCK=1024), 4, 1), (g._scatter_kernel, dict(BLOCK=1024), 4, 1),
               (g._offsets_kernel, dict(BM=16, E_P2=128, BB=64, FILL=1024), 4, 1)]
    # every tile the few-token path may pick, at the widest step it runs, for bf16 and FP8 experts; and every
    # tile of the dense MLP's gate/up + SiLU (kernels/mlp.py), the same kernel with one fixed expert
    for fp8 in (False, True):
        kernels += [(moe._gemv_gate_up_kernel,
                     dict(TOP_K=8, BN=bn, BK=bk, FP8=fp8, ROUTED=True, LINES=1, PDL=True),
                     warps, 3) for bn, bk, warps in moe.GEMV_TILES]
        kernels += [(moe._gemv_gate_up_kernel, dict(TOP_K=1, BN=bn, BK=bk, FP8=fp8, ROUTED=False,
                                                    LINES=bk // (128 if fp8 else 64), PDL=True), warps, 3)
                    for bn, bk, warps in mlp.TILES]
        kernels += [(moe._gemv_down_kernel, dict(TOP_K=8, K_P2=8, BN=bn, BK=bk, FP8=fp8, PDL=True), warps, 3)
                    for bn, bk, warps in moe.DOWN_TILES]
        for cfg in (g.SMALL, g.LARGE):
            tile = dict(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, FP8=fp8)
            kernels += [(g._gate_up_kernel, dict(TOP_K=8, **tile), cfg.num_warps, cfg.num_stages),
                        (g._down_kernel, tile, cfg.num_warps, cfg.num_stages)]
    fp8_types = {**types, "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "srow_ptr": "*i32"}
    for fn, consts, warps, stages in kernels:
        k = compile_sm90(fn, fp8_types if consts.get("FP8") else types, consts, warps, stages,
                         unaligned=SIZES)
        what = f"{fn.__name__} {consts}"
        assert k.metadata.shared <= MAX_SHARED, f"{what}: {k.metadata.shared} bytes of shared memory"
        used = spills(k)
        assert used in (None, "STACK:0 LOCAL:0"), f"{what}: {used}"
        if fn in (g._gate_up_kernel, g._down_kernel):  # the K loop must pipeline (asynchronous copies)
            assert "async_copy" in k.asm["ttgir"], what


LOAD_BYTES = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}


@pytest.mark.filterwarnings("ignore")
def test_fp8_down_gemv_loads_its_weights_before_the_loops_barrier():
    """With FP8 experts the down GEMV scales the activations through shared memory, behind a barrier. No load
    can cross a barrier, and weights loaded after it would wait each iteration for the activations' round trip
    to the L2 cache: every tile issues the whole tile's loads (k experts' BN x BK weight bytes and their
    activations) before the loop's first barrier."""
    from tp_engine.kernels import moe

    types = {"act_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ids_ptr": "*i32", "wts_ptr": "*bf16",
             "out_ptr": "*bf16", "s_ptr": "*fp32", "srow_ptr": "*i32"}
    for bn, bk, warps in moe.DOWN_TILES:
        consts = dict(TOP_K=8, K_P2=8, BN=bn, BK=bk, FP8=True, PDL=True)
        k = compile_sm90(moe._gemv_down_kernel, types, consts, warps, 3, unaligned=SIZES)
        ops = loop_body(k.asm["cubin"])
        if ops is None:
            pytest.skip("this Triton build has no nvdisasm")
        barrier = next(i for i, op in enumerate(ops) if op.startswith("BAR"))
        loaded = sum(next((LOAD_BYTES[p] for p in op.split(".") if p in LOAD_BYTES), 4)
                     for op in ops[:barrier] if op.startswith("LDG"))
        tile = (8 * bn * bk + 8 * bk * 2) // (32 * warps)  # per thread: fp8 weights and bf16 activations
        assert loaded >= tile, f"tile {(bn, bk, warps)}: {loaded} bytes of {tile} loaded before the barrier"
