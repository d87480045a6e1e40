"""The top-k / top-p kernels (tp_engine/kernels/sampling.py) in Triton's interpreter, without a GPU: the
candidates' ids equal torch.topk over topk_sampling's order keys (value descending, then id ascending) on rows
with ties, signed zeros, -inf and equal maxima on both sides of a chunk boundary, and over many chunks whose
largest keys decide what each chunk keeps (a row's whole top in one chunk); the draw among them equals
topk_sampling.draw_among. On CUDA, tests/test_gpu_sampling.py
holds the whole draw to the CPU reference. Skips without Triton (it comes with CUDA builds of torch)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = r'''
import torch
from tp_engine.kernels import sampling
from tp_engine.sampling.topk_sampling import order_key

gen = torch.Generator().manual_seed(0)
vocab = 2 * sampling.TOPK_BLOCK + 904  # a partial last chunk
x = torch.randn(7, vocab, generator=gen) * 3
x[0] = (x[0] * 2).round() / 2  # many ties, as bf16 logits have
x[1] = 0.0
x[1, ::3] = -0.0  # equal to +0.0: ranked by id
x[2, 100:4000] = float("-inf")
b = sampling.TOPK_BLOCK
x[3, [b - 1, b, vocab - 1]] = 50.0  # equal maxima in three chunks
x[6, b + 5] = float("nan")
x[6, 77] = -torch.tensor(float("nan"))  # NaNs of both signs: first, as one
rows = torch.tensor([5, 0, 1, 2, 3, 4, 0, 6])
temps = torch.tensor([0.7, 1.0, 0.3, 2.5, 1.0, 0.6, 0.6, 0.9])
found = {}
for k in (1, 5, 20, 33, sampling.TOPK_MAX_K):
    got = found[k] = sampling.topk_candidates(x, rows, temps, k)
    ref = order_key(x[rows] / temps[:, None]).topk(k, dim=-1, sorted=True).indices
    assert torch.equal(got, ref), (k, (got != ref).nonzero()[:5])

# many chunks (a small block), so the floor taken from the chunks' maxima decides what each chunk keeps
y = torch.randn(6, 40 * 64 + 17, generator=gen) * 3
y[0, 128:192] = 10 + torch.rand(64, generator=gen)  # the whole top in one chunk, more keys than k there
y[1] = (y[1] * 2).round() / 2
y[2] = 0.0  # every key equal but for its id
y[3, 7:] = float("-inf")  # fewer finite values than k
y[4, 900] = float("nan")
y_rows = torch.tensor([0, 1, 2, 3, 4, 5, 0])
y_temps = torch.tensor([1.0, 0.6, 1.0, 0.9, 1.0, 1.3, 0.01])
for k in (1, 5, 20, 33):  # below the block, where the floor prunes (k = TOPK_MAX_K runs above)
    got = sampling.topk_candidates(y, y_rows, y_temps, k, block=64)
    ref = order_key(y[y_rows] / y_temps[:, None]).topk(k, dim=-1, sorted=True).indices
    assert torch.equal(got, ref), (k, (got != ref).nonzero()[:5])

# the draw among the candidates against topk_sampling.draw_among, with top-k and top-p masks of every kind
from tp_engine.sampling.topk_sampling import draw_among, row_hash
n = len(rows)
ks = torch.tensor([1, 3, 20, 64, 64, 7, 20, 20])
ps = torch.tensor([1.0, 0.95, 0.5, 1e-6, 0.95, 1.0, 0.9, 0.9])
ids = found[64] if 64 in found else sampling.topk_candidates(x, rows, temps, 64)  # checked above
for step in range(12):
    hashes = row_hash(torch.arange(n) * 7919 + 3, torch.full((n,), step))
    got = sampling.draw_among(x, rows, temps, ids, ks, ps, hashes)
    want = draw_among(x[rows[:, None], ids] / temps[:, None], ids, ks, ps, hashes, vocab)
    assert torch.equal(got, want) and got[-1] == 77, (step, got, want)  # a NaN is drawn, as greedy picks it
print("ok")
'''


@pytest.mark.slow
def test_topk_candidates_match_the_order_key_in_interpreter(tmp_path):
    script = tmp_path / "topk.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-4000:]
