"""The arg-max kernels (tp_engine/kernels/sampling.py: `argmax`, `gumbel_argmax`) in Triton's interpreter, without a
GPU, against torch.argmax and the sampler's torch path. Skips without Triton (it comes with CUDA builds of torch)."""
import pytest

from triton_interpreter import run_script

pytest.importorskip("triton")

SCRIPT = r'''
import torch
import triton_interpreter  # the test-side patches of the interpreter
from tp_engine.kernels import sampling
from tp_engine.topk_sampling import noise_at, row_hash

b = sampling.ARGMAX_BLOCK
vocab = 2 * b + 904  # a partial last chunk
gen = torch.Generator().manual_seed(0)
x = torch.randn(8, vocab, generator=gen) * 3
x[0, [b - 1, b, vocab - 1]] = 50.0  # equal maxima in three chunks: the lowest id
x[1, [3, b + 7]] = 50.0
x[1, b + 9] = float("nan")  # a NaN beats every value, +inf included, as in torch.argmax
x[1, 5] = float("inf")
x[2, [2 * b + 1, b + 2]] = float("nan")  # the first NaN
x[3] = float("-inf")  # nothing but -inf: id 0
x[4, vocab - 1] = float("inf")
x[5] = (x[5] * 2).round() / 2  # many ties, as bf16 logits have
x[6, :b] = float("-inf")
x[7, [5, 9]] = float("inf")
for _ in range(2):  # the kernel leaves its counters ready for the next call
    got = sampling.argmax(x)
    assert torch.equal(got, x.argmax(dim=-1)), (got, x.argmax(dim=-1))

# the temperature draw on a subset of rows against the torch path of sampler._plain_draw
rows = torch.tensor([5, 0, 2, 7, 1])
temps = torch.tensor([0.7, 1.0, 0.3, 2.5, 1.0])
ids = torch.arange(vocab)[None, :].expand(len(rows), -1)
for step in range(4):
    hashes = row_hash(torch.arange(len(rows)) * 7919 + 3, torch.full((len(rows),), step))
    want = (x[rows] / temps[:, None] - torch.log(-torch.log(noise_at(hashes, ids)))).argmax(dim=-1)
    got = sampling.gumbel_argmax(x, rows, temps, hashes)
    assert torch.equal(got, want), (step, got, want)
print("interpreter ok")
'''


def test_argmax_kernels_pick_as_torch_argmax_in_interpreter(tmp_path):
    """Greedy and temperature draws in one launch each: the chunks' bests merged by the row's last program pick
    exactly torch.argmax's id (the lowest id of the maximum, the first NaN before all), across chunk boundaries."""
    run_script(SCRIPT, tmp_path)
