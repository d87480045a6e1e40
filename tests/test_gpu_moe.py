"""Qwen3-MoE on the GPU: the fused MoE kernels against the torch reference (FP8 experts too), bf16 greedy
parity with transformers, CUDA-graph decode against eager (an FP8 checkpoint too), and TP=2 against TP=1.

Every test needs a CUDA GPU (marker `gpu`; the TP=2 one also `multi_gpu`) and skips elsewhere. The checkpoint
is a tiny Qwen3-MoE written by transformers, with head_dim 128, 4 query and 2 KV heads like
tests/test_gpu.py's (so both share one compiled flashinfer module), trained until its logits are peaked
(tests/gpu_helpers.py).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_helpers import (BF16, DEV, HAS_CUDA, PARITY_PROMPTS, assert_follows, assert_parity, generate,
                         hf_greedy, llm, memorize, needs_flashinfer)

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
PROMPTS = [[5, 17, 300, 42, 7, 99, 1000, 3], [8] * 40, list(range(100, 233)), [1500, 2, 77],
           list(range(2000, 1500, -7))]


@pytest.fixture(scope="session")
def moe_ckpt(tmp_path_factory) -> str:
    """3 layers (layer 1 dense), 16 experts, top-4, renormalised, head_dim 128; trained until it knows
    gpu_helpers.SEQUENCES (peaked logits and routing); bf16 safetensors."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                         num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[1],
                         max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    return memorize(Qwen3MoeForCausalLM(cfg), tmp_path_factory.mktemp("tiny_qwen3_moe") / "m", steps=120)


@pytest.fixture(scope="session")
def hf_moe(moe_ckpt):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(moe_ckpt, dtype=BF16).to(DEV).eval()


@pytest.fixture(scope="session")
def hf_moe_ref(moe_ckpt):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(moe_ckpt, dtype=torch.float32).to(DEV).eval()


# ---- kernels ----

def _experts(E: int, H: int, inter: int, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    gate_up = (torch.randn(E, 2 * inter, H, device=DEV, generator=g) * 0.03).to(BF16)
    down = (torch.randn(E, H, inter, device=DEV, generator=g) * 0.03).to(BF16)
    return gate_up, down, g


@pytest.mark.parametrize("n", [1, 3, 4, 5, 64, 700])
def test_fused_moe_matches_reference(n):
    """Qwen3-30B-A3B's expert shapes at TP=2 (128 experts, top-8, hidden 2048, 384 of the 768 inner rows):
    the GEMV path (n <= 4) and the grouped path agree with the torch loop to bf16 rounding."""
    pytest.importorskip("triton")
    from tp_engine.kernels import moe, moe_grouped
    from tp_engine.layers.moe import experts_reference

    gate_up, down, g = _experts(128, 2048, 384)
    x = torch.randn(n, 2048, device=DEV, generator=g).to(BF16)
    logits = (torch.randn(n, 128, device=DEV, generator=g) * 2).to(BF16)
    weights, ids = moe.topk_softmax(logits, 8, True)
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    ref_w, ref_ids = probs.topk(8, dim=-1)
    # bf16 router logits tie often (8 bits of mantissa over 128 experts), and tied experts may come in
    # another order or, at the k-th place, be another of the tied ones: the chosen probabilities must agree
    assert torch.equal(probs.gather(1, ids.long()).sort(dim=-1, descending=True).values, ref_w)
    torch.testing.assert_close(weights, (ref_w / ref_w.sum(-1, keepdim=True)).to(BF16))
    # The tolerance is what bf16 costs the torch loop itself, measured against the same loop in fp32.
    exact = experts_reference(x.float(), gate_up.float(), down.float(), weights.float(), ids)
    ref_err = (experts_reference(x, gate_up, down, weights, ids).float() - exact).abs()
    outs = {"auto": moe.fused_moe(x, gate_up, down, weights, ids)}
    if n <= moe.GEMV_MAX_TOKENS:
        outs["gemv"] = moe.moe_gemv(x, gate_up, down, weights, ids)
    for cfg in (moe_grouped.SMALL, moe_grouped.LARGE):
        outs[f"grouped BM={cfg.BM}"] = moe_grouped.moe_grouped(x, gate_up, down, weights, ids, cfg)
    for name, out in outs.items():
        err = (out.float() - exact).abs()
        assert err.max() <= 2 * ref_err.max() + 1e-6, (name, err.max().item(), ref_err.max().item())
        assert err.mean() <= 1.5 * ref_err.mean() + 1e-7, (name, err.mean().item(), ref_err.mean().item())


@pytest.mark.parametrize("n", [1, 8])
def test_fused_moe_in_a_cuda_graph(n):
    """Captured once, replayed with new tokens and new routing: equal to the eager call, bit for bit."""
    pytest.importorskip("triton")
    from tp_engine.kernels import moe

    gate_up, down, g = _experts(128, 2048, 384, seed=1)
    x = torch.zeros(n, 2048, device=DEV, dtype=BF16)
    logits = torch.zeros(n, 128, device=DEV, dtype=BF16)
    for _ in range(2):  # compile outside the capture
        moe.fused_moe(x, gate_up, down, *moe.topk_softmax(logits, 8, True))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = moe.fused_moe(x, gate_up, down, *moe.topk_softmax(logits, 8, True))
    for _ in range(3):
        x.copy_(torch.randn(n, 2048, device=DEV, generator=g))
        logits.copy_(torch.randn(n, 128, device=DEV, generator=g) * 2)
        graph.replay()
        assert torch.equal(out, moe.fused_moe(x, gate_up, down, *moe.topk_softmax(logits, 8, True)))


# ---- whole engine ----

def test_router_logits_do_not_depend_on_a_ranks_kernel_timing(monkeypatch):
    """The router is replicated: every rank must route a token alike. At one token its matmul takes one fixed
    GEMV tile, not the kernel each rank's timing picked (here: a rank whose timing chose cuBLAS)."""
    from tp_engine.kernels import gemv, select
    from tp_engine.layers.moe import TopKRouter

    router = TopKRouter(2048, 128, 8, True).to(DEV, BF16)
    router.ops = select(DEV, "on")  # as the engine binds them; a failed self-test is a failure here
    torch.nn.init.normal_(router.weight, std=0.02)
    x = torch.randn(1, 2048, device=DEV, dtype=BF16)
    monkeypatch.setitem(gemv._GEMV_CHOICE, (tuple(router.weight.shape), BF16, DEV.index), "torch")
    expected = gemv._gemv(x, router.weight, gemv.REPLICATED_CONFIG)
    seen = []
    monkeypatch.setattr(gemv, "_gemv", lambda *a: seen.append(a[2]) or expected)
    router(x)
    assert seen == [gemv.REPLICATED_CONFIG]


def test_bf16_greedy_matches_hf(moe_ckpt, hf_moe, hf_moe_ref):
    needs_flashinfer()
    m = llm(moe_ckpt)
    ours = generate(m, PARITY_PROMPTS, max_new_tokens=12)
    del m
    torch.cuda.empty_cache()
    assert_parity(hf_moe_ref, PARITY_PROMPTS, ours, hf_greedy(hf_moe, PARITY_PROMPTS, 12))


def test_cuda_graph_decode_matches_eager(moe_ckpt, hf_moe_ref, monkeypatch):
    """Batches of a captured size (4: the GEMV path; 8: the grouped path) run the same kernels on the same
    shapes with and without graphs (flashinfer's attention in the graphs too): equal token for token. A padded
    batch (5 -> 8) must agree up to near ties."""
    needs_flashinfer()
    from tp_engine.kernels import decode_attention
    monkeypatch.setattr(decode_attention, "MAX_CONTEXT", 0)
    eight = PROMPTS + [[3, 1, 4], [1000] * 9, list(range(7, 70, 3))]
    results = {}
    for graphs in (True, False):
        m = llm(moe_ckpt, cuda_graph=graphs)
        assert (m.engine.graphs is not None) == graphs
        results[graphs] = {"four": generate(m, PROMPTS[:4]),
                           "one": generate(m, PROMPTS[4:], max_new_tokens=20),
                           "eight": generate(m, eight), "sampled": generate(m, PROMPTS[:4], temperature=0.8),
                           "padded5": generate(m, PROMPTS)}
        del m
        torch.cuda.empty_cache()
    g, e = results[True], results[False]
    for key in ("four", "one", "eight", "sampled"):
        assert g[key] == e[key], key
    assert_parity(hf_moe_ref, PROMPTS, g["padded5"], e["padded5"])


def test_experts_without_the_fused_kernels_run_with_cuda_graph_on(moe_ckpt, hf_moe, hf_moe_ref):
    """`advanced.fused_kernels: off` (or Triton missing): the torch experts read their token counts on the
    host, which a capture refuses, so with cuda_graph on (the default) the graphs stay off for such a model,
    start-up succeeds on every rank, and its tokens follow transformers'."""
    needs_flashinfer()
    m = llm(moe_ckpt, cuda_graph=True, advanced={"fused_kernels": "off"})
    assert m.engine.graphs is None and m.engine.pieces is None
    ours = generate(m, PARITY_PROMPTS, max_new_tokens=12)
    del m
    torch.cuda.empty_cache()
    assert_parity(hf_moe_ref, PARITY_PROMPTS, ours, hf_greedy(hf_moe, PARITY_PROMPTS, 12))


@pytest.mark.parametrize("n", [1, 5, 64])
def test_fused_moe_fp8_experts_match_their_dequantized_values(n):
    """FP8 experts, dequantized in registers, at Qwen3-30B-A3B's shapes at TP=4, rank 1: 192 inner rows from
    row 192, so the scale row changes inside a part and down's columns start 64 into a block. The grouped path
    (n > 4) computes on exactly the dequantized bf16 values: the tolerance of the bf16 test above. The GEMV
    path scales the activations instead, so the weights skip their rounding to bf16 (2**-9 of each)."""
    pytest.importorskip("triton")
    from tp_engine.kernels import moe
    from tp_engine.kernels.moe_grouped import ExpertScales
    from tp_engine.layers.fp8 import ScaleLayout
    from tp_engine.layers.linear import ColRange, RowPart
    from tp_engine.layers.moe import experts_reference

    E, H, full, r, inner = 128, 2048, 768, 1, 192
    gu_lay = ScaleLayout({"gate": RowPart(0, inner, r * inner, full),
                          "up": RowPart(inner, inner, r * inner, full)}, ColRange(0, H, H))
    dn_lay = ScaleLayout({"down": RowPart(0, H, 0, H)}, ColRange(r * inner, inner, full))
    assert dn_lay.k_shift == 64 and gu_lay.row_align == 64
    g = torch.Generator(device=DEV).manual_seed(1)
    fp8 = torch.float8_e4m3fn
    gu_w = (torch.randn(E, 2 * inner, H, device=DEV, generator=g) * 60).clamp(-448, 448).to(fp8)
    dn_w = (torch.randn(E, H, inner, device=DEV, generator=g) * 60).clamp(-448, 448).to(fp8)
    gu_s = torch.rand(E, gu_lay.rows, gu_lay.col_blocks[1], device=DEV, generator=g) / 3000 + 1e-5
    dn_s = torch.rand(E, dn_lay.rows, dn_lay.col_blocks[1], device=DEV, generator=g) / 3000 + 1e-5
    scales = ExpertScales(gu_s, gu_lay.scale_row.to(DEV), dn_s, dn_lay.scale_row.to(DEV), dn_lay.k_shift,
                          gu_lay.row_align)
    gu_deq = torch.stack([gu_lay.dequantize(gu_w[e], gu_s[e], BF16) for e in range(E)])
    dn_deq = torch.stack([dn_lay.dequantize(dn_w[e], dn_s[e], BF16) for e in range(E)])
    x = torch.randn(n, H, device=DEV, generator=g).to(BF16)
    weights, ids = moe.topk_softmax((torch.randn(n, E, device=DEV, generator=g) * 2).to(BF16), 8, True)
    exact = experts_reference(x.float(), gu_deq.float(), dn_deq.float(), weights.float(), ids)
    out = moe.fused_moe(x, gu_w, dn_w, weights, ids, scales).float()
    assert gu_w.dtype == fp8  # nothing was dequantized on the way
    if n > moe.GEMV_MAX_TOKENS:
        ref_err = (experts_reference(x, gu_deq, dn_deq, weights, ids).float() - exact).abs()
        err = (out - exact).abs()
        assert err.max() <= 2 * ref_err.max() + 1e-6 and err.mean() <= 1.5 * ref_err.mean() + 1e-7
    else:
        assert float((out - exact).norm() / exact.norm()) < 0.02


def test_fp8_moe_checkpoint_keeps_fp8_experts(moe_ckpt, tmp_path_factory, monkeypatch):
    """The FP8 version of the memorized model: on the GPU its experts stay in fp8; CUDA-graph decode (with
    flashinfer's attention, as eager decode) equals eager; the greedy tokens follow the bf16 model's (peaked
    logits: FP8 rounding rarely moves them)."""
    needs_flashinfer()
    from tp_engine.kernels import decode_attention
    bound = decode_attention.MAX_CONTEXT
    sys.path.insert(0, str(REPO / "launch"))
    from quantize_fp8 import quantize_checkpoint
    from tp_engine.layers import FusedMoE

    fp8_dir = tmp_path_factory.mktemp("moe_fp8") / "m"
    quantize_checkpoint(moe_ckpt, str(fp8_dir))
    runs = {}
    for name, path, graphs in (("graph", str(fp8_dir), True), ("eager", str(fp8_dir), False),
                               ("bf16", moe_ckpt, True)):
        monkeypatch.setattr(decode_attention, "MAX_CONTEXT", 0 if name == "graph" else bound)
        m = llm(path, cuda_graph=graphs)
        experts = [mod for mod in m.engine.model.modules() if isinstance(mod, FusedMoE)]
        assert experts
        assert all((e.gate_up_proj.dtype == torch.float8_e4m3fn) == (name != "bf16") for e in experts)
        assert all((e.scales is not None) == (name != "bf16") for e in experts)
        # captured batch sizes only (4 and 1: the GEMV path; 8: the grouped one): graphs and eager run alike
        eight = PROMPTS + [[3, 1, 4], [1000] * 9, list(range(7, 70, 3))]
        runs[name] = (generate(m, PROMPTS[:4]) + generate(m, PROMPTS[4:], max_new_tokens=20)
                      + generate(m, eight))
        del m
        torch.cuda.empty_cache()
    assert runs["graph"] == runs["eager"]
    assert_follows(runs["graph"], runs["bf16"], "FP8 follows bf16")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_cli(tmp_path: Path, ckpt: str, nproc: int, name: str, extra: dict | None = None) -> list[list[int]]:
    cfg = {"model": ckpt, "prompts": [{"input_ids": p} for p in PARITY_PROMPTS[:4]],
           "output": str(tmp_path / f"{name}.jsonl"),
           "sampling": {"max_new_tokens": 10, "ignore_eos": True}, "kv_cache": {"num_pages": 256},
           "max_batch_size": 8, "cuda_graph_max_batch": 8, **(extra or {})}
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={_free_port()}", "launch/generate.py", "--config", str(path), "--quiet"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=150, env=dict(os.environ))
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    lines = [json.loads(x) for x in Path(cfg["output"]).read_text().splitlines()]
    return [o["output_token_ids"] for o in sorted(lines, key=lambda o: o["index"])]


@pytest.mark.multi_gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp2_matches_tp1_greedy(moe_ckpt, hf_moe_ref, tmp_path):
    needs_flashinfer()
    one = _run_cli(tmp_path, moe_ckpt, 1, "tp1")
    two = _run_cli(tmp_path, moe_ckpt, 2, "tp2")
    assert_parity(hf_moe_ref, PARITY_PROMPTS[:4], two, one)
    eager = _run_cli(tmp_path, moe_ckpt, 2, "tp2_eager", {"cuda_graph": False})
    # the graphs' attention is the decode kernel (kernels/decode_attention.py), eager decode flashinfer's
    assert_parity(hf_moe_ref, PARITY_PROMPTS[:4], two, eager)
