"""Block-FP8 checkpoints on CPU: the quantizer's format, each rank's shard of the weights and of the scale
grid (shards that cut through 128-blocks, KV heads replicated), greedy tokens against transformers in float64
on the dequantized weights at TP 1, 2 and 4 through the Python API, and the loader's errors.

The model's shapes make every TP split cut blocks: hidden 192 (1.5 blocks), q 8 x 48 = 384 rows, k and v
2 x 48 = 96 rows, intermediate 640 (5 blocks; 320 and 160 rows per rank).
"""
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import api_outputs, make_checkpoint
from tp_engine import comm
from tp_engine.comm import StartupError, TPGroup
from tp_engine.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tp_engine.layers.fp8 import Fp8Weight, finish_loading
from tp_engine.checkpoint.loader import TensorSource
from tp_engine.checkpoint.model_config import ModelConfig, ModelError
from tp_engine.checkpoint.quant import FP8, quantize

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))
from quantize_fp8 import quantize_checkpoint  # noqa: E402

SHAPES = dict(vocab=384, hidden=192, inter=640, heads=8, kv_heads=2, head_dim=48)
PROMPTS = [[5, 17, 300, 42, 8], [1, 2, 3], [250, 9, 77, 13, 101, 4, 3, 2, 1, 0, 66], [7]]
MAX_NEW = 10
NEAR_TIE = 1e-3  # float32 against float64 logits


def reference_dequantize(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The format's definition, written out: each element times its 128 x 128 block's scale, in float64."""
    n, k = w.shape
    return w.double() * s.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """bf16 source, its FP8 checkpoint (small shards), the same with every scale in a file of its own read
    before the weights, and the float64 dequantized reference for transformers."""
    root = tmp_path_factory.mktemp("fp8")
    src = make_checkpoint(root / "bf16", **SHAPES)
    fp8 = root / "fp8"
    quantize_checkpoint(str(src), str(fp8), shard_bytes=60_000)
    tensors = {}
    for f in sorted(fp8.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    scales_first = root / "scales_first"
    shutil.copytree(fp8, scales_first)
    for f in scales_first.glob("*.safetensors"):
        f.unlink()
    scales = {k: v for k, v in tensors.items() if k.endswith("_scale_inv")}
    save_file(scales, str(scales_first / "a-scales.safetensors"), metadata={"format": "pt"})
    save_file({k: v for k, v in tensors.items() if k not in scales},
              str(scales_first / "b-weights.safetensors"), metadata={"format": "pt"})
    weight_map = {k: ("a-scales" if k in scales else "b-weights") + ".safetensors" for k in tensors}
    index = {"metadata": {}, "weight_map": weight_map}
    (scales_first / "model.safetensors.index.json").write_text(json.dumps(index))
    ref = root / "ref64"
    ref.mkdir()
    dense = {k: (reference_dequantize(v, tensors[k + "_scale_inv"]) if v.dtype == FP8 else v.double())
             for k, v in tensors.items() if not k.endswith("_scale_inv")}
    save_file(dense, str(ref / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((fp8 / "config.json").read_text())
    del cfg["quantization_config"]
    (ref / "config.json").write_text(json.dumps(cfg))
    return {"src": src, "fp8": fp8, "scales_first": scales_first, "ref": ref, "tensors": tensors}


# ---- the quantizer ----

def test_quantizer_writes_qwen_format(ckpts):
    fp8, src = ckpts["fp8"], ckpts["src"]
    cfg = json.loads((fp8 / "config.json").read_text())
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3",
                                          "quant_method": "fp8", "weight_block_size": [128, 128]}
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((fp8 / f).is_file() for f in files)
    source = load_file(str(src / "model.safetensors"))
    out = ckpts["tensors"]
    assert set(out) == set(source) | {k + "_scale_inv" for k in source if k.endswith("_proj.weight")}
    for name, t in source.items():
        if not name.endswith("_proj.weight"):  # embeddings, norms, LM head: unchanged
            assert out[name].dtype == t.dtype and torch.equal(out[name], t), name
            continue
        q, s = out[name], out[name + "_scale_inv"]
        n, k = t.shape
        assert q.dtype == FP8 and q.shape == t.shape and s.dtype == torch.float32
        assert s.shape == (-(-n // 128), -(-k // 128))
        padded = torch.nn.functional.pad(t.float(), (0, -k % 128, 0, -n % 128))
        blocks = padded.view(s.shape[0], 128, s.shape[1], 128)
        torch.testing.assert_close(s, blocks.abs().amax(dim=(1, 3)) / 448, rtol=0, atol=0)  # amax / 448
        scale = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        want = (t.float() / scale).to(FP8)  # nearest
        assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)), name
    assert index["weight_map"]["model.layers.0.mlp.down_proj.weight_scale_inv"] in files


# ---- each rank's shard ----

def _layers(rank: int, world: int) -> dict:
    comm.set_tp(TPGroup(rank, world))
    try:
        return {"qkv": QKVParallelLinear(192, 48, 8, 2),
                "gate_up": MergedColumnParallelLinear(192, [640, 640]),
                "down": RowParallelLinear(640, 192, reduce=False),
                "o": RowParallelLinear(384, 192, reduce=False)}
    finally:
        comm.set_tp(TPGroup())


PARTS = {"qkv": [("q", (384, 192)), ("k", (96, 192)), ("v", (96, 192))],
         "gate_up": [(0, (640, 192)), (1, (640, 192))], "down": [(None, (192, 640))],
         "o": [(None, (192, 384))]}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("scale_first", [False, True])
def test_rank_shards_of_weights_and_scales(world, scale_first):
    """Each rank's scale layout gives every element of its shard the checkpoint block's scale, and the CPU
    dequantization equals the unsharded dequantized weight's slice exactly. Rank by rank in this process."""
    torch.manual_seed(0)
    full = {name: [(sid, quantize(torch.randn(shape) * 0.05)) for sid, shape in parts]
            for name, parts in PARTS.items()}
    dense = {name: [(sid, reference_dequantize(*qs).float()) for sid, qs in parts]
             for name, parts in full.items()}
    for rank in range(world):
        layers = _layers(rank, world)
        for name, layer in layers.items():
            Fp8Weight(layer, w8a8=False)
            loads = [(layer.weight, TensorSource(q), sid) for sid, (q, _) in full[name]]
            loads += [(layer.weight_scale_inv, TensorSource(s), sid) for sid, (_, s) in full[name]]
            for param, src, sid in (loads[::-1] if scale_first else loads):
                param.weight_loader(param, src, sid)
            # the GPU layout: element (n, k) reads weight_scale_inv[scale_row[n], (k + k_shift) // 128]
            q = layer.quant
            n, k = layer.weight.shape
            scale = layer.weight_scale_inv[layer.scale_row.long()].repeat_interleave(128, 1)
            scale = scale[:, q.k_shift:q.k_shift + k]
            if name in ("down", "o"):
                cols = layer.col_range()
                want = torch.cat([d for _, d in dense[name]])[:, cols.start:cols.start + cols.cols]
            else:
                parts = layer.row_parts()
                want = torch.cat([d[parts[sid].start:parts[sid].start + parts[sid].rows]
                                  for sid, d in dense[name]])
            assert torch.equal((layer.weight.float() * scale), want), (name, rank, world)
            finish_loading(layer)
            assert layer.quant is None and layer.weight.dtype == torch.float32
            assert torch.equal(layer.weight.data, want), (name, rank, world)


def test_only_the_qkv_projection_has_its_one_token_kernel_timed_after_a_norm():
    """A decode step runs a norm right before the Q/K/V projection, so its FP8 kernel is chosen by timing the
    candidates after one (kernels/fp8.py); the O and down projections follow other kernels and are timed
    alone. (Gate/up at one token is chosen in kernels/mlp.py.) Each layer's call says which."""
    from types import SimpleNamespace

    seen = {}

    def fake_fp8_linear(x, weight, scale, scale_row, k_shift, row_align, w8a8, after_norm=False):
        seen[name] = after_norm
        return x.new_zeros(x.shape[0], weight.shape[0])

    for name, layer in _layers(0, 1).items():
        Fp8Weight(layer, w8a8=False)
        layer.ops = SimpleNamespace(fp8_linear=fake_fp8_linear)  # what the engine binds on the GPU
        assert layer(torch.randn(1, layer.weight.shape[1])).shape == (1, layer.weight.shape[0])
    assert seen == {"qkv": True, "gate_up": False, "down": False, "o": False}


def test_scale_layout_needs_few_rows_and_knows_its_alignment():
    comm.set_tp(TPGroup(1, 2))
    try:
        qkv = QKVParallelLinear(4096, 128, 32, 8)  # Qwen3-8B at TP 2: every part block-aligned
        odd = MergedColumnParallelLinear(192, [640, 640])  # rank 1: rows 320-639 of each part, 2.5 blocks in
    finally:
        comm.set_tp(TPGroup())
    Fp8Weight(qkv, w8a8=False)
    assert qkv.weight_scale_inv.shape == (16 + 4 + 4, 32) and qkv.quant.row_align == 128
    Fp8Weight(odd, w8a8=False)
    assert odd.weight_scale_inv.shape == (3 + 3, 2)  # blocks 2, 3, 4 of each part
    assert odd.scale_row[:3].tolist() == [0, 0, 0] and odd.scale_row[63:65].tolist() == [0, 1]
    assert odd.quant.row_align == 64


# ---- end to end, against transformers in float64 ----

@pytest.fixture(scope="module")
def expected(ckpts):
    from transformers import Qwen3ForCausalLM
    model = Qwen3ForCausalLM.from_pretrained(ckpts["ref"], dtype=torch.float64).eval()
    outs = []
    for ids in PROMPTS:
        seq = list(ids)
        with torch.no_grad():
            for _ in range(MAX_NEW):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        outs.append(seq[len(ids):])
    return model, outs


def check_against(model, prompt, ours, theirs) -> None:
    """Equal up to a first difference that is a near tie in the float64 reference."""
    for j, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ours[:j]])).logits[0, -1]
            assert abs(float(logits[a] - logits[b])) < NEAR_TIE, f"token {j}: {a} vs {b}"
            return


# ---- errors ----

def _variant(ckpts, tmp_path, change_tensors=None, change_config=None) -> Path:
    dst = tmp_path / "broken"
    shutil.copytree(ckpts["fp8"], dst)
    if change_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        change_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if change_tensors is not None:
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        for fname in sorted(set(index["weight_map"].values())):
            tensors = load_file(str(dst / fname))
            change_tensors(tensors)
            save_file(tensors, str(dst / fname), metadata={"format": "pt"})
            index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != fname}
            index["weight_map"].update({k: fname for k in tensors})
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def _start(path) -> str:
    from tp_engine.llm import LLM
    with pytest.raises(StartupError) as e:
        LLM(model=str(path), device="cpu")
    return str(e.value)


NAME = "model.layers.1.self_attn.k_proj.weight"


def test_missing_scale_names_it(ckpts, tmp_path):
    msg = _start(_variant(ckpts, tmp_path, change_tensors=lambda t: t.pop(NAME + "_scale_inv", None)))
    assert "missing" in msg and NAME + "_scale_inv" in msg


def test_wrong_scale_shape_names_it(ckpts, tmp_path):
    def change(t):
        if NAME + "_scale_inv" in t:
            t[NAME + "_scale_inv"] = torch.ones(2, 2)
    msg = _start(_variant(ckpts, tmp_path, change_tensors=change))
    assert NAME + "_scale_inv" in msg and "[1, 2]" in msg and "[2, 2]" in msg


def test_unquantized_weight_where_fp8_is_expected(ckpts, tmp_path):
    def change(t):
        if NAME in t:
            t[NAME] = t[NAME].to(torch.bfloat16)
    msg = _start(_variant(ckpts, tmp_path, change_tensors=change))
    assert NAME in msg and "float8_e4m3fn" in msg


def test_scales_without_quantization_config(ckpts, tmp_path):
    msg = _start(_variant(ckpts, tmp_path, change_config=lambda c: c.pop("quantization_config")))
    assert "weight_scale_inv" in msg and "quantization_config" in msg


@pytest.mark.parametrize("change,needles", [
    ({"quant_method": "awq"}, ["quant_method", "'awq'", "fp8"]),
    ({"fmt": "e5m2"}, ["fmt", "'e5m2'", "e4m3"]),
    ({"weight_block_size": [64, 64]}, ["weight_block_size", "[64, 64]", "[128, 128]"]),
    ({"weight_block_size": None}, ["weight_block_size", "missing"]),
    ({"weight_block_size": 128}, ["weight_block_size 128", "[128, 128]"]),
    ({"activation_scheme": "static"}, ["activation_scheme", "'static'", "dynamic"]),
])
def test_unsupported_quantization_config(change, needles):
    raw = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2,
           "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128], **change}}
    with pytest.raises(ModelError) as e:
        ModelConfig.from_dict(raw)
    assert "config.json" in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)


def test_modules_to_not_convert_and_dummy_weights(ckpts, tmp_path):
    """A checkpoint that keeps layer 0's MLP unquantized loads mixed; random FP8 weights (load_format dummy)
    run too."""
    from tp_engine.llm import LLM
    mixed = tmp_path / "mixed"
    quantize_checkpoint(str(ckpts["src"]), str(mixed), modules_to_not_convert=("model.layers.0.mlp",))
    with safe_open(str(next(mixed.glob("*.safetensors"))), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.float32  # as in the source
        assert "model.layers.0.mlp.up_proj.weight_scale_inv" not in f.keys()
    for opts in ({"model": str(mixed)}, {"model": str(ckpts["fp8"]), "load_format": "dummy"}):
        llm = LLM(device="cpu", sampling={"max_new_tokens": 4}, **opts)
        out = llm.generate([{"input_ids": PROMPTS[0]}])[0]
        assert len(out["output_token_ids"]) == 4
        llm.shutdown()


def test_quantizer_refuses_to_split_an_engine_matmul(ckpts, tmp_path):
    """Keeping gate_proj but not up_proj (or one expert of a MoE layer) unquantized gives a checkpoint the
    engine cannot load: refused before anything is written."""
    from quantize_fp8 import engine_matmul
    with pytest.raises(SystemExit) as e:
        quantize_checkpoint(str(ckpts["src"]), str(tmp_path / "out"),
                            modules_to_not_convert=("model.layers.0.mlp.gate_proj",))
    assert "model.layers.0.mlp.gate_proj unquantized but not the rest of model.layers.0.mlp.gate_up_proj" \
        in str(e.value)
    assert not (tmp_path / "out").exists()
    for fused in ("qkv_proj", "model.layers.0.mlp.gate_up_proj"):  # the engine's names, not the checkpoint's
        with pytest.raises(SystemExit,
                           match=f"--modules-to-not-convert {fused}: no module of the checkpoint"):
            quantize_checkpoint(str(ckpts["src"]), str(tmp_path / "out"), modules_to_not_convert=(fused,))
    assert not (tmp_path / "out").exists()
    assert engine_matmul("model.layers.3.mlp.experts.17.down_proj.weight") == "model.layers.3.mlp.experts"
    assert engine_matmul("model.layers.3.self_attn.v_proj.weight") == "model.layers.3.self_attn.qkv_proj"


def test_quantizer_refuses_a_used_destination_and_bad_arguments(ckpts, tmp_path, capsys):
    """Quantizing into the source folder or over another checkpoint is refused before anything is written (a
    rewritten config.json would leave a folder that loads neither way); bad arguments exit 2 naming the
    option, not a traceback."""
    from quantize_fp8 import main
    src = ckpts["src"]
    before = (src / "config.json").read_text()
    for dst in (src, ckpts["fp8"]):
        with pytest.raises(SystemExit, match="already holds a checkpoint"):
            quantize_checkpoint(str(src), str(dst))
    assert (src / "config.json").read_text() == before
    with pytest.raises(SystemExit, match="has no config.json"):
        quantize_checkpoint(str(tmp_path / "nothing"), str(tmp_path / "out"))
    for bad in (["--shard-size", "5G"], ["--shard-size", "inf"], ["--device", "nodevice"]):
        with pytest.raises(SystemExit) as e:
            main([str(src), str(tmp_path / "out"), *bad])
        assert e.value.code == 2 and bad[0] in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_quantizer_refuses_a_destination_it_cannot_write(ckpts, tmp_path):
    """A destination that is a file, lies under one, or is not writable gets one message before any work,
    rather than a traceback (after the first shard for a folder that is not writable); nothing is touched."""
    afile = tmp_path / "afile"
    afile.write_text("keep")
    for dst in (afile, afile / "out"):
        with pytest.raises(SystemExit) as e:
            quantize_checkpoint(str(ckpts["src"]), str(dst))
        assert str(e.value).startswith(f"cannot write into {dst}: "), str(e.value)
    assert afile.read_text() == "keep"
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        with pytest.raises(SystemExit) as e:
            quantize_checkpoint(str(ckpts["src"]), str(locked))
        assert str(e.value).startswith(f"cannot write into {locked}: "), str(e.value)
        assert not any(locked.iterdir())

def test_quantizer_sizes_float64_tensors(ckpts, tmp_path):
    """A float64 source's unquantized tensors count at 8 bytes an element: every shard of more than one tensor
    stays within --shard-size, and the index's total_size is the sum of the files' tensors."""
    src = tmp_path / "f64"
    shutil.copytree(ckpts["src"], src)
    save_file({k: v.double() for k, v in load_file(str(src / "model.safetensors")).items()},
              str(src / "model.safetensors"), metadata={"format": "pt"})
    index = quantize_checkpoint(str(src), str(tmp_path / "out"), shard_bytes=200_000)
    sizes = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        tensors = load_file(str(f))
        sizes[f.name] = (len(tensors), sum(t.numel() * t.element_size() for t in tensors.values()))
    assert index["metadata"]["total_size"] == sum(b for _, b in sizes.values())
    assert all(b <= 200_000 for n, b in sizes.values() if n > 1), sizes


def test_quantizer_refuses_a_weight_with_infinite_values(ckpts, tmp_path):
    """A weight holding an inf is refused by name: its block's scale would be inf, and every other value of
    the 128 x 128 block would read back as NaN."""
    src = tmp_path / "inf"
    shutil.copytree(ckpts["src"], src)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = float("inf")
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SystemExit,
                       match="'model.layers.0.mlp.down_proj.weight' holds NaN or infinite values"):
        quantize_checkpoint(str(src), str(tmp_path / "out"))


def test_fp8_linear_weights_never_exist_in_the_compute_dtype(ckpts, tmp_path, monkeypatch):
    """The engine builds a block-FP8 model's linear weights as meta placeholders, so quantize_linears gives
    them fp8 storage without a first copy in the compute dtype (Qwen3-235B-A22B at TP 2 would not fit one); a
    layer the config leaves unquantized is allocated after, keeps its loader and holds the checkpoint's
    values."""
    from tp_engine import models as models_module
    from tp_engine.llm import LLM
    mixed = tmp_path / "mixed"
    quantize_checkpoint(str(ckpts["src"]), str(mixed), modules_to_not_convert=("model.layers.0.mlp",))
    seen, quantize_linears = [], models_module.quantize_linears

    def spy(model, *args):
        seen.append({n: p.device.type for n, p in model.named_parameters() if n.endswith("proj.weight")})
        quantize_linears(model, *args)

    monkeypatch.setattr(models_module, "quantize_linears", spy)
    llm = LLM(model=str(mixed), device="cpu", sampling={"max_new_tokens": 4})
    # 2 layers x qkv, o, gate_up, down
    assert len(seen[0]) == 2 * 4 and set(seen[0].values()) == {"meta"}, seen
    params = dict(llm.engine.model.named_parameters())
    assert all(p.device.type == "cpu" for p in params.values())
    with safe_open(str(next(mixed.glob("*.safetensors"))), "pt") as f:
        gate, up = (f.get_tensor(f"model.layers.0.mlp.{n}_proj.weight") for n in ("gate", "up"))
        down = f.get_tensor("model.layers.0.mlp.down_proj.weight")
    assert torch.equal(params["model.layers.0.mlp.gate_up_proj.weight"], torch.cat([gate, up]).float())
    assert torch.equal(params["model.layers.0.mlp.down_proj.weight"], down.float())
    llm.shutdown()


@pytest.mark.slow
def test_bench_runs_both_formats_and_writes_an_fp8_checkpoint(ckpts, tmp_path):
    """launch/bench.py --weights bf16,fp8 in one call (on CPU, tiny shapes): an FP8 checkpoint in Qwen's
    format written from the config's shapes, both formats measured."""
    import subprocess
    model = tmp_path / "shapes"
    model.mkdir()
    shutil.copy(ckpts["src"] / "config.json", model / "config.json")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "launch" / "bench.py"), "--model", str(model), "--weights", "bf16,fp8",
           "--workload", "latency,load", "--engine", "ours", "--new-tokens", "4", "--prompt-len", "8",
           "--set", "device=cpu", "--write-checkpoint", str(tmp_path / "random"), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["weights"]["format"] == "bf16" and res["fp8"]["weights"]["format"] == "fp8"
    for run in (res, res["fp8"]):
        lat = run["latency"]
        assert (lat["prompt_tokens"], lat["new_tokens"]) == (8, 4), lat
        # the rate and the step time are one measurement (rounded to 0.1 tokens/s and 1 us)
        ms = lat["ms_per_step"]
        assert 1e3 / (ms + 5e-4) - 0.05 <= lat["decode_tok_s"] <= 1e3 / (ms - 5e-4) + 0.05, lat
    # the engine holds each of the model's weights once
    assert res["weights"]["bytes_per_rank"] == res["weights"]["model_bytes_over_tp"]
    fp8 = tmp_path / "random-fp8"
    quant = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert quant["weight_block_size"] == [128, 128]
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(fp8 / index["model.layers.0.mlp.down_proj.weight"]), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight").dtype == FP8
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight_scale_inv").shape == (2, 5)  # [192, 640]


# ---- Qwen3-MoE experts ----

@pytest.fixture(scope="module")
def moe_ckpts(tmp_path_factory):
    """A Qwen3-MoE checkpoint (expert inner size 160: 80 rows per rank at TP 2, 40 at TP 4, both inside a
    block), its FP8 version, and transformers' float64 model on the dequantized weights (its eager expert
    loop)."""
    from transformers import Qwen3MoeForCausalLM
    from helpers import make_moe_checkpoint

    root = tmp_path_factory.mktemp("fp8_moe")
    src = make_moe_checkpoint(root / "bf16", hidden=192, inter=256, moe_inter=160, layers=2, heads=4,
                              kv_heads=1, head_dim=48, experts=8, top_k=2, vocab=389)
    quantize_checkpoint(str(src), str(root / "fp8"), shard_bytes=200_000)
    tensors = {}
    for f in (root / "fp8").glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    assert "model.layers.1.mlp.experts.7.down_proj.weight_scale_inv" in tensors
    assert tensors["model.layers.1.mlp.gate.weight"].dtype != FP8  # the router stays unquantized
    dense = {k: (reference_dequantize(v, tensors[k + "_scale_inv"]) if v.dtype == FP8 else v.double())
             for k, v in tensors.items() if not k.endswith("_scale_inv")}
    (root / "ref").mkdir()
    save_file(dense, str(root / "ref" / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((root / "fp8" / "config.json").read_text())
    del cfg["quantization_config"]
    (root / "ref" / "config.json").write_text(json.dumps(cfg))
    model = Qwen3MoeForCausalLM.from_pretrained(root / "ref", dtype=torch.float64).eval()
    model.config._experts_implementation = "eager"  # transformers' grouped experts have no float64
    want = []
    for ids in PROMPTS:
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW,
                                 min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
        want.append(out[0, len(ids):].tolist())
    return root / "fp8", model, want


DENSE_AT = {1: "fp8", 2: "scales_first", 4: "fp8"}  # which dense FP8 checkpoint runs at each TP


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_greedy_equals_transformers_float64(ckpts, expected, moe_ckpts, tp, tmp_path):
    """The dense FP8 checkpoint (at TP 2 the one whose scales are read before the weights) and the MoE one
    with FP8 experts give transformers' float64 tokens on the dequantized weights, near ties excepted; both in
    one torchrun job per TP (starting the processes is most of a job's time), TP 1 in this process."""
    models = {"dense": ckpts[DENSE_AT[tp]], "moe": moe_ckpts[0]}
    sampling = {"max_new_tokens": MAX_NEW, "ignore_eos": True}  # the references run MAX_NEW steps
    results = api_outputs(models, PROMPTS, sampling, tp, tmp_path)
    references = {"dense": expected, "moe": moe_ckpts[1:]}
    for name, (model, want) in references.items():
        got = [o["output_token_ids"] for o in results[name]]
        assert len(got) == len(PROMPTS), name
        for prompt, ours, theirs in zip(PROMPTS, got, want):
            check_against(model, prompt, ours, theirs)
        assert sum(a == b for a, b in zip(got, want)) >= len(PROMPTS) - 1, name  # ties are rare: most match


def test_quantizer_keeps_a_moe_layers_experts_named_as_one_module(moe_ckpts, tmp_path):
    """`mlp.experts` in modules_to_not_convert names the stacked experts as the engine (and transformers) read
    it: the quantizer keeps every expert unquantized, and the engine loads the checkpoint."""
    from tp_engine.llm import LLM
    path, _, _ = moe_ckpts
    out = tmp_path / "kept"
    quantize_checkpoint(str(path.parent / "bf16"), str(out), modules_to_not_convert=("mlp.experts",))
    tensors = {}
    for f in out.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    assert tensors["model.layers.1.mlp.experts.7.down_proj.weight"].dtype != FP8
    assert tensors["model.layers.1.self_attn.q_proj.weight"].dtype == FP8
    llm = LLM(model=str(out), device="cpu", sampling={"max_new_tokens": 3})
    assert len(llm.generate([{"input_ids": PROMPTS[0]}])[0]["output_token_ids"]) == 3


def test_experts_kept_unquantized_one_by_one(moe_ckpts, tmp_path):
    """modules_to_not_convert listing every expert of a layer keeps that layer's experts unquantized, as
    listing q_proj, k_proj and v_proj keeps qkv_proj, and the engine loads the checkpoint; listing some
    experts only is refused with one message naming the layer."""
    from tp_engine.comm import StartupError
    from tp_engine.llm import LLM
    path, _, _ = moe_ckpts
    out = tmp_path / "kept"
    each = tuple(f"model.layers.1.mlp.experts.{e}" for e in range(8))
    quantize_checkpoint(str(path.parent / "bf16"), str(out), modules_to_not_convert=each)
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.7.down_proj.weight_scale_inv" not in names
    assert "model.layers.0.mlp.experts.7.down_proj.weight_scale_inv" in names
    llm = LLM(model=str(out), device="cpu", sampling={"max_new_tokens": 3})
    assert len(llm.generate([{"input_ids": PROMPTS[0]}])[0]["output_token_ids"]) == 3
    llm.shutdown()
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = list(each[:3])
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StartupError, match="names only some of the experts of model.layers.1.mlp.experts"):
        LLM(model=str(out), device="cpu")
