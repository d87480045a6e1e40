"""The dense MLP's fused gate/up + SiLU at one token (tp_engine/kernels/mlp.py), checked without a GPU: every
tile in Triton's interpreter (TRITON_INTERPRET=1, CPU tensors; tiles it runs alike, once) against the torch
MLP, with bf16, fp32 and block-FP8 weights, on shapes below the tile sizes (the masks) and an FP8 shard whose
scale rows change inside a part. tests/test_moe_kernels.py compiles the tiles for sm_90; tests/test_gpu.py
runs them on a GPU."""
import pytest

pytest.importorskip("triton")

from triton_interpreter import run_script  # noqa: E402

INTERPRETER_SCRIPT = r'''
import torch
import torch.nn.functional as F
import triton
import triton_interpreter  # noqa: F401  (its fixes of the interpreter)

from tp_engine.kernels import mlp
from tp_engine.layers.fp8 import ScaleLayout
from tp_engine.layers.linear import ColRange, RowPart


def torch_mlp(x, w):  # models/qwen3.Qwen3MLP without the fused kernels
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    return F.silu(gate) * up


def interpreted(tiles, k):
    """The tiles as the interpreter runs them, each once: it has no warps, and `mlp.fused` clamps the
    reduction step to the next power of two of the row (here every step of the dense tiles, two of the FP8
    ones)."""
    runs = {}
    for bn, bk, warps in tiles:
        runs.setdefault((bn, min(bk, triton.next_power_of_2(k))), (bn, bk, warps))
    return list(runs.values())


torch.manual_seed(0)
I, K = 40, 72
for dt in (torch.float32, torch.bfloat16):
    w = (torch.randn(2 * I, K) * 0.2).to(dt)
    x = torch.randn(1, K).to(dt)
    ref = torch_mlp(x, w)
    for tile in interpreted(mlp.TILES, K):
        got = mlp.fused(x, w, tile)
        assert got.shape == (1, I) and got.dtype == dt
        # the same roundings as the torch MLP; only the sums inside the products run in another order
        torch.testing.assert_close(got, ref, msg=f"{dt} {tile}")

# block-FP8: rank 1 of 2 of a 320-row gate and up (each rank's part starts 32 rows into a block), 200 columns
FULL, H, r = 320, 200, 1
n = FULL // 2
lay = ScaleLayout({0: RowPart(0, n, r * n, FULL), 1: RowPart(n, n, r * n, FULL)}, ColRange(0, H, H))
assert lay.row_align == 32 and lay.k_shift == 0
w = (torch.randn(2 * n, H) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
scale = torch.rand(lay.rows, lay.col_blocks[1]) / 600 + 1e-4
assert set(mlp.tiles((scale, lay.scale_row, 32, False))) == {t for t in mlp.TILES if 32 % t[0] == 0}
for dt in (torch.float32, torch.bfloat16):
    x = torch.randn(1, H).to(dt)
    ref = torch_mlp(x, lay.dequantize(w, scale, dt))
    tiles = mlp.tiles((scale, lay.scale_row, lay.row_align, False))
    for tile in interpreted(tiles, H) if dt == torch.float32 else tiles[-1:]:  # where the tolerance is tight
        got = mlp.fused(x, w, tile, (scale, lay.scale_row, lay.row_align, False))
        # the scales multiply the activations, so the weights skip the reference's rounding to bf16 (2**-9
        # of each)
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < (1e-5 if dt == torch.float32 else 0.01), (dt, tile, err)
    # the FP8 GEMV taking gate and up rows in pairs: its tiles, and its body for scale rows that change inside
    # a tile (row_align 1)
    pairs = [c for kind, c in mlp.candidates((scale, lay.scale_row, 32, False)) if kind == "paired"]
    assert pairs and all(c[0] % 2 == 0 for c in pairs)
    tried = [(c, lay.row_align) for c in pairs[:2 if dt == torch.float32 else 1]] + [((64, 2, 4), 1)]
    for cfg, align in tried:
        got = mlp.paired(x, w, cfg, (scale, lay.scale_row, align, False))
        assert got.shape == (1, n) and got.dtype == dt
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < (1e-5 if dt == torch.float32 else 0.01), (dt, cfg, align, err)
print("interpreter ok")
'''


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_fused_gate_up_silu_matches_the_torch_mlp_in_interpreter(tmp_path):
    run_script(INTERPRETER_SCRIPT, tmp_path)
