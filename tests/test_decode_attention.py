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
for heads, kvh, page, lens, splits in ((4, 2, 16, [1, 17, 40], 4), (8, 1, 4, [100, 3], 8),
                                       (16, 1, 16, [70], 2), (4, 4, 4, [9, 33], 3)):
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
    dec = da.PagedDecode(indptr, last, torch.tensor(ids, dtype=torch.int32), heads, kvh, d, page,
                         splits=splits, block_t=32, min_chunk=32)
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


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_decode_attention_matches_float64_in_interpreter(tmp_path):
    run_script(SCRIPT, tmp_path)



QK_SCRIPT = r"""
import torch
import triton_interpreter  # noqa: F401  (its fixes of the interpreter)
from gpu_helpers import paged_attention_reference

from tp_engine.kernels import decode_attention as da
from tp_engine.kernels.norm import qk_norm_rope_store
from tp_engine.layers.norm import RMSNorm
from tp_engine.layers.rotary import RotaryEmbedding

g = torch.Generator().manual_seed(1)
bf = torch.bfloat16
for heads, kvh, page, lens in ((4, 2, 16, [1, 17, 40]), (8, 1, 4, [100, 3]), (4, 4, 4, [9, 33])):
    d = 64
    counts = [-(-n // page) for n in lens]
    perm = torch.randperm(len(lens) * 30 + 2, generator=g)
    pages, at = [], 0
    for c in counts:
        pages.append(perm[at:at + c].tolist())
        at += c
    cache = torch.randn(len(perm), 2, page, kvh, d, generator=g).to(bf)
    positions = torch.tensor(lens) - 1  # each request's new token is its last
    slots = torch.tensor([p[-1] * page + (n - 1) % page for p, n in zip(pages, lens)])
    k_rows = slots + slots // page * page  # rows of the cache viewed as [pages * 2 * page, kv_heads, d]
    qkv = (torch.randn(len(lens), (heads + 2 * kvh) * d, generator=g) * 3).to(bf)
    q_norm, k_norm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
    q_norm.weight.data = (torch.rand(d, generator=g) + 0.5).to(bf)
    k_norm.weight.data = (torch.rand(d, generator=g) + 0.5).to(bf)
    rope = RotaryEmbedding(d, 256, 10000.0)

    # the torch layers (layers/norm.py, layers/rotary.py) and an index_put of K and V
    qt, kt, vt = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
    qt, kt = rope(positions, q_norm.norm(qt.reshape(-1, heads, d)), k_norm.norm(kt.reshape(-1, kvh, d)))
    want_cache = cache.clone()
    rows = want_cache.view(-1, kvh, d)
    rows[k_rows], rows[k_rows + page] = kt, vt.reshape(-1, kvh, d)

    q = qk_norm_rope_store(qkv, q_norm.weight, k_norm.weight, 1e-6, rope.cos, rope.sin, positions, k_rows,
                           cache, heads, kvh, d, page)
    assert torch.equal(q, qt), (heads, kvh, "Q differs from the torch layers'")
    assert torch.equal(cache.view(torch.int16), want_cache.view(torch.int16)), (heads, kvh, "K/V differ")
    ids = torch.tensor(sum(pages, []), dtype=torch.int32)
    indptr = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([n - (c - 1) * page for n, c in zip(lens, counts)], dtype=torch.int32)
    dec = da.PagedDecode(indptr, last, ids, heads, kvh, d, page, splits=3, block_t=32, min_chunk=32)
    ref = paged_attention_reference(qt, want_cache, pages, lens)
    err = (dec.run(q, cache).double() - ref).abs().max().item()
    assert err < 2e-2, (heads, kvh, page, lens, err)
print("interpreter ok")
"""


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_qk_norm_rope_store_equals_the_torch_layers_in_interpreter(tmp_path):
    """The graphs' decode path before attention: `qk_norm_rope_store` gives the Q and writes the K/V of the
    torch layers bit for bit (RMSNorm, RoPE, an index_put into the page), and the decode kernel then attends
    as float64 attention over what the torch layers computed."""
    run_script(QK_SCRIPT, tmp_path)


@pytest.mark.filterwarnings("ignore")
def test_decode_kernel_reads_the_page_table_and_prefetches_before_waiting():
    """With programmatic dependent launch the kernel does all it can before it waits for the kernel before it
    (which writes q and the newest token's K and V): it reads its page table and starts the first tile's K and
    V rows into the L2 cache. Compiled for sm_90 on Qwen3-8B's heads: the prefetches come before the wait, and
    nothing spills."""
    from sm90 import compile_sm90, spills

    from tp_engine.kernels import decode_attention as da

    types = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "indptr_ptr": "*i32", "last_ptr": "*i32",
             "ids_ptr": "*i32", "out_ptr": "*bf16", "part_ptr": "*fp32", "ml_ptr": "*fp32",
             "count_ptr": "*i32", "scale_log2": "fp32"}
    consts = dict(H=32, KVH=8, G=4, GP=16, D=128, PAGE=16, SPLITS=32, BLOCK_T=128, LINES=2, PDL=True)
    k = compile_sm90(da._decode_kernel, types, consts, da.WARPS, da.STAGES)
    ptx = k.asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.count("prefetch.global.L2", 0, wait) >= 2, "no prefetch before the wait"
    assert ptx.count("ld.global", 0, wait) >= 4, "the page table is read after the wait"
    assert spills(k) in (None, "STACK:0 LOCAL:0")


@pytest.mark.filterwarnings("ignore")
def test_qk_norm_rope_store_reads_its_norm_weights_before_waiting():
    """The kernel before attention loads both norm weights (no kernel writes them) before its wait for the QKV
    matmul, as the matmuls load their first tile. Compiled for sm_90: four loads come before the wait."""
    from sm90 import compile_sm90

    from tp_engine.kernels import norm

    types = {name: "*bf16" for name in ("qkv_ptr", "q_out_ptr", "qw_ptr", "kw_ptr", "cache_ptr")}
    types.update(cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64", rows_ptr="*i64", eps="fp32", inv_d="fp32")
    k = compile_sm90(norm._qk_norm_rope_store_kernel, types,
                     dict(H=32, KVH=8, D=128, PAGE=16, PDL=True), 1, 1)
    ptx = k.asm["ptx"]
    assert ptx.count("ld.global", 0, ptx.index("griddepcontrol.wait")) == 4
