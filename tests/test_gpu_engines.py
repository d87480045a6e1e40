"""GPU: engines own their choices. Two LLMs in one process, one with the fused kernels and one without, each
give the tokens a fresh LLM of their own config gives, and only the first runs the kernels; at TP 2 the engine
sets up the push all-reduce at start-up, with CUDA graphs or without.

Needs a CUDA GPU (marker `gpu`; the TP 2 test also `multi_gpu`) and skips elsewhere. The checkpoint is the
tiny Qwen3 of gpu_helpers that knows its sequences by heart (tiny_ckpt).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gpu_helpers import HAS_CUDA, PARITY_PROMPTS, assert_parity, generate, llm, needs_flashinfer
from helpers import free_port

REPO = Path(__file__).resolve().parents[1]
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


TP2_SCRIPT = """
import json, os, sys
from tp_engine.comm.custom_all_reduce import _PushAllReduce
from tp_engine.llm import LLM
from tp_engine.sampling.sampler import SamplingParams

m = LLM(model=sys.argv[1], cuda_graph=False, kv_cache={"num_pages": 256}, max_batch_size=8, seed=0)
outs = m.generate([{"input_ids": p} for p in json.loads(sys.argv[2])],
                  SamplingParams(max_new_tokens=10, ignore_eos=True))
report = {"kind": m.engine.all_reduce_kind, "push": isinstance(m.engine.tp.fast_all_reduce, _PushAllReduce),
          "tokens": None if outs is None else [o["output_token_ids"] for o in outs]}
with open(sys.argv[3] + os.environ["RANK"], "w") as f:
    json.dump(report, f)
m.shutdown()
"""


@pytest.mark.multi_gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp2_without_cuda_graphs_runs_the_push_all_reduce(tiny_ckpt, hf_ref, tmp_path):
    """`cuda_graph: false` at TP 2: the engine sets up the push all-reduce at start-up on its group, as with
    graphs, and its greedy tokens follow TP 1's up to near ties."""
    needs_flashinfer()
    script = tmp_path / "tp2.py"
    script.write_text(TP2_SCRIPT)
    prompts = PARITY_PROMPTS[:4]
    port = f"--master_port={free_port()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", port, str(script), tiny_ckpt,
           json.dumps(prompts), str(tmp_path / "rank")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    reports = [json.loads((tmp_path / f"rank{r}").read_text()) for r in range(2)]
    assert all(r["kind"] == "push" and r["push"] for r in reports), reports
    one = llm(tiny_ckpt)
    want = generate(one, prompts, max_new_tokens=10)
    del one
    torch.cuda.empty_cache()
    assert_parity(hf_ref, prompts, reports[0]["tokens"], want)
