"""Block-FP8 checkpoints on the GPU: every FP8 kernel against a bf16 matmul of the dequantized weights, inside
a CUDA graph too; greedy tokens against transformers on the dequantized weights and against the bf16 model;
CUDA-graph decode against eager decode; TP=2 against TP=1.

Marker `gpu` (and `multi_gpu` for TP=2); skipped without CUDA. The model has head_dim 128 like
tests/test_gpu.py (one flashinfer module for both), knows a few sequences by heart (peaked logits,
tests/gpu_helpers.py), and has an intermediate size of 640 (5 blocks; 2.5 per rank at TP 2).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpu_helpers import (BF16, DEV, HAS_CUDA, PARITY_PROMPTS, assert_follows, assert_parity, generate,
                         hf_greedy, llm, memorize, needs_flashinfer)

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The bf16 model, its FP8 checkpoint, and the dequantized weights in bf16 (transformers' reference)."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sys.path.insert(0, str(REPO / "launch"))
    from quantize_fp8 import quantize_checkpoint

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=2048, hidden_size=512, intermediate_size=640, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                      max_position_embeddings=2048, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      bos_token_id=0, eos_token_id=1, pad_token_id=0)
    root = tmp_path_factory.mktemp("fp8_gpu")
    memorize(Qwen3ForCausalLM(cfg), root / "bf16")
    quantize_checkpoint(str(root / "bf16"), str(root / "fp8"))
    tensors = {}
    for f in (root / "fp8").glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    dense = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = tensors[name + "_scale_inv"]
            n, k = t.shape
            t = t.float() * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        dense[name] = t.to(BF16)
    (root / "deq").mkdir()
    save_file(dense, str(root / "deq" / "model.safetensors"), metadata={"format": "pt"})
    c = json.loads((root / "fp8" / "config.json").read_text())
    del c["quantization_config"]
    (root / "deq" / "config.json").write_text(json.dumps(c))
    return {name: str(root / name) for name in ("bf16", "fp8", "deq")}


@pytest.fixture(scope="module")
def hf_deq(ckpts):
    """transformers on the dequantized weights: in bf16 (the tokens to match) and in fp32 (the judge of
    near ties)."""
    from transformers import AutoModelForCausalLM
    return {dt: AutoModelForCausalLM.from_pretrained(ckpts["deq"], dtype=dt).to(DEV).eval()
            for dt in (BF16, torch.float32)}


# ---- kernels ----

def _group_quant(x: torch.Tensor, shift: int) -> torch.Tensor:
    """The reference's per-token-group fp8 quantization of the activations (groups on the weight's k-blocks),
    returned dequantized."""
    m, k = x.shape
    nb = -(-(k + shift) // 128)
    xp = torch.zeros(m, nb * 128, device=x.device)
    xp[:, shift:shift + k] = x.float()
    xb = xp.view(m, nb, 128)
    s = xb.abs().amax(-1).clamp(min=1e-10) / 448
    q = (xb / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s[..., None]
    return q.view(m, -1)[:, shift:shift + k]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("n,k,shift,offset", [(1536, 4096, 0, 0), (4096, 1536, 64, 64), (1000, 640, 32, 40)])
def test_fp8_kernels_match_dequantized_bf16_matmul(n, k, shift, offset):
    """Every candidate of every token-count bucket: weight-only within bf16 rounding of the bf16 matmul of the
    dequantized weights; w8a8 within its own reference (the activations quantized in torch) and within fp8
    rounding of the activations of that matmul."""
    from tp_engine.kernels import fp8

    if fp8.triton is None:
        pytest.skip("Triton is not available")
    g = torch.Generator(device=DEV).manual_seed(0)
    w = (torch.randn(n, k, device=DEV, generator=g) * 120).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale_row = ((torch.arange(n, device=DEV) + offset) // 128).to(torch.int32)
    scale = torch.rand((n - 1 + offset) // 128 + 1, -(-(k + shift) // 128), device=DEV,
                       generator=g) / 3000 + 1e-5
    align = 128 if offset % 128 == 0 else offset & -offset
    deq = fp8.dequantize(w, scale, scale_row, shift, BF16)
    for m in (1, 3, 16, 40, 100, 300, 1000):
        x = torch.randn(m, k, device=DEV, generator=g).to(BF16)
        ref = F.linear(x, deq)
        ref8 = F.linear(_group_quant(x, shift), deq.float())
        for a8 in (False, True):
            for choice in fp8._candidates(fp8._bucket(m), a8):
                out = fp8._run(choice, x, w, scale, scale_row, shift, align, a8)
                weight_only = not a8 or choice[0] in ("gemv", "dequant")
                if weight_only:
                    assert _rel(out, ref) < 5e-3, (m, choice)
                else:
                    assert _rel(out, ref8) < 5e-3, (m, choice)
                    assert _rel(out, ref) < 5e-2, (m, choice)
            out = fp8.linear(x, w, scale, scale_row, shift, align, a8)  # the timed choice
            # with w8a8, one token may run the weight-only GEMV or the w8a8 GEMM, whichever is faster
            assert min(_rel(out, ref8) if a8 else 1.0, _rel(out, ref) if not a8 or m == 1 else 1.0) < 5e-3


def test_fp8_linear_in_a_cuda_graph():
    from tp_engine.kernels import fp8

    if fp8.triton is None:
        pytest.skip("Triton is not available")
    g = torch.Generator(device=DEV).manual_seed(1)
    n, k = 3072, 1024
    w = (torch.randn(n, k, device=DEV, generator=g) * 120).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale_row = (torch.arange(n, device=DEV) // 128).to(torch.int32)
    scale = torch.rand(n // 128, k // 128, device=DEV, generator=g) / 3000 + 1e-5
    xs = {m: torch.zeros(m, k, device=DEV, dtype=BF16) for m in (1, 8)}
    for a8 in (False, True):
        for m, x in xs.items():
            fp8.linear(x, w, scale, scale_row, 0, 128, a8)  # chooses outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outs = {m: fp8.linear(x, w, scale, scale_row, 0, 128, a8) for m, x in xs.items()}
        for _ in range(2):
            for x in xs.values():
                x.copy_(torch.randn(x.shape, device=DEV, generator=g))
            graph.replay()
            for m, x in xs.items():
                assert torch.equal(outs[m], fp8.linear(x, w, scale, scale_row, 0, 128, a8)), (m, a8)


def test_fp8_linear_after_a_norm_times_each_candidate_after_one(monkeypatch):
    """With after_norm (the Q/K/V projection), every candidate of the one-token choice is timed after an add +
    RMSNorm, as in a decode step; without it, none is. The two choices are kept apart, and both compute the
    dequantized matmul."""
    from tp_engine.kernels import fp8, norm

    if fp8.triton is None:
        pytest.skip("Triton is not available")
    calls = []
    real = norm.add_rmsnorm
    monkeypatch.setattr(norm, "add_rmsnorm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(fp8, "_CHOICE", {})
    g = torch.Generator(device=DEV).manual_seed(2)
    n, k = 1536, 1024
    w = (torch.randn(n, k, device=DEV, generator=g) * 120).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale_row = (torch.arange(n, device=DEV) // 128).to(torch.int32)
    scale = torch.rand(n // 128, k // 128, device=DEV, generator=g) / 3000 + 1e-5
    x = torch.randn(1, k, device=DEV, generator=g).to(BF16)
    ref = F.linear(x.float(), fp8.dequantize(w, scale, scale_row, 0, torch.float32))
    plain = fp8.linear(x, w, scale, scale_row, 0, 128, False)
    assert not calls and len(fp8._CHOICE) == 1
    after = fp8.linear(x, w, scale, scale_row, 0, 128, False, after_norm=True)
    candidates = len(fp8._candidates(1, False))
    assert len(calls) >= 3 * candidates and len(fp8._CHOICE) == 2  # 26 calls a timed candidate
    for out in (plain, after):
        assert _rel(out, ref) < 5e-3


# ---- whole engine ----

def test_fp8_greedy_matches_transformers_on_dequantized_weights(ckpts, hf_deq):
    needs_flashinfer()
    m = llm(ckpts["fp8"])
    ours = generate(m, PARITY_PROMPTS, max_new_tokens=12)
    del m
    torch.cuda.empty_cache()
    assert_parity(hf_deq[torch.float32], PARITY_PROMPTS, ours, hf_greedy(hf_deq[BF16], PARITY_PROMPTS, 12))


@pytest.mark.parametrize("kind", ["fused", "paired"])
def test_fp8_mlp_through_the_fused_gate_up_kernel_matches_transformers(ckpts, hf_deq, kind, monkeypatch):
    """Every MLP's FP8 gate/up and silu * up in one kernel (kernels/mlp.py: the experts' kernel, or the FP8
    GEMV taking gate and up rows in pairs), whatever the timing would pick: the tokens of transformers on the
    dequantized weights, up to near ties."""
    needs_flashinfer()
    from tp_engine.kernels import mlp
    kernel, calls = getattr(mlp, kind), []
    monkeypatch.setattr(mlp, "_CHOICE", {})
    monkeypatch.setattr(mlp, "_choose",
                        lambda x, w, fp8: [c for c in mlp.candidates(fp8) if c[0] == kind][-1])
    monkeypatch.setattr(mlp, kind, lambda *a, **k: calls.append(a[3] is not None) or kernel(*a, **k))
    m = llm(ckpts["fp8"])
    ours = [generate(m, [p], max_new_tokens=12)[0] for p in PARITY_PROMPTS]  # batch 1, where it runs
    del m
    torch.cuda.empty_cache()
    assert calls and all(calls), "the fused FP8 kernel did not run"
    assert_parity(hf_deq[torch.float32], PARITY_PROMPTS, ours, hf_greedy(hf_deq[BF16], PARITY_PROMPTS, 12))


@pytest.mark.parametrize("gemm", ["weight_only", "w8a8"])
def test_fp8_graph_decode_equals_eager_and_follows_bf16(ckpts, gemm, monkeypatch):
    """CUDA-graph decode with flashinfer's attention runs the kernels eager decode runs, on the same shapes:
    the same tokens (batch sizes that are captured sizes). On this peaked model the FP8 weights (and w8a8's
    fp8 activations) leave the greedy tokens of the bf16 model as they are, up to rare near ties."""
    needs_flashinfer()
    from tp_engine.kernels import decode_attention
    bound = decode_attention.MAX_CONTEXT
    four, one = PARITY_PROMPTS[:4], PARITY_PROMPTS[4:5]
    runs = {}
    for name, path, graphs in (("graph", ckpts["fp8"], True), ("eager", ckpts["fp8"], False),
                               ("bf16", ckpts["bf16"], True)):
        monkeypatch.setattr(decode_attention, "MAX_CONTEXT", 0 if name == "graph" else bound)
        m = llm(path, cuda_graph=graphs, advanced={"fp8_gemm": gemm})
        assert (m.engine.graphs is not None) == graphs
        runs[name] = generate(m, four) + generate(m, one, max_new_tokens=30)
        del m
        torch.cuda.empty_cache()
    assert runs["graph"] == runs["eager"]
    assert_follows(runs["graph"], runs["bf16"], "FP8 follows bf16")


@pytest.mark.multi_gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fp8_tp2_matches_tp1(ckpts, hf_deq, tmp_path):
    """At TP 2 the intermediate shards cut a 128-block (320 rows each): the same tokens as TP 1 up to near
    ties."""
    from test_gpu import CLI_PROMPTS, _run_cli
    needs_flashinfer()
    one = _run_cli(tmp_path, ckpts["fp8"], 1, "fp8_tp1")
    two = _run_cli(tmp_path, ckpts["fp8"], 2, "fp8_tp2")
    assert_parity(hf_deq[torch.float32], CLI_PROMPTS, two, one)
    eager = _run_cli(tmp_path, ckpts["fp8"], 2, "fp8_tp2_eager", {"cuda_graph": False})
    # the graphs' attention is the decode kernel (kernels/decode_attention.py), eager decode flashinfer's
    assert_parity(hf_deq[torch.float32], CLI_PROMPTS, two, eager)
