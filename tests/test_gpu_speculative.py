"""GPU: speculative decoding through the GPU path (flashinfer, the fused kernels, CUDA graphs: the verifying
steps as one-token rows in the decode graphs, the proposer's forwards in graphs of its own): greedy output
keeps parity with transformers in fp32 (equal tokens, or a near tie where they part) with a draft model,
with n-gram lookup and with an EAGLE-3 head, and the model as its own draft has every token accepted.

Needs a CUDA GPU (marker `gpu`). The checkpoints are tiny Qwen3s of gpu_helpers that know its sequences by
heart (tiny_ckpt; four layers for the EAGLE head, which reads three).
"""
from __future__ import annotations

import pytest
import torch

from gpu_helpers import (DEV, HAS_CUDA, PARITY_PROMPTS, assert_parity, generate, llm, needs_flashinfer,
                         tiny_memorized)
from test_eagle3 import head_config, head_tensors, write_head

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
# decode graphs of up to 32 rows: six requests verifying four drafts each take 30
ROWS = {"max_batch_size": 32, "cuda_graph_max_batch": 32}


class Watch:
    """Counts what a CUDA-graph runner replays: its steps, and those that ran as one-token rows."""

    def __init__(self, runner) -> None:
        self.replays = self.split = 0
        rows, run = runner.rows, runner.run

        def rows_(batch):
            out = rows(batch)
            self.split += out is not None and out is not batch
            return out

        def run_(batch):
            self.replays += 1
            return run(batch)
        runner.rows, runner.run = rows_, run_


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A 4-layer tiny Qwen3 that knows the sequences, its fp32 reference (from disk), and an EAGLE-3 head of
    its shapes in the published layout (random weights: it drafts, the target decides)."""
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("deep")
    path = tiny_memorized(root / "target", layers=4)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEV).eval()
    cfg = head_config(hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=128, vocab_size=2048, draft_vocab_size=512,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    return path, ref, str(write_head(root / "head", cfg, head_tensors(cfg, own_embed=False)))


def test_eagle3_greedy_keeps_parity_through_the_graphs(deep):
    needs_flashinfer()
    path, ref, head = deep
    m = llm(path, speculative={"method": "eagle3", "model": head, "num_tokens": 4, "adaptive": False},
            **ROWS)
    target, drafting = Watch(m.engine.graphs), Watch(m.engine.spec.drafting.graphs)
    prompts = PARITY_PROMPTS[:6]
    ours = generate(m, prompts, max_new_tokens=24)
    counts = m.engine.spec_summary()
    assert_parity(ref, prompts, ours, generate(llm(path), prompts, max_new_tokens=24))
    assert counts["spec_share"] > 0.5
    assert target.split > 0 and drafting.replays > 0, (target.split, drafting.replays)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculative_greedy_keeps_parity(tiny_ckpt, hf_ref, method):
    needs_flashinfer()
    spec = {"method": method, "num_tokens": 4, "adaptive": False}
    if method == "draft":
        spec["model"] = tiny_ckpt
    m = llm(tiny_ckpt, speculative=spec, **ROWS)
    target = Watch(m.engine.graphs)
    drafting = Watch(m.engine.spec.drafting.graphs) if method == "draft" else None
    prompts = PARITY_PROMPTS[:6]
    ours = generate(m, prompts, max_new_tokens=24)
    counts = m.engine.spec_summary()
    assert target.split > 0  # the verifying steps replayed the decode graphs
    assert drafting is None or drafting.replays > 0
    plain = llm(tiny_ckpt)
    theirs = generate(plain, prompts, max_new_tokens=24)
    assert_parity(hf_ref, prompts, ours, theirs)
    assert counts["spec_share"] > 0.5
    if method == "draft":  # the model drafting for itself: every draft is the model's own pick
        assert counts["acceptance_rate"] > 0.97, counts
