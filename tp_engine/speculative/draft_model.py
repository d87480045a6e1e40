"""A draft model: a smaller Qwen3 with the target's tokenizer (Qwen3-0.6B for Qwen3-8B or 32B) proposes
tokens by decoding ahead of the target.

It is sharded like the target, on the same ranks (its layers take the same group), and keeps its own KV
pool with the target's page size and page ids: a request's page table addresses both, so the draft needs no
page bookkeeping of its own. Its K/V at a position is valid once the draft has run over the request's tokens
up to there (`RequestState.spec_cached`); runtime/drafting.py catches it up before it drafts.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tp_engine.attention import make_backend
from tp_engine.attention.kv_cache import KVCache
from tp_engine.base.batch import Batch, forward_context
from tp_engine.checkpoint.model_config import ModelConfig
from tp_engine.models import load_model

TOKENIZER_FILES = ("tokenizer.json", "vocab.json")


def check_same_tokenizer(draft_dir: str, target_dir: str, draft: ModelConfig, target: ModelConfig) -> None:
    """Refuse a draft whose vocabulary is not the target's: its token ids would mean other text."""
    where = f"{draft_dir}/config.json"
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{where}: vocab_size {draft.vocab_size} differs from the target's "
                         f"{target.vocab_size} (speculative.model must share the target's tokenizer)")
    if set(draft.eos_token_ids) != set(target.eos_token_ids):
        raise ValueError(f"{where}: end-of-sequence ids {list(draft.eos_token_ids)} differ from the "
                         f"target's {list(target.eos_token_ids)} (speculative.model must share the target's "
                         "tokenizer)")
    for name in TOKENIZER_FILES:
        a, b = Path(draft_dir, name), Path(target_dir, name)
        if a.is_file() and b.is_file() and _vocab(a) != _vocab(b):
            raise ValueError(f"{a} differs from the target's {b}: the draft has another tokenizer "
                             "(speculative.model must share the target's)")


def _vocab(path: Path) -> object:
    """The token -> id map of a tokenizer file (its other settings may differ harmlessly)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if "model" in data:  # tokenizer.json
        added = sorted((t["id"], t["content"]) for t in data.get("added_tokens", []))
        return data["model"].get("vocab"), added
    return data


class DraftModel:
    """The draft's weights, KV pool and attention backend; `step` runs one drafting forward."""

    shift = 0  # a catch-up row's input at position i is token i (an EAGLE head's is token i + 1)
    keeps_drafted = True  # its K/V at the drafts it ran on holds where the target accepts them

    def __init__(self, cfg: dict, target: ModelConfig, tp_size: int, rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        path = cfg["speculative"]["model"]
        self.cfg = mc = ModelConfig.from_dir(path)
        check_same_tokenizer(path, cfg["model"], mc, target)
        mc.check_tp(tp_size)
        self.model = load_model(mc, {**cfg, "model": path}, dtype, device, rank)
        self.dtype, self.device = dtype, device
        qkv = self.model.model.layers[0].self_attn.qkv_proj
        self.heads, self.kv_heads = qkv.q_heads, qkv.kv_heads
        self.kv = self.attn = None

    def bind(self, ops, fused_qkv: bool) -> None:
        self.model.bind(ops, fused_qkv)

    def bytes_per_page(self, page_size: int) -> int:
        mc = self.cfg
        return KVCache.bytes_per_page(mc.num_layers, page_size, self.kv_heads, mc.head_dim, self.dtype)

    def allocate(self, num_pages: int, page_size: int, backend: str, max_batch: int, ops) -> None:
        """Its KV pool, as many pages as the target's, and its attention backend."""
        mc = self.cfg
        self.kv = KVCache(mc.num_layers, num_pages, page_size, self.kv_heads, mc.head_dim, self.dtype,
                          self.device)
        self.attn = make_backend(backend, self.device, num_heads=self.heads, num_kv_heads=self.kv_heads,
                                 head_dim=mc.head_dim, page_size=page_size, dtype=self.dtype,
                                 max_batch=max_batch, num_pages=num_pages, ops=ops)

    def keep(self, out: None) -> None:
        """Nothing to keep between forwards: the tokens carry all a draft model needs."""

    @torch.inference_mode()
    def step(self, batch: Batch, refs: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        """One drafting forward of a planned batch whose tokens are resolved: logits of each row's last
        position (every row's in a decode batch) on rank 0, None elsewhere; capturable in a CUDA graph."""
        with forward_context(batch, self.kv, self.attn):
            return self.model(batch.input_ids, fp32=False), None
