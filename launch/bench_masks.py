"""xgrammar alone on this host: the masks of one decode step of --rows constrained requests under the
structured workload's 8 JSON schemas (launch/bench_structured.py), each matcher a seeded random walk of 0 to
--depth tokens through its grammar (most end inside a JSON string, where a row costs the most). Timed: each
row on its own, xgrammar's batch fill on each thread count of --threads, and the take of one token a row in
one call. No GPU and no engine: what this host's cores give the mask thread.

  python launch/bench_masks.py [--model configs/models/qwen3-0.6b] [--tokenizer DIR] [--rows 256]
                               [--threads 1,2,4,8,15] [--out FILE]

The tokenizer is the model's, else --tokenizer DIR's, else the structured workload's trained one.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "launch")]

import torch  # noqa: E402

from bench_structured import model_with_tokenizer, record_schema  # noqa: E402
from tp_engine import SamplingParams  # noqa: E402
from tp_engine.sampling.constraints import Grammars, constraint_of  # noqa: E402


def walks(compiled: list, rows: int, depth: int, words: int, seed: int) -> list[list[int]]:
    """Row r's tokens: a walk of up to `depth` tokens through schema r % 8, each drawn among those its mask
    allows, ending before the grammar would."""
    import xgrammar

    rng, mask, out = random.Random(seed), torch.zeros(1, words, dtype=torch.int32), []
    for r in range(rows):
        m, taken = xgrammar.GrammarMatcher(compiled[r % len(compiled)]), []
        for _ in range(rng.randrange(depth + 1)):
            m.fill_next_token_bitmask(mask, 0)
            tok = rng.choice(allowed_ids(mask[0]))
            m.accept_token(tok)
            if m.is_terminated():
                break
            taken.append(tok)
        out.append(taken)
    return out


def allowed_ids(row: torch.Tensor) -> list[int]:
    """The token ids a mask row ([words] int32, bit j of word w: token 32 w + j) allows, in order."""
    return torch.nonzero(((row.unsqueeze(1) >> torch.arange(32)) & 1).flatten()).flatten().tolist()


def matchers(compiled: list, tokens: list[list[int]]) -> list:
    import xgrammar

    out = []
    for r, toks in enumerate(tokens):
        m = xgrammar.GrammarMatcher(compiled[r % len(compiled)])
        for t in toks:
            m.accept_token(t)
        out.append(m)
    return out


def timed_ms(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "configs" / "models" / "qwen3-0.6b"))
    p.add_argument("--tokenizer", metavar="DIR")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--depth", type=int, default=80)
    p.add_argument("--threads", default="1,2,4,8,15")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", metavar="FILE")
    args = p.parse_args()
    import xgrammar
    from transformers import AutoTokenizer
    from xgrammar.matcher import _core

    model, source = model_with_tokenizer(args.model, args.tokenizer)
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    vocab, eos = cfg["vocab_size"], cfg.get("eos_token_id")
    # compiled as the engine compiles a request's constraint
    grammars = Grammars(lambda: (AutoTokenizer.from_pretrained(model), ""), vocab,
                        [eos] if isinstance(eos, int) else eos or [])
    words = (vocab + 31) // 32
    compiled = [grammars.compile(*constraint_of(SamplingParams(json_schema=record_schema(v))))
                for v in range(8)]
    tokens = walks(compiled, args.rows, args.depth, words, args.seed)
    ms, masks = matchers(compiled, tokens), torch.zeros(args.rows, words, dtype=torch.int32)
    per_row = [timed_ms(lambda j=j, m=m: m.fill_next_token_bitmask(masks, j), 5) * 1e3
               for j, m in enumerate(ms)]
    q = statistics.quantiles(per_row, n=10, method="inclusive")  # within the rows measured
    batch = {}
    for n in (int(t) for t in args.threads.split(",")):
        filler, rows = xgrammar.BatchGrammarMatcher(n), list(range(len(ms)))
        batch[n] = round(timed_ms(lambda f=filler: f.batch_fill_next_token_bitmask(ms, masks, rows),
                                  args.repeat), 3)
    allowed = [allowed_ids(row)[-1] for row in masks]
    fresh = matchers(compiled, tokens)
    start = time.perf_counter()
    took = _core.BatchGrammarMatcher.batch_accept_token([m._handle for m in fresh], allowed, False)
    take_ms = (time.perf_counter() - start) * 1e3
    assert 0 not in took
    res = {"host_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
           "tokenizer": source, "rows": args.rows, "walk_tokens_median": statistics.median(map(len, tokens)),
           "row_fill_us": {"p10": round(q[0], 1), "p50": round(q[4], 1), "p90": round(q[8], 1),
                           "max": round(max(per_row), 1)},
           "rows_one_by_one_ms": round(sum(per_row) / 1e3, 3), "batch_fill_ms_by_threads": batch,
           "take_ms": round(take_ms, 3)}
    print(json.dumps(res))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
