"""The forward context: what one step computes, set once per step so layers take no plumbing arguments.

Whoever runs a forward (the engine, its CUDA-graph runners, the memory plan) wraps it in `forward_context`,
and the layers that need the step (attention: the batch, KV cache and backend; the LM head: each request's
last row) read it with `get_context`. It is held in a ContextVar, not a module global: its value belongs to
the thread (or asyncio task) that set it and is restored when the forward ends, so an engine running in
another thread of the same process never sees this step, and nothing of it outlives the forward. A
ContextVar rather than a step held by the model: every attention layer and the LM head would need a
reference to that holder, given through their constructors, while with this the model's forward reads like
the math.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Batch:
    """One step's work, identical on every rank. Token rows are packed: N tokens of B requests.

    Prefill: each request contributes its new tokens (`extend_lens`). Decode: exactly one token each.
    """

    is_prefill: bool
    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    out_loc: torch.Tensor  # [N] flat KV slot (page * page_size + offset) each new token is written to
    seq_lens: list[int]  # [B] KV length of each request after this step
    extend_lens: list[int]  # [B] new tokens of each request in this step
    page_tables: list  # [B] pages of each request, in order (int32 arrays: step_message.PageTables)
    # rows whose logits the step returns, in the packed N rows: each request's last token, and every token of
    # a request that verifies drafts (step_message.StepMessage.verify)
    logit_rows: torch.Tensor
    plan: dict[str, Any] = field(default_factory=dict)  # what the attention backend prepared for this batch
    # 0: the target model's step; else a proposer's forward: 1 its first of a step (catching up on the
    # requests' tokens), 2 a next one (inputs: the tokens the forward before drew); runtime/drafting.py
    draft: int = 0
    verify: int = 0  # in a target step, the leading rows that verify drafts (every token of them has logits)

    @property
    def size(self) -> int:
        return len(self.seq_lens)

    @property
    def decode_rows(self) -> int:
        """How many leading rows have one new token: all of a decode step; in a mixed step its decode rows,
        which the scheduler puts first (they hold the references to the previous step's tokens)."""
        return next((i for i, n in enumerate(self.extend_lens) if n != 1), self.size)


@dataclass
class Context:
    batch: Batch
    kv_cache: Any  # tp_engine.attention.kv_cache.KVCache
    attn: Any  # an attention backend
    # the decoder layers whose input (the residual stream) the step keeps in `aux`, in order: what an EAGLE
    # head reads of the target (speculative/eagle.py)
    capture: tuple[int, ...] = ()
    aux: list = field(default_factory=list)


_STEP: ContextVar[Context | None] = ContextVar("tp_engine_step", default=None)


def get_context() -> Context | None:
    """The step of the forward running in this thread, or None outside one."""
    return _STEP.get()


@contextmanager
def forward_context(batch: Batch, kv_cache, attn, capture: tuple[int, ...] = ()):
    """The step the layers read (`get_context`) while the block runs; the one before it after."""
    ctx = Context(batch, kv_cache, attn, capture)
    token = _STEP.set(ctx)
    try:
        yield ctx
    finally:
        _STEP.reset(token)
