"""The KV pool's size on CUDA from the memory plan, and its messages (the measuring itself runs on the GPU,
tests/test_gpu_memory.py)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tp_engine.runtime import memory_plan
from tp_engine.runtime.memory_plan import GiB, MARGIN, MemoryPlan

DEMO = Path(__file__).resolve().parents[1] / "configs" / "models" / "demo"


def fake_engine(weights: int = 61 * GiB) -> SimpleNamespace:
    cfg = {"kv_cache": {"num_pages": None, "page_size": 16, "gpu_memory_utilization": 0.9},
           "max_prefill_tokens": 8192, "max_batch_size": 256, "cuda_graph_max_tokens": 4096,
           "cuda_graph_max_batch": 256}
    return SimpleNamespace(cfg=cfg, model_cfg=None, device=torch.device("cuda", 0), max_model_len=40960,
                           tp=SimpleNamespace(size=1, is_first=True, dp=None), weight_bytes=lambda: weights)


def test_the_kv_pool_gets_what_the_weights_step_and_graphs_leave(monkeypatch):
    """KV pages = (free - (1 - u) x total - step - graphs - margin) / page bytes, less the scratch page."""
    kv = 9 * GiB + 123
    plan = MemoryPlan(total=80 * GiB, keep_free=8 * GiB, held=61 * GiB, step=3 * GiB, graphs=2 * GiB,
                      kv=kv)
    monkeypatch.setattr(memory_plan, "measure", lambda *a: plan)
    n, got = memory_plan.num_pages(fake_engine(), per_page=1 << 20, graph_tokens=4096, graph_batch=256)
    assert got is plan and n == kv // (1 << 20) - 1


def test_no_room_for_the_kv_cache_names_every_term_and_the_keys(monkeypatch):
    """A plan that leaves nothing for the KV cache is one start-up error with the figures it came from."""
    plan = MemoryPlan(total=80 * GiB, keep_free=8 * GiB, held=66 * GiB, step=4 * GiB, graphs=2 * GiB,
                      kv=-(MARGIN + GiB // 4))
    monkeypatch.setattr(memory_plan, "measure", lambda *a: plan)
    with pytest.raises(ValueError) as err:
        memory_plan.num_pages(fake_engine(), per_page=1 << 20, graph_tokens=4096, graph_batch=256)
    assert str(err.value) == (
        "no room for the KV cache on cuda:0: of 80.00 GiB, 8.00 GiB stay free "
        "(kv_cache.gpu_memory_utilization), 66.00 GiB are in use (the weights 61.00 GiB), the largest step "
        "takes 4.00 GiB, the CUDA graphs 2.00 GiB, the margin 0.50 GiB: 0.00 GiB for the KV cache; lower "
        "max_prefill_tokens, cuda_graph_max_tokens or cuda_graph_max_batch, raise "
        "kv_cache.gpu_memory_utilization, or use more ranks or FP8 weights")


def test_a_step_budget_past_the_measured_one_is_refused():
    """The memory plan measured a step of max_prefill_tokens: a run asking for larger steps is refused by name
    before it can run out of memory."""
    from tp_engine.llm import LLM
    llm = LLM(model=str(DEMO), device="cpu", max_prefill_tokens=64)
    try:
        llm.engine.cfg["max_prefill_tokens"] = 128
        with pytest.raises(ValueError,
                           match="max_prefill_tokens 128 is larger than the 64 this engine measured"):
            llm.generate([[1, 2, 3]])
    finally:
        llm.shutdown()


def test_the_measured_step_keeps_every_position_inside_the_model(tmp_path, monkeypatch):
    """The measured step of max_prefill_tokens tokens, more than the model's max_position_embeddings, holds no
    request longer than max_model_len: a position past the model's span would read past its RoPE table (on
    the GPU an out-of-bounds read, which can fault). The step keeps its tokens and at least its rows."""
    from helpers import make_checkpoint
    from tp_engine.llm import LLM
    ckpt = make_checkpoint(tmp_path / "m", max_pos=64)
    llm = LLM(model=str(ckpt), device="cpu", max_prefill_tokens=200, max_batch_size=4)
    try:
        for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
            monkeypatch.setattr(torch.cuda, name, lambda *a: None)
        for name in ("memory_allocated", "max_memory_allocated"):
            monkeypatch.setattr(torch.cuda, name, lambda *a: 0)
        seen = []
        context = memory_plan.forward_context

        def watch(batch, *args):
            seen.append(batch)
            return context(batch, *args)
        monkeypatch.setattr(memory_plan, "forward_context", watch)
        memory_plan.profile_step(llm.engine, 200, 4, sampled=True)
    finally:
        llm.shutdown()
    (batch,) = seen
    assert sum(batch.extend_lens) == 200 and batch.size >= 4
    assert max(batch.seq_lens) <= 64 and int(batch.positions.max()) < 64, batch.seq_lens
