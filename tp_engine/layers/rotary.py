"""Rotary position embedding (the rotate-half form Qwen3 uses), from a cos/sin table built once."""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [N, heads, head_dim], k: [N, kv_heads, head_dim]; positions: [N]."""
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
