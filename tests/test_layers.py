"""Each parallel layer, sharded over 2 and 4 gloo ranks, equals its unsharded equivalent (fp32)."""
import gc
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from tp_engine import comm
from tp_engine.layers import (ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead,
                              QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding)
from tp_engine.checkpoint.loader import TensorSource

TOL = dict(rtol=1.3e-6, atol=1e-5)


def _worker(rank, world, init_file, errors):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    comm.set_tp(comm.TPGroup(rank, world, torch.device("cpu"), dist.group.WORLD, dist.group.WORLD))
    for name, check in CHECKS.items():
        torch.manual_seed(0)  # the same full weights and inputs on every rank
        try:
            check(rank, world)
        except Exception:
            errors.put((name, f"rank {rank}: {traceback.format_exc()}"))
    # drops every reference to the group first: gloo can abort a process that exits holding one
    comm.shutdown()
    gc.collect()


def run_checks(world: int, tmp_path) -> dict[str, str]:
    """Every check on `world` spawned gloo ranks (starting processes is the slow part); name -> first
    failure."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, str(tmp_path / "init"), errors))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs), f"a rank crashed at world size {world}"
    found = {}
    while not errors.empty():
        name, msg = errors.get()
        found.setdefault(name, msg)
    return found


def load(param, full, shard=None):
    param.weight_loader(param, TensorSource(full), shard)


def check_column(rank, world):
    w, b, x = torch.randn(48, 20), torch.randn(48), torch.randn(5, 20)
    layer = ColumnParallelLinear(20, 48, bias=True)
    load(layer.weight, w)
    load(layer.bias, b)
    n = 48 // world
    torch.testing.assert_close(layer(x), (x @ w.T + b)[:, rank * n:(rank + 1) * n], **TOL)


def check_merged(rank, world):
    g, u, x = torch.randn(32, 16), torch.randn(32, 16), torch.randn(3, 16)
    layer = MergedColumnParallelLinear(16, [32, 32])
    load(layer.weight, g, 0)
    load(layer.weight, u, 1)
    n = 32 // world
    want = torch.cat([(x @ g.T)[:, rank * n:(rank + 1) * n], (x @ u.T)[:, rank * n:(rank + 1) * n]], -1)
    torch.testing.assert_close(layer(x), want, **TOL)


def check_qkv(rank, world, kv_heads):
    heads, d, hidden = 8, 4, 16
    q = torch.randn(heads * d, hidden)
    k, v = torch.randn(kv_heads * d, hidden), torch.randn(kv_heads * d, hidden)
    x = torch.randn(3, hidden)
    layer = QKVParallelLinear(hidden, d, heads, kv_heads)
    for name, t in zip("qkv", (q, k, v)):
        load(layer.weight, t, name)
    hq = heads // world
    kv_local = max(1, kv_heads // world)
    # replication when world > kv
    first_kv = rank * kv_heads // world if world > kv_heads else rank * kv_local
    want = torch.cat([(x @ q.T)[:, rank * hq * d:(rank + 1) * hq * d],
                      (x @ k.T)[:, first_kv * d:(first_kv + kv_local) * d],
                      (x @ v.T)[:, first_kv * d:(first_kv + kv_local) * d]], -1)
    torch.testing.assert_close(layer(x), want, **TOL)


def check_row(rank, world):
    w, b, x = torch.randn(12, 40), torch.randn(12), torch.randn(4, 40)
    layer = RowParallelLinear(40, 12, bias=True)
    load(layer.weight, w)
    load(layer.bias, b)
    n = 40 // world
    torch.testing.assert_close(layer(x[:, rank * n:(rank + 1) * n]), x @ w.T + b, **TOL)  # bias added once


def check_embedding(rank, world):
    vocab = 1001  # not divisible by 2 or 4
    w = torch.randn(vocab, 24)
    emb = VocabParallelEmbedding(vocab, 24)
    load(emb.weight, w)
    ids = torch.tensor([0, 1, 500, 999, 1000, 250, 751])
    torch.testing.assert_close(emb(ids), F.embedding(ids, w), **TOL)


def check_lm_head(rank, world):
    from tp_engine.base.batch import Batch, forward_context
    vocab = 1001
    w, h = torch.randn(vocab, 24), torch.randn(9, 24)
    head = ParallelLMHead(vocab, 24)
    load(head.weight, w)
    z = torch.zeros(9, dtype=torch.long)
    last = torch.tensor([3, 4, 8])  # three requests of 4, 1 and 4 tokens
    batch = Batch(True, z, z, z, [4, 1, 4], [4, 1, 4], [[0], [1], [2]], last)
    with forward_context(batch, None, None):
        logits = head(h)
    if rank == 0:  # three rows: the gathered [tp, B, shard] must come back as [B, vocab], in vocab order
        torch.testing.assert_close(logits, h[last] @ w.T, **TOL)
    else:
        assert logits is None


def check_moe(rank, world):
    """Experts split by their inner dimension, router replicated: the all-reduced partial sums equal the
    unsharded experts, and the experts themselves run no collective (the next norm all-reduces)."""
    from tp_engine.layers import FusedMoE, TopKRouter
    from tp_engine.layers.moe import experts_reference
    from tp_engine.checkpoint.loader import default_loader
    E, H, inter, k = 6, 16, 24, 2
    gate, up, down = (torch.randn(E, inter, H) * 0.3, torch.randn(E, inter, H) * 0.3,
                      torch.randn(E, H, inter) * 0.3)  # outputs of order 1, as the other checks
    router_w, x = torch.randn(E, H), torch.randn(7, H)
    router = TopKRouter(H, E, k, renormalize=True)
    default_loader(router.weight, TensorSource(router_w))
    experts = FusedMoE(E, H, inter)
    for e in range(E):
        load(experts.gate_up_proj, gate[e], (e, "gate"))
        load(experts.gate_up_proj, up[e], (e, "up"))
        load(experts.down_proj, down[e], (e, "down"))
    weights, ids = router(x)
    picks = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(picks, ids)
    assert all(torch.equal(p, ids) for p in picks), "ranks routed differently"
    calls = []
    all_reduce = dist.all_reduce
    dist.all_reduce = lambda *a, **kw: calls.append(1) or all_reduce(*a, **kw)
    try:
        partial = experts(x, weights, ids)
    finally:
        dist.all_reduce = all_reduce
    assert not calls
    n = inter // world
    mine = slice(rank * n, (rank + 1) * n)
    want = experts_reference(x, torch.cat([gate[:, mine], up[:, mine]], 1), down[:, :, mine], weights, ids)
    torch.testing.assert_close(partial, want, **TOL)
    full = experts_reference(x, torch.cat([gate, up], 1), down, weights, ids)
    torch.testing.assert_close(comm.all_reduce(partial, comm.get_tp()), full, **TOL)


CHECKS = {"column": check_column, "merged": check_merged, "row": check_row, "embedding": check_embedding,
          "lm_head": check_lm_head, "moe": check_moe}


def _qkv_split(rank, world):
    check_qkv(rank, world, kv_heads=4)


def _qkv_replicated(rank, world):
    check_qkv(rank, world, kv_heads=2 if world == 4 else 1)


def _set_up_agreement(rank, world):
    """A set-up step of the fast all-reduce that fails on one rank fails on all (comm/custom_all_reduce.py):
    a rank that went on alone would wait in a kernel its peers never launch."""
    from tp_engine.comm.custom_all_reduce import _attempt
    _, ok = _attempt(lambda: 1 // (rank - 1), comm.get_tp(), "a step that fails on rank 1 only")
    assert not ok
    out, ok = _attempt(lambda: rank * 10, comm.get_tp(), "a step that works everywhere")
    assert ok and out == rank * 10


CHECKS.update(qkv_split=_qkv_split, qkv_replicated=_qkv_replicated, set_up_agreement=_set_up_agreement)


# one test a world size: the parallel workers never both start its ranks
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_parallel_layers_equal_unsharded(world, tmp_path):
    failures = run_checks(world, tmp_path)
    assert not failures, "\n".join(f"{name}: {msg}" for name, msg in failures.items())


def test_tp_that_cannot_split_heads_names_the_numbers():
    from tp_engine.checkpoint.model_config import ModelConfig, ModelError
    cfg = ModelConfig.from_dict({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 12,
                                 "num_hidden_layers": 1, "num_attention_heads": 6, "num_key_value_heads": 3})
    with pytest.raises(ModelError, match="num_attention_heads=6 .* size 4"):
        cfg.check_tp(4)
    cfg = ModelConfig.from_dict({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 12,
                                 "num_hidden_layers": 1, "num_attention_heads": 12, "num_key_value_heads": 3})
    with pytest.raises(ModelError, match="num_key_value_heads=3 .* size 2"):
        cfg.check_tp(2)
    cfg.check_tp(3)
    cfg.check_tp(6)  # 6 % 3 == 0: KV heads replicated
