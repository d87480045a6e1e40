"""GPU: engines own their choices. Two LLMs in one process, one with the fused kernels and one without, each
give the tokens a fresh LLM of their own config gives, and only the first runs the kernels.

Needs a CUDA GPU (marker `gpu`) and skips elsewhere. The checkpoint is the
tiny Qwen3 of gpu_helpers that knows its sequences by heart (tiny_ckpt).
"""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from gpu_helpers import HAS_CUDA, PARITY_PROMPTS, generate, llm, needs_flashinfer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]


@pytest.fixture
def kernel_calls(monkeypatch) -> Counter:
    """The kernels kernels.select gives, each call counted by name from here on (calls from Python: eager
    steps and captures, not graph replays)."""
    from tp_engine import kernels
    calls, real = Counter(), kernels._ops

    def counted() -> SimpleNamespace:
        def wrap(name, fn):
            def call(*args, **kwargs):
                calls[name] += 1
                return fn(*args, **kwargs)
            return call
        return SimpleNamespace(**{name: wrap(name, fn) for name, fn in vars(real()).items()})

    monkeypatch.setattr(kernels, "_ops", counted)
    return calls


def test_two_llms_with_and_without_fused_kernels_each_give_their_own_tokens(tiny_ckpt, kernel_calls):
    """`advanced.fused_kernels` on and off in two LLMs alive together, called in turn: each gives what a
    fresh LLM of its config gives alone, and the kernels run only in the calls of the one that has them (a
    process-wide choice would make the latest engine's every engine's)."""
    needs_flashinfer()
    configs = {"on": {"advanced": {"fused_kernels": "on"}}, "off": {"advanced": {"fused_kernels": "off"}}}
    work = [(PARITY_PROMPTS[:4], 12), (PARITY_PROMPTS[4:5], 20)]  # a batch of 4, then one alone
    alone = {}
    for name, options in configs.items():
        m = llm(tiny_ckpt, **options)
        alone[name] = [generate(m, prompts, max_new_tokens=n) for prompts, n in work]
        del m
        torch.cuda.empty_cache()
    engines = {name: llm(tiny_ckpt, **options) for name, options in configs.items()}
    on, off = engines["on"].engine, engines["off"].engine
    assert on.ops is not None and off.ops is None
    assert on.model.model.layers[0].self_attn.fused_qkv and not off.model.model.layers[0].self_attn.fused_qkv
    got = {"on": [], "off": []}
    for prompts, n in work:
        for name in ("off", "on"):
            before = sum(kernel_calls.values())
            got[name].append(generate(engines[name], prompts, max_new_tokens=n))
            ran = sum(kernel_calls.values()) - before
            assert (ran > 0) == (name == "on"), f"{name}: {ran} kernel calls"
    del engines, on, off
    torch.cuda.empty_cache()
    assert got == alone
