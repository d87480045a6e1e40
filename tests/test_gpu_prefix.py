"""GPU: prefix cache and chunked prefill with flashinfer, the fused kernels and CUDA-graph decode, in bf16.

The model knows gpu_helpers.SEQUENCES by heart, so greedy margins on their prefixes stand far above bf16
rounding: tokens with the prefix cache on equal those with it off, chunked equal unchunked, and both stay
with transformers up to near ties. Every test needs a CUDA GPU (marker `gpu`) and skips elsewhere.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_helpers import (BF16, DEV, HAS_CUDA, SEQUENCES, assert_parity, generate, hf_greedy, llm,
                         needs_flashinfer, step_batch)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

# prompts that are prefixes of one another, identical ones, and others: pages are shared within a step
SHARED = [SEQUENCES[0][:n].tolist() for n in (16, 24, 33, 24, 40)] + \
    [SEQUENCES[1][:n].tolist() for n in (20, 20, 31)]


def test_prefix_cache_on_equals_off_with_cuda_graphs(tiny_ckpt, hf_ref):
    needs_flashinfer()
    out = {}
    for cache in (True, False):
        m = llm(tiny_ckpt, prefix_cache=cache, kv_cache={"num_pages": 256, "page_size": 8})
        assert m.engine.graphs is not None
        params = dict(max_new_tokens=8, ignore_eos=True)
        first = m.generate([{"input_ids": p} for p in SHARED], _params(**params))
        # the first call's pages
        second = m.generate([{"input_ids": p} for p in SHARED[:3]], _params(**params))
        out[cache] = [o["output_token_ids"] for o in first + second]
        hits = sum(o["cached_prompt_tokens"] for o in first + second)
        assert (hits > 0) == cache
        assert all(o["cached_prompt_tokens"] > 0 for o in second) == cache
        del m
        torch.cuda.empty_cache()
    assert out[True] == out[False]
    prompts = SHARED + SHARED[:3]
    assert_parity(hf_ref, prompts, out[True], [hf_greedy(hf_ref, [p], 8)[0] for p in prompts])


def test_chunked_prefill_equals_unchunked(tiny_ckpt, hf_ref):
    """Prompts in chunks of at most 12 tokens per step, decode rows included (mixed steps on the prefill
    kernel, pure decode steps in CUDA graphs), against whole prompts in one step."""
    needs_flashinfer()
    prompts = [SEQUENCES[i][:n].tolist() for i, n in zip(range(6), (40, 3, 29, 17, 8, 36))]
    out = {}
    for chunk in (12, 8192):
        m = llm(tiny_ckpt, max_prefill_tokens=chunk, prefix_cache=False)
        replays = []
        run = m.engine.graphs.run
        m.engine.graphs.run = lambda batch: replays.append(batch.size) or run(batch)
        out[chunk] = generate(m, prompts, max_new_tokens=8)
        assert replays, "pure decode steps must run as CUDA graphs"
        del m
        torch.cuda.empty_cache()
    assert out[12] == out[8192]
    assert_parity(hf_ref, prompts, out[12], [hf_greedy(hf_ref, [p], 8)[0] for p in prompts])


def test_flashinfer_mixed_step_over_shared_pages_matches_torch():
    """One prefill-type step holding a decode row, a chunk continuing a prompt and a request whose first
    pages are another's: flashinfer and the torch backend write the same slots and attend alike."""
    needs_flashinfer()
    from tp_engine.attention.flashinfer_backend import FlashInferBackend
    from tp_engine.attention.torch_backend import TorchBackend
    from tp_engine.attention.kv_cache import KVCache

    H, KVH, D, S, P = 8, 2, 128, 16, 32
    g = torch.Generator().manual_seed(1)
    # request 0 decodes at 21 tokens; request 1 computes tokens 32..47 of its prompt into page 7; request 2
    # shares request 1's first three pages, page 7 written in this very step, and computes its tokens 48..49
    tables = [[3, 9], [5, 6, 7], [5, 6, 7, 11]]
    seq, ext = [21, 48, 50], [1, 16, 2]
    caches = {b: KVCache(1, P, S, KVH, D, BF16, DEV) for b in ("fi", "ref")}
    fill = torch.randn(P + 1, 2, S, KVH, D, generator=g).to(DEV, BF16)  # the K/V earlier steps wrote
    for c in caches.values():
        c.data[0].copy_(fill)
    N = sum(ext)
    q = torch.randn(N, H, D, generator=g).to(DEV, BF16)
    k = torch.randn(N, KVH, D, generator=g).to(DEV, BF16)
    v = torch.randn(N, KVH, D, generator=g).to(DEV, BF16)
    fi = FlashInferBackend(device=DEV, num_heads=H, num_kv_heads=KVH, head_dim=D, page_size=S, dtype=BF16,
                           max_batch=8, num_pages=P)
    ref = TorchBackend(device=DEV, num_heads=H, num_kv_heads=KVH, head_dim=D, page_size=S)
    outs = {}
    for name, backend in (("fi", fi), ("ref", ref)):
        batch = step_batch(True, seq, ext, tables, S, DEV)
        backend.prepare(batch)
        outs[name] = backend.forward(0, q, k, v, caches[name], batch)
    assert torch.equal(caches["fi"].data, caches["ref"].data)
    torch.testing.assert_close(outs["fi"].float(), outs["ref"].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.multi_gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp2_prefix_cache_and_chunks_equal_plain_run(tiny_ckpt, hf_ref, tmp_path):
    """TP=2 over NCCL: shared pages and chunks of 12 tokens give the tokens of a run without either; only
    rank 0 holds the cache, the other rank follows the page-table changes in the step messages."""
    needs_flashinfer()
    runs = {}
    for name, extra in (("on", {"max_prefill_tokens": 12}), ("off", {"prefix_cache": False})):
        cfg = {"model": tiny_ckpt, "prompts": [{"input_ids": p} for p in SHARED], "max_batch_size": 8,
               "output": str(tmp_path / f"{name}.jsonl"),
               "sampling": {"max_new_tokens": 8, "ignore_eos": True},
               "kv_cache": {"num_pages": 256, "page_size": 8}, "cuda_graph_max_batch": 8, **extra}
        path = tmp_path / f"{name}.yaml"
        path.write_text(json.dumps(cfg))  # JSON is YAML
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "launch/generate.py", "--config", str(path), "--quiet"]
        proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                              timeout=150, env=dict(os.environ))
        assert proc.returncode == 0, proc.stderr[-6000:]
        runs[name] = [json.loads(x) for x in Path(cfg["output"]).read_text().splitlines()]
    assert sum(o["cached_prompt_tokens"] for o in runs["on"]) > 0
    assert all(o["cached_prompt_tokens"] == 0 for o in runs["off"])
    on, off = ([o["output_token_ids"] for o in runs[k]] for k in ("on", "off"))
    assert on == off
    assert_parity(hf_ref, SHARED, on, [hf_greedy(hf_ref, [p], 8)[0] for p in SHARED])


def _params(**kw):
    from tp_engine.sampling.sampler import SamplingParams
    return SamplingParams(**kw)
