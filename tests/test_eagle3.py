"""The EAGLE-3 draft head (models/eagle3.py) on a checkpoint written in the published SpecForge / SGLang
layout: its forward and logits equal a plain-torch reference of the published computation, at TP 1 and TP 2,
over a paged KV cache; bad checkpoints are refused naming the key or tensor and the file."""
from __future__ import annotations

import gc
import json
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from helpers import make_checkpoint
from tp_engine import comm
from tp_engine.attention.kv_cache import KVCache
from tp_engine.attention.torch_backend import TorchBackend
from tp_engine.base.batch import Batch, forward_context
from tp_engine.checkpoint.eagle3_config import Eagle3Config
from tp_engine.checkpoint.loader import CheckpointError
from tp_engine.checkpoint.model_config import ModelConfig
from tp_engine.checkpoint.model_config_checks import ModelError
from tp_engine.models.eagle3 import load_eagle3

VOCAB, LAYERS = 512, 8  # the tiny target's
TOL = dict(rtol=1e-5, atol=1e-5)
# "shared": the head takes the target's embeddings (hidden sizes equal); "own": it has embed_tokens and a
# hidden size of its own (fc takes target_hidden_size)
VARIANTS = {"shared": {}, "own": {"hidden_size": 48, "target_hidden_size": 64}}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("target"), vocab=VOCAB, hidden=64, layers=LAYERS)


def head_config(**over) -> dict:
    """A config.json with the published field names (SpecForge's qwen3 configs, scaled down)."""
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "rope_scaling": None, "max_position_embeddings": 2048, "vocab_size": VOCAB, "draft_vocab_size": 96,
           "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "float32",
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}}
    cfg.update(over)
    return cfg


def head_tensors(cfg: dict, own_embed: bool, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random weights under the published tensor names; norms away from 1 and a d2t that is not the identity,
    so that a skipped norm or an ignored map shows."""
    g = torch.Generator().manual_seed(seed)
    H, I, vd = cfg["hidden_size"], cfg["intermediate_size"], cfg["draft_vocab_size"]
    ht = cfg.get("target_hidden_size") or H
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]

    def w(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std
    p = "midlayer."
    t = {"fc.weight": w(H, 3 * ht, std=0.05), p + "input_layernorm.weight": 1 + w(H, std=0.3),
         p + "hidden_norm.weight": 1 + w(H, std=0.3), p + "self_attn.q_proj.weight": w(q, 2 * H),
         p + "self_attn.k_proj.weight": w(kv, 2 * H), p + "self_attn.v_proj.weight": w(kv, 2 * H),
         p + "self_attn.o_proj.weight": w(H, q), p + "post_attention_layernorm.weight": 1 + w(H, std=0.3),
         p + "mlp.gate_proj.weight": w(I, H), p + "mlp.up_proj.weight": w(I, H),
         p + "mlp.down_proj.weight": w(H, I), "norm.weight": 1 + w(H, std=0.3),
         "lm_head.weight": w(vd, H, std=1)}
    V = cfg["vocab_size"]
    target = torch.randperm(V, generator=g)[:vd].sort().values  # the draft vocabulary, in target ids
    t["d2t"] = target - torch.arange(vd)
    t["t2d"] = torch.zeros(V, dtype=torch.bool)
    t["t2d"][target] = True
    if own_embed:
        t["embed_tokens.weight"] = w(V, H, std=1)
    return t


def write_head(path: Path, cfg: dict, tensors: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def make_head(path: Path, variant: str) -> Path:
    cfg = head_config(**VARIANTS[variant])
    return write_head(path, cfg, head_tensors(cfg, own_embed=variant == "own"))


def reference(t: dict, cfg: dict, embeds, hidden, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """The published head on one sequence (its rows in order, causal attention), in plain fp32 torch: the
    layer's output before the final norm, and the logits in the target vocabulary (-inf off the draft's)."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n, p = len(positions), "midlayer."

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x):
        ang = positions[:, None].double() / theta ** (torch.arange(0, d, 2).double() / d)
        cos, sin = (torch.cat([f] * 2, -1)[:, None].float() for f in (ang.cos(), ang.sin()))
        return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin

    e, h = rms(embeds, t[p + "input_layernorm.weight"]), rms(hidden, t[p + "hidden_norm.weight"])
    x = torch.cat([e, h], -1)
    q = rope((x @ t[p + "self_attn.q_proj.weight"].T).view(n, nh, d))
    k = rope((x @ t[p + "self_attn.k_proj.weight"].T).view(n, nkv, d)).repeat_interleave(nh // nkv, 1)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(n, nkv, d).repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, nh * d)
    h = hidden + o @ t[p + "self_attn.o_proj.weight"].T  # the residual: the hidden state before its norm
    m = rms(h, t[p + "post_attention_layernorm.weight"])
    out = h + (F.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)) \
        @ t[p + "mlp.down_proj.weight"].T
    draft = rms(out, t["norm.weight"]) @ t["lm_head.weight"].T
    logits = torch.full((n, VOCAB), float("-inf"))
    logits[:, torch.arange(len(t["d2t"])) + t["d2t"]] = draft  # target id = draft id + d2t[draft id]
    return out, logits


def check_head(head_dir: Path, target_dir: Path) -> None:
    """Two requests (5 and 3 tokens) in one prompt step over pages out of order, then one more token each
    that takes the head's previous output as its hidden state and attends to the cached rows."""
    rank = comm.get_tp().rank
    head = load_eagle3(str(head_dir), ModelConfig.from_dir(str(target_dir)), torch.float32,
                       torch.device("cpu"))
    cfg = json.loads((head_dir / "config.json").read_text())
    t = load_file(str(head_dir / "model.safetensors"))
    H, ht = cfg["hidden_size"], cfg.get("target_hidden_size") or cfg["hidden_size"]
    g = torch.Generator().manual_seed(7)  # the same inputs on every rank
    table = t.get("embed_tokens.weight", torch.randn(VOCAB, H, generator=g))  # else: the target's, as given
    ids, ids2 = torch.randint(VOCAB, (8,), generator=g), torch.randint(VOCAB, (2,), generator=g)
    aux = torch.randn(8, 3 * ht, generator=g)
    embeds = head.embed(ids) if head.embed is not None else table[ids]
    embeds2 = head.embed(ids2) if head.embed is not None else table[ids2]
    attn = head.midlayer.self_attn
    cache = KVCache(1, 4, 4, attn.kv_heads, attn.head_dim, torch.float32, torch.device("cpu"))
    backend = TorchBackend(torch.device("cpu"), attn.heads, attn.kv_heads, attn.head_dim, 4)
    pos = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    prefill = Batch(True, ids, pos, torch.tensor([8, 9, 10, 11, 0, 4, 5, 6]), [5, 3], [5, 3],
                    [[2, 0], [1]], torch.tensor([4, 7]))
    decode = Batch(False, ids2, torch.tensor([5, 3]), torch.tensor([1, 7]), [6, 4], [1, 1], [[2, 0], [1]],
                   torch.arange(2))
    with torch.no_grad():
        backend.prepare(prefill)
        with forward_context(prefill, cache, backend):
            out = head(embeds, head.fuse(aux))
            logits = head.logits(out)
        backend.prepare(decode)
        with forward_context(decode, cache, backend):
            out2 = head(embeds2, out[prefill.logit_rows])
            logits2 = head.logits(out2)
    assert (logits is None) == (logits2 is None) == (rank != 0)
    for r, rows in enumerate([slice(0, 5), slice(5, 8)]):
        ref_out, ref_logits = reference(t, cfg, table[ids[rows]], aux[rows] @ t["fc.weight"].T, pos[rows])
        torch.testing.assert_close(out[rows], ref_out, **TOL)
        # the next token: the previous output fed back as its hidden state, at the next position
        seq_embeds = torch.cat([table[ids[rows]], table[ids2[r:r + 1]]])
        seq_hidden = torch.cat([aux[rows] @ t["fc.weight"].T, ref_out[-1:]])
        seq_pos = torch.cat([pos[rows], pos[rows][-1:] + 1])
        ref_out2, ref_logits2 = reference(t, cfg, seq_embeds, seq_hidden, seq_pos)
        torch.testing.assert_close(out2[r], ref_out2[-1], **TOL)
        if rank == 0:
            torch.testing.assert_close(logits[r], ref_logits[-1], **TOL)
            torch.testing.assert_close(logits2[r], ref_logits2[-1], **TOL)
            assert logits2[r].isfinite().sum() == cfg["draft_vocab_size"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_head_equals_the_published_forward(variant, target_dir, tmp_path):
    """Forward (the pre-norm output the next step takes) and logits mapped through d2t equal the reference
    of the published head, for a prompt step and a following one-token step."""
    check_head(make_head(tmp_path / variant, variant), target_dir)


def _tp_worker(rank: int, world: int, init_file: str, dirs: list, errors) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    comm.set_tp(comm.TPGroup(rank, world, torch.device("cpu"), dist.group.WORLD, dist.group.WORLD))
    for head_dir in dirs[1:]:
        try:
            check_head(Path(head_dir), Path(dirs[0]))
        except Exception:
            errors.put(f"rank {rank}, {head_dir}: {traceback.format_exc()}")
    comm.shutdown()  # drops every reference to the group first: gloo can abort a process exiting with one
    gc.collect()


def test_head_at_tp2_equals_the_published_forward(target_dir, tmp_path):
    """Sharded over 2 gloo ranks (heads, MLP and draft vocabulary split, fc replicated), the head computes
    the same as the reference, and only rank 0 gets logits."""
    dirs = [str(target_dir)] + [str(make_head(tmp_path / v, v)) for v in VARIANTS]
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    init = str(tmp_path / "init")
    procs = [ctx.Process(target=_tp_worker, args=(r, 2, init, dirs, errors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, "\n".join(found)
    assert all(p.exitcode == 0 for p in procs)


def test_aux_layers_are_the_streams_entering_the_layer_after_each_id(target_dir):
    """eagle_config ids name the output of target layer j (SpecForge, SGLang): the head reads the stream
    entering layer j + 1. SpecForge's default ids [1, L/2 - 1, L - 4] give SGLang's default capture
    (2, L/2, L - 3), which is also what a config without ids gets."""
    target = ModelConfig.from_dir(str(target_dir))
    assert Eagle3Config.from_dict(head_config(), target).aux_layers == (2, 4, 5)
    assert Eagle3Config.from_dict(head_config(eagle_config={}), target).aux_layers == (2, 4, 5)
    ids = {"eagle_aux_hidden_state_layer_ids": [0, 2, 6]}
    assert Eagle3Config.from_dict(head_config(eagle_config=ids), target).aux_layers == (1, 3, 7)


def _drop(name):
    return lambda t: t.pop(name)


def _set(name, fn):
    return lambda t: t.__setitem__(name, fn(t[name]))


BAD = {  # config changes, tensor change, error, words the message holds
    "fc input": ({"target_hidden_size": 48}, None, ModelError, ["target_hidden_size=48", "config.json"]),
    "hidden size": ({"hidden_size": 48}, None, ModelError, ["hidden_size=48", "config.json"]),
    "fc shape": ({}, _set("fc.weight", lambda w: w[:, :96]), CheckpointError,
                 ["fc.weight", "model.safetensors"]),
    "vocab": ({"vocab_size": 500}, None, ModelError, ["vocab_size=500", "config.json"]),
    "no d2t": ({}, _drop("d2t"), CheckpointError, ["'d2t'", "draft_vocab_size"]),
    "no lm_head": ({}, _drop("lm_head.weight"), CheckpointError, ["lm_head.weight", "missing"]),
    "two layers": ({"num_hidden_layers": 2}, None, ModelError, ["num_hidden_layers=2", "config.json"]),
    "rope scaling": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, None, ModelError,
                     ["rope_scaling", "llama3", "config.json"]),
    "d2t range": ({}, _set("d2t", lambda d: d + 1000), CheckpointError,
                  ["'d2t'", "model.safetensors", "draft id 0"]),
    "d2t dtype": ({}, _set("d2t", lambda d: d.float()), CheckpointError, ["'d2t'", "integer"]),
    "t2d": ({}, _set("t2d", lambda m: ~m), CheckpointError, ["'t2d'", "model.safetensors"]),
    "aux ids": ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}}, None, ModelError,
                ["eagle_config.eagle_aux_hidden_state_layer_ids", "[1, 3, 7]"]),
    "aux ids twice": ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 0, 0]}}, None, ModelError,
                      ["eagle_config.eagle_aux_hidden_state_layer_ids", "ascending", "[0, 0, 0]"]),
    "aux ids out of order": ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [4, 1, 3]}}, None,
                             ModelError, ["eagle_config.eagle_aux_hidden_state_layer_ids", "[4, 1, 3]"]),
    "speculators": ({"architectures": ["Eagle3Speculator"]}, None, ModelError,
                    ["Eagle3Speculator", "speculators"]),
    "norm before residual": ({"norm_before_residual": True}, None, ModelError, ["norm_before_residual"]),
    "tied": ({"tie_word_embeddings": True}, None, ModelError, ["tie_word_embeddings"]),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_heads_are_refused_by_name(case, target_dir, tmp_path):
    """A head that does not fit the target, or that the implementation here does not compute, fails at load
    with one message naming the key or tensor (and the file), before any step."""
    over, edit, error, words = BAD[case]
    cfg = head_config(**over)
    tensors = head_tensors(head_config(), own_embed=False)
    if edit is not None:
        edit(tensors)
    path = write_head(tmp_path / "head", cfg, tensors)
    with pytest.raises(error) as e:
        load_eagle3(str(path), ModelConfig.from_dir(str(target_dir)), torch.float32, torch.device("cpu"))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_head_without_embeddings_needs_the_targets_hidden_size(target_dir, tmp_path):
    """The target's embeddings serve a head without embed_tokens only when the hidden sizes agree."""
    cfg = head_config(hidden_size=48, target_hidden_size=64)
    path = write_head(tmp_path / "head", cfg, head_tensors(cfg, own_embed=False))
    with pytest.raises(CheckpointError, match="embed_tokens.weight"):
        load_eagle3(str(path), ModelConfig.from_dir(str(target_dir)), torch.float32, torch.device("cpu"))


def test_heads_must_split_across_the_tp_size(target_dir):
    """The TP check names the field that does not divide, and the file."""
    cfg = Eagle3Config.from_dict(head_config(), ModelConfig.from_dir(str(target_dir)), "head/config.json")
    cfg.check_tp(2)
    with pytest.raises(ModelError, match=r"head/config.json: cannot split num_attention_heads=4 .* size 3"):
        cfg.check_tp(3)
