"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the (padded) vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tp_engine.base.batch import get_context
from tp_engine.comm import all_reduce, gather_to_rank0, get_tp
from tp_engine.layers.linear import check_shape, matmul

PAD_TO = 64  # each rank's slice is a multiple of 64 rows, which keeps the matmul aligned


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.tp = get_tp()
        self.vocab_size = vocab_size
        step = PAD_TO * self.tp.size
        self.padded_vocab = (vocab_size + step - 1) // step * step
        self.shard = self.padded_vocab // self.tp.size
        self.start = self.tp.rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, src, shard_id=None) -> None:
        check_shape(src, (self.vocab_size, param.shape[1]))
        n = max(0, min(self.shard, self.vocab_size - self.start))  # the last shard may be partly padding
        param.data.zero_()
        if n:
            param.data[:n].copy_(src.narrow(0, self.start, n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.shard)
        out = F.embedding(local.masked_fill(~mine, 0), self.weight)
        out.mul_(mine.unsqueeze(-1).to(out.dtype))  # ids owned by other ranks give zero rows
        return all_reduce(out, self.tp)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits of each request's last position, gathered on rank 0 (other ranks get None)."""
    ops = None  # the engine's fused kernels, set once after the build (layers/linear.py's docstring)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        ctx = get_context()
        if ctx is not None and ctx.batch.is_prefill:
            hidden = hidden[ctx.batch.logit_rows]  # prefill: one row per request, not per token
        logits = gather_to_rank0(matmul(hidden, self.weight, ops=self.ops), self.tp)
        return None if logits is None else logits[:, : self.vocab_size]
