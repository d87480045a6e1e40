"""The soak workload of launch/bench.py: many short requests through one LLM, as a long job sends them, with
its speed, memory and open files measured per tenth of the requests.

The first and the last tenth each run as CALLS generate calls that return their outputs (a script that sends
its prompts in chunks), greedy and sampled in turn; the eight tenths between them run as one call that keeps
nothing (`return_outputs=False`, results through `on_finish`, as the command line runs). Prompts have 16 to
64 random tokens; every other one starts with a shared prefix of 16 or 32 tokens, drawn from a few that
change as the run goes on, so that the prefix cache keeps finding, filling and evicting pages.

Targets: output tok/s of the last tenth within 5% of the first's; host RSS and GPU memory at the end within
1% of what they were after the first tenth; open file descriptors the same. The memory and file figures of
the targets are taken between generate calls, on every rank. In the long call, requests admitted together
end together: a middle tenth's rate counts the requests that ended in it, and moves by up to a batch of them.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import random
import sys
import time
from array import array

import torch

from tp_engine import LLM, SamplingParams, comm

CALLS = 5  # generate calls in the first and in the last tenth
PREFIX_WINDOW = 8  # prompts draw among this many live prefixes ...
PREFIX_EVERY = 64  # ... and a new one replaces the oldest every this many prompts
# the long call's sampling: Qwen3's recommended values
LONG = SamplingParams(temperature=0.6, top_k=20, top_p=0.95, max_new_tokens=24, ignore_eos=True)
SPEED_TOLERANCE, MEMORY_TOLERANCE = 0.05, 0.01
_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if sys.platform.startswith("linux") else None


class _MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2: the C allocator's totals over all its arenas."""
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


_MALLINFO2 = getattr(_LIBC, "mallinfo2", None)  # glibc 2.33 and later
if _MALLINFO2 is not None:
    _MALLINFO2.restype = _MallInfo2


def soak_prompt(seed: int, k: int, vocab: int) -> list[int]:
    """Prompt k of a run: 16 to 64 random tokens, or for even k a shared prefix (16 or 32 tokens, one of
    PREFIX_WINDOW that move on as k grows, so that old ones fall out of use) and up to 32 tokens of its
    own."""
    rng = random.Random(seed * 1_000_003 + k)
    if k % 2:
        return [rng.randrange(vocab) for _ in range(rng.randint(16, 64))]
    shared = random.Random(seed * 1_000_003 - 1 - (k // PREFIX_EVERY + rng.randrange(PREFIX_WINDOW)))
    prefix = [shared.randrange(vocab) for _ in range(shared.choice((16, 32)))]
    return prefix + [rng.randrange(vocab) for _ in range(rng.randint(0, 32))]


def call_params(call: int, seed: int) -> SamplingParams:
    """The sampling of chunked call `call` (of its tenth): greedy, temperature with top-p (a full sort), or
    Qwen3's top-k/top-p with logprobs, in turn; 16 to 32 new tokens."""
    kinds = [{}, {"temperature": 0.7, "top_p": 0.9},
             {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "logprobs": 2}]
    return SamplingParams(max_new_tokens=16 + call * 7 % 17, ignore_eos=True, seed=seed + call,
                          **kinds[call % 3])


def snapshot(device: torch.device) -> dict:
    """This process's memory, live Python objects and open files. `rss` is read after the collector ran
    and the C allocator gave its free pages back (malloc_trim): memory held, not memory kept for reuse,
    which moves by megabytes. `heap` is what the C allocator has handed out and not had back (tensors'
    storage, large Python buffers), and `blocks` what Python's small-object allocator has (ints, strings,
    small lists): both count memory in use, whatever the allocators keep around it. `objects` counts what
    the collector tracks (tensors, dicts, lists, class instances): a leak of one of them per request or per
    step shows there exactly, before it shows in RSS."""
    gc.collect()
    out = {"rss_untrimmed": vm_rss()}
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)
    out.update(rss=vm_rss(), objects=len(gc.get_objects()), blocks=sys.getallocatedblocks(),
               fds=len(os.listdir("/proc/self/fd")))
    if _MALLINFO2 is not None:
        info = _MALLINFO2()
        out["heap"] = info.uordblks + info.hblkhd  # in use in the arenas, and in chunks of their own mmap
    if device.type == "cuda":
        out.update(gpu_allocated=torch.cuda.memory_allocated(device),
                   gpu_reserved=torch.cuda.memory_reserved(device))
    return out


def vm_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class Tenths:
    """Rank 0's figures at the end of each tenth: output tok/s over the time spent inside generate calls
    (less the time spent measuring), memory, open files, the prefix cache."""

    def __init__(self, llm: LLM, ends: list[int]) -> None:
        self.llm, self.ends, self.rows = llm, set(ends), []
        self.done = self.tokens = self.cached = 0
        self.busy, self.since, self.last = 0.0, None, (0.0, 0)

    def run(self, prompts: list, params: SamplingParams, keep: bool) -> None:
        self.since = time.perf_counter()
        try:
            self.llm.generate(prompts, params, on_finish=self.finished, return_outputs=keep)
        finally:
            self.busy += time.perf_counter() - self.since
            self.since = None

    def finished(self, out: dict) -> None:
        self.done += 1
        self.tokens += len(out["output_token_ids"])
        self.cached += out["cached_prompt_tokens"]
        if self.done not in self.ends:
            return
        now = time.perf_counter()
        seconds = self.busy + now - self.since
        (t, n), self.last = self.last, (seconds, self.tokens)
        engine = self.llm.engine
        rate = (self.tokens - n) / max(seconds - t, 1e-9)
        self.rows.append({"requests": self.done, "output_tok_s": round(rate, 1),
                          "seconds": round(seconds, 3), "cached_prompt_tokens": self.cached,
                          "cached_pages": engine.pool.num_cached, **snapshot(engine.device)})
        self.busy -= time.perf_counter() - now  # the measuring does not count


def run_soak(llm: LLM, n: int, seed: int = 0) -> dict | None:
    """Every rank: n requests (at least 10 * CALLS) through `llm`, after a short warm-up. Rank 0 returns the
    figures and the targets' verdicts; the other ranks None."""
    if n < 10 * CALLS:
        raise ValueError(f"the soak workload needs at least {10 * CALLS} requests, got {n}")
    engine, per_tenth = llm.engine, n // 10
    vocab, device = engine.model_cfg.vocab_size, engine.device
    # Every prompt is made first, as a job reads its prompts file, at 4 bytes a token as the command line
    # holds them: prompts made as the run goes would move the host memory it measures.
    prompts = [{"input_ids": array("i", soak_prompt(seed, k, vocab))} for k in range(n)]
    # Warm-up, on prompts of another seed: each kind of chunked call, then the long call's kind on enough
    # prompts to fill the batch, so that the first tenth starts with every step shape the run will see.
    for call in range(3):
        llm.generate([soak_prompt(seed + 1, k, vocab) for k in range(32 * call, 32 * call + 32)],
                     call_params(call, seed))
    llm.generate([soak_prompt(seed + 1, k, vocab) for k in range(96, 96 + 2 * engine.max_batch)], LONG,
                 return_outputs=False)
    middle = n - 2 * per_tenth  # the long call's requests: 8 tenths and the remainder of n / 10
    tenths = Tenths(llm, [per_tenth + middle * k // 8 for k in range(9)] + [n])
    ends = []

    def chunked(first: int) -> None:
        """A tenth as CALLS calls that return their outputs, like a script's loop over chunks of prompts."""
        bounds = [first + per_tenth * c // CALLS for c in range(CALLS + 1)]
        for c in range(CALLS):
            tenths.run(prompts[bounds[c]:bounds[c + 1]], call_params(c, seed + first), keep=True)
        ends.append(snapshot(device))

    chunked(0)
    tenths.run(prompts[per_tenth:per_tenth + middle], LONG, keep=False)
    chunked(n - per_tenth)
    per_rank = comm.all_gather_object(ends, engine.tp)
    if not engine.tp.is_first:
        return None
    first, last = tenths.rows[0], tenths.rows[-1]
    return {"requests": n, "output_tokens": tenths.tokens, "seconds": round(tenths.busy, 2),
            "kv_pages": engine.kv.num_pages, "tenths": tenths.rows,
            "per_rank": [{"after_first_tenth": a, "at_end": b} for a, b in per_rank],
            "targets": verdicts(first["output_tok_s"], last["output_tok_s"], per_rank)}


def verdicts(first_tok_s: float, last_tok_s: float, per_rank: list) -> dict:
    """Each target's figures and whether it is met (memory and files: on every rank)."""
    ratio = last_tok_s / first_tok_s
    out = {"speed": {"first_tenth_tok_s": first_tok_s, "last_tenth_tok_s": last_tok_s,
                     "ratio": round(ratio, 4), "pass": abs(ratio - 1) <= SPEED_TOLERANCE}}
    for key in ("rss", "gpu_allocated", "gpu_reserved"):
        if key not in per_rank[0][0]:
            continue
        growth = [b[key] - a[key] for a, b in per_rank]
        rel = [g / a[key] for g, (a, _) in zip(growth, per_rank)]
        out[key] = {"growth_bytes": growth, "growth": [round(r, 5) for r in rel],
                    "pass": all(r < MEMORY_TOLERANCE for r in rel)}
    out["fds"] = {"after_first_tenth": [a["fds"] for a, _ in per_rank],
                  "at_end": [b["fds"] for _, b in per_rank],
                  "pass": all(a["fds"] == b["fds"] for a, b in per_rank)}
    return out


def bench_soak(args, options: dict, res: dict) -> None:
    """launch/bench.py's `soak`: one LLM built from the bench's options, then run_soak; PASS or FAIL per
    target on stderr."""
    llm = LLM(overrides=args.overrides, **options)
    try:
        out = run_soak(llm, args.soak_requests, args.seed)
    finally:
        llm.shutdown()
    if out is None:
        return
    res["soak"] = out
    for name, target in out["targets"].items():
        figures = {k: v for k, v in target.items() if k != "pass"}
        print(f"soak {name}: {'PASS' if target['pass'] else 'FAIL'} {figures}", file=sys.stderr)
