"""An EAGLE-3 head as a proposer: one decoder layer that drafts from the target's own hidden states.

The head reads, at each position, the target's residual stream entering three of its layers
(`Eagle3Head.aux_layers`), fused by its `fc` into one vector: the feature. The target writes every token's
feature into a cache beside its KV cache, at the token's KV slot, in each of its forwards (`store_features`);
the head reads them from there whenever it catches up, so the target never waits for the head.

At position i the head takes the feature of position i and the embedding of token i + 1, and its output
there drafts token i + 2. Its KV cache (one layer, the target's page size and page ids) is valid where the
head ran on the target's features: drafting steps run on its own output instead (the hidden state a step
feeds the next), and the positions they wrote are caught up again on the target's features once the target
has verified them (runtime/drafting.py).
"""
from __future__ import annotations

import torch

from tp_engine.attention import make_backend
from tp_engine.attention.kv_cache import KVCache
from tp_engine.base.batch import Batch, forward_context
from tp_engine.checkpoint.model_config import ModelConfig
from tp_engine.models.eagle3 import load_eagle3


class Eagle3Drafter:
    shift = 1  # a catch-up row's input at position i is token i + 1
    keeps_drafted = False  # the drafting steps' K/V is redone on the target's features

    def __init__(self, cfg: dict, target: ModelConfig, target_model, dtype: torch.dtype,
                 device: torch.device) -> None:
        dummy = cfg["seed"] if cfg["load_format"] == "dummy" else None  # random weights, as the target's
        self.head = load_eagle3(cfg["speculative"]["model"], target, dtype, device, dummy)
        self.capture = tuple(self.head.aux_layers)
        self.embed = self.head.embed or target_model.model.embed_tokens
        attn = self.head.midlayer.self_attn
        self.heads, self.kv_heads, self.head_dim = attn.heads, attn.kv_heads, attn.head_dim
        self.hidden = self.head.config.hidden_size
        self.dtype, self.device = dtype, device
        self.kv = self.attn = self.features = self.prev = None

    def bind(self, ops, fused_qkv: bool) -> None:
        self.head.bind(ops)  # its attention has no Q/K norm to fuse: the backend's plain forward

    def bytes_per_page(self, page_size: int) -> int:
        kv = KVCache.bytes_per_page(1, page_size, self.kv_heads, self.head_dim, self.dtype)
        return kv + page_size * self.hidden * self.dtype.itemsize  # and a feature per token

    def allocate(self, num_pages: int, page_size: int, backend: str, max_batch: int, ops) -> None:
        self.kv = KVCache(1, num_pages, page_size, self.kv_heads, self.head_dim, self.dtype, self.device)
        # one feature per KV slot, the scratch page's too (a CUDA graph's padded rows write there)
        self.features = torch.zeros((num_pages + 1) * page_size, self.hidden, dtype=self.dtype,
                                    device=self.device)
        # each request's output in the latest forward, by its row there (`keep`)
        self.prev = torch.zeros(max_batch, self.hidden, dtype=self.dtype, device=self.device)
        self.attn = make_backend(backend, self.device, num_heads=self.heads, num_kv_heads=self.kv_heads,
                                 head_dim=self.head_dim, page_size=page_size, dtype=self.dtype,
                                 max_batch=max_batch, num_pages=num_pages, ops=ops)

    def store_features(self, batch: Batch, aux: list[torch.Tensor]) -> None:
        """After a target forward (every rank): each of its tokens' feature, at the token's KV slot."""
        self.features[batch.out_loc] = self.head.fuse(torch.cat(aux, dim=-1))

    def keep(self, out: torch.Tensor) -> None:
        """After a forward: each row's output at its last position [B, hidden], what a next forward's rows
        read by their row in this one."""
        self.prev[:len(out)].copy_(out)

    @torch.inference_mode()
    def step(self, batch: Batch, refs: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One drafting forward of a planned batch whose tokens are resolved; capturable in a CUDA graph. A
        catch-up row reads the target's feature at its slot; a next-step row (refs[i] >= 0: its row in the
        forward before) the head's own output there. Returns the logits of each row's last position (every
        row's in a decode batch) on rank 0 (None elsewhere), and the head's output at every token."""
        own = self.prev[refs.clamp(min=0)]
        hidden = torch.where((refs >= 0)[:, None], own, self.features[batch.out_loc])
        with forward_context(batch, self.kv, self.attn):
            out = self.head(self.embed(batch.input_ids), hidden)
            return self.head.logits(out), out
