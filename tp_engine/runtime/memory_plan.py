"""How many KV pages a rank gets: on CUDA, what is left of the engine's share of the card once the weights,
the largest step and the CUDA graphs have theirs.

`kv_cache.gpu_memory_utilization` (u) is the share of the card's memory the engine may hold; (1 - u) of it
stays free. Before the KV pool exists, the engine runs the largest step its configuration allows on a
scratch cache and measures what the step takes beyond the weights: `max_prefill_tokens` tokens over
min(max_batch_size, max_prefill_tokens) requests (more where one would pass max_model_len), a row of logits
each, sampled with a sort of the whole vocabulary and 20 logprobs. The CUDA graphs' memory pools are measured
the same way before they exist: the prompt-step pieces as an eager step of `cuda_graph_max_tokens` tokens,
the decode graphs as a step of their largest batch, plus the logits each decode graph keeps (and each of a
draft model's or EAGLE-3 head's graphs, whose steps are smaller than the model's). Then

    KV cache = free memory - (1 - u) x total - largest step - CUDA graph pools - MARGIN

MARGIN covers what is not measured: the graphs' executable memory and the allocator's fragmentation.
On CPU the pool is CPU_KV_BYTES (kv_cache.py) and nothing is measured.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from tp_engine import comm
from tp_engine.attention import make_backend
from tp_engine.base.batch import Batch, forward_context
from tp_engine.runtime.cuda_graph import bucket_sizes
from tp_engine.attention.kv_cache import KVCache, budget_pages, check_pool, pages_for
from tp_engine.sampling.sampler import SamplingParams, sample, token_logprobs
from tp_engine.runtime.step_message import on_device

log = logging.getLogger("tp_engine")
GiB = 2**30
MARGIN = GiB // 2  # bytes kept beyond what the plan measures


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass
class MemoryPlan:
    """What one rank's memory holds, in bytes, as measured before the KV pool is allocated."""

    total: int  # the card's memory (or the allocator's cap, when one is set)
    keep_free: int  # (1 - gpu_memory_utilization) x total
    held: int  # in use now: the weights, the CUDA context, communication buffers, other processes
    step: int  # the largest step, beyond what is held
    graphs: int  # the CUDA graph pools, estimated
    kv: int  # what is left for the KV cache (may be negative: then nothing is)

    def describe(self) -> str:
        return (f"of {gib(self.total)}, {gib(self.keep_free)} stay free (kv_cache.gpu_memory_utilization), "
                f"{gib(self.held)} are in use (the weights {{weights}}), "
                f"the largest step takes {gib(self.step)}, the CUDA graphs {gib(self.graphs)}, "
                f"the margin {gib(MARGIN)}: {gib(max(self.kv, 0))} for the KV cache")


def num_pages(engine, per_page: int, graph_tokens: int, graph_batch: int) -> tuple[int, MemoryPlan | None]:
    """The KV pool's pages on this rank, the same on every rank (the smallest), and on CUDA the plan they come
    from; `graph_tokens` and `graph_batch` are the largest prompt-step piece and decode graph the engine will
    capture (0: none)."""
    cfg = engine.cfg
    kvc = cfg["kv_cache"]
    plan = None
    if kvc["num_pages"]:
        return kvc["num_pages"], plan
    if engine.device.type != "cuda":
        most = cfg["max_batch_size"] * pages_for(engine.max_model_len, kvc["page_size"])
        n = comm.all_reduce_min(budget_pages(per_page, most), engine.tp, everywhere=True)
        check_pool(n, kvc, per_page)
    else:
        plan = measure(engine, graph_tokens, graph_batch)
        # the scratch page counted; every replica alike, so that a prompt one can run, all can
        n = comm.all_reduce_min(max(plan.kv // per_page - 1, 0), engine.tp, everywhere=True)
        if n < 1:
            raise ValueError(f"no room for the KV cache on {engine.device}: {explain(engine, plan)}; lower "
                             "max_prefill_tokens, cuda_graph_max_tokens or cuda_graph_max_batch, raise "
                             "kv_cache.gpu_memory_utilization, or use more ranks or FP8 weights")
        if engine.tp.is_first:
            log.info("GPU memory: %s", explain(engine, plan))
    if engine.tp.is_first:
        pool = n * kvc["page_size"]
        short = f"; a request holds at most {pool} of max_model_len {engine.max_model_len} tokens " \
            "(kv_cache.num_pages sets the pool)" if pool < engine.max_model_len else ""
        log.info("KV cache: %d pages of %d tokens = %d tokens per rank%s", n, kvc["page_size"], pool, short)
    return n, plan


def oom_asked(e: Exception) -> str:
    """torch's out-of-memory message, its first sentence: how much was asked and what was free (a library's
    message as it is)."""
    return str(e).split(". ")[0].strip()


def explain(engine, plan: MemoryPlan) -> str:
    return plan.describe().replace("{weights}", gib(engine.weight_bytes()))


def measure(engine, graph_tokens: int, graph_batch: int) -> MemoryPlan:
    """Run the largest step and the graphs' steps on scratch caches; the plan from what they took."""
    cfg, dev = engine.cfg, engine.device
    tokens = cfg["max_prefill_tokens"]
    rows = min(cfg["max_batch_size"], tokens)
    try:
        step = profile_step(engine, tokens, rows, sampled=True)
        graphs = 0
        if graph_tokens:  # the prompt-step pieces: the model body over their largest token count
            graphs += profile_step(engine, graph_tokens, 1, sampled=False)
        if graph_batch:  # the decode graphs: their largest batch, and the logits every graph keeps
            graphs += profile_step(engine, graph_batch, graph_batch, sampled=False)
            variants = 2 if engine.ops is not None else 1  # flashinfer's and the decode kernel's graphs
            itemsize = torch.empty((), dtype=engine.dtype).element_size()
            models = 2 if getattr(engine.spec, "proposer", None) is not None else 1  # a proposer's graphs
            kept = models * variants * sum(bucket_sizes(graph_batch))  # rows of logits
            graphs += kept * engine.model_cfg.vocab_size * itemsize
    except torch.cuda.OutOfMemoryError as e:  # a rank leaves at once: the others may wait in a collective
        free = torch.cuda.mem_get_info(dev)[0]
        raise comm.StartupError(
            f"out of memory on {dev} while measuring the largest step ({tokens} tokens over {rows} "
            f"requests: max_prefill_tokens, max_batch_size) or a CUDA graph's step (cuda_graph_max_tokens "
            f"{cfg['cuda_graph_max_tokens']}, cuda_graph_max_batch {cfg['cuda_graph_max_batch']}), with the "
            f"weights ({gib(engine.weight_bytes())}) loaded and {gib(free)} free: {oom_asked(e)}; "
            "lower those keys, or use more ranks or FP8 weights") from None
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    reserved = torch.cuda.memory_reserved(dev)
    keep_free = int((1 - cfg["kv_cache"]["gpu_memory_utilization"]) * total)
    room = free - keep_free
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(dev)
    if fraction < 1:  # the allocator refuses past its cap, whatever the card has free
        cap = int(fraction * total)
        total, keep_free = cap, int((1 - cfg["kv_cache"]["gpu_memory_utilization"]) * cap)
        room = min(room, cap - keep_free - reserved)
    held = total - keep_free - room
    return MemoryPlan(total, keep_free, held, step, graphs, room - step - graphs - MARGIN)


def step_lens(tokens: int, rows: int, longest: int) -> list[int]:
    """The requests' lengths of a step of `tokens` tokens: rows - 1 of one token, the rest in requests of at
    most `longest` (max_model_len) tokens, as a scheduler's step could hold them. A position past the model's
    span would read past its RoPE table."""
    rest = tokens - rows + 1
    return [1] * (rows - 1) + [min(longest, rest - i) for i in range(0, rest, longest)]


@torch.inference_mode()
def profile_step(engine, tokens: int, rows: int, sampled: bool) -> int:
    """Peak bytes an eager prompt step of `tokens` tokens over `rows` requests or more takes (`step_lens`), on
    a scratch KV cache that is not counted. With `sampled`, the step as the engine runs it: its attention
    backend's buffers counted, and rank 0 samples every row with a full sort of the vocabulary and takes 20
    logprobs; without, what a CUDA graph of the step holds."""
    mc, dev, S = engine.model_cfg, engine.device, engine.cfg["kv_cache"]["page_size"]
    lens = step_lens(tokens, rows, engine.max_model_len)
    rows = len(lens)
    pages = [pages_for(n, S) for n in lens]
    kv = KVCache(mc.num_layers, sum(pages), S, engine.kv_heads_local, mc.head_dim, engine.dtype, dev)
    qkv, scratch_pages = engine.model.model.layers[0].self_attn.qkv_proj, kv.num_pages

    def backend():
        return make_backend(engine.cfg["attention_backend"], dev, num_heads=qkv.q_heads,
                            num_kv_heads=qkv.kv_heads, head_dim=mc.head_dim, page_size=S, dtype=engine.dtype,
                            max_batch=rows, num_pages=scratch_pages, ops=engine.ops)

    attn = None if sampled else backend()  # a graph's pool holds no attention buffers: they are not counted
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)  # tensors, not the cache's segments: a segment still held by one
    torch.cuda.reset_peak_memory_stats(dev)  # small tensor would hide the step's use of its free part
    attn = attn or backend()
    starts = np.cumsum([0] + pages[:-1])
    tables = [np.arange(s, s + p, dtype=np.int32) for s, p in zip(starts, pages)]
    loc = np.concatenate([t[np.arange(n) // S] * S + np.arange(n) % S for t, n in zip(tables, lens)])
    gen = torch.Generator().manual_seed(0)  # spread ids: the experts' routing as a real batch spreads it
    batch = Batch(True, torch.randint(0, mc.vocab_size, (tokens,), generator=gen),
                  torch.from_numpy(np.concatenate([np.arange(n) for n in lens])), torch.from_numpy(loc),
                  lens, lens, tables, torch.from_numpy(np.cumsum(lens) - 1))
    batch = on_device(batch, dev)
    attn.prepare(batch)
    with forward_context(batch, kv, attn):
        logits = engine.model(batch.input_ids)
    if sampled and logits is not None:
        params = [SamplingParams(temperature=1.0, top_p=0.9, logprobs=20)] * rows
        tokens_out = sample(logits, params, list(range(rows)), [0] * rows, engine.ops)
        token_logprobs(logits, tokens_out, 20, engine.ops)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del attn, batch, logits, kv
    torch.cuda.empty_cache()
    return peak


def graph_oom(engine, e: Exception) -> str:
    cfg = engine.cfg
    return (f"out of memory on {engine.device} while capturing CUDA graphs (cuda_graph_max_batch "
            f"{cfg['cuda_graph_max_batch']}, cuda_graph_max_tokens {cfg['cuda_graph_max_tokens']}), "
            f"with the KV cache ({gib(engine.kv.data.numel() * engine.kv.data.element_size())}) "
            f"allocated: {oom_asked(e)}; "
            "lower kv_cache.gpu_memory_utilization or those keys, or set cuda_graph: false")


def is_oom(e: Exception) -> bool:
    """torch's out-of-memory error, or a library's (cuBLAS cannot make its handle or workspace)."""
    return isinstance(e, torch.cuda.OutOfMemoryError) or "ALLOC_FAILED" in str(e)


def step_oom(engine, batch: Batch, e: Exception) -> str:
    cfg = engine.cfg
    return (f"out of memory on {engine.device} in a step of {len(batch.input_ids)} tokens over {batch.size} "
            f"requests: {oom_asked(e)}; lower kv_cache.gpu_memory_utilization "
            f"({cfg['kv_cache']['gpu_memory_utilization']}) or max_prefill_tokens "
            f"({cfg['max_prefill_tokens']})")
