"""The EAGLE-3 draft head (SpecForge / SGLang checkpoint layout; config: checkpoint/eagle3_config.py): one
Llama decoder layer over token embeddings (the head's own, or the target's) and the target's fused hidden
states, with its own LM head over a reduced draft vocabulary.

    fuse:     g = fc(cat(a_1, a_2, a_3))         the target's residual streams entering `aux_layers`
    forward:  e = input_layernorm(embed(token)),  h = hidden_norm(g)
              x = g + o_proj(attention(RoPE(q, k), v)),  q, k, v = qkv_proj(cat(e, h))
              out = x + mlp(post_attention_layernorm(x))
    logits:   lm_head(norm(out)) [draft vocab] placed at the target ids d + d2t[d], -inf elsewhere

`out`, the pre-norm output, is the hidden state the next draft step takes in place of g (SGLang's and vLLM's
draft decode feed back the sum before the final norm; SpecForge's training loop likewise). A row pairs the
token at position p with the hidden state of position p - 1 (the target's, fused, or the previous draft
step's output) and, as SpecForge trains it, takes position p - 1 for RoPE (only differences of positions
matter to attention, so any one shift for every row gives the same result). Attention uses layer 0 of the
head's own KV cache. Every layer shards at any TP like the target's; fc is replicated.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from tp_engine.base.batch import get_context
from tp_engine.checkpoint.eagle3_config import Eagle3Config
from tp_engine.checkpoint.loader import CheckpointError, checkpoint_files, init_dummy, load_checkpoint
from tp_engine.checkpoint.model_config import ModelConfig
from tp_engine.comm import get_tp
from tp_engine.layers import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RMSNorm,
                              RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding)
from tp_engine.layers.linear import matmul, weight_param


class ReplicatedLinear(nn.Module):
    """y = x W^T with W whole on every rank, which all compute the same rows (fc: 3 x target hidden -> hidden,
    small beside the target's layers)."""

    ops = None  # the engine's fused kernels (layers/linear.py's docstring)

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = weight_param(out_features, in_features)
        self.weight.replicated = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight, replicated=True, ops=self.ops)


class Eagle3Attention(nn.Module):
    """Llama attention (no Q/K norm) over [embeds | hidden]: Q, K and V take 2 x hidden inputs."""

    layer_id = 0  # the head's KV cache has one layer

    def __init__(self, cfg: Eagle3Config, rotary: RotaryEmbedding) -> None:
        super().__init__()
        d = cfg.head_dim
        self.rotary = rotary
        self.qkv_proj = QKVParallelLinear(2 * cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, reduce=False)  # the norm reduces
        self.heads, self.kv_heads, self.head_dim = self.qkv_proj.q_heads, self.qkv_proj.kv_heads, d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split([h * d, kvh * d, kvh * d], dim=-1)
        q, k = self.rotary(ctx.batch.positions, q.reshape(-1, h, d), k.reshape(-1, kvh, d))
        o = ctx.attn.forward(self.layer_id, q, k, v.reshape(-1, kvh, d), ctx.kv_cache, ctx.batch)
        return self.o_proj(o.reshape(-1, h * d))


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)  # all-reduced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj.ops is not None:  # silu(gate) * up through the engine's kernels
            return self.down_proj(self.gate_up_proj.silu_mul(x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config, rotary: RotaryEmbedding) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)  # on the embeddings
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps)  # on the hidden state
        self.self_attn = Eagle3Attention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = Eagle3MLP(cfg)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        e = self.input_layernorm(embeds)[0]
        h = self.hidden_norm(hidden)[0]
        x = self.self_attn(torch.cat([e, h], dim=-1))
        # the residual is the hidden state before its norm; o_proj's partial sums are all-reduced here
        x, residual = self.post_attention_layernorm(x, hidden, reduce=True)
        return self.mlp(x) + residual


class Eagle3Head(nn.Module):
    # checkpoint name -> (our fused parameter, which part of it), as the target's
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: Eagle3Config, own_embed: bool = False) -> None:
        """own_embed: the checkpoint holds embed_tokens.weight; otherwise the engine passes the target's
        embeddings (`embed` is None)."""
        super().__init__()
        self.config = cfg  # not `cfg`: the loader reads a target's tie_word_embeddings and quant there
        self.aux_layers: tuple[int, ...] = cfg.aux_layers
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if own_embed else None
        self.fc = ReplicatedLinear(3 * cfg.target_hidden_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.midlayer = Eagle3DecoderLayer(cfg, rotary)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.draft_vocab_size, cfg.hidden_size)
        # draft id d is target id d + d2t[d] (the checkpoint's tensors); t2d[t]: target id t is in the draft
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("target_ids", torch.arange(cfg.draft_vocab_size), persistent=False)

    @property
    def embed(self) -> VocabParallelEmbedding | None:
        """The head's own token embeddings, or None: the target's serve."""
        return self.embed_tokens

    def bind(self, ops) -> None:
        """The engine's fused kernels `ops` (None: the torch code) for every layer that has them."""
        for module in self.modules():
            if hasattr(type(module), "ops"):
                module.ops = ops

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's auxiliary hidden states [N, 3 x target hidden], in `aux_layers` order -> [N, hidden]
        (fc)."""
        return self.fc(aux)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeds, hidden [N, hidden] -> the layer's output [N, hidden] before the final norm: the hidden
        state the next draft step takes, and what `logits` reads."""
        return self.midlayer(embeds, hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Draft logits in the target's vocabulary, [rows, vocab] in the model's dtype with -inf at the target
        ids outside the draft vocabulary, on rank 0 (None on the others); a prompt step's rows are each
        request's last (ParallelLMHead)."""
        logits = self.lm_head(self.norm(hidden)[0])
        if logits is None:
            return None
        out = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        out[:, self.target_ids] = logits
        return out

    def check_vocab_map(self, files: dict[str, str]) -> None:
        """d2t must send the draft ids to distinct target ids, and t2d, where the checkpoint has it, mark
        exactly those; sets `target_ids`. files: tensor name -> the file it is in."""
        vocab, target = self.config.vocab_size, torch.arange(self.config.draft_vocab_size) + self.d2t.cpu()
        where = f"tensor 'd2t' in {files.get('d2t')}"
        bad = ((target < 0) | (target >= vocab)).nonzero()
        if len(bad):
            d = int(bad[0])
            raise CheckpointError(f"{where}: draft id {d} maps to target id {int(target[d])}, outside the "
                                  f"target's vocabulary of {vocab}")
        ids, counts = target.unique(return_counts=True)
        if (counts > 1).any():
            t = int(ids[counts > 1][0])
            raise CheckpointError(f"{where}: draft ids {(target == t).nonzero().flatten().tolist()} all map "
                                  f"to target id {t}")
        if "t2d" in files:
            marked = self.t2d.cpu()
            if int(marked.sum()) != len(target) or not bool(marked[target].all()):
                raise CheckpointError(f"tensor 't2d' in {files['t2d']} does not mark the target ids that d2t "
                                      f"maps the draft vocabulary to ({int(marked.sum())} marked, "
                                      f"{int(marked[target].sum())} of the {len(target)} mapped)")
        self.target_ids.copy_(target)


def tensor_files(path: str) -> dict[str, str]:
    """Each tensor name of the checkpoint in `path` -> the file it is in (safetensors headers only)."""
    out = {}
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                out.update((name, file.name) for name in handle.keys())
        except Exception as e:  # safetensors reports truncation and corruption with its own error types
            raise CheckpointError(f"cannot read checkpoint file {file}: {e}") from None
    return out


def load_eagle3(path: str, target_cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                dummy_seed: int | None = None) -> Eagle3Head:
    """The EAGLE-3 head in directory `path`, checked against the target `target_cfg`, built in `dtype` on
    `device` and sharded for this rank's TP group. dummy_seed: random weights from config.json alone
    (`load_format: dummy`, for benchmarks of the published shapes), the draft vocabulary the first ids."""
    cfg = Eagle3Config.from_dir(path, target_cfg)
    cfg.check_tp(get_tp().size)
    if dummy_seed is not None:
        return _dummy_head(cfg, dtype, device, dummy_seed)
    files = tensor_files(path)
    if cfg.draft_vocab_size < cfg.vocab_size and "d2t" not in files:
        raise CheckpointError(f"checkpoint {path} is missing tensor 'd2t': draft_vocab_size "
                              f"{cfg.draft_vocab_size} < vocab_size {cfg.vocab_size} needs the map of draft "
                              "ids to target ids")
    own = "embed_tokens.weight" in files
    if not own and cfg.hidden_size != target_cfg.hidden_size:
        raise CheckpointError(f"checkpoint {path} has no embed_tokens.weight, and the target's embeddings "
                              f"(hidden_size {target_cfg.hidden_size}) do not fit the head's hidden_size "
                              f"{cfg.hidden_size}")
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = Eagle3Head(cfg, own_embed=own)
    finally:
        torch.set_default_dtype(torch.float32)
    load_checkpoint(head, path)
    head.check_vocab_map(files)
    return head.eval()


def _dummy_head(cfg: Eagle3Config, dtype: torch.dtype, device: torch.device, seed: int) -> Eagle3Head:
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = Eagle3Head(cfg, own_embed=cfg.hidden_size != cfg.target_hidden_size)
    finally:
        torch.set_default_dtype(torch.float32)
    init_dummy(head, seed, get_tp().rank)
    return head.eval()
