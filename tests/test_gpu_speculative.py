"""GPU: speculative decoding through the GPU path (flashinfer, the fused kernels, CUDA graphs for the plain
steps between speculating ones): greedy output keeps parity with transformers in fp32 (equal tokens, or a
near tie where they part) with a draft model and with n-gram lookup, and the model as its own draft has
every token accepted.

Needs a CUDA GPU (marker `gpu`). The checkpoint is the tiny Qwen3 of gpu_helpers that knows its sequences by
heart (tiny_ckpt).
"""
from __future__ import annotations

import pytest

from gpu_helpers import HAS_CUDA, PARITY_PROMPTS, assert_parity, generate, llm, needs_flashinfer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculative_greedy_keeps_parity(tiny_ckpt, hf_ref, method):
    needs_flashinfer()
    spec = {"method": method, "num_tokens": 4, "adaptive": False}
    if method == "draft":
        spec["model"] = tiny_ckpt
    m = llm(tiny_ckpt, speculative=spec)
    prompts = PARITY_PROMPTS[:6]
    ours = generate(m, prompts, max_new_tokens=24)
    counts = m.engine.spec_summary()
    plain = llm(tiny_ckpt)
    theirs = generate(plain, prompts, max_new_tokens=24)
    assert_parity(hf_ref, prompts, ours, theirs)
    assert counts["spec_share"] > 0.5
    if method == "draft":  # the model drafting for itself: every draft is the model's own pick
        assert counts["acceptance_rate"] > 0.97, counts
