"""Attention backends. Each takes the batch's plan once per step (`prepare`) and then, per layer,
stores the new K/V into the paged cache and attends over it (`forward`)."""
from __future__ import annotations

import torch


def make_backend(name: str, device: torch.device, **kw):
    if name == "auto":
        name = "flashinfer" if device.type == "cuda" else "torch"
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("attention_backend flashinfer needs device cuda")
        from tp_engine.attention.flashinfer_backend import FlashInferBackend
        return FlashInferBackend(device=device, **kw)
    from tp_engine.attention.torch_backend import TorchBackend
    return TorchBackend(device=device, **kw)


def check_backend(name: str, device: torch.device) -> None:
    if name == "flashinfer" and device.type != "cuda":
        raise ValueError("attention_backend flashinfer needs device cuda; use torch (or auto) on CPU")
    if device.type == "cuda" and name in ("auto", "flashinfer"):
        try:
            import flashinfer  # noqa: F401
        except ImportError:
            raise ValueError("flashinfer is not installed (pip install -e '.[gpu]'); "
                             "or set attention_backend: torch") from None
