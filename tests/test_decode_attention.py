"""The decode attention kernel (tp_engine/kernels/decode_attention.py) in Triton's interpreter, without a GPU:
against softmax(q k / sqrt(d)) v in float64 over the same pages, with grouped query heads (1, 2, 8 and 16 per
KV head), pages out of order and shared, page sizes 4 and 16, and requests short enough for one program or
long enough that several programs' partial results are merged; twice, so the merge counters are seen to reset.
tests/test_gpu_attention.py runs it on a GPU, in a CUDA graph, against flashinfer.
"""
import pytest

pytest.importorskip("triton")

from triton_interpreter import run_script  # noqa: E402

SCRIPT = r'''
import torch
import triton_interpreter  # noqa: F401  (its fixes of the interpreter)
from gpu_helpers import paged_attention_reference

from tp_engine.kernels import decode_attention as da


g = torch.Generator().manual_seed(0)
merged = 0
for heads, kvh, page, lens, splits in ((4, 2, 16, [1, 17, 40], 4), (8, 1, 4, [100, 3], 8), (16, 1, 16, [70], 2),
                                       (4, 4, 4, [9, 33], 3)):
    d = 64
    counts = [-(-n // page) for n in lens]
    pool = len(lens) * 30 + 2
    perm = torch.randperm(pool, generator=g)
    ids, at = [], 0
    for c in counts:
        ids += perm[at:at + c].tolist()
        at += c
    ids[-1] = ids[0]  # a page listed for two requests (a shared prefix page), read by both
    indptr = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([n - (c - 1) * page for n, c in zip(lens, counts)], dtype=torch.int32)
    cache = torch.randn(pool, 2, page, kvh, d, generator=g).to(torch.bfloat16)
    q = torch.randn(len(lens), heads, d, generator=g).to(torch.bfloat16)
    # several programs per request from 33 tokens on
    dec = da.PagedDecode(indptr, last, torch.tensor(ids, dtype=torch.int32), heads, kvh, d, page, splits=splits,
                         block_t=32, min_chunk=32)
    want = paged_attention_reference(q, cache, [ids[a:b] for a, b in zip(indptr[:-1], indptr[1:])], lens)
    for _ in range(2):
        got = dec.run(q, cache).double()
        err = (got - want).abs().max().item()
        assert err < 2e-2, (heads, kvh, page, lens, err)
        assert int(dec.count.abs().sum()) == 0, "a merge counter was left set"
    for n in lens:  # the kernel's split of a request of n tokens
        chunk = max(32, -(-(-(-n // splits)) // 32) * 32)
        merged += -(-n // chunk) > 1
assert merged >= 4, merged
print("interpreter ok")
'''


@pytest.mark.filterwarnings("ignore")
def test_decode_attention_matches_float64_in_interpreter(tmp_path):
    run_script(SCRIPT, tmp_path)
