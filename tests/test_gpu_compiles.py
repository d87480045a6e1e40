"""GPU: the start-up compiles the Triton kernels a run launches, so that no run pays a compile inside it
(a compile takes about a second: a first run's stall otherwise).

Needs a CUDA GPU (marker `gpu`); skips elsewhere. The run is a process of its own: a kernel compiled by an
earlier test in this process would hide a compile.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpu_helpers import HAS_CUDA, needs_flashinfer
from helpers import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

# Mixed steps with every count of decoding rows up to ~150 beside prompt chunks of any length, and the draws
# of the three usual settings: greedy, temperature alone, and Qwen3's recommended top_k 20 / top_p 0.95.
SCRIPT = r'''
import json, sys
from triton import knobs
from tp_engine.llm import LLM
from tp_engine.sampling.sampler import SamplingParams

llm = LLM(model=sys.argv[1], kv_cache={"num_pages": 2048}, max_batch_size=160, max_prefill_tokens=256, seed=0)
compiled = []
knobs.runtime.jit_cache_hook = lambda *, fn, **_: compiled.append(fn.name)  # before a compile or a disk load
n = 150
prompts = [{"input_ids": [2 + (7 * k + j) % 2000 for j in range(3 + (13 * k) % 70)]} for k in range(n)]
settings = [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=0.6, top_k=20, top_p=0.95)]
params = [SamplingParams(max_new_tokens=20, ignore_eos=True, seed=k, **settings[k % 3]) for k in range(n)]
outs = llm.generate(prompts, params)
assert [len(o["output_token_ids"]) for o in outs] == [20] * n
llm.shutdown()
print("COMPILED " + json.dumps(compiled))
'''


def test_a_run_after_start_up_compiles_no_kernel(tiny_ckpt):
    needs_flashinfer()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tiny_ckpt], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("COMPILED ")][-1]
    assert json.loads(line[len("COMPILED "):]) == []
