"""launch/bench.py's `replicas` workload: the throughput workload's requests through the Python API (LLM), the
way a job of data-parallel replicas runs them (tensor_parallel_size below the world size: rank 0 hands the
requests to the replicas as they have room). Run at one rank with the same arguments, it is its own baseline:
the ratio of the two output tok/s is what the replicas gain.

    python launch/bench.py --model configs/models/qwen3-0.6b --workload replicas --engine ours
    torchrun --nproc_per_node=2 launch/bench.py --model configs/models/qwen3-0.6b --workload replicas \\
        --engine ours --set tensor_parallel_size=1
"""
from __future__ import annotations

import time
from typing import Callable

import torch.distributed as dist

from tp_engine import LLM, SamplingParams

Specs = list[tuple[list[int], int]]  # (prompt ids, new tokens) a request


def run_replicas(llm: LLM, args, make: Callable[[int, int, int], Specs]) -> dict | None:
    """Every rank: a warm-up call of 32 short requests, then `make(vocab, --num-requests, --seed)`'s requests
    in one generate call, timed. Rank 0 returns the figures, the other ranks None."""
    vocab = llm.engine.model_cfg.vocab_size

    def params(new: int) -> SamplingParams:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              max_new_tokens=new, ignore_eos=True, seed=args.seed)

    def generate(specs: Specs) -> list[dict] | None:
        return llm.generate([{"input_ids": ids} for ids, _ in specs], [params(new) for _, new in specs])

    generate([(ids[:200], 48) for ids, _ in make(vocab, 32, args.seed + 1)])  # prefill and graph buckets
    specs = make(vocab, args.num_requests, args.seed)
    t0 = time.perf_counter()
    outs = generate(specs)
    wall = time.perf_counter() - t0
    if outs is None:
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    tp = llm.cfg["tensor_parallel_size"] or world
    n_out = sum(len(o["output_token_ids"]) for o in outs)
    return {"replicas": world // tp, "tensor_parallel_size": tp, "requests": len(specs),
            "prompt_tokens": sum(len(ids) for ids, _ in specs), "output_tokens": n_out,
            "errors": sum(o.get("error") is not None for o in outs),
            "seconds": round(wall, 3), "output_tok_s": round(n_out / wall, 1)}


def bench_replicas(args, options: dict, res: dict, make: Callable[[int, int, int], Specs]) -> None:
    """One LLM built from the bench's options, then run_replicas; its figures under res["replicas"]."""
    llm = LLM(overrides=args.overrides, **options)
    try:
        out = run_replicas(llm, args, make)
    finally:
        llm.shutdown()
    if out is not None:
        res["replicas"] = out
