"""Mixture-of-experts layers: the replicated router and the tensor-parallel experts.

Every rank holds every expert, each cut like the dense MLP: gate and up by rows (column-parallel), down by
columns (row-parallel). A rank computes all k chosen experts of every token on its slice of their inner
dimension, so its combined output is a partial sum, and one all-reduce after the combine (done by the next
RMSNorm, as for the dense MLP) completes every expert at once. The router is replicated: every rank sees the
same hidden states and so picks the same experts.

Expert parallelism could place whole experts instead: a rank would keep the experts of its range (the
weight loader already receives the expert of each tensor) and give the others weight zero; the all-reduce
after the combine stays where it is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tp_engine.comm import get_tp
from tp_engine.layers.linear import check_shape, matmul, weight_param


class TopKRouter(nn.Module):
    """Scores every expert for every token and keeps the k best: softmax over all experts in fp32, the top k,
    renormalised to sum to 1 when `renormalize` (config norm_topk_prob). The weight is whole on every rank."""
    ops = None  # the engine's fused kernels, set once after the build (layers/linear.py's docstring)

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.weight.replicated = True  # the same values on every rank, random weights too (loader.init_dummy)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (routing weights [N, k] in x's dtype, expert ids [N, k]), largest weight first."""
        ops = self.ops
        logits = matmul(x, self.weight, replicated=True, ops=ops)  # every rank must pick the same experts
        if ops is not None:
            return ops.moe_topk_softmax(logits, self.top_k, self.renormalize)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


class FusedMoE(nn.Module):
    """The experts of one sparse layer, each a SwiGLU MLP, stacked: `gate_up_proj` [E, 2 I/tp, hidden] holds
    expert e's [gate_r | up_r] rows, `down_proj` [E, hidden, I/tp] its columns of down.

    Checkpoint tensors are per expert (`{e}.gate_proj.weight`, ...; `checkpoint_parts` tells the loader),
    and reach `weight_loader` with shard id (e, "gate" | "up" | "down"). weight_device: as LinearBase's.
    """
    ops = None  # the engine's fused kernels, set once after the build (layers/linear.py's docstring)

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 weight_device: str | None = None) -> None:
        super().__init__()
        self.tp = get_tp()
        assert intermediate % self.tp.size == 0, \
            f"moe_intermediate_size {intermediate} does not split across {self.tp.size} ranks"
        self.num_experts, self.hidden, self.full_inter = num_experts, hidden, intermediate
        self.scales = None  # block scales when the experts stay in fp8 (layers/fp8.py)
        self.inter = n = intermediate // self.tp.size
        self.gate_up_proj = weight_param(num_experts, 2 * n, hidden, device=weight_device)
        self.down_proj = weight_param(num_experts, hidden, n, device=weight_device)
        gate, up, down = names
        experts = range(num_experts)
        self.gate_up_proj.checkpoint_parts = [(f"{e}.{name}.weight", (e, part)) for e in experts
                                              for name, part in ((gate, "gate"), (up, "up"))]
        self.down_proj.checkpoint_parts = [(f"{e}.{down}.weight", (e, "down")) for e in experts]
        self.gate_up_proj.weight_loader = self.down_proj.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, src, shard_id: tuple[int, str]) -> None:
        e, part = shard_id
        n, start = self.inter, self.tp.rank * self.inter
        if part == "down":  # row-parallel: this rank's columns
            check_shape(src, (self.hidden, self.full_inter))
            param.data[e].copy_(src.narrow(1, start, n))
        else:  # column-parallel: this rank's rows of gate, then of up
            check_shape(src, (self.full_inter, self.hidden))
            param.data[e].narrow(0, 0 if part == "gate" else n, n).copy_(src.narrow(0, start, n))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), [N, hidden]."""
        ops = self.ops
        if ops is not None:  # `scales`: fp8 experts (layers/fp8.Fp8Experts.keep)
            return ops.fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids, self.scales)
        return experts_reference(x, self.gate_up_proj, self.down_proj, weights, ids)


def experts_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
    """The CPU path (and the reference of the GPU kernels): a loop over the experts that received tokens, in
    expert order, each adding its weighted outputs into its tokens' rows, as transformers' eager experts do.
    Reads the per-expert counts on the host."""
    k = ids.shape[1]
    out = torch.zeros_like(x)
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # token slots grouped by expert; slot s is token s // k
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start:start + count]
        start += count
        tokens = slots // k
        gate, up = F.linear(x[tokens], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights.reshape(-1)[slots, None]
        out.index_add_(0, tokens, y)
    return out
