"""An engine's start-up steps (Engine.__init__ runs them): load the model, agree on the fused kernels,
decide on and capture the CUDA graphs."""
from __future__ import annotations

import logging
import time
from functools import partial
from types import SimpleNamespace

import torch

from tp_engine import comm
from tp_engine.attention import check_backend, make_backend
from tp_engine.attention.kv_cache import KVCache
from tp_engine.base.config import fingerprint
from tp_engine.checkpoint.model_config import ModelConfig
from tp_engine.models import compute_dtype, load_model
from tp_engine.runtime.memory_plan import gib, graph_oom, num_pages
from tp_engine.sampling.sampler import compile_draws

log = logging.getLogger("tp_engine")


def setup_model(engine) -> None:
    """Read config.json, check it against the TP size and the config, and load this rank's weights."""
    cfg, device = engine.cfg, engine.device
    engine.model_cfg = mc = ModelConfig.from_dir(cfg["model"])
    mc.check_tp(engine.tp.size)
    engine.dtype = compute_dtype(cfg["dtype"], mc, device)
    engine.max_model_len = cfg["max_model_len"] or mc.max_position_embeddings
    if engine.max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len {engine.max_model_len} is larger than the model's "
                         f"max_position_embeddings {mc.max_position_embeddings}")
    check_backend(cfg["attention_backend"], device)
    t0 = time.perf_counter()
    try:
        engine.model = load_model(mc, cfg, engine.dtype, device, engine.tp.rank)
    except RuntimeError as e:  # torch.OutOfMemoryError too: config.json's sizes, or a device too small
        if "alloc" not in str(e):
            raise
        too_big = mc.too_big(e, device, engine.tp.size, engine.dtype.itemsize)
        raise ValueError(f"{cfg['model']}/config.json: {too_big}") from None
    engine.load_seconds = time.perf_counter() - t0


def agree_on_kernels(engine, ops: SimpleNamespace | None) -> SimpleNamespace | None:
    """This rank's kernels (kernels.select) if every rank can run them, else None (the push all-reduce
    needs them on all); on rank 0 the sampler's compiled for the model's vocabulary."""
    if engine.device.type == "cuda" and not comm.all_reduce_min(int(ops is not None), engine.tp):
        if ops is not None:
            log.warning("fused Triton kernels disabled on rank %d: another rank cannot use them",
                        engine.tp.rank)
        return None
    if ops is not None and engine.device.type == "cuda" and engine.tp.is_first:  # rank 0 alone samples
        compile_draws(engine.model_cfg.vocab_size, engine.device, ops)
    return ops


def graphs_wanted(engine) -> bool:
    """Whether the engine captures CUDA graphs (decode steps; prompt steps too at TP 1)."""
    cfg = engine.cfg
    if engine.device.type != "cuda" or not cfg["cuda_graph"] or cfg["attention_backend"] == "torch":
        return False
    if engine.model_cfg.moe is not None and engine.ops is None:
        # see moe.py
        log.warning("CUDA graphs off: the MoE experts without the fused kernels cannot be captured")
        return False
    return True


def setup_cache(engine) -> bool:
    """Size the KV pool by the memory plan (the proposer's caches count per page, and the CUDA graphs about
    to be captured) and allocate it, with the attention backend. Returns whether CUDA graphs are captured."""
    cfg, device, mc = engine.cfg, engine.device, engine.model_cfg
    error = None
    page_size = cfg["kv_cache"]["page_size"]
    qkv = engine.model.model.layers[0].self_attn.qkv_proj
    engine.kv_heads_local = qkv.kv_heads
    engine.step_tokens = cfg["max_prefill_tokens"]  # the largest step, as the memory plan measured it
    graphs = graphs_wanted(engine)
    graph_tokens = 0  # piecewise_graph.py: TP 1 only
    if graphs and engine.tp.size == 1:
        graph_tokens = min(cfg["cuda_graph_max_tokens"], cfg["max_prefill_tokens"])
    graph_batch = min(cfg["cuda_graph_max_batch"], cfg["max_batch_size"]) if graphs else 0
    per_page = KVCache.bytes_per_page(mc.num_layers, page_size, qkv.kv_heads, mc.head_dim, engine.dtype)
    if engine.spec is not None:  # the proposer's caches take as many pages as the target's
        per_page += engine.spec.bytes_per_page(page_size)
    try:  # raises only past num_pages' collective, which no rank then misses: check_startup agrees
        pages, engine.memory = num_pages(engine, per_page, graph_tokens, graph_batch)
        engine.kv = KVCache(mc.num_layers, pages, page_size, qkv.kv_heads, mc.head_dim, engine.dtype, device)
    except ValueError as e:  # no room for a page, or no memory for the pages asked for
        error = e
    comm.check_startup(error, fingerprint(cfg), engine.tp)
    engine.max_batch = min(cfg["max_batch_size"], engine.kv.num_pages)  # each running request holds a page
    engine.attn = make_backend(cfg["attention_backend"], device, num_heads=qkv.q_heads,
                               num_kv_heads=qkv.kv_heads, head_dim=mc.head_dim, page_size=page_size,
                               dtype=engine.dtype, max_batch=engine.max_batch,
                               num_pages=engine.kv.num_pages, ops=engine.ops)
    return graphs


def capture_graphs(engine) -> None:
    """The decode graphs, the prompt-step pieces and the proposer's graphs; out of memory here is named, with
    what to lower."""
    from tp_engine.runtime.cuda_graph import GraphRunner, target_step
    from tp_engine.runtime.piecewise_graph import piecewise_graphs
    before = torch.cuda.memory_reserved(engine.device)
    most = min(engine.cfg["cuda_graph_max_batch"], engine.max_batch)
    try:
        engine.graphs = GraphRunner(engine, most, engine.kv, engine.attn, partial(target_step, engine))
        engine.pieces = piecewise_graphs(engine)
        if engine.spec is not None:
            engine.spec.capture_graphs(engine, most)
    except torch.cuda.OutOfMemoryError as e:  # this rank leaves at once: the others may wait in a collective
        raise comm.StartupError(graph_oom(engine, e)) from None
    torch.cuda.empty_cache()  # the warm-up steps' blocks, cached for the capture stream alone
    engine.graph_bytes = torch.cuda.memory_reserved(engine.device) - before
    if engine.tp.is_first:
        log.info("CUDA graphs hold %s", gib(engine.graph_bytes))
