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
        self.kv = self.attn = self.features = None
        self.last_hidden: torch.Tensor | None = None  # each row's output in the latest forward

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
        self.attn = make_backend(backend, self.device, num_heads=self.heads, num_kv_heads=self.kv_heads,
                                 head_dim=self.head_dim, page_size=page_size, dtype=self.dtype,
                                 max_batch=max_batch, num_pages=num_pages, ops=ops)

    def store_features(self, batch: Batch, aux: list[torch.Tensor]) -> None:
        """After a target forward (every rank): each of its tokens' feature, at the token's KV slot."""
        self.features[batch.out_loc] = self.head.fuse(torch.cat(aux, dim=-1))

    @torch.inference_mode()
    def forward(self, batch: Batch, ref_rows: torch.Tensor | None) -> torch.Tensor | None:
        """One drafting forward: a catch-up batch reads the target's features at its slots; a next-step
        batch (`ref_rows`: each row's row in the forward before) the head's own output there."""
        if ref_rows is None:
            hidden = self.features[batch.out_loc]
        else:
            hidden = self.last_hidden[ref_rows]
        self.attn.prepare(batch)
        with forward_context(batch, self.kv, self.attn):
            out = self.head(self.embed(batch.input_ids), hidden)
            self.last_hidden = out[batch.logit_rows] if batch.is_prefill else out
            return self.head.logits(out)
