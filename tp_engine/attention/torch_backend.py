"""Plain PyTorch attention over the paged KV cache: the CPU path, and the reference the GPU backend
must equal."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tp_engine.base.batch import Batch
from tp_engine.attention.kv_cache import page_table


class TorchBackend:
    name = "torch"
    fuses_qkv = False  # the model norms Q and K and applies RoPE itself (attention.fuses_qkv)

    def __init__(self, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 **_) -> None:
        self.device, self.page_size = device, page_size
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5

    def prepare(self, batch: Batch) -> None:
        """Per request: the (page, slot) of every cached token and the causal mask; shared by all layers."""
        indptr, ids, _ = page_table(batch, self.page_size)
        ids = torch.from_numpy(ids).to(self.device, torch.int64)
        reqs = []
        row = 0
        for i, (n, L) in enumerate(zip(batch.extend_lens, batch.seq_lens)):
            pos = torch.arange(L, device=self.device)
            page = ids[int(indptr[i]):int(indptr[i + 1])][pos // self.page_size]
            q_pos = torch.arange(L - n, L, device=self.device)
            mask = pos[None, :] <= q_pos[:, None] if n > 1 else None
            reqs.append((row, n, page, pos % self.page_size, mask))
            row += n
        batch.plan["torch"] = reqs

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache,
                batch: Batch) -> torch.Tensor:
        """q: [N, heads, d], k/v: [N, kv_heads, d] -> [N, heads, d]."""
        kv_cache.store(layer, k, v, batch.out_loc)
        cache = kv_cache.layer(layer)
        out = torch.empty_like(q)
        for row, n, page, slot, mask in batch.plan["torch"]:
            keys = cache[page, 0, slot].repeat_interleave(self.group, dim=1).transpose(0, 1)  # [heads, L, d]
            vals = cache[page, 1, slot].repeat_interleave(self.group, dim=1).transpose(0, 1)
            qb = q[row:row + n].transpose(0, 1)  # [heads, n, d]
            o = F.scaled_dot_product_attention(qb, keys, vals, attn_mask=mask, scale=self.scale)
            out[row:row + n] = o.transpose(0, 1)
        return out
