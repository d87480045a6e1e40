"""GPU: logprobs on bf16 against transformers, and the top-k / top-p candidate draw on CUDA fp32 logits.

Needs a CUDA GPU (marker `gpu`); skips elsewhere. The checkpoint is a tiny Qwen3 trained until it knows
gpu_helpers.SEQUENCES by heart (peaked logits), as in test_gpu.py.
"""
from __future__ import annotations

import pytest
import torch

from gpu_helpers import DEV, HAS_CUDA, PARITY_PROMPTS, llm, memorize
from test_sampling import mixed_params, random_rows, reference
from tp_engine.sampler import SamplingParams, request_seed, sample

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

# The engine's logits come from bf16 activations and a bf16 LM head: each is rounded to 8 bits of mantissa
# (a logit near 16 to 1/16) and sums in another order move them as much again, so a log-probability, one
# logit minus a log-sum-exp, can be off by a few of those steps. The fp32 reference on the same bf16 weights
# agrees to well under this.
LOGPROB_ATOL = 0.25


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=2048,
                      tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      bos_token_id=0, eos_token_id=1, pad_token_id=0)
    return memorize(Qwen3ForCausalLM(cfg), tmp_path_factory.mktemp("tiny_qwen3_lp"))


def test_logprobs_on_bf16_are_close_to_transformers(tiny_ckpt):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).to(DEV).eval()
    engine = llm(tiny_ckpt)
    outs = engine.generate([{"input_ids": p} for p in PARITY_PROMPTS[:4]],
                           SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=5))
    checked = 0
    for prompt, out in zip(PARITY_PROMPTS, outs):
        ids = out["output_token_ids"]
        with torch.inference_mode():
            logits = ref(input_ids=torch.tensor([prompt + ids], device=DEV)).logits[0, len(prompt) - 1:-1]
        lp = torch.log_softmax(logits.double(), dim=-1).cpu()
        assert [e["token"] for e in out["logprobs"]] == ids
        for t, e in enumerate(out["logprobs"]):
            assert abs(e["logprob"] - lp[t, ids[t]].item()) < LOGPROB_ATOL, (t, e["logprob"], lp[t, ids[t]].item())
            assert e["top"][0][0] == ids[t]  # greedy: the chosen token is the most likely
            values = [v for _, v in e["top"]]
            assert values == sorted(values, reverse=True) and len(values) == 5
            for i, v in e["top"]:
                assert abs(v - lp[t, i].item()) < LOGPROB_ATOL
            checked += 1
    assert checked == 48


def test_candidate_draw_equals_the_full_sort_reference_on_cuda():
    gen = torch.Generator().manual_seed(3)
    for vocab in (1000, 151936):
        n = 64 if vocab > 10000 else 400
        logits = random_rows(gen, n, vocab, DEV)
        params = mixed_params(n, vocab)
        seeds = [request_seed(9, i, i % 4) for i in range(n)]
        steps = [i % 11 for i in range(n)]
        got = sample(logits, params, seeds, steps)
        assert torch.equal(got, reference(logits, params, seeds, steps)), vocab
        # bf16-rounded logits: many exact ties
        tied = logits.to(torch.bfloat16).float()
        assert torch.equal(sample(tied, params, seeds, steps), reference(tied, params, seeds, steps)), vocab


def test_fused_draw_handles_the_top_hash_value_like_the_torch_path():
    """The fused temperature-only kernel clamps the uniform below 1 exactly as topk_sampling.noise_at does."""
    from tp_engine.kernels import select
    from tp_engine.sampler import uniform_noise

    assert select(DEV, "on") is not None  # a failed self-test is a failure here, not a skip
    vocab = 1 << 17
    seeds = [s for s in range(2000)
             if (uniform_noise(torch.tensor([s]), torch.tensor([0]), vocab) >= 1 - 2 ** -24).any()]
    assert len(seeds) >= 4
    logits = torch.randn(len(seeds), vocab, generator=torch.Generator().manual_seed(0)) * 2
    params = [SamplingParams(temperature=0.7)] * len(seeds)
    got = sample(logits.to(DEV), params, seeds, [0] * len(seeds)).cpu()
    assert torch.equal(got, sample(logits, params, seeds, [0] * len(seeds)))
