"""Qwen3 dense decoder over packed [N, C] hidden states (N tokens of all requests in the step)."""
from __future__ import annotations

import torch
from torch import nn

from tp_engine.checkpoint.model_config import ModelConfig
from tp_engine.base.batch import get_context
from tp_engine.layers import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RMSNorm,
                              RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding)


def weight_device(cfg: ModelConfig) -> str | None:
    """Where the linear layers' and experts' weights are built: as placeholders on the meta device in a
    block-FP8 model (layers/fp8.quantize_linears then gives them fp8 storage), else on the default device."""
    return "meta" if cfg.quant is not None else None


class Qwen3Attention(nn.Module):
    # Whether the engine's attention backend takes Q/K norm, RoPE and the K/V write in one kernel with
    # attention (`forward_qkv`); told once, after the build (Qwen3ForCausalLM.bind).
    fused_qkv = False

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id, self.rotary, d, wd = layer_id, rotary, cfg.head_dim, weight_device(cfg)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.attention_bias, weight_device=wd)
        # partial sums: the post-attention norm all-reduces them (fused with its residual add and norm)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, cfg.attention_bias, reduce=False,
                                        weight_device=wd)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)  # per-head norms on Q and K, before RoPE
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.heads, self.kv_heads, self.head_dim = self.qkv_proj.q_heads, self.qkv_proj.kv_heads, d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        if self.fused_qkv:
            # GPU: Q/K norm, RoPE and the K/V write in one kernel, then attention (same arithmetic as below)
            o = ctx.attn.forward_qkv(self.layer_id, qkv, self, ctx.kv_cache, ctx.batch)
            return self.o_proj(o.reshape(-1, h * d))
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        q = self.q_norm.norm(q.reshape(-1, h, d))
        k = self.k_norm.norm(k.reshape(-1, kvh, d))
        q, k = self.rotary(ctx.batch.positions, q, k)
        o = ctx.attn.forward(self.layer_id, q, k, v.reshape(-1, kvh, d), ctx.kv_cache, ctx.batch)
        return self.o_proj(o.reshape(-1, h * d))


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        wd = weight_device(cfg)
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                                       weight_device=wd)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, reduce=False,
                                           weight_device=wd)  # partial sums, as o_proj's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj.ops is not None:  # silu(gate) * up in one kernel, or the matmul's at one token
            return self.down_proj(self.gate_up_proj.silu_mul(x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, mlp: nn.Module) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(cfg, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp  # returns partial sums, like o_proj

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual adds live inside the norms: h = x + attn(norm(x)); out = h + mlp(norm(h)). The
        # attention and MLP outputs leave their row-parallel projections as per-rank partial sums; the norm
        # after each all-reduces them. Layer 0's input is the embedding, whole on every rank.
        x, residual = self.input_layernorm(x, residual, reduce=self.layer_id > 0)
        ctx = get_context()
        if ctx is not None and self.layer_id in ctx.capture:  # the stream entering this layer
            ctx.aux.append(residual.clone())
        x = self.self_attn(x)
        x, residual = self.post_attention_layernorm(x, residual, reduce=True)
        return self.mlp(x), residual


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, i, rotary, self.make_mlp(cfg, i))
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        return Qwen3MLP(cfg)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual)
        return self.norm(x, residual, reduce=True)[0]  # the last layer's MLP output is still partial


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name -> (our fused parameter, which part of it)
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    model_class = Qwen3Model

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = self.model_class(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def bind(self, ops, fused_qkv: bool) -> None:
        """The engine's choices, told once after the build: the fused kernels `ops` (kernels.select, the same
        on every rank; None: the torch code) for every layer that has them, and whether its attention backend
        fuses the Q/K norm, RoPE and the K/V write (attention.fuses_qkv)."""
        for module in self.modules():
            if hasattr(type(module), "ops"):
                module.ops = ops
            if isinstance(module, Qwen3Attention):
                module.fused_qkv = fused_qkv

    def forward(self, input_ids: torch.Tensor, fp32: bool = True) -> torch.Tensor | None:
        """Last-position logits [B, vocab] on rank 0, in fp32 (or, fp32=False, in the model's dtype); None
        on the other ranks."""
        return self.logits(self.model(input_ids), fp32)

    def logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor | None:
        """The LM head on the final hidden states [N, hidden] (of each request's last position in a prompt
        step)."""
        logits = self.lm_head(hidden)
        return logits.float() if logits is not None and fp32 else logits
