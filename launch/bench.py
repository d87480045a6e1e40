"""Benchmarks of the engine (and of HF transformers on the same workload), one JSON line on stdout.

    python launch/bench.py --model configs/models/qwen3-0.6b --workload latency
    torchrun --nproc_per_node=2 launch/bench.py --model configs/models/qwen3-8b --workload all \\
        --write-checkpoint /tmp/qwen3-8b-random
    python launch/bench.py --model configs/models/qwen3-30b-a3b --workload latency

Workloads (comma-separated, or `all`):
  latency     batch 1, 128 prompt tokens, 256 new tokens, greedy, ignore_eos: decode tok/s, ms/step and
              the weight bandwidth achieved (bytes of weights per rank / step time; for Qwen3-MoE the bytes
              one token reads, `active_weight_bytes`: its k experts, not all of them)
  throughput  256 requests, prompt and output lengths uniform in [100, 1024], temperature 0.6, ignore_eos,
              fixed seed: output tok/s over the whole run (after a warm-up), TTFT and TPOT percentiles
  load        with --write-checkpoint: seconds to build the engine from the safetensors on disk
  shared_prefix  --num-requests requests: one --prefix-len (2,000) token prefix +
              U[--suffix-min, --suffix-max] ([100, 300]) unique tokens, --shared-new-tokens (128) new,
              temperature 0.6: the same requests with the prefix cache off, then on (emptied before each);
              output tok/s, TTFT, cached prompt tokens of both, and the ratio on/off (`speedup`)
  long_prompt --long-decoders (64) requests decode; once the first has --long-after (16) tokens, one
              --long-len (32,000) token prompt arrives: its TTFT, the decoders' time per output token
              (p50/p99) while it prefills and its p50 otherwise (the ratio p99 / that p50): with the
              configured max_prefill_tokens and max_prefill_cost_while_decoding (`chunked`), each
              --long-costs value (`cost_N`), chunks of max_prefill_tokens alone (`tokens_only`), the whole
              prompt in one step (`unchunked`); with --long-spans, each cost also at each of those exchange
              rates for deep prompt tokens in place of the model's (`cost_N_span_S`, step_budget.py)
  sampling    the throughput workload with temperature only, then with --top-k/--top-p (Qwen3's
              recommended 20 and 0.95 when both are unset), both twice: the first pass a warm-up; both
              figures and their ratio
  mixed       the throughput workload's requests twice in one call: one shared setting (--temperature,
              top-k 20, top-p 0.95), then settings per request (every other one greedy, the rest that
              shared setting; every third with 5 logprobs), in shared batches; the same prompts and
              max_new_tokens; both figures and their ratio
  n8          --n-prompts prompts (64) x --n-samples samples (8) of --n-new-tokens (512) each, against the
              same number of requests sent as separate prompts; both figures and their ratio
  soak        --num-requests (100,000) short requests (16-64 prompt tokens, 16-32 new, greedy and
              sampled, shared prefixes) through one LLM in many generate calls: output tok/s, host RSS,
              GPU memory and open files per tenth, PASS/FAIL per target on stderr (launch/bench_soak.py)
  structured  JSON-schema constrained decoding against the same requests unconstrained (ignore_eos off,
              output tokens of both reported): batch 1 greedy with an 8-field schema, --new-tokens new
              (tok/s ratio, target >= 0.97); --num-requests (256) requests over 8 schemas at --temperature
              (output tok/s ratio, target >= 0.90); a 20-field schema's compile time, first and cached
              (target <= 1 ms); PASS/FAIL per target on stderr (launch/bench_structured.py; --tokenizer DIR,
              else the model's own or a byte-level BPE trained for it)
  replicas    the throughput workload's requests through the Python API, as a job of data-parallel
              replicas runs them (--set tensor_parallel_size below the world size); at one rank, its own
              baseline (launch/bench_replicas.py)

(shared_prefix, long_prompt, sampling, mixed, n8, soak, structured and replicas are not part of `all`.)
The throughput workload samples with --temperature, --top-k and --top-p.

--engine hf|both adds HF transformers (eager `generate`, bf16; TP>1 through tp_plan="auto") on the same
workloads: the same latency request (--hf-new-tokens new tokens), and for throughput the first
--hf-requests requests as one left-padded batch with --hf-max-new new tokens each.

Weights are random: `load_format: dummy` from config.json, or a checkpoint written by --write-checkpoint
DIR (bf16 safetensors in HF names, sharded, with an index), which the engine then loads from disk.

--weights bf16,fp8 runs the engine's workloads once per weight format, in one call: bf16 as above, then
block-FP8 (Qwen's *-FP8 format: float8_e4m3fn linears with a float32 scale per 128 x 128 block, bf16
embeddings, norms and LM head), from a config.json with a quantization_config (dummy weights) or from an FP8
checkpoint that --write-checkpoint writes beside the bf16 one, in DIR-fp8. FP8 figures go under "fp8"; their
bandwidth floor counts the bytes an FP8 step reads (Engine.weight_bytes: fp8 linears, scales, bf16 rest).
HF runs the bf16 model only.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tp_engine.base import config as C  # noqa: E402
from tp_engine import comm  # noqa: E402
from tp_engine.runtime.engine import Engine  # noqa: E402
from tp_engine.checkpoint.model_config import ModelConfig  # noqa: E402
from tp_engine.checkpoint.quant import BLOCK, QWEN_FP8_CONFIG, is_quantizable, quantize  # noqa: E402
from tp_engine.sampling.sampler import SamplingParams  # noqa: E402
from tp_engine.runtime.request import RequestOutput  # noqa: E402
from bench_compiles import KernelCompiles  # noqa: E402
from bench_replicas import bench_replicas  # noqa: E402
from bench_soak import bench_soak  # noqa: E402
from bench_structured import bench_structured  # noqa: E402

log = logging.getLogger("tp_engine")
HBM_BYTES_PER_S = 4.2e12  # device-to-device copy measured on the H200 (bytes read + written)
SHARD_BYTES = 4 << 30
# each builds an LLM of its own, after the other workloads' engine
LLM_WORKLOADS = {"soak", "structured", "replicas"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="directory with config.json (public Qwen3 shapes in configs/models)")
    p.add_argument("--workload", default="latency",
                   help="latency, throughput, load, shared_prefix, long_prompt, sampling, mixed, n8, soak, "
                        "structured, replicas (comma-separated) or all (the first three)")
    p.add_argument("--engine", default="both", choices=["ours", "hf", "both"])
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="engine config override, e.g. --set cuda_graph=false")
    p.add_argument("--write-checkpoint", metavar="DIR",
                   help="write a random bf16 checkpoint here (if absent) and load it; "
                   "with --weights fp8 also an FP8 one in DIR-fp8")
    p.add_argument("--weights", default="bf16", help="weight formats to run, in order: bf16, fp8 or bf16,fp8")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--num-requests", type=int,
                   help="requests (throughput, shared_prefix, structured: 256; soak: 100,000)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="structured: a directory with the tokenizer files to compile constraints with "
                        "(default: the model's own, else a byte-level BPE trained for it)")
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-k", type=int, default=0, help="throughput: top-k (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="throughput: top-p (1 = off)")
    p.add_argument("--n-prompts", type=int, default=64, help="n8: prompts")
    p.add_argument("--n-samples", type=int, default=8, help="n8: samples per prompt")
    p.add_argument("--n-new-tokens", type=int, default=512, help="n8: new tokens per sample")
    p.add_argument("--hf-new-tokens", type=int, default=None,
                   help="HF latency run length (default --new-tokens)")
    p.add_argument("--hf-requests", type=int, default=32,
                   help="HF throughput: this many requests as one batch")
    p.add_argument("--hf-max-new", type=int, default=128,
                   help="HF throughput: new tokens per request (capped)")
    p.add_argument("--prefix-len", type=int, default=2000, help="shared_prefix: tokens of the shared prefix")
    p.add_argument("--suffix-min", type=int, default=100,
                   help="shared_prefix: fewest unique tokens per request")
    p.add_argument("--suffix-max", type=int, default=300,
                   help="shared_prefix: most unique tokens per request")
    p.add_argument("--shared-new-tokens", type=int, default=128, help="shared_prefix: new tokens per request")
    p.add_argument("--long-len", type=int, default=32000, help="long_prompt: tokens of the long prompt")
    p.add_argument("--long-decoders", type=int, default=64,
                   help="long_prompt: requests decoding when it arrives")
    p.add_argument("--long-after", type=int, default=16,
                   help="long_prompt: it arrives after this many decode tokens")
    p.add_argument("--long-costs", type=lambda v: [int(c) for c in v.split(",") if c], default=[],
                   help="long_prompt: more values of max_prefill_cost_while_decoding to measure, "
                        "e.g. 512,2048")
    p.add_argument("--long-decode-tokens", type=int, default=256, help="long_prompt: new tokens per decoder")
    p.add_argument("--long-spans", type=lambda v: [float(c) for c in v.split(",") if c], default=[],
                   help="long_prompt: attention spans to measure each cost at, in place of the model's, "
                        "e.g. 1920,960")
    p.add_argument("--profile", action="store_true", help="latency: step-time breakdown from torch.profiler")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="with --profile: the profiled steps' timeline as a Chrome trace (rank 0)")
    p.add_argument("--force-accept", type=float, default=None, metavar="L",
                   help="with speculative.method set (--set): each verifying request takes L tokens a step "
                        "on average, whatever the target says (random weights accept almost nothing): times "
                        "the machinery at a published acceptance; the tokens are not the model's")
    # measuring only; the engine's own switches are config keys (--set advanced.all_reduce=nccl and the like)
    p.add_argument("--push-chunk", type=int, default=None, metavar="N",
                   help="values per program and row in the push all-reduce fused with RMSNorm (default 512; "
                        "0: a whole row per program)")
    p.add_argument("--no-fast-plan", action="store_true",
                   help="always the public plan() of the flashinfer CUDA-graph wrappers")
    p.add_argument("--no-split-kv", action="store_true",
                   help="CUDA-graph decode without flashinfer's KV split")
    p.add_argument("--no-pdl", action="store_true",
                   help="the Triton kernels without programmatic dependent launch")
    p.add_argument("--no-decode-kernel", action="store_true",
                   help="flashinfer's attention for every decode row: in CUDA-graph decode and in mixed "
                        "steps' graph pieces (not the decode kernel on short contexts)")
    p.add_argument("--gpu", default=os.environ.get("GPU_KIND", ""), help="label recorded in the results")
    p.add_argument("--out", help="also write the JSON line to this file")
    p.add_argument("--memory-cap-gib", type=float, default=None,
                   help="cap the allocator at this many GiB (torch.cuda.set_per_process_memory_fraction), "
                        "e.g. 79.1 to run as on an 80 GB H100; the memory plan sizes the KV pool within it")
    args = p.parse_args(argv)
    args.soak_requests = args.num_requests or 100_000
    args.num_requests = args.num_requests or 256
    return args


# ---- utilities ----

def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def model_bytes(cfg: dict, bytes_per_param: int = 2, fp8: bool = False) -> int:
    """Bytes of all weights of the full model (tied embeddings counted once); fp8: the quantized linears at
    one byte per weight plus a float32 scale per 128 x 128 block."""
    return sum(tensor_bytes(name, shape, bytes_per_param, fp8) for name, shape in checkpoint_tensors(cfg))


def tensor_bytes(name: str, shape: tuple, bytes_per_param: int = 2, fp8: bool = False) -> int:
    if fp8 and is_quantizable(name, shape):
        return prod(shape) + 4 * -(-shape[0] // BLOCK) * -(-shape[1] // BLOCK)
    return prod(shape) * bytes_per_param


def prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def mlp_tensors(pre: str, h: int, i: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(pre + "gate_proj.weight", (i, h)), (pre + "up_proj.weight", (i, h)),
            (pre + "down_proj.weight", (h, i))]


def checkpoint_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a Qwen3 (or Qwen3-MoE: router and per-expert tensors) checkpoint in HF naming."""
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // q
    moe = ModelConfig.from_dict(cfg).moe
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for n in range(L):
        pre = f"model.layers.{n}."
        out += [(pre + "input_layernorm.weight", (h,)), (pre + "post_attention_layernorm.weight", (h,)),
                (pre + "self_attn.q_proj.weight", (q * d, h)), (pre + "self_attn.k_proj.weight", (kv * d, h)),
                (pre + "self_attn.v_proj.weight", (kv * d, h)), (pre + "self_attn.o_proj.weight", (h, q * d)),
                (pre + "self_attn.q_norm.weight", (d,)), (pre + "self_attn.k_norm.weight", (d,))]
        if moe is not None and moe.is_sparse(n):
            out.append((pre + "mlp.gate.weight", (moe.num_experts, h)))
            for e in range(moe.num_experts):
                out += mlp_tensors(f"{pre}mlp.experts.{e}.", h, moe.intermediate_size)
        else:
            out += mlp_tensors(pre + "mlp.", h, i)
    out.append(("model.norm.weight", (h,)))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (cfg["vocab_size"], h)))
    return out


def active_weight_bytes(cfg: dict, tp: int, bytes_per_param: int = 2) -> int:
    """Bytes of weights one rank reads to decode one token (batch 1): attention, norms, each dense MLP, the
    router and k experts of each sparse layer, one embedding row and the LM head, each at its per-rank share
    (KV projections replicated when TP exceeds the KV heads, the router whole)."""
    mc = ModelConfig.from_dict(cfg)
    h, d = mc.hidden_size, mc.head_dim
    kv_local = max(1, mc.num_kv_heads // tp)
    attn = (2 * mc.num_heads // tp + 2 * kv_local) * d * h + 2 * d + 2 * h  # q, o; k, v; q/k norms; 2 norms
    n = 0
    for layer in range(mc.num_layers):
        if mc.moe is not None and mc.moe.is_sparse(layer):
            n += attn + mc.moe.num_experts * h + mc.moe.top_k * 3 * h * mc.moe.intermediate_size // tp
        else:
            n += attn + 3 * h * mc.intermediate_size // tp
    step = 64 * tp  # the vocabulary padding of layers/embedding.py
    vocab_shard = (mc.vocab_size + step - 1) // step * step // tp
    return (n + h + h + vocab_shard * h) * bytes_per_param  # an embedding row, the final norm, the LM head


def write_checkpoint(model_dir: str, out_dir: str, seed: int, fp8: bool = False) -> float:
    """Random bf16 safetensors shards + index + config.json; each rank writes every world-th shard. fp8: the
    same random weights, quantized (launch/quantize_fp8.py's format). Returns the seconds this took (0 when
    the directory already holds a complete checkpoint)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    index = out / "model.safetensors.index.json"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    done = index.is_file()
    if world > 1:
        done = comm.all_gather_object(done)[0]
    if done:
        return 0.0
    t0 = time.perf_counter()
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    tensors = checkpoint_tensors(cfg)
    shards, cur, size = [], [], 0
    for name, shape in tensors:
        n = tensor_bytes(name, shape, 2, fp8)
        if cur and size + n > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += n
    shards.append(cur)
    out.mkdir(parents=True, exist_ok=True)
    files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator(device=dev)
    for k, shard in enumerate(shards):
        if k % world != rank():
            continue
        data = {}
        for name, shape in shard:
            if len(shape) == 1:
                data[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                gen.manual_seed(seed * 1_000_003 + hash_name(name))
                w = torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_(0.0, 0.02, generator=gen)
                if fp8 and is_quantizable(name, shape):
                    q, s = quantize(w)
                    data[name], data[name + "_scale_inv"] = q.cpu(), s.cpu()
                else:
                    data[name] = w.cpu()
        save_file(data, str(out / files[k]), metadata={"format": "pt"})
        del data
    if rank() == 0:
        total = sum(tensor_bytes(name, s, 2, fp8) for name, s in tensors)
        weight_map = {name + suffix: files[k] for k, shard in enumerate(shards) for name, shape in shard
                      for suffix in (["", "_scale_inv"] if fp8 and is_quantizable(name, shape) else [""])}
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        (out / "config.json").write_text(json.dumps(fp8_config(cfg) if fp8 else cfg, indent=2))
    if world > 1:
        comm.all_gather_object(True)  # every rank waits until all shards and the index exist
    return time.perf_counter() - t0


def fp8_config(cfg: dict) -> dict:
    return {**cfg, "quantization_config": dict(QWEN_FP8_CONFIG)}


def fp8_config_dir(model_dir: str) -> str:
    """A directory with model_dir's config.json plus an FP8 quantization_config (load_format dummy). The same
    path on every rank, since the ranks compare their configs; each writes the same file."""
    out = Path(tempfile.gettempdir()) / "tp_engine_bench" / f"{Path(model_dir).resolve().name}-fp8"
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"config.json.{rank()}"
    tmp.write_text(json.dumps(fp8_config(json.loads((Path(model_dir) / "config.json").read_text())),
                              indent=2))
    os.replace(tmp, out / "config.json")
    return str(out)


def hash_name(name: str) -> int:
    h = 0
    for ch in name.encode():
        h = (h * 131 + ch) % 1_000_000_007
    return h


def run_requests(engine: Engine, requests: list[RequestOutput], on_token=None, on_finish=None) -> None:
    """Rank 0 runs the requests; the other ranks follow its steps."""
    if engine.tp.is_first:
        engine.run(requests, on_token, on_finish)
    else:
        engine.follow()


def empty_prefix_cache(engine: Engine) -> None:
    """Forget the cached prompt pages (rank 0's pool): a measured run reuses nothing of an earlier one."""
    if engine.pool is not None:
        engine.pool.clear()


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def throughput_requests(args, vocab: int, n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, o = rng.randint(args.min_len, args.max_len), rng.randint(args.min_len, args.max_len)
        out.append((random_ids(rng, p, vocab), o))
    return out


# ---- our engine ----

def bench_latency(engine: Engine, args, res: dict) -> None:
    vocab = engine.model_cfg.vocab_size
    prompt = random_ids(random.Random(args.seed), args.prompt_len, vocab)

    def one(n_new: int, on_token=None) -> list[float]:
        times: list[float] = []

        def tok(r):
            times.append(time.perf_counter())
            if on_token is not None:
                on_token(r)
        req = RequestOutput(0, list(prompt),
                            SamplingParams(max_new_tokens=n_new, ignore_eos=True, seed=args.seed))
        run_requests(engine, [req], tok)
        return times

    one(32)  # warm-up
    times = one(args.new_tokens)
    if engine.tp.is_first:
        step = (times[-1] - times[0]) / (len(times) - 1)
        wb = engine.weight_bytes()
        if engine.model_cfg.moe is not None:  # a token reads only its experts: the floor counts what is read
            cfg = json.loads((Path(engine.cfg["model"]) / "config.json").read_text())
            wb = active_weight_bytes(cfg, engine.tp.size, engine.dtype.itemsize)
        res["latency"] = {
            "decode_tok_s": round(1 / step, 1), "ms_per_step": round(step * 1e3, 3),
            ("active_weight_bytes_per_rank" if engine.model_cfg.moe is not None
             else "weight_bytes_per_rank"): wb,
            "bandwidth_tb_s": round(wb / step / 1e12, 3),
            "floor_ms_per_step": round(wb / HBM_BYTES_PER_S * 1e3, 3),
            "floor_tok_s": round(HBM_BYTES_PER_S / wb, 1),
            "fraction_of_floor": round(wb / HBM_BYTES_PER_S / step, 3),
            "prompt_tokens": args.prompt_len, "new_tokens": args.new_tokens,
        }
    plans = getattr(engine.attn, "_fast_plans", {})
    if engine.tp.is_first and plans:
        res["latency"]["direct_plan"] = sum(f is not None for f in plans.values()) == len(plans)
    if args.profile:
        breakdown = profile_decode(engine, one, min(args.new_tokens, 24), args.trace)
        if engine.tp.is_first:
            lat = res["latency"]
            if "gpu_busy" in breakdown:  # the profiler slows the host down: take the step time measured above
                breakdown["step"] = round(lat["ms_per_step"] * 1e3, 1)
                breakdown["host_not_overlapped"] = round(breakdown["step"] - breakdown["gpu_busy"], 1)
            lat["breakdown_per_step_us"] = breakdown


def profile_decode(engine: Engine, one, n_new: int, trace: str | None = None) -> dict:
    """Per decode step: GPU time by kernel family (torch.profiler) and the host time no kernel covers;
    the steps' timeline to `trace` (a Chrome trace)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    started = []

    def on_token(r):
        if not started:  # after the prefill step: profile decode steps only
            sync()
            prof.start()
            started.append(1)

    times = one(n_new, on_token if engine.tp.is_first else None)
    if not engine.tp.is_first:
        return {}
    sync()
    prof.stop()
    if trace:
        prof.export_chrome_trace(trace)
    steps = len(times) - 1
    families = {"attention": 0.0, "matmul": 0.0, "all_reduce": 0.0, "norm_rope_act": 0.0, "other": 0.0}
    names: dict[str, float] = {}
    counts: dict[str, int] = {}
    try:
        for e in prof.events():
            if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            us = e.time_range.elapsed_us()
            n = e.name
            names[n] = names.get(n, 0.0) + us
            counts[n] = counts.get(n, 0) + 1
            low = n.lower()
            if any(k in low for k in ("prefill", "decode", "merge", "attention", "flashinfer")):
                families["attention"] += us
            elif any(k in low for k in ("nccl", "all_reduce", "allreduce", "one_shot", "symm")):
                families["all_reduce"] += us
            elif any(k in low for k in ("gemm", "xmma", "cutlass", "nvjet", "gemv", "cublas", "splitk",
                                        "sm90_")):
                families["matmul"] += us
            elif any(k in low for k in ("rmsnorm", "qk_norm", "silu", "gumbel")):
                families["norm_rope_act"] += us
            else:
                families["other"] += us
    except Exception as e:  # the breakdown is a diagnosis; never lose the run for it
        return {"error": f"{type(e).__name__}: {e}"}
    gpu = sum(families.values()) / steps
    out = {k: round(v / steps, 1) for k, v in families.items()}
    out.update({"gpu_busy": round(gpu, 1),
                "top_kernels": {k[:80]: [round(v / steps, 1), round(counts[k] / steps, 1)]
                                for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:30]}})
    return out


class HostTimers:
    """Wall time per phase of each step on every rank (rank 0 schedules; the others wait for its message,
    so their `broadcast` time is mostly waiting). Installed by patching the functions the engine calls."""

    def __init__(self, engine: Engine) -> None:
        import tp_engine.runtime.engine as E
        from tp_engine.runtime.scheduler import Scheduler
        from tp_engine.runtime.step_message import StepMessage

        self.t: dict[str, float] = {}
        self.n: dict[str, int] = {}  # calls per label
        self.patches = []
        for owner, name, label in ((E.comm, "broadcast_ints", "broadcast"),
                                   (E, "decode_message", "decode_message"),
                                   (Scheduler, "schedule", "schedule"), (E, "step_message", "message"),
                                   (StepMessage, "encode", "encode"), (Scheduler, "commit", "commit"),
                                   (Scheduler, "update", "update"), (engine, "forward", "forward_launch"),
                                   (engine, "share_tokens", "sample_and_share"),
                                   (engine, "take_tokens", "wait_gpu_and_update")):
            self._wrap(owner, name, label)
        # inside forward_launch: static inputs + page table + plan, and the plan
        if engine.graphs is not None:
            self._wrap(engine.graphs, "_load", "graph_inputs_and_plan")
            self._wrap(engine.attn, "plan_graph_decode", "graph_plan")
        # a speculating step (it waits for the GPU where it reads drafts and verified tokens): its drafting
        # (catch-up and draft forwards, to the drafts on the host), its verifying forward and rejection
        # sampling, the requests taking the tokens; and how many of its steps caught the proposer up
        if engine.spec is not None:
            import tp_engine.runtime.speculation as S
            self._wrap(S, "issue_verified", "spec_verify")
            self._wrap(S, "take_verified", "spec_take")
            self._wrap(engine.spec.policy, "record_switch", "spec_switch")
            if engine.spec.drafting is not None:
                self._wrap(engine.spec.drafting, "propose", "spec_draft")

    def _wrap(self, owner, name, label) -> None:
        orig = getattr(owner, name)
        t, n = self.t, self.n

        def timed(*a, **k):
            t0 = time.perf_counter()
            n[label] = n.get(label, 0) + 1
            try:
                return orig(*a, **k)
            finally:
                t[label] = t.get(label, 0.0) + time.perf_counter() - t0
        self.patches.append((owner, name, orig, None))
        setattr(owner, name, timed)

    def remove(self) -> None:
        for owner, name, orig, own in reversed(self.patches):
            if isinstance(owner, type) or type(owner).__name__ == "module":
                setattr(owner, name, orig)
            else:  # an instance: drop the wrapper to uncover the class's method
                delattr(owner, name)


def host_profile(engine: Engine, args, res: dict) -> None:
    """Latency request again, with the host phases of each step timed on every rank."""
    prompt = random_ids(random.Random(args.seed), args.prompt_len, engine.model_cfg.vocab_size)
    timers = HostTimers(engine)
    try:
        t0 = time.perf_counter()
        req = RequestOutput(0, list(prompt),
                            SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, seed=args.seed))
        run_requests(engine, [req])
        wall = time.perf_counter() - t0
    finally:
        timers.remove()
    steps = args.new_tokens + 1  # the prefill step, the decode steps and the stop message
    mine = {k: round(v / steps * 1e6, 1) for k, v in timers.t.items() if not k.startswith("spec_")}
    mine["wall_per_step"] = round(wall / steps * 1e6, 1)
    per_rank = comm.all_gather_object(mine) if engine.tp.size > 1 else [mine]
    if engine.tp.is_first:
        res["latency"]["host_us_per_step"] = {f"rank{r}": d for r, d in enumerate(per_rank)}
        verifying = timers.n.get("spec_verify", 0)
        if verifying:  # per speculating step, on rank 0
            spec = {k[5:]: round(v / verifying * 1e6, 1) for k, v in timers.t.items()
                    if k.startswith("spec_") and k != "spec_switch"}
            res["latency"]["spec_us_per_verifying_step"] = {
                **spec, "verifying_steps": verifying, "switches": timers.n.get("spec_switch", 0),
                "tokens": args.new_tokens}


def bench_throughput(engine: Engine, args, res: dict, key: str = "throughput", top_k: int | None = None,
                     top_p: float | None = None, settings=None) -> None:
    """settings(k, max_new_tokens): request k's SamplingParams in place of the one shared setting."""
    vocab = engine.model_cfg.vocab_size
    top_k = args.top_k if top_k is None else top_k
    top_p = args.top_p if top_p is None else top_p
    shared = {"temperature": args.temperature, "top_k": top_k, "top_p": top_p}

    def make(specs, base):
        return [RequestOutput(base + k, list(ids), settings(k, o) if settings else
                              SamplingParams(**shared, max_new_tokens=o, ignore_eos=True, seed=args.seed))
                for k, (ids, o) in enumerate(specs)]

    warm = throughput_requests(args, vocab, 32, args.seed + 1)
    # warm-up: prefill + graph buckets
    run_requests(engine, make([(ids[:200], 48) for ids, _ in warm], 10_000))
    specs = throughput_requests(args, vocab, args.num_requests, args.seed)
    reqs = make(specs, 0)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    empty_prefix_cache(engine)  # the sampling workload runs these same prompts twice

    def on_token(r):
        if len(r.output_ids) == 1:
            first[r.index] = time.perf_counter()

    def on_finish(r):
        last[r.index] = time.perf_counter()

    t0 = time.perf_counter()
    with KernelCompiles() as compiles:
        run_requests(engine, reqs, on_token, on_finish)
    wall = time.perf_counter() - t0
    if not engine.tp.is_first:
        return
    n_out = sum(len(r.output_ids) for r in reqs)
    ttft = [first[r.index] - t0 for r in reqs]
    tpot = [(last[r.index] - first[r.index]) / (len(r.output_ids) - 1) for r in reqs if len(r.output_ids) > 1]
    if settings:  # what the requests' own settings were
        shared = {"greedy_requests": sum(r.params.temperature == 0 for r in reqs),
                  "top_k_top_p_requests": sum(r.params.top_k > 0 or r.params.top_p < 1 for r in reqs),
                  "logprobs_requests": sum(r.params.logprobs > 0 for r in reqs)}
    res[key] = {
        **shared,
        "output_tok_s": round(n_out / wall, 1), "seconds": round(wall, 3), "requests": len(reqs),
        "prompt_tokens": sum(len(r.prompt_ids) for r in reqs), "output_tokens": n_out,
        "total_tok_s": round((n_out + sum(len(r.prompt_ids) for r in reqs)) / wall, 1),
        "ttft_s": {f"p{q}": round(pct(ttft, q), 4) for q in (50, 90, 99)},
        "tpot_ms": {f"p{q}": round(pct(tpot, q) * 1e3, 3) for q in (50, 90, 99)},
        "preempted": engine.num_preempted,
        "kernel_compiles": compiles.report(),  # during the measured run: a one-time cost inside it
    }


def bench_shared_prefix(engine: Engine, args, res: dict) -> None:
    """The same requests with the prefix cache off, then on; the cache is emptied before each run."""
    vocab, pool = engine.model_cfg.vocab_size, engine.pool  # the pool is rank 0's; the others follow

    def make(base: int, n: int) -> list[RequestOutput]:
        rng = random.Random(args.seed + 7)
        prefix = random_ids(rng, args.prefix_len, vocab)
        return [RequestOutput(base + k,
                              prefix + random_ids(rng, rng.randint(args.suffix_min, args.suffix_max), vocab),
                              SamplingParams(temperature=args.temperature, ignore_eos=True, seed=args.seed,
                                             max_new_tokens=args.shared_new_tokens)) for k in range(n)]

    run_requests(engine, make(10_000, 8))  # warm-up
    out = {}
    for cache in (False, True):
        if pool is not None:
            pool.clear()
            pool.enabled = cache
        reqs, first = make(0, args.num_requests), {}

        def on_token(r):
            first.setdefault(r.index, time.perf_counter())

        t0 = time.perf_counter()
        run_requests(engine, reqs, on_token)
        wall = time.perf_counter() - t0
        if engine.tp.is_first:
            n_out = sum(len(r.output_ids) for r in reqs)
            ttft = [first[r.index] - t0 for r in reqs]
            out["on" if cache else "off"] = {
                "output_tok_s": round(n_out / wall, 1), "seconds": round(wall, 3), "requests": len(reqs),
                "prompt_tokens": sum(len(r.prompt_ids) for r in reqs), "output_tokens": n_out,
                "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in reqs),
                "ttft_s": {f"p{q}": round(pct(ttft, q), 4) for q in (50, 99)},
                "preempted": engine.num_preempted}
    if pool is not None:
        pool.enabled = engine.cfg["prefix_cache"]
    if engine.tp.is_first:
        out["speedup"] = round(out["on"]["output_tok_s"] / out["off"]["output_tok_s"], 3)
        res["shared_prefix"] = out


def bench_long_prompt(engine: Engine, args, res: dict) -> None:
    """Decoders run; a long prompt arrives: its TTFT and their time per token while it prefills, chunked
    and not."""
    vocab, cfg = engine.model_cfg.vocab_size, dict(engine.cfg)
    chunk, cost = args.long_chunk, cfg["max_prefill_cost_while_decoding"]
    warm = random_ids(random.Random(args.seed), min(args.long_len, 2048), vocab)
    run_requests(engine, [RequestOutput(0, warm, SamplingParams(max_new_tokens=4, ignore_eos=True))])
    out = {}
    costs = [cost] + [c for c in args.long_costs if c != cost]
    modes = [("chunked", chunk, cost, None)] + [(f"cost_{c}", chunk, c, None) for c in costs[1:]] + \
        [(f"cost_{c}_span_{s:g}", chunk, c, s) for c in costs for s in args.long_spans] + \
        [("tokens_only", chunk, 0, None), ("unchunked", args.long_len + args.long_decoders, 0, None)]
    # each mode twice, the first unmeasured: its mixed steps compile kernels for shapes the warm-up had not
    for label, budget, bound, span in [m for m in modes for _ in range(2)]:
        # read by the next run's scheduler, on rank 0
        engine.cfg["max_prefill_tokens"], engine.cfg["max_prefill_cost_while_decoding"] = budget, bound
        empty_prefix_cache(engine)  # every run computes the long prompt
        rng = random.Random(args.seed + 11)
        decoding = SamplingParams(temperature=args.temperature, max_new_tokens=args.long_decode_tokens,
                                  ignore_eos=True, seed=args.seed)
        decoders = [RequestOutput(k, random_ids(rng, args.prompt_len, vocab), decoding)
                    for k in range(args.long_decoders)]
        long = RequestOutput(args.long_decoders, random_ids(rng, args.long_len, vocab),
                             SamplingParams(max_new_tokens=4, ignore_eos=True))
        times: dict[int, list[float]] = {r.index: [] for r in decoders}
        arrived, answered, scheds = [], [], []
        new_scheduler = engine.new_scheduler

        def make_scheduler():
            sched = new_scheduler()
            sched.span = span or sched.span  # this mode's exchange rate for deep prompt tokens
            scheds.append(sched)
            return sched

        engine.new_scheduler = make_scheduler

        def on_token(r):
            now = time.perf_counter()
            if r is long:
                answered.append(now)
                return
            times[r.index].append(now)
            if not arrived and len(r.output_ids) >= args.long_after:
                scheds[0].add(long)  # arrives while the decoders run
                arrived.append(now)

        try:
            run_requests(engine, decoders, on_token)
        finally:
            del engine.new_scheduler
        if engine.tp.is_first:
            t0, t1 = arrived[0], answered[0]
            steady = [b - a for ts in times.values() for a, b in zip(ts, ts[1:]) if b <= t0 or a >= t1]
            gaps = [b - a for ts in times.values() for a, b in zip(ts, ts[1:]) if b > t0 and a < t1]
            out[label] = {"max_prefill_tokens": budget, "max_prefill_cost_while_decoding": bound,
                          "attention_span": scheds[0].span,
                          "long_ttft_s": round(t1 - t0, 4),
                          "decode_tpot_ms_while_prefilling":
                              {f"p{q}": round(pct(gaps, q) * 1e3, 3) for q in (50, 99)},
                          "decode_tokens_while_prefilling": len(gaps),
                          "decode_tpot_ms_p50_otherwise": round(pct(steady, 50) * 1e3, 3),
                          "p99_while_prefilling_over_p50": round(pct(gaps, 99) / pct(steady, 50), 2)}
    engine.cfg["max_prefill_tokens"] = chunk  # the other workloads' steps, as configured
    engine.cfg["max_prefill_cost_while_decoding"] = cost
    if engine.tp.is_first:
        res["long_prompt"] = {"long_len": args.long_len, "decoders": args.long_decoders, **out}


def bench_sampling(engine: Engine, args, res: dict) -> None:
    """Throughput with temperature only, then with top-k/top-p: what the filters cost. Both settings run the
    whole workload once before the measured runs (kept under `first_runs`): a process's first run of a
    setting at this size stalls at its start (TTFT p50 1.1-1.5 s against 0.3 s after it, on an H100), a
    one-time cost larger than the filters' own."""
    top_k, top_p = (args.top_k, args.top_p) if args.top_k or args.top_p < 1 else (20, 0.95)
    first: dict = {}
    out: dict = {}
    for runs in (first, out):
        bench_throughput(engine, args, runs, "temperature_only", 0, 1.0)
        bench_throughput(engine, args, runs, "top_k_top_p", top_k, top_p)
    if engine.tp.is_first:
        out["ratio"] = round(out["top_k_top_p"]["output_tok_s"] / out["temperature_only"]["output_tok_s"], 4)
        out["first_runs"] = {k: {"output_tok_s": v["output_tok_s"], "ttft_p50_s": v["ttft_s"]["p50"],
                                 "kernel_compiles": v["kernel_compiles"]} for k, v in first.items()}
        res["sampling"] = out


def mixed_settings(args, top_k: int, top_p: float):
    """Request k's settings in the mixed run: greedy for even k, else --temperature with top_k/top_p; every
    third request with 5 logprobs; max_new_tokens as drawn."""
    def settings(k: int, o: int) -> SamplingParams:
        t, kk, p = (args.temperature, top_k, top_p) if k % 2 else (0.0, 0, 1.0)
        return SamplingParams(temperature=t, top_k=kk, top_p=p, max_new_tokens=o, ignore_eos=True,
                              seed=args.seed, logprobs=5 if k % 3 == 0 else 0)
    return settings


def bench_mixed(engine: Engine, args, res: dict) -> None:
    """The throughput requests with one shared setting, then with mixed per-request settings, in shared
    batches: what mixing costs. Both runs draw the same prompts and max_new_tokens."""
    top_k, top_p = (args.top_k, args.top_p) if args.top_k or args.top_p < 1 else (20, 0.95)
    out: dict = {}
    bench_throughput(engine, args, out, "shared", top_k, top_p)
    bench_throughput(engine, args, out, "mixed", settings=mixed_settings(args, top_k, top_p))
    if engine.tp.is_first:
        out["ratio"] = round(out["mixed"]["output_tok_s"] / out["shared"]["output_tok_s"], 4)
        res["mixed"] = out


def bench_n_samples(engine: Engine, args, res: dict) -> None:
    """--n-prompts x --n-samples samples (one prompt each, sampled n times), against as many separate
    prompts."""
    vocab, rng = engine.model_cfg.vocab_size, random.Random(args.seed)
    count = args.n_prompts * args.n_samples

    def params():
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              max_new_tokens=args.n_new_tokens, ignore_eos=True, seed=args.seed)

    prompts = [random_ids(rng, args.prompt_len, vocab) for _ in range(args.n_prompts)]
    runs = {"n_samples": [RequestOutput(i, list(p), params(), sample=j) for i, p in enumerate(prompts)
                          for j in range(args.n_samples)],
            "separate_prompts": [RequestOutput(k, random_ids(rng, args.prompt_len, vocab), params())
                                 for k in range(count)]}
    warm = SamplingParams(max_new_tokens=16, ignore_eos=True)  # a warm-up run first
    run_requests(engine, [RequestOutput(10_000 + k, list(p[:64]), warm) for k, p in enumerate(prompts[:8])])
    out: dict = {}
    for name, reqs in runs.items():
        empty_prefix_cache(engine)  # the warm-up used the prompts' first tokens
        t0 = time.perf_counter()
        run_requests(engine, reqs)
        wall = time.perf_counter() - t0
        n_out = sum(len(r.output_ids) for r in reqs)
        out[name] = {"output_tok_s": round(n_out / wall, 1), "seconds": round(wall, 3), "requests": len(reqs),
                     "output_tokens": n_out, "preempted": engine.num_preempted}
    if engine.tp.is_first:
        out["ratio"] = round(out["n_samples"]["output_tok_s"] / out["separate_prompts"]["output_tok_s"], 4)
        out.update(prompts=args.n_prompts, samples=args.n_samples, new_tokens=args.n_new_tokens)
        res["n8"] = out


# ---- HF transformers on the same workloads ----

def hf_model(model_dir: str, ckpt: str | None, tp: int):
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if tp > 1:
        if not ckpt:
            raise ValueError("HF with TP > 1 needs a checkpoint on disk: pass --write-checkpoint DIR")
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, tp_plan="auto")
    elif ckpt:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map={"": dev})
    else:
        cfg = AutoConfig.from_pretrained(model_dir)
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(dev):
                model = (Qwen3MoeForCausalLM if cfg.model_type == "qwen3_moe" else Qwen3ForCausalLM)(cfg)
        finally:
            torch.set_default_dtype(torch.float32)
    return model.eval(), dev


def hf_generate(model, ids: torch.Tensor, mask: torch.Tensor, n: int) -> float:
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
    sync()
    return time.perf_counter() - t0


def bench_hf(args, cfg: dict, ckpt: str | None, workloads: set[str], res: dict, tp: int) -> None:
    model, dev = hf_model(args.model, ckpt, tp)
    vocab = cfg["vocab_size"]
    out: dict = {}
    if "latency" in workloads:
        n = args.hf_new_tokens or args.new_tokens
        prompt = random_ids(random.Random(args.seed), args.prompt_len, vocab)
        ids = torch.tensor([prompt], device=dev)
        mask = torch.ones_like(ids)
        hf_generate(model, ids, mask, 4)  # warm-up
        t1 = hf_generate(model, ids, mask, 1)
        tn = hf_generate(model, ids, mask, n)
        step = (tn - t1) / (n - 1)
        out["latency"] = {"decode_tok_s": round(1 / step, 1), "ms_per_step": round(step * 1e3, 3),
                          "new_tokens": n}
    if "throughput" in workloads:
        specs = throughput_requests(args, vocab, args.num_requests, args.seed)[: args.hf_requests]
        width = max(len(p) for p, _ in specs)
        ids = torch.zeros(len(specs), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for k, (p, _) in enumerate(specs):  # left padding
            ids[k, width - len(p):] = torch.tensor(p)
            mask[k, width - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        gen = min(max(o for _, o in specs), args.hf_max_new)
        hf_generate(model, ids, mask, 2)  # warm-up
        ttft = hf_generate(model, ids, mask, 1)
        total = hf_generate(model, ids, mask, gen)
        useful = sum(min(o, gen) for _, o in specs)
        out["throughput"] = {"output_tok_s": round(useful / total, 1), "seconds": round(total, 3),
                             "requests": len(specs), "new_tokens_each": gen, "ttft_s": round(ttft, 4),
                             "tpot_ms": round((total - ttft) / (gen - 1) * 1e3, 3)}
    res["hf"] = out
    del model
    gc.collect()
    torch.cuda.empty_cache()


# ---- main ----

def set_measuring_knobs(args) -> dict:
    """The module constants behind the measuring-only flags, set before the engine is built."""
    from tp_engine import kernels
    from tp_engine.kernels import decode_attention
    from tp_engine.attention import flashinfer_backend
    from tp_engine.comm import push_all_reduce

    if args.push_chunk is not None:
        push_all_reduce.PUSH_NORM_CHUNK = args.push_chunk
    flashinfer_backend.FAST_PLAN = not args.no_fast_plan
    flashinfer_backend.SPLIT_KV = not args.no_split_kv
    kernels.PDL = not args.no_pdl
    if args.no_decode_kernel:
        decode_attention.MAX_CONTEXT = 0
    return {"push_chunk": push_all_reduce.PUSH_NORM_CHUNK, "fast_plan": flashinfer_backend.FAST_PLAN,
            "split_kv": flashinfer_backend.SPLIT_KV, "pdl": kernels.PDL,
            "decode_kernel_max_context": decode_attention.MAX_CONTEXT}


def bench_ours(args, cfg_json: dict, options: dict, workloads: set[str], world: int, res: dict,
               fp8: bool) -> None:
    """Our engine on the workloads, its figures into `res`."""
    cfg = C.build_config(None, args.overrides, **options)
    args.long_chunk = cfg["max_prefill_tokens"]  # long_prompt's chunked modes
    if "long_prompt" in workloads:  # its unchunked mode runs the whole prompt in one step: plan memory for it
        cfg["max_prefill_tokens"] = max(args.long_chunk, args.long_len + args.long_decoders)
    t0 = time.perf_counter()
    try:
        engine = Engine(cfg)
    except Exception as e:
        # out of memory is not a graph problem: the eager engine would need the same memory, and more time
        if not cfg["cuda_graph"] or world > 1 or "out of memory" in str(e):
            raise
        import traceback  # measure the eager path rather than nothing, and say why
        traceback.print_exc()
        res["cuda_graph_error"] = f"{type(e).__name__}: {e}"[:500]
        gc.collect()
        torch.cuda.empty_cache()
        cfg["cuda_graph"] = False
        t0 = time.perf_counter()
        engine = Engine(cfg)
    engine.cfg["max_prefill_tokens"] = args.long_chunk  # the other workloads' steps, as configured
    if args.force_accept is not None:
        if engine.spec is None:
            raise SystemExit("--force-accept needs --set speculative.method=...")
        engine.spec.forced_length = args.force_accept
    res["engine_init_s"] = round(time.perf_counter() - t0, 2)
    res["load_s"] = round(engine.load_seconds, 2)
    wb = engine.weight_bytes()
    expect = model_bytes(cfg_json, torch.empty((), dtype=engine.dtype).element_size(), fp8) // world
    res["weights"] = {"format": "fp8" if fp8 else "bf16", "bytes_per_rank": wb, "model_bytes_over_tp": expect,
                      "ratio": round(wb / expect, 4)}
    if torch.cuda.is_available():
        res["weights"]["gpu_allocated_after_start"] = torch.cuda.memory_allocated()
        if engine.memory is not None:  # the start-up memory plan, and what the CUDA graphs took in the end
            res["memory_plan"] = {**vars(engine.memory), "graph_bytes_measured": engine.graph_bytes,
                                  "card_bytes": torch.cuda.mem_get_info()[1]}
    res["kv_cache_tokens_per_rank"] = engine.kv.num_pages * engine.kv.page_size
    res["cuda_graph"] = engine.graphs is not None
    from tp_engine.kernels import fp8 as fp8_kernels, gemv, mlp
    res["fused_triton_kernels"] = engine.ops is not None
    res["all_reduce"] = engine.all_reduce_kind if world > 1 else None
    res["control_channel"] = "shm" if engine.tp.channel is not None else ("gloo" if world > 1 else None)
    if "latency" in workloads:
        bench_latency(engine, args, res)
        if args.profile:
            host_profile(engine, args, res)
    if "throughput" in workloads:
        bench_throughput(engine, args, res)
    if "shared_prefix" in workloads:
        bench_shared_prefix(engine, args, res)
    if "long_prompt" in workloads:
        bench_long_prompt(engine, args, res)
    if "sampling" in workloads:
        bench_sampling(engine, args, res)
    if "mixed" in workloads:
        bench_mixed(engine, args, res)
    if "n8" in workloads:
        bench_n_samples(engine, args, res)
    if engine.spec is not None:
        res["speculative"] = {**engine.cfg["speculative"], "forced_length": args.force_accept,
                              **engine.spec_summary()}
    if engine.ops is not None:  # which batch-1 matmuls run the GEMV kernel, per weight shape
        res["gemv"] = {"x".join(map(str, k[0])): str(v) for k, v in gemv._GEMV_CHOICE.items()}
        # at one token
        res["mlp_gate_up"] = {"x".join(map(str, k[0])): str(v) for k, v in mlp._CHOICE.items()}
        if fp8:  # the FP8 kernel and tile per weight shape and token-count bucket
            res["fp8_kernels"] = {f"{'x'.join(map(str, k[0]))}{f' shift {k[1]}' if k[1] else ''} m<={k[3]}"
                                  f"{' w8a8' if k[4] else ''}": str(v)
                                  for k, v in fp8_kernels._CHOICE.items()}
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if rank() == 0 else logging.WARNING,
                        format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    workloads = {"latency", "throughput", "load"} if args.workload == "all" else set(args.workload.split(","))
    if "load" in workloads and not args.write_checkpoint:
        raise SystemExit("--workload load needs --write-checkpoint DIR")
    cfg_json = json.loads((Path(args.model) / "config.json").read_text())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.memory_cap_gib:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, args.memory_cap_gib * 2**30 / torch.cuda.mem_get_info(local)[1]), local)
    res: dict = {"model": Path(args.model).name, "tp": world, "gpu": args.gpu, "workloads": sorted(workloads),
                 "date": time.strftime("%Y-%m-%d"),
                 "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                 "model_bytes": model_bytes(cfg_json), "knobs": set_measuring_knobs(args),
                 "weight_formats": args.weights, "memory_cap_gib": args.memory_cap_gib}
    ckpt = None
    try:
        # the engine would join the ranks later; the writer needs them now
        if args.write_checkpoint and world > 1:
            comm.init_distributed(comm.pick_device("auto"))
        for fmt in args.weights.split(","):
            if fmt not in ("bf16", "fp8"):
                raise SystemExit(f"--weights: unknown format {fmt!r} (bf16, fp8)")
            fp8 = fmt == "fp8"
            out = res.setdefault("fp8", {}) if fp8 else res  # bf16 figures stay where they always were
            options = {"model": fp8_config_dir(args.model) if fp8 else args.model, "load_format": "dummy",
                       "seed": args.seed}
            if args.write_checkpoint:
                path = args.write_checkpoint + ("-fp8" if fp8 else "")
                out["checkpoint_write_s"] = round(write_checkpoint(args.model, path, args.seed, fp8), 2)
                options.update(model=path, load_format="auto")
                ckpt = ckpt if fp8 else path
            if args.engine in ("ours", "both") and workloads - LLM_WORKLOADS:
                bench_ours(args, cfg_json, options, workloads, world, out, fp8)
                _checkpoint_results(args, res)
            if args.engine in ("ours", "both") and "soak" in workloads:  # an LLM of its own, after that one
                bench_soak(args, options, out)
                _checkpoint_results(args, res)
            if args.engine in ("ours", "both") and "structured" in workloads:
                bench_structured(args, options, out)
                _checkpoint_results(args, res)
            if args.engine in ("ours", "both") and "replicas" in workloads:
                bench_replicas(args, options, out, lambda vocab, n, s: throughput_requests(args, vocab, n, s))
                _checkpoint_results(args, res)
        if args.engine in ("hf", "both") and workloads & {"latency", "throughput"}:
            try:
                bench_hf(args, cfg_json, ckpt, workloads, res, world)
            except Exception as e:  # keep our figures when the baseline fails
                res["hf"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    finally:
        if rank() == 0:
            line = json.dumps(res)
            print(line, flush=True)
            if args.out:
                Path(args.out).write_text(line + "\n")
        if dist.is_initialized():
            try:
                comm.shutdown()
            except Exception:
                pass
    return 0


def _checkpoint_results(args, res: dict) -> None:
    if args.out and rank() == 0:
        Path(args.out).write_text(json.dumps(res) + "\n")


if __name__ == "__main__":
    sys.exit(main())
