"""RMSNorm, with the residual add (and the all-reduce before it) fused in the way the Qwen3 decoder
chains it."""
from __future__ import annotations

import torch
from torch import nn

from tp_engine.comm import all_reduce, all_reduce_add_rmsnorm, get_tp


class RMSNorm(nn.Module):
    ops = None  # the engine's fused kernels, set once after the build (layers/linear.py's docstring)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps, self.tp = eps, get_tp()  # the group of the engine building it (a process may hold several)
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        # Same order of operations as transformers: normalise in fp32, cast back, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                reduce: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); the first call of a model passes no residual.

        reduce: `x` is this rank's partial sum from a RowParallelLinear(reduce=False), all-reduced here
        first; on the GPU the all-reduce, the add and the norm are then one kernel where they can be."""
        if reduce:
            fused = None
            if residual is not None:
                fused = all_reduce_add_rmsnorm(x, residual, self.weight, self.eps, self.tp)
            if fused is not None:
                return fused
            x = all_reduce(x, self.tp)
        ops = self.ops
        if ops is not None and x.dtype == self.weight.dtype:
            return ops.add_rmsnorm(x, residual, self.weight, self.eps)  # the same arithmetic in one kernel
        if residual is not None:
            x = x + residual
        return self.norm(x), x
