"""Load a Hugging Face safetensors checkpoint into the sharded model; each rank reads only its slices."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


class CheckpointError(ValueError):
    """A problem with the checkpoint files; the message names the file or the tensor."""


# safetensors dtype codes of the weights the engine converts to its own dtype. Others (int8, bool, ...) would
# be cast to floats without complaint and give garbage: quantized checkpoints need their own kernels, so
# float8 is taken only by the parameters of a block-FP8 checkpoint that hold it (layers/fp8.py).
FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
FP8_DTYPE = "F8_E4M3"


class SliceSource:
    """A lazy view of one checkpoint tensor: `.narrow` reads only the requested rows or columns, and checks
    that they are finite (every value this rank loads is looked at once)."""

    def __init__(self, handle, name: str, fp8: bool = False) -> None:
        self.slice = handle.get_slice(name)
        self.shape = tuple(self.slice.get_shape())
        dtype = self.slice.get_dtype()
        if dtype not in FLOAT_DTYPES and not (fp8 and dtype == FP8_DTYPE):
            allowed = ", ".join([*FLOAT_DTYPES.values(), *(["float8_e4m3fn"] if fp8 else [])])
            hint = ("; float8 weights with weight_scale_inv belong only to the linear layers of a block-FP8 "
                    "checkpoint (its quantization_config in config.json, the module not in "
                    "modules_to_not_convert): embeddings, norms, the LM head and the MoE router stay "
                    "unquantized"
                    if dtype == FP8_DTYPE and not fp8 else "")
            raise ValueError(f"dtype {dtype} is not supported; weights must be {allowed}{hint}")

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        t = self.slice[index]
        # no infinities in e4m3fn; NaN is every bit of exponent and mantissa set
        if t.dtype == torch.float8_e4m3fn:
            if t.numel() and ((t.view(torch.uint8) & 0x7F) == 0x7F).any():
                raise ValueError("holds NaN values")
        elif t.numel():
            # min and max propagate NaN, so both are finite only if every value is: a full check, at about a
            # fifteenth of the cost of torch.isfinite(t).all() on CPU (no boolean copy of the tensor)
            lo, hi = torch.aminmax(t)
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise ValueError("holds NaN or infinite values")
        return t


class TensorSource:
    """The same interface over an in-memory tensor (tests, tools)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.shape = tensor, tuple(tensor.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.tensor.narrow(dim, start, length)


def default_loader(param: nn.Parameter, src, shard_id=None) -> None:
    """Replicated parameters (norms): the whole tensor on every rank."""
    if tuple(src.shape) != tuple(param.shape):
        raise ValueError(f"expected shape {list(param.shape)}, checkpoint has {list(src.shape)}")
    param.data.copy_(src.narrow(0, 0, src.shape[0]))


def checkpoint_files(model_dir: str) -> list[Path]:
    """The safetensors files, chosen as transformers chooses: `model.safetensors` if present (a folder saved
    again whole keeps its stale shard index), else the shards of `model.safetensors.index.json`, else every
    *.safetensors file."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if (root / "model.safetensors").is_file():
        files = [root / "model.safetensors"]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise TypeError("'weight_map' must map tensor names to file names")
        except (ValueError, KeyError, TypeError) as e:  # ValueError: not JSON, or not UTF-8
            raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
        files = [root / f for f in dict.fromkeys(weight_map.values())]
        if not files:
            raise CheckpointError(f"{index} lists no tensors: its 'weight_map' is empty")
        gone = f"listed in {index.name} is missing"
    else:
        files = sorted(root.glob("*.safetensors"))
        gone = "is not a readable file (a link whose target is gone?)"
    if not files:
        raise CheckpointError(
            f"no *.safetensors weights in {model_dir} (set load_format: dummy for random weights)")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} {gone}")
    return files


def checkpoint_map(model: nn.Module) -> dict[str, tuple[str, object]]:
    """Every tensor the checkpoint must hold -> (the parameter it loads into, the shard id its loader gets).

    A parameter is one tensor of its own name, except a parameter that lists the tensors it holds
    (`checkpoint_parts`: names relative to its module, e.g. the stacked experts' "17.gate_proj.weight" with
    shard (17, "gate")), and a fused module named in the model's `packed_modules` ("q_proj" -> part "q" of
    "qkv_proj": model.layers.0.self_attn.q_proj.weight -> model.layers.0.self_attn.qkv_proj.weight)."""
    parts_of: dict[str, list] = {}
    for ckpt, (ours, shard) in getattr(model, "packed_modules", {}).items():
        parts_of.setdefault(ours, []).append((ckpt, shard))
    out = {}
    for pname, param in model.named_parameters():
        module, _, leaf = pname.rpartition(".")
        parent, _, mod = module.rpartition(".")
        if hasattr(param, "checkpoint_parts"):
            names = [(f"{module}.{rel}", shard) for rel, shard in param.checkpoint_parts]
        elif mod in parts_of:
            names = [(f"{parent}.{ckpt}.{leaf}", shard) for ckpt, shard in parts_of[mod]]
        else:
            names = [(pname, None)]
        out.update((name, (pname, shard)) for name, shard in names)
    return out


EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def load_checkpoint(model: nn.Module, model_dir: str) -> None:
    """Every parameter of `model` from the checkpoint in `model_dir`, this rank's shard of each; the
    model's persistent buffers (an EAGLE-3 head's vocabulary map) too, whole, where the checkpoint has
    them."""
    params = dict(model.named_parameters())
    targets = checkpoint_map(model)
    state = model.state_dict(keep_vars=True)
    buffers = {name: b for name, b in model.named_buffers() if name in state}  # the persistent ones
    tied = getattr(model, "cfg", None) is not None and model.cfg.tie_word_embeddings
    seen: dict[str, str] = {}  # tensor name -> the file it came from
    tied_head = None  # with tied embeddings, the file of an lm_head.weight the checkpoint also holds
    for file in checkpoint_files(model_dir):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    if name.endswith("rotary_emb.inv_freq"):
                        continue  # derived, in some checkpoints
                    if tied and name == HEAD:
                        tied_head = file
                        continue
                    if name in buffers:
                        _load_buffer(buffers[name], handle, name, file)
                        seen[name] = file.name
                        continue
                    if name not in targets:
                        unquantized = getattr(getattr(model, "cfg", None), "quant", 0) is None
                        hint = ("; the checkpoint is quantized, but config.json has no quantization_config"
                                if name.endswith(".weight_scale_inv") and unquantized else "")
                        # mlp.experts.gate_up_proj: no expert id
                        if name.rpartition(".")[0].endswith(".mlp.experts"):
                            hint = ("; the checkpoint stores each layer's experts fused in one tensor, this "
                                    "engine loads one per expert (mlp.experts.E.gate_proj.weight, up_proj, "
                                    "down_proj), as Qwen's releases and transformers' save_pretrained write "
                                    "them")
                        raise CheckpointError(f"unexpected tensor '{name}' in {file.name}{hint}")
                    if name in seen:  # which copy transformers takes depends on its version: refuse both
                        raise CheckpointError(f"tensor '{name}' is in both {seen[name]} and {file.name}")
                    _load(params, targets, handle, name, file)
                    seen[name] = file.name
        except CheckpointError:
            raise
        except Exception as e:  # safetensors reports truncation and corruption with its own error types
            raise CheckpointError(f"cannot read checkpoint file {file}: {e}") from None
    if tied_head is not None and EMBEDDING in seen:
        _check_tied_head(params, targets, tied_head)
    elif tied_head is not None:  # the head alone: the embedding comes from it, as in transformers
        with safe_open(str(tied_head), framework="pt", device="cpu") as handle:
            _load(params, targets, handle, EMBEDDING, tied_head, HEAD)
        seen[EMBEDDING] = tied_head.name
    missing = sorted(targets.keys() - seen.keys())
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {model_dir} is missing tensor(s): {', '.join(missing[:5])}{more}")


def _load(params: dict, targets: dict, handle, name: str, file: Path, source: str | None = None) -> None:
    """Checkpoint tensor `source` (default: `name`) into the parameter that tensor `name` loads into."""
    pname, shard = targets[name]
    param = params[pname]
    loader = getattr(param, "weight_loader", default_loader)
    try:
        loader(param, SliceSource(handle, source or name, param.dtype == torch.float8_e4m3fn), shard)
    except ValueError as e:
        raise CheckpointError(f"tensor '{source or name}' in {file.name}: {e}") from None


def _load_buffer(buf: torch.Tensor, handle, name: str, file: Path) -> None:
    """A buffer whole: same shape, and the same kind of dtype (integer, bool or floating point)."""
    t = handle.get_tensor(name)

    def kind(dtype: torch.dtype) -> str:
        return "bool" if dtype == torch.bool else "floating" if dtype.is_floating_point else "integer"
    if t.shape != buf.shape or kind(t.dtype) != kind(buf.dtype):
        raise CheckpointError(f"tensor '{name}' in {file.name}: expected {kind(buf.dtype)} values of shape "
                              f"{list(buf.shape)}, checkpoint has {t.dtype} {list(t.shape)}")
    buf.copy_(t)


def _check_tied_head(params: dict, targets: dict, file: Path) -> None:
    """With tie_word_embeddings, a stored lm_head.weight must equal the embedding (transformers 5 unties a
    head that differs). Each rank compares its own rows."""
    pname, shard = targets[EMBEDDING]
    embedding = params[pname]
    head = nn.Parameter(torch.empty_like(embedding), requires_grad=False)
    head.weight_loader = getattr(embedding, "weight_loader", default_loader)
    with safe_open(str(file), framework="pt", device="cpu") as handle:
        _load({pname: head}, targets, handle, EMBEDDING, file, HEAD)
    if not torch.equal(head, embedding):
        raise CheckpointError(f"{HEAD} in {file.name} differs from {EMBEDDING}, while config.json sets "
                              "tie_word_embeddings: true; transformers then uses them apart: set "
                              "tie_word_embeddings to false in config.json for that")


def init_dummy(model: nn.Module, seed: int, rank: int = 0) -> None:
    """Random weights of the right shapes (benchmarks of public model shapes without a download): each rank's
    shards its own draws, the weights every rank holds whole (`replicated`: the MoE router) the same ones."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed + rank)
    same = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if hasattr(p, "dummy_init"):  # not a plain float tensor (layers/fp8.py): it fills itself
            p.dummy_init(p, gen)
        elif p.dim() == 1:
            p.data.fill_(1.0) if "norm" in name else p.data.zero_()
        else:
            p.data.normal_(0.0, 0.02, generator=same if getattr(p, "replicated", False) else gen)
