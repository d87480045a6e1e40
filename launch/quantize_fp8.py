"""Write a block-FP8 checkpoint, in the format of Qwen's *-FP8 releases, from a bf16 (fp16, fp32) Qwen3 one.

    python launch/quantize_fp8.py /models/Qwen3-8B /models/Qwen3-8B-fp8
    python launch/quantize_fp8.py SRC DST --shard-size 2GB --device cuda \\
        --modules-to-not-convert model.layers.0.mlp

Every projection weight of the decoder layers (q/k/v/o, gate/up/down; each expert's too) becomes
`weight` (float8_e4m3fn) and `weight_scale_inv` (float32, one per 128 x 128 block): per block, scale = the
largest magnitude / 448 and weight / scale rounded to the nearest fp8 value (tp_engine/checkpoint/quant.py).
The embeddings, norms, the LM head and the MoE router are copied as they are. The output is sharded
(model-0000k-of-0000n.safetensors with model.safetensors.index.json); config.json gains a
`quantization_config` (quant_method fp8, fmt e4m3, activation_scheme dynamic, weight_block_size [128, 128]);
the other files (tokenizer, generation_config.json) are copied. DST must be a new folder (or one without a
checkpoint): writing over the source would leave neither model loadable.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tp_engine.checkpoint.loader import checkpoint_files  # noqa: E402
from tp_engine.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from tp_engine.checkpoint.quant import (BLOCK, QWEN_FP8_CONFIG, QuantConfig, is_quantizable,  # noqa: E402
                                        quantize)

# per element, for shard sizes
BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I64": 8, "I32": 4}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '64KB' or a number of bytes; argparse names the flag when this raises ValueError."""
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
    unit = next((u for u in units if text.upper().endswith(u)), None)
    size = float(text[:-2]) * units[unit] if unit else float(text)
    if not 1 <= size < float("inf"):  # inf too: int(inf) raises OverflowError, which argparse does not catch
        raise ValueError(text)
    return int(size)


def engine_matmul(name: str) -> str:
    """The engine's matmul a checkpoint weight goes into: q/k/v and gate/up are fused, and a MoE layer's
    experts are stacked into one (so they must all be quantized, or none)."""
    module = name.rsplit(".", 1)[0]
    if ".mlp.experts." in module:
        return module.split(".mlp.experts.")[0] + ".mlp.experts"
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{Qwen3ForCausalLM.packed_modules.get(leaf, (leaf,))[0]}"


def plan(src: Path, skip: QuantConfig) -> list[tuple[str, Path, bool, int]]:
    """(name, source file, quantize?, output bytes) for every tensor, in the source order."""
    out = []
    for file in checkpoint_files(str(src)):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                shape, size = tuple(sl.get_shape()), BYTES.get(sl.get_dtype(), 4)
                numel = 1
                for d in shape:
                    numel *= d
                module = name.rsplit(".", 1)[0]  # the engine asks about a MoE layer's experts as one module
                experts = ".mlp.experts." in name and skip.skips(engine_matmul(name))
                q = is_quantizable(name, shape) and not (skip.skips(module) or experts)
                blocks = -(-shape[0] // BLOCK) * -(-shape[-1] // BLOCK) if q else 0
                out.append((name, file, q, numel + 4 * blocks if q else numel * size))
    return out


def check_skips(tensors: list[tuple[str, Path, bool, int]], skip: QuantConfig) -> None:
    """Refuse, before any time is spent quantizing, a --modules-to-not-convert entry that names no module of
    the checkpoint (the engine's fused qkv_proj, say: the engine and transformers match checkpoint names), and
    one that keeps only part of one engine matmul unquantized (the engine could not load the result)."""
    modules = {name.rsplit(".", 1)[0] for name, *_ in tensors}
    modules |= {engine_matmul(name) for name, *_ in tensors if ".mlp.experts." in name}  # a layer's experts
    for entry in skip.modules_to_not_convert:
        if not any(QuantConfig(modules_to_not_convert=(entry,)).skips(m) for m in modules):
            raise SystemExit(f"--modules-to-not-convert {entry}: no module of the checkpoint has that name; "
                             "use the checkpoint's names (q_proj, k_proj, v_proj, gate_proj, up_proj, "
                             "mlp.experts, ...)")
    quantized: dict[str, dict[str, bool]] = {}
    for name, _, q, _ in tensors:
        if is_quantizable(name, (1, 1)):
            quantized.setdefault(engine_matmul(name), {})[name.rsplit(".", 1)[0]] = q
    for matmul, parts in quantized.items():
        if len(set(parts.values())) > 1:
            kept = [m for m, q in parts.items() if not q]
            raise SystemExit(f"--modules-to-not-convert keeps {', '.join(kept[:3])}"
                             f"{' ...' if len(kept) > 3 else ''} unquantized but not the rest of {matmul} "
                             f"({len(parts)} weights), which the engine runs as one matmul: name all of "
                             "them, or their parent module")


def quantize_checkpoint(src: str, dst: str, shard_bytes: int = 5 << 30, device: str = "cpu",
                        modules_to_not_convert: tuple[str, ...] = ()) -> dict:
    """Write the FP8 checkpoint of `src` into `dst`; returns its index."""
    src_dir, dst_dir = Path(src), Path(dst)
    if not (src_dir / "config.json").is_file():
        raise SystemExit(f"{src_dir} has no config.json: not a checkpoint folder")
    if dst_dir.exists() and (dst_dir.resolve() == src_dir.resolve() or any(
            (dst_dir / f).exists() for f in ("config.json", "model.safetensors.index.json")) or
            any(dst_dir.glob("*.safetensors"))):
        raise SystemExit(f"{dst_dir} already holds a checkpoint (or is the source): write into a new folder")
    config = json.loads((src_dir / "config.json").read_text())
    if config.get("quantization_config"):
        raise SystemExit(f"{src_dir / 'config.json'} already has a quantization_config")
    skip = QuantConfig(modules_to_not_convert=tuple(modules_to_not_convert))
    tensors = plan(src_dir, skip)
    check_skips(tensors, skip)
    shards, size = [[]], 0
    for entry in tensors:
        if shards[-1] and size + entry[3] > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry[3]
    try:  # a destination that is a file, or not writable, fails here rather than after the first shard's work
        dst_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=dst_dir).close()
    except OSError as e:
        raise SystemExit(f"cannot write into {dst_dir}: {e.strerror or e}") from None
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map, handles = {}, {}
    try:
        for shard, fname in zip(shards, names):
            data = {}
            for name, file, q, _ in shard:
                if file not in handles:
                    handles[file] = safe_open(str(file), framework="pt")
                t = handles[file].get_tensor(name)
                if q:
                    # its block's scale would be inf: the block would read as NaN
                    if not torch.isfinite(t).all():
                        raise SystemExit(f"{file.name}: tensor {name!r} holds NaN or infinite values")
                    w, s = quantize(t.to(device))
                    data[name], data[name + "_scale_inv"] = w.cpu(), s.cpu()
                else:
                    data[name] = t
            save_file(data, str(dst_dir / fname), metadata={"format": "pt"})
            weight_map.update({name: fname for name in data})
    finally:
        handles.clear()
    total = sum(e[3] for e in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dst_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    qcfg = dict(QWEN_FP8_CONFIG)
    if modules_to_not_convert:
        qcfg["modules_to_not_convert"] = list(modules_to_not_convert)
    config["quantization_config"] = qcfg
    (dst_dir / "config.json").write_text(json.dumps(config, indent=2))
    for f in src_dir.iterdir():  # tokenizer, generation_config.json, ...
        if f.is_file() and f.suffix != ".safetensors" and \
                f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst_dir / f.name)
    return index


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="checkpoint directory (config.json + safetensors)")
    p.add_argument("dst", help="output directory")
    p.add_argument("--shard-size", default="5GB", type=parse_size,
                   help="largest output file (e.g. 5GB, 500MB)")
    p.add_argument("--device", default="cpu", help="where to quantize (cuda is faster for large models)")
    p.add_argument("--modules-to-not-convert", nargs="*", default=[], metavar="MODULE",
                   help="modules (checkpoint names) to keep unquantized; recorded in quantization_config")
    args = p.parse_args(argv)
    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        p.error(f"--device {args.device}: {str(e).splitlines()[0]}")
    index = quantize_checkpoint(args.src, args.dst, args.shard_size, args.device,
                                tuple(args.modules_to_not_convert))
    files = sorted(set(index["weight_map"].values()))
    print(f"wrote {len(index['weight_map'])} tensors in {len(files)} file(s), "
          f"{index['metadata']['total_size'] / 1e9:.2f} GB, to {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
