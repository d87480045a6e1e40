"""Decode attention per layer call in a CUDA graph: flashinfer's graph decode wrapper against the decode
kernel of tp_engine/kernels/decode_attention.py, over the same random pages (GPU only).

    python launch/bench_attention.py --heads 32/4,16/8 --contexts 128,512,1024,2048 \\
        --batches 1,2,4,8,16,64,256

Prints one JSON line per (heads, context, batch): microseconds per call of each, the best of 5 replays of a
graph of --layers calls, each over its own layer's cache (as a decode step reads them).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tp_engine.kernels.decode_attention import PagedDecode  # noqa: E402

D, S = 128, 16
BF16 = torch.bfloat16


def per_call_us(fn, caches: list[torch.Tensor], q: torch.Tensor) -> float:
    out = torch.empty_like(q)
    for c in caches[:2]:
        fn(q, c, out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        for c in caches:
            fn(q, c, out)
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / len(caches))
    return best


def measure(heads: int, kv_heads: int, ctx: int, bs: int, layers: int) -> dict:
    import flashinfer
    dev = torch.device("cuda")
    pages = -(-ctx // S)
    caches = [torch.randn(bs * pages + 1, 2, S, kv_heads, D, device=dev).to(BF16) for _ in range(layers)]
    indptr = torch.arange(bs + 1, dtype=torch.int32, device=dev) * pages
    ids = torch.randperm(bs * pages, device=dev).to(torch.int32)
    last = torch.full((bs,), ctx - (pages - 1) * S, dtype=torch.int32, device=dev)
    q = torch.randn(bs, heads, D, device=dev).to(BF16)
    fi = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(512 << 20, dtype=torch.uint8, device=dev), "NHD", use_cuda_graph=True,
        use_tensor_cores=True, paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=ids,
        paged_kv_last_page_len_buffer=last)
    fi.plan(indptr.cpu(), ids.cpu(), last.cpu(), heads, kv_heads, D, S, q_data_type=BF16, kv_data_type=BF16)
    kernel = PagedDecode(indptr, last, ids, heads, kv_heads, D, S)
    return {"heads": heads, "kv_heads": kv_heads, "context": ctx, "batch": bs,
            "flashinfer_us": round(per_call_us(lambda q, c, o: fi.run(q, c, out=o), caches, q), 2),
            "kernel_us": round(per_call_us(kernel.run, caches, q), 2)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default="32/4,16/8", help="query heads / KV heads, comma-separated")
    p.add_argument("--contexts", default="128,512,1024,2048", help="tokens per request")
    p.add_argument("--batches", default="1,2,4,8,16,64,256", help="requests per step")
    p.add_argument("--layers", type=int, default=24, help="calls per graph, each over its own cache")
    args = p.parse_args(argv)
    for hk in args.heads.split(","):
        heads, kv_heads = (int(x) for x in hk.split("/"))
        for ctx in (int(c) for c in args.contexts.split(",")):
            for bs in (int(b) for b in args.batches.split(",")):
                print(json.dumps(measure(heads, kv_heads, ctx, bs, args.layers)), flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
