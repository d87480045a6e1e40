"""Token selection on rank 0: greedy, temperature, top-k, top-p.

Random draws come from a counter-based hash of (seed, request index, output step, token id), not from a
stateful generator, so a request's samples do not depend on which other requests share its batch, on
preemption, on the TP size or on the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from tp_engine.config import SCHEMA, check_value

_M32 = 0xFFFFFFFF


@dataclass
class SamplingParams:
    """The `sampling` keys of the config, and `seed`; checked by the same rules as the config
    (config.SCHEMA), with the same messages. `stop` may be one string."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # one stop string, not one per character
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError (a ValueError) for a value the config would refuse; generate() calls it again on
        every rank, since the fields may have been changed after construction."""
        for f in fields(self):
            key = "seed" if f.name == "seed" else f"sampling.{f.name}"
            check_value(f"SamplingParams.{f.name}", SCHEMA[key], getattr(self, f.name))


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix on int64 tensors (values stay below 2**63, so no overflow)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] uniforms in (0, 1), a pure function of (seed, step, token id) per row."""
    row = _hash32(_hash32(seeds & _M32) ^ (steps & _M32))
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _hash32((row[:, None] + ids[None, :] * 0x9E3779B1) & _M32)
    return ((bits >> 8).float() + 0.5) / float(1 << 24)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`; on CUDA through pinned memory, so the host does not wait."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], steps: list[int]) -> torch.Tensor:
    """logits: [B, vocab] fp32 -> chosen ids [B] (int64)."""
    greedy = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if not rows:
        return greedy
    dev = logits.device
    if logits.is_cuda and logits.dtype == torch.float32 and all(
            params[i].top_k == 0 and params[i].top_p >= 1 for i in rows):
        from tp_engine.kernels import fused_ops
        ops = fused_ops(dev)
        if ops is not None:  # the same draw in one pass over the logits (kernels/sampling.py)
            row_hash = _hash32(_hash32(to_device([seeds[i] for i in rows], torch.int64, dev) & _M32)
                               ^ (to_device([steps[i] for i in rows], torch.int64, dev) & _M32))
            temps = to_device([params[i].temperature for i in rows], torch.float32, dev)
            rows_t = to_device(rows, torch.int64, dev)
            if logits.stride(-1) != 1:
                logits = logits.contiguous()
            greedy[rows_t] = ops.gumbel_argmax(logits, rows_t, temps, row_hash)
            return greedy
    rows_t = to_device(rows, torch.int64, dev)
    x = logits[rows_t] / to_device([params[i].temperature for i in rows], torch.float32, dev)[:, None]
    top_k = [params[i].top_k for i in rows]
    if any(top_k):
        k = to_device([t if t > 0 else x.shape[-1] for t in top_k], torch.int64, dev)
        kth = x.sort(dim=-1, descending=True).values.gather(1, (k - 1).clamp(max=x.shape[-1] - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    if any(params[i].top_p < 1 for i in rows):
        top_p = to_device([params[i].top_p for i in rows], torch.float32, dev)
        sorted_x, order = x.sort(dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum - sorted_x.softmax(-1) > top_p[:, None]  # keep the smallest prefix whose mass reaches top_p
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    u = uniform_noise(to_device([seeds[i] for i in rows], torch.int64, dev),
                      to_device([steps[i] for i in rows], torch.int64, dev), x.shape[-1])
    chosen = (x - torch.log(-torch.log(u))).argmax(dim=-1)  # Gumbel-max: a draw from softmax(x)
    out = greedy.clone()
    out[rows_t] = chosen
    return out
