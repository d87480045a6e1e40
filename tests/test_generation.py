"""Batching, continuous admission and seeded sampling."""
import pytest
import torch

from helpers import make_checkpoint, run_cli
from tp_engine.llm import LLM
from tp_engine.sampling.sampler import SamplingParams, sample

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [8], [100, 200], list(range(40, 77)), [11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("gen") / "m", vocab=384)


@pytest.fixture(scope="module")
def alone(ckpt):
    llm = LLM(model=str(ckpt), device="cpu", sampling={"max_new_tokens": 16})
    return [llm.generate([{"input_ids": p}])[0]["output_token_ids"] for p in PROMPTS]


@pytest.mark.slow
@pytest.mark.parametrize("tp,max_batch", [(1, 256), (2, 256), (2, 2)])
def test_batch_equals_each_prompt_alone(ckpt, alone, tp, max_batch, tmp_path):
    # max_batch 2: requests join and leave the running batch while others decode (continuous batching)
    cfg = {"model": str(ckpt), "prompts": [{"input_ids": p} for p in PROMPTS], "max_batch_size": max_batch,
           "sampling": {"max_new_tokens": 16}}
    proc, lines = run_cli(cfg, tmp_path, nproc=tp if tp > 1 else 0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line["output_token_ids"] for line in lines] == alone


@pytest.mark.slow
def test_seeded_sampling_repeats_across_runs_and_tp(ckpt, tmp_path):
    sampling = {"max_new_tokens": 16, "temperature": 0.9, "top_k": 50, "top_p": 0.95}
    cfg = {"model": str(ckpt), "prompts": [{"input_ids": p} for p in PROMPTS], "seed": 7,
           "sampling": sampling}
    runs = {}
    for tp in (2, 4):
        proc, lines = run_cli(cfg, tmp_path, nproc=tp, name=f"tp{tp}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[tp] = [line["output_token_ids"] for line in lines]
    # TP=1 through the Python API, in this process: the same seed, then another seed, then greedy
    llm, prompts = LLM(model=str(ckpt), device="cpu"), [{"input_ids": p} for p in PROMPTS]
    tokens = {seed: [g["output_token_ids"]
                     for g in llm.generate(prompts, SamplingParams(seed=seed, **sampling))]
              for seed in (7, 8)}
    assert tokens[7] == runs[2] == runs[4]
    assert tokens[8] != tokens[7]  # the seed matters
    greedy = llm.generate(prompts, SamplingParams(max_new_tokens=16))
    assert [g["output_token_ids"] for g in greedy] != tokens[7]  # and it did sample


def test_sampler_distribution_and_filters():
    torch.manual_seed(0)
    logits = torch.randn(1, 6) * 1.5
    steps = 20000
    rows = logits.expand(steps, -1)
    p = SamplingParams(temperature=1.0)
    picks = sample(rows, [p] * steps, [123] * steps, list(range(steps)))
    freq = torch.bincount(picks, minlength=6).float() / steps
    torch.testing.assert_close(freq, logits.softmax(-1)[0], atol=0.015, rtol=0)
    greedy = logits.argmax(-1).item()
    assert sample(logits, [SamplingParams(temperature=1.0, top_k=1)], [1], [0]).item() == greedy
    assert sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)], [1], [0]).item() == greedy
    top2 = set(logits[0].topk(2).indices.tolist())
    got = set(sample(rows[:500], [SamplingParams(temperature=5.0, top_k=2)] * 500, [5] * 500,
                     list(range(500))).tolist())
    assert got == top2
