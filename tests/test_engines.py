"""Each engine owns its choices: several LLMs in one process, each with its own dtype and kernels, do not see
each other's; the layers run the kernels their engine gave them, never a module-level choice."""
from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import make_moe_checkpoint
from tp_engine import kernels
from tp_engine.base.batch import Batch, forward_context, get_context
from tp_engine.layers.moe import experts_reference
from tp_engine.llm import LLM
from tp_engine.models.qwen3 import Qwen3ForCausalLM
from tp_engine.sampling.sampler import SamplingParams
from tp_engine.sampling.topk_sampling import top_ids

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "models" / "demo")
PROMPTS = [[{"input_ids": [5, 17, 300, 42, 8]}, {"input_ids": [1, 2, 3]}],  # two generate calls
           [{"input_ids": list(range(40, 70))}]]
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2)  # logprobs: the dtype shows in them


class CpuKernels:
    """The interface of the fused kernels (kernels.select's object) in torch on the CPU, with the arithmetic
    of the torch code each replaces: an engine given these computes what it computes without them, and
    `calls` says which engine ran them."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()

    def linear(self, x, w, replicated=False):
        self.calls["linear"] += 1
        return F.linear(x, w)

    def add_rmsnorm(self, x, residual, w, eps):
        self.calls["add_rmsnorm"] += 1
        s = x if residual is None else x + residual
        h = s.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype), s

    def silu_mul(self, x):
        self.calls["silu_mul"] += 1
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gate_up_silu(self, x, w, fp8):
        self.calls["gate_up_silu"] += 1
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        return F.silu(gate) * up

    def argmax(self, logits):
        self.calls["argmax"] += 1
        return logits.argmax(dim=-1)

    def topk_candidates(self, logits, rows, temperatures, k):
        self.calls["topk_candidates"] += 1
        return top_ids(logits[rows].float() / temperatures[:, None], k)

    def resolve_tokens(self, ids, last, slots=None):
        self.calls["resolve_tokens"] += 1
        assert slots is None  # the graphs' form, not an eager step's
        return ids.copy_(torch.where(ids >= 0, ids, last[(-1 - ids).clamp(min=0)]))

    def moe_topk_softmax(self, logits, top_k, renormalize):
        self.calls["moe_topk_softmax"] += 1
        weights, ids = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids

    def fused_moe(self, x, gate_up, down, weights, ids, scales):
        self.calls["fused_moe"] += 1
        return experts_reference(x, gate_up, down, weights, ids)


@pytest.fixture
def cpu_kernels(monkeypatch) -> list[CpuKernels]:
    """`advanced.fused_kernels: on` gives an engine on the CPU a CpuKernels of its own (listed here, in
    order); auto and off the torch code, as they do."""
    made, select = [], kernels.select

    def fake_select(device, mode="auto", fp8=False):
        if mode != "on":
            return select(device, mode, fp8)
        made.append(CpuKernels())
        return made[-1]

    monkeypatch.setattr(kernels, "select", fake_select)
    return made


FP32 = dict(model=DEMO, device="cpu", dtype="float32")
BF16_KERNELS = dict(model=DEMO, device="cpu", dtype="bfloat16", advanced={"fused_kernels": "on"})


def outputs(llm: LLM, prompts: list) -> list[tuple]:
    return [(o["output_token_ids"], o["logprobs"]) for o in llm.generate(prompts, GREEDY)]


def check_two_engines(made: list[CpuKernels]) -> None:
    """A float32 LLM without kernels and a bfloat16 LLM with kernels (CpuKernels), alive together and called
    in turn, give the tokens (and logprobs) each gives alone; the kernels run in the second's calls only."""
    alone = {}
    for name, opts in (("fp32", FP32), ("bf16", BF16_KERNELS)):
        llm = LLM(**opts)
        alone[name] = [outputs(llm, p) for p in PROMPTS]
        llm.shutdown()
    fp32, bf16 = LLM(**FP32), LLM(**BF16_KERNELS)
    ops = made[-1]
    got = {"fp32": [], "bf16": []}
    try:
        for prompts in PROMPTS:
            before = sum(ops.calls.values())
            got["fp32"].append(outputs(fp32, prompts))
            assert sum(ops.calls.values()) == before, f"float32 engine ran the other's kernels: {ops.calls}"
            got["bf16"].append(outputs(bf16, prompts))
            assert sum(ops.calls.values()) > before
    finally:
        fp32.shutdown()
        bf16.shutdown()
    assert alone["fp32"] != alone["bf16"]  # the dtypes give other logprobs: a mix-up would show
    assert got == alone
    assert set(ops.calls) == {"linear", "add_rmsnorm", "gate_up_silu", "argmax", "topk_candidates",
                              "resolve_tokens"}, ops.calls


def test_two_llms_with_other_dtypes_and_kernels_each_give_their_own_tokens(cpu_kernels):
    check_two_engines(cpu_kernels)


def test_the_two_llm_check_fails_when_the_kernel_choice_is_one_per_process(cpu_kernels, monkeypatch):
    """The check above fails when the latest engine's kernel choice is every engine's, as a process-wide
    switch makes it: here `bind` sets it on the layer classes, for every model of the process."""
    def process_wide(model, ops, fused_qkv):
        for module in model.modules():
            if hasattr(type(module), "ops"):
                monkeypatch.setattr(type(module), "ops", ops)  # undone after the test

    monkeypatch.setattr(Qwen3ForCausalLM, "bind", process_wide)
    with pytest.raises(AssertionError, match="ran the other's kernels"):
        check_two_engines(cpu_kernels)


def test_layers_run_the_kernels_their_engine_gave_them(cpu_kernels, monkeypatch, tmp_path):
    """A Qwen3-MoE engine with kernels runs them in every layer kind (norms, matmuls, MLP, router, experts)
    and in the sampler and the step's token references; kernels installed where the kernels module once kept
    its process-wide choice are never called, by this engine or by one without kernels."""
    elsewhere = CpuKernels()
    monkeypatch.setattr(kernels, "_CHOSEN", {"ops": elsewhere}, raising=False)
    monkeypatch.setattr(kernels, "fused_ops", lambda device: elsewhere, raising=False)
    moe = str(make_moe_checkpoint(tmp_path / "moe", mlp_only_layers=(1,)))
    prompts = PROMPTS[0]
    plain = LLM(model=moe, device="cpu")
    want = outputs(plain, prompts)
    fused = LLM(model=moe, device="cpu", advanced={"fused_kernels": "on"})
    assert outputs(fused, prompts) == want
    assert outputs(plain, prompts) == want
    fused.shutdown()
    plain.shutdown()
    ops = cpu_kernels[-1]
    assert set(ops.calls) == {"linear", "add_rmsnorm", "gate_up_silu", "argmax", "topk_candidates",
                              "resolve_tokens", "moe_topk_softmax", "fused_moe"}, ops.calls
    assert not elsewhere.calls, elsewhere.calls


class Recorder:
    """An attention backend that records which path each layer took, and asks nothing more of the model."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def forward(self, layer, q, k, v, kv_cache, batch):
        self.paths.append("torch")
        return torch.zeros_like(q)

    def forward_qkv(self, layer, qkv, attn, kv_cache, batch):
        self.paths.append("fused")
        return qkv.new_zeros(qkv.shape[0], attn.heads, attn.head_dim)


@pytest.mark.parametrize("fused", [False, True])
def test_the_model_takes_the_attention_path_it_was_bound_to(fused, tmp_path):
    """Whether attention fuses the Q/K norm, RoPE and the K/V write is told to the model once (`bind`); each
    layer then takes that path whatever the backend object of a step says of itself."""
    from helpers import make_checkpoint
    from tp_engine.checkpoint.model_config import ModelConfig
    from tp_engine.models import build_model

    model = build_model(ModelConfig.from_dir(str(make_checkpoint(tmp_path / "m"))))
    model.bind(None, fused_qkv=fused)
    attn, ids = Recorder(), torch.tensor([3, 1, 4])
    batch = Batch(True, ids, torch.arange(3), torch.arange(3), [3], [3], [[0]], torch.tensor([2]))
    attn.fuses_qkv = not fused  # what the backend says of itself is not asked
    with forward_context(batch, None, attn):
        model(ids)
    assert attn.paths == ["fused" if fused else "torch"] * 2


def test_forward_context_belongs_to_the_thread_that_set_it():
    """Two engines running steps in two threads at once: each thread's layers read its own step, and none is
    left behind when the step ends."""
    z = torch.zeros(1, dtype=torch.long)
    batches = [Batch(False, z, z, z, [1], [1], [[0]], z) for _ in range(2)]
    inside, seen = threading.Barrier(2), [None, None]

    def step(i: int) -> None:
        with forward_context(batches[i], None, None):
            inside.wait(timeout=10)  # both threads are inside a step now
            seen[i] = get_context().batch
            inside.wait(timeout=10)

    threads = [threading.Thread(target=step, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen[0] is batches[0] and seen[1] is batches[1]
    assert get_context() is None


def test_the_all_reduce_is_set_up_at_start_up_without_cuda_graphs(monkeypatch):
    """The engine sets up its all-reduce for small messages once at start-up, on its own group, with or
    without CUDA graphs (the CPU has none: its collectives stay with gloo)."""
    from tp_engine import comm
    calls, enable = [], comm.enable_fast_all_reduce

    def spy(tp, dtype, fused, choice="auto", timeout_s=300.0, **kw):
        calls.append((tp, fused, choice))
        return enable(tp, dtype, fused, choice, timeout_s, **kw)

    monkeypatch.setattr(comm, "enable_fast_all_reduce", spy)
    llm = LLM(model=DEMO, device="cpu", cuda_graph=False, advanced={"all_reduce": "push"})
    assert calls == [(llm.engine.tp, False, "push")]
    assert llm.engine.all_reduce_kind == "nccl" and llm.engine.tp.fast_all_reduce is None
    llm.shutdown()
