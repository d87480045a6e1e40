"""The memory plan on the GPU: under an allocator cap that gives the weights the share of the card they have
on an 80 GB H100, the engine starts with its defaults and runs its largest step, CUDA graphs on, within the
cap."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_helpers import HAS_CUDA, needs_flashinfer
from tp_engine.runtime.memory_plan import MARGIN

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
REPO = Path(__file__).resolve().parents[1]
GiB = 2**30

SCRIPT = r"""
import json, logging, random, sys
import torch
from tp_engine.llm import LLM
from tp_engine.sampling.sampler import SamplingParams
logging.basicConfig(level=logging.INFO)
model, cap, max_prefill = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.mem_get_info()[1])
llm = LLM(model=model, load_format="dummy", max_prefill_tokens=max_prefill, max_model_len=2 * max_prefill)
rng = random.Random(0)
# one step of max_prefill tokens over 256 requests: 255 short prompts, and a long one whose first chunk
# fills it
prompts = [{"input_ids": [rng.randrange(1000, 100000) for _ in range(16)]} for _ in range(255)]
prompts.append({"input_ids": [rng.randrange(1000, 100000) for _ in range(max_prefill + 512)]})
params = SamplingParams(temperature=1.0, top_p=0.9, logprobs=20, max_new_tokens=16, ignore_eos=True)
outs = llm.generate(prompts, params)
e = llm.engine
print(json.dumps({"finish": sorted({o["finish_reason"] for o in outs}),
                  "peak": torch.cuda.max_memory_reserved(), "plan": vars(e.memory),
                  "graph_bytes": e.graph_bytes, "pieces": e.pieces is not None,
                  "graphs": e.graphs is not None}))
llm.shutdown()
"""


def weight_bytes(cfg: dict) -> int:
    """bf16 bytes of a Qwen3 or Qwen3-MoE config's weights (norms left out)."""
    h, v, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    attn = h * q * 2 + h * kv * 2
    if "num_experts" in cfg:
        mlp = cfg["num_experts"] * 3 * h * cfg["moe_intermediate_size"] + cfg["num_experts"] * h
    else:
        mlp = 3 * h * cfg["intermediate_size"]
    return 2 * (L * (attn + mlp) + 2 * v * h)


@pytest.mark.parametrize("name,layers,room_gib,max_prefill", [
    ("qwen3-30b-a3b", 12, 9, 8192),   # the experts' routing buffers, 256 rows of logits sampled
    ("qwen3-8b", 12, 10, 32768),      # a 32k prompt in one step
])
def test_largest_step_runs_within_a_memory_cap(tmp_path, name, layers, room_gib, max_prefill):
    """Under an allocator cap of the weights and a few GiB, the plan leaves room for the largest step and the
    graphs and gives the KV pool all the rest: every request finishes and the allocator's peak stays under the
    cap (an estimate short of what a step or the graphs take would run out of memory here)."""
    needs_flashinfer()
    cfg = json.loads((REPO / "configs" / "models" / name / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = layers
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], 2 * max_prefill)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    cap = weight_bytes(cfg) + room_gib * GiB
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(cap), str(max_prefill)],
                          capture_output=True, text=True, timeout=400, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["finish"] == ["length"] and got["graphs"], got
    assert got["peak"] <= cap, (got["peak"] / GiB, cap / GiB)
    # the graphs' estimate, with the margin kept for what it leaves out (flashinfer's per-wrapper buffers, the
    # pools' rounding), covers what the captured graphs hold
    assert got["plan"]["kv"] > 0 and got["graph_bytes"] <= got["plan"]["graphs"] + MARGIN, got
    assert "GPU memory: of" in proc.stderr and "CUDA graphs hold" in proc.stderr


OOM_SCRIPT = r"""
import sys, torch
from tp_engine.llm import LLM
from tp_engine.sampling.sampler import SamplingParams
llm = LLM(model=sys.argv[1], load_format="dummy", max_prefill_tokens=16384)
llm.generate([[1000, 1001]], SamplingParams(max_new_tokens=1))
torch.cuda.empty_cache()  # from here on, 64 MiB more than is held: a 16k-token step cannot fit
held = torch.cuda.memory_reserved() + (64 << 20)
torch.cuda.set_per_process_memory_fraction(held / torch.cuda.mem_get_info()[1])
try:
    llm.generate([{"input_ids": list(range(1000, 17000))}], SamplingParams(max_new_tokens=1))
except RuntimeError as e:
    print(e)
"""


def test_a_step_that_runs_out_of_memory_names_the_step_and_the_keys():
    """Memory taken after start-up (here by a cap) leaves a long step none: its error names the step and what
    to lower, not the allocator's traceback."""
    needs_flashinfer()
    proc = subprocess.run([sys.executable, "-c", OOM_SCRIPT, str(REPO / "configs" / "models" / "qwen3-0.6b")],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert re.match(r"out of memory on cuda:0 in a step of 16000 tokens over 1 requests: .*; lower "
                    r"kv_cache.gpu_memory_utilization \(0.9\) or max_prefill_tokens \(16384\)$",
                    proc.stdout.strip()), proc.stdout
