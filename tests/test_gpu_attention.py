"""The decode attention kernel of CUDA-graph decode (tp_engine/kernels/decode_attention.py) on the GPU.

Inside a CUDA graph whose page-table buffers are refilled between replays, as the graph runner refills them,
at batch sizes 1 and 8, with Qwen3's head groupings and requests of 1 to 5,000 tokens (one program, or
several whose partial results are merged): each output is as close to attention in float64 as flashinfer's
decode over the same pages is.

Marker `gpu`; skipped without CUDA.
"""
from __future__ import annotations

import pytest
import torch

from gpu_helpers import BF16, DEV, HAS_CUDA, needs_flashinfer, paged_attention_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
D, S = 128, 16


@pytest.mark.parametrize("heads,kvh", [(16, 8), (32, 4), (64, 8)])
@pytest.mark.parametrize("bs", [1, 8])
def test_decode_kernel_in_a_graph_is_as_accurate_as_flashinfer(heads, kvh, bs):
    needs_flashinfer()
    import flashinfer

    from tp_engine.kernels.decode_attention import PagedDecode
    g = torch.Generator(device=DEV).manual_seed(bs * 100 + heads)
    most = 5000
    n_pages = bs * -(-most // S) + 1
    cache = torch.randn(n_pages, 2, S, kvh, D, device=DEV, generator=g).to(BF16)
    indptr = torch.zeros(bs + 1, dtype=torch.int32, device=DEV)
    last = torch.ones(bs, dtype=torch.int32, device=DEV)
    ids = torch.zeros(n_pages, dtype=torch.int32, device=DEV)
    q = torch.zeros(bs, heads, D, device=DEV, dtype=BF16)
    out = torch.zeros_like(q)
    dec = PagedDecode(indptr, last, ids, heads, kvh, D, S)
    dec.run(q, cache, out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        dec.run(q, cache, out)
    fi = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(256 << 20, dtype=torch.uint8, device=DEV),
                                                       "NHD", use_tensor_cores=True)
    trials = [[1, 5, 16, 17, 130, 700, 2100, most], [most] * 8, [1] * 8,
              [129, 256, 257, 1000, 33, 64, 65, 4097]]
    for lens in trials:
        lens = lens[:bs] if bs > 1 else [lens[-1]]
        counts = [-(-n // S) for n in lens]
        perm = torch.randperm(n_pages, device=DEV, generator=g).to(torch.int32)
        pages, at = [], 0
        for c in counts:
            pages.append(perm[at:at + c].tolist())
            at += c
        table = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
        lasts = torch.tensor([n - (c - 1) * S for n, c in zip(lens, counts)], dtype=torch.int32)
        flat = torch.tensor(sum(pages, []), dtype=torch.int32)
        indptr.copy_(table)
        last.copy_(lasts)
        ids[:len(flat)].copy_(flat)
        q.copy_(torch.randn(q.shape, device=DEV, generator=g).to(BF16))
        graph.replay()
        fi.plan(table, flat, lasts, heads, kvh, D, S, q_data_type=BF16, kv_data_type=BF16)
        theirs = fi.run(q, cache)
        torch.cuda.synchronize()
        want = paged_attention_reference(q, cache, pages, lens)
        err, fi_err = (out.double() - want).abs().max().item(), (theirs.double() - want).abs().max().item()
        assert err <= 2 * fi_err + 1e-3, f"lengths {lens}: error {err:.2e} against flashinfer's {fi_err:.2e}"
        assert int(dec.count.abs().sum()) == 0, "a merge counter was left set"
