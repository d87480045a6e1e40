"""GPU: logprobs on bf16 against transformers, and the top-k / top-p candidate draw on CUDA fp32 logits.

Needs a CUDA GPU (marker `gpu`); skips elsewhere. The checkpoint is a tiny Qwen3 trained until it knows
gpu_helpers.SEQUENCES by heart (peaked logits), as in test_gpu.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_helpers import (DEV, HAS_CUDA, NEAR_TIE_ABS, NEAR_TIE_REL, PARITY_PROMPTS, llm,
                         needs_flashinfer)
from helpers import free_port
from test_sampling import mixed_params, random_rows, reference
from tp_engine.sampling import sampler
from tp_engine.sampling.sampler import SamplingParams, request_seed, sample, token_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]


def logprob_tolerance(logits: torch.Tensor) -> float:
    """The engine's logits come from bf16 activations and a bf16 LM head: gpu_helpers' near-tie rule bounds
    how far one bf16 logit strays from the fp32 reference (2% of the largest logit, at least 0.1). A
    log-probability is a logit minus a log-sum-exp dominated by the largest logits, so it may stray twice
    that."""
    return 2 * max(NEAR_TIE_ABS, NEAR_TIE_REL * logits.abs().max().item())


def check_logprobs(ref, prompts, outs) -> int:
    """Greedy outputs' logprobs against the reference's log-softmax (float64); returns the entries checked."""
    checked = 0
    for prompt, out in zip(prompts, outs):
        ids = out["output_token_ids"]
        with torch.inference_mode():
            logits = ref(input_ids=torch.tensor([prompt + ids], device=DEV)).logits[0, len(prompt) - 1:-1]
        lp = torch.log_softmax(logits.double(), dim=-1).cpu()
        assert [e["token"] for e in out["logprobs"]] == ids
        for t, e in enumerate(out["logprobs"]):
            tol = logprob_tolerance(logits[t])
            want = lp[t, ids[t]].item()
            assert abs(e["logprob"] - want) < tol, (t, e["logprob"], want, tol)
            assert e["top"][0][0] == ids[t]  # greedy: the chosen token is the most likely
            values = [v for _, v in e["top"]]
            assert values == sorted(values, reverse=True) and len(values) == 5
            for i, v in e["top"]:
                assert abs(v - lp[t, i].item()) < tol
            assert sum(torch.tensor(values).exp()) <= 1 + 1e-4
            checked += 1
    return checked


def test_logprobs_on_bf16_are_close_to_transformers(tiny_ckpt, hf_ref):
    needs_flashinfer()
    engine = llm(tiny_ckpt)  # decode steps in CUDA graphs
    outs = engine.generate([{"input_ids": p} for p in PARITY_PROMPTS[:4]],
                           SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=5))
    assert check_logprobs(hf_ref, PARITY_PROMPTS, outs) == 48


@pytest.mark.multi_gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_logprobs_and_samples_at_tp2(tiny_ckpt, hf_ref, tmp_path):
    """Only rank 0 has the gathered logits: the logprobs at TP 2 are those of the whole vocabulary."""
    needs_flashinfer()
    prompts = PARITY_PROMPTS[:4]
    lines = {}
    for name, sampling in (("greedy", {"logprobs": 5}),
                           ("sampled", {"logprobs": 3, "n": 2, "temperature": 0.8, "top_k": 20,
                                        "top_p": 0.95})):
        out = tmp_path / f"{name}.jsonl"
        cfg = {"model": tiny_ckpt, "prompts": [{"input_ids": p} for p in prompts], "output": str(out),
               "sampling": {"max_new_tokens": 12, "ignore_eos": True, **sampling},
               "kv_cache": {"num_pages": 256}, "max_batch_size": 8, "cuda_graph_max_batch": 8}
        (tmp_path / f"{name}.yaml").write_text(json.dumps(cfg))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={free_port()}", "launch/generate.py", "--config",
               str(tmp_path / f"{name}.yaml"), "--quiet"]
        proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                              timeout=150, env=dict(os.environ))
        assert proc.returncode == 0, proc.stderr[-6000:]
        lines[name] = [json.loads(x) for x in out.read_text().splitlines()]
    assert check_logprobs(hf_ref, prompts, lines["greedy"]) == 48
    assert [(x["index"], x["sample"]) for x in lines["sampled"]] == \
        [(i, j) for i in range(4) for j in range(2)]
    for x in lines["sampled"]:
        assert [e["token"] for e in x["logprobs"]] == x["output_token_ids"]
        assert all(len(e["top"]) == 3 and e["logprob"] <= e["top"][0][1] + 1e-6 for e in x["logprobs"])


def test_candidate_draw_equals_the_full_sort_reference_on_cuda():
    from tp_engine.kernels import select

    ops = select(DEV, "on")  # a failed self-test is a failure here, not a skip
    gen = torch.Generator().manual_seed(3)
    for vocab in (1000, 151936):
        n = 64 if vocab > 10000 else 400
        logits = random_rows(gen, n, vocab, DEV)
        params = mixed_params(n, vocab)
        seeds = [request_seed(9, i, i % 4) for i in range(n)]
        steps = [i % 11 for i in range(n)]
        got = sample(logits, params, seeds, steps, ops)
        assert torch.equal(got, reference(logits, params, seeds, steps)), vocab
        # bf16-rounded logits: many exact ties
        tied = logits.to(torch.bfloat16).float()
        want = reference(tied, params, seeds, steps)
        assert torch.equal(sample(tied, params, seeds, steps, ops), want), vocab
        # bf16 itself, as the decode graphs return it: the kernels (not a torch fallback) read it as fp32
        bf = logits.to(torch.bfloat16)
        assert sampler._kernels(bf, ops) is not None
        assert torch.equal(sample(bf, params, seeds, steps, ops), want), vocab


def test_logprobs_rank_ties_on_cuda_as_on_the_cpu():
    """The top logprobs come from kernels/sampling.topk_candidates on CUDA: ties by id, the lower first."""
    from tp_engine.kernels import select

    ops = select(DEV, "on")  # a failed self-test is a failure here, not a skip
    gen = torch.Generator().manual_seed(4)
    logits = torch.randint(0, 4, (8, 151936), generator=gen).float()
    greedy = logits.argmax(-1)
    cpu = token_logprobs(logits, greedy, 20)
    gpu = token_logprobs(logits.to(DEV), greedy.to(DEV), 20, ops)
    assert torch.equal(gpu[1].cpu(), cpu[1]) and torch.equal(gpu[1][:, 0].cpu(), greedy)
    torch.testing.assert_close(gpu[2].cpu(), cpu[2])


def test_qwen3_sampling_through_the_topk_kernel_equals_the_cpu_reference():
    """temperature 0.6, top_k 20, top_p 0.95 (Qwen3's generation_config.json): every row's candidates come
    from kernels/sampling.topk_candidates; the draws equal the CPU full-sort reference, bf16 ties included."""
    from tp_engine.kernels import select

    ops = select(DEV, "on")  # a failed self-test is a failure here, not a skip
    assert ops is not None
    gen = torch.Generator().manual_seed(5)
    n, vocab = 64, 151936
    logits = random_rows(gen, n, vocab)
    params = [SamplingParams(temperature=0.6, top_k=20, top_p=0.95)] * n
    seeds = [request_seed(1, i) for i in range(n)]
    for step in range(2):
        for rows in (logits, logits.to(torch.bfloat16).float()):
            got = sample(rows.to(DEV), params, seeds, [step] * n, ops).cpu()
            assert torch.equal(got, reference(rows, params, seeds, [step] * n)), step


def test_a_nan_logit_is_what_every_kernel_draw_picks():
    """As on the CPU (test_sampling.py): every fused draw, the top-k draw among the candidates included, picks
    the first NaN of a row, whatever its sign bit, in fp32 and bf16 logits, never an id past the
    vocabulary."""
    from tp_engine.kernels import select

    ops = select(DEV, "on")  # a failed self-test is a failure here, not a skip
    assert ops is not None
    vocab = 151936
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1))
    logits[:, 40000] = float("nan")
    logits[:, 7] = -torch.tensor(float("nan"))
    logits[:, 3] = 30.0
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.7, top_k=100),
              SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=0.6, top_k=20, top_p=0.95)]
    for rows in (logits.to(DEV), logits.to(DEV, torch.bfloat16)):
        assert sampler._kernels(rows, ops) is not None
        got = sample(rows, params, [11 * i for i in range(6)], [0] * 6, ops)
        assert got.tolist() == [7] * 6, (rows.dtype, got)


def test_fused_draw_handles_the_top_hash_value_like_the_torch_path():
    """The fused temperature-only kernel clamps the uniform below 1 exactly as topk_sampling.noise_at does."""
    from tp_engine.kernels import select
    from tp_engine.sampling.sampler import uniform_noise

    ops = select(DEV, "on")  # a failed self-test is a failure here, not a skip
    assert ops is not None
    vocab = 1 << 17
    seeds = [s for s in range(2000)
             if (uniform_noise(torch.tensor([s]), torch.tensor([0]), vocab) >= 1 - 2 ** -24).any()]
    assert len(seeds) >= 4
    logits = torch.randn(len(seeds), vocab, generator=torch.Generator().manual_seed(0)) * 2
    params = [SamplingParams(temperature=0.7)] * len(seeds)
    got = sample(logits.to(DEV), params, seeds, [0] * len(seeds), ops).cpu()
    assert torch.equal(got, sample(logits, params, seeds, [0] * len(seeds)))


def test_greedy_argmax_kernel_equals_torch_over_many_calls():
    """kernels/sampling.argmax merges each row's chunks in the row's last program (an atomic counter it
    resets): over calls queued back to back, with more rows than its first counters and ties, NaN and -inf
    rows, every result equals torch.argmax."""
    from tp_engine.kernels import select

    ops = select(DEV, "on")
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randn(300, 151936, generator=gen).to(DEV) * 4,
            torch.randint(0, 3, (40, 151936), generator=gen).float().to(DEV),
            torch.randn(7, 1000, generator=gen).to(DEV)]
    rows[0][3] = float("-inf")
    rows[0][4, 70000] = float("nan")
    rows[0][5, [4095, 4096, 151935]] = 100.0
    want = [x.argmax(dim=-1) for x in rows]
    got = [ops.argmax(rows[i % 3]) for i in range(60)]  # no synchronisation in between
    for i, g in enumerate(got):
        assert torch.equal(g, want[i % 3]), i
