"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder (models/qwen3.py) whose MLP is, in the
sparse layers, a mixture of experts: each token runs the k experts the router scores highest.

    p = softmax(x W_router^T)                  over all experts, in fp32
    top = the k largest of p                   renormalised to sum to 1 when norm_topk_prob
    y = sum over e in top of p_e * down_e(silu(gate_e x) * up_e x)

Attention, norms, embeddings and the LM head are the dense model's. Which layers are sparse: config
`decoder_sparse_step` and `mlp_only_layers` (ModelConfig.moe.is_sparse); the others keep a dense MLP.
"""
from __future__ import annotations

import torch
from torch import nn

from tp_engine.layers import FusedMoE, TopKRouter
from tp_engine.checkpoint.model_config import ModelConfig
from tp_engine.models.qwen3 import Qwen3ForCausalLM, Qwen3MLP, Qwen3Model, weight_device


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.gate = TopKRouter(cfg.hidden_size, moe.num_experts, moe.top_k, moe.norm_topk_prob)  # replicated
        # tensor-parallel experts: partial sums, all-reduced by the next norm like the dense MLP's down_proj
        self.experts = FusedMoE(moe.num_experts, cfg.hidden_size, moe.intermediate_size,
                                weight_device=weight_device(cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        return self.experts(x, weights, experts)


class Qwen3MoeModel(Qwen3Model):
    def make_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        return Qwen3MoeSparseBlock(cfg) if cfg.moe.is_sparse(layer_id) else Qwen3MLP(cfg)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_class = Qwen3MoeModel
