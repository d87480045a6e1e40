"""Attention backends. Each takes the batch's plan once per step (`prepare`) and then, per layer,
stores the new K/V into the paged cache and attends over it (`forward`); a backend whose `fuses_qkv` is True
also takes the projection's Q, K and V straight (`forward_qkv`: Q/K norm, RoPE and the K/V write in one
kernel)."""
from __future__ import annotations

import torch


def _resolve(name: str, device: torch.device) -> str:
    return ("flashinfer" if device.type == "cuda" else "torch") if name == "auto" else name


def make_backend(name: str, device: torch.device, ops=None, **kw):
    """The backend `name` (config key attention_backend) on `device`; ops: the engine's fused kernels."""
    name = _resolve(name, device)
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("attention_backend flashinfer needs device cuda")
        from tp_engine.attention.flashinfer_backend import FlashInferBackend
        return FlashInferBackend(device=device, ops=ops, **kw)
    from tp_engine.attention.torch_backend import TorchBackend
    return TorchBackend(device=device, **kw)


def fuses_qkv(name: str, device: torch.device, ops) -> bool:
    """Whether the backend `make_backend(name, device, ops)` makes takes the fused path (`forward_qkv`): known
    before it is made, so the model is told once at start-up (Qwen3ForCausalLM.bind)."""
    return _resolve(name, device) == "flashinfer" and ops is not None


def check_backend(name: str, device: torch.device) -> None:
    if name == "flashinfer" and device.type != "cuda":
        raise ValueError("attention_backend flashinfer needs device cuda; use torch (or auto) on CPU")
    if device.type == "cuda" and name in ("auto", "flashinfer"):
        try:
            import flashinfer  # noqa: F401
        except ImportError:
            raise ValueError("flashinfer is not installed (pip install -e '.[gpu]'); "
                             "or set attention_backend: torch") from None
