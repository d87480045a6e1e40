"""The arg-max kernels (tp_engine/kernels/sampling.py: `argmax`, `gumbel_argmax`) in Triton's interpreter,
without a GPU, against torch.argmax and the sampler's torch path. Skips without Triton (it comes with CUDA
builds of torch)."""
import pytest

from triton_interpreter import run_script

pytest.importorskip("triton")

SCRIPT = r'''
import torch
import triton_interpreter  # the test-side patches of the interpreter
from tp_engine.kernels import sampling
from tp_engine.sampling.topk_sampling import noise_at, row_hash

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

# bf16 logits (a CUDA graph's) are read as their fp32 values: the same picks as on the fp32 copy, ties
# included
bf = x.to(torch.bfloat16)
assert torch.equal(sampling.argmax(bf), bf.float().argmax(dim=-1))
hashes = row_hash(torch.arange(len(rows)) * 7919 + 3, torch.full((len(rows),), 5))
want = (bf.float()[rows] / temps[:, None] - torch.log(-torch.log(noise_at(hashes, ids)))).argmax(dim=-1)
assert torch.equal(sampling.gumbel_argmax(bf, rows, temps, hashes), want)
print("interpreter ok")
'''


@pytest.mark.slow
def test_argmax_kernels_pick_as_torch_argmax_in_interpreter(tmp_path):
    """Greedy and temperature draws in one launch each: the chunks' bests merged by the row's last program
    pick exactly torch.argmax's id (the lowest id of the maximum, the first NaN before all), across chunk
    boundaries."""
    run_script(SCRIPT, tmp_path)


RESOLVE_SCRIPT = r'''
import torch
import triton_interpreter  # the test-side patches of the interpreter
from tp_engine.attention.flashinfer_backend import slot_rows
from tp_engine.kernels import sampling

last = torch.tensor([11, 12, 13, 14, 15])
# references -1 - row to the previous step's tokens, and plain ids
ids = torch.tensor([-1, 7, -5, -2, 0, -3, 9])
want = torch.where(ids >= 0, ids, last[(-1 - ids).clamp(min=0)])
loc = torch.tensor([0, 15, 16, 31, 32, 1000, 4095])  # page starts and ends
for page_size in (1, 16, 64):
    got = ids.clone()
    k, v = torch.full_like(loc, -1), torch.full_like(loc, -1)
    sampling.resolve_tokens(got, last, (loc, page_size, k, v))
    want_k, want_v = slot_rows(loc, page_size)
    assert torch.equal(got, want), (got, want)
    assert torch.equal(k, want_k) and torch.equal(v, want_v), (page_size, k, want_k, v, want_v)
got = ids.clone()
sampling.resolve_tokens(got, last)  # without slots: the ids alone
assert torch.equal(got, want)
many = torch.arange(-5, 2 * sampling.RESOLVE_BLOCK + 3) % 9 - 5  # ids over three of the kernel's blocks
got = many.clone()
sampling.resolve_tokens(got, last)
assert torch.equal(got, torch.where(many >= 0, many, last[(-1 - many).clamp(min=0)]))
print("interpreter ok")
'''


def test_resolve_kernel_also_gives_the_kv_rows_in_interpreter(tmp_path):
    """A decode graph's first launch: the previous step's tokens into the input ids and each token's K and V
    cache rows, as step_tokens.resolve's torch path and flashinfer_backend.slot_rows compute them."""
    run_script(RESOLVE_SCRIPT, tmp_path)
