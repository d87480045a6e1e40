"""The few-token expert kernels (tp_engine/kernels/moe.py) over a sweep of tiles, on one token routed to k
random experts of a layer of the given shape (GPU only). Prints one JSON line per kernel and tile, the
fastest first.

    python launch/bench_moe.py --experts 128 --hidden 2048 --inter 768 --top-k 8     # Qwen3-30B-A3B, TP=1

Each time is one call's GPU time from a CUDA graph of 24 calls cycling through 8 routings (as the engine
times its tiles, so that the experts' weights come from HBM); the bandwidth counts the k experts' weights.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tp_engine.kernels import moe  # noqa: E402
from tp_engine.kernels.gemv import _time  # noqa: E402


def sweep(run, tiles, acc_per_row: int, weight_bytes: int, kind: str) -> list[dict]:
    rows = []
    for bn, bk, warps in tiles:
        regs = acc_per_row * bn * bk / (32 * warps)  # fp32 partial sums per thread
        if not 2 <= regs <= 128:
            continue
        us = _time(lambda r: run(r, (bn, bk, warps)), ROUTES) * 1e3
        rows.append({"kernel": kind, "tile": [bn, bk, warps], "us": round(us, 2),
                     "tb_s": round(weight_bytes / us / 1e6, 2), "in_engine": (bn, bk, warps) in
                     (moe.GEMV_TILES if kind == "gate_up" else moe.DOWN_TILES)})
    return sorted(rows, key=lambda r: r["us"])


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768, help="each expert's inner rows on this rank")
    p.add_argument("--top-k", type=int, default=8)
    a = p.parse_args()
    dev, bf16, e, h, i, k = torch.device("cuda"), torch.bfloat16, a.experts, a.hidden, a.inter, a.top_k
    gate_up = torch.randn(e, 2 * i, h, device=dev, dtype=bf16) * 0.02
    down = torch.randn(e, h, i, device=dev, dtype=bf16) * 0.02
    x = torch.randn(1, h, device=dev, dtype=bf16)
    ROUTES = [torch.randperm(e, device=dev)[:k].reshape(1, k).to(torch.int32) for _ in range(8)]
    weights = torch.softmax(torch.randn(1, k, device=dev), -1).to(bf16)
    act = moe._gate_up(x, gate_up, ROUTES[0], moe.GEMV_TILES[0])
    size = 2  # bytes per weight
    results = sweep(lambda r, t: moe._gate_up(x, gate_up, r, t),
                    itertools.product((1, 2, 4, 8, 16), (128, 256, 512, 1024), (2, 4, 8)), 2,
                    k * 2 * i * h * size, "gate_up")
    results += sweep(lambda r, t: moe._down(act, down, r, weights, t),
                     itertools.product((1, 2, 4, 8), (128, 256, 512), (2, 4, 8)), k, k * h * i * size, "down")
    for row in results:
        print(json.dumps(row))
