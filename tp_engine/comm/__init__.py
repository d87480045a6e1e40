"""All communication between ranks: every collective the engine runs, by name.

Tensor collectives run on the compute device (`TPGroup.group`: NCCL on CUDA, gloo on CPU) inside the
model's forward, each on the group it is given (the engine's `TPGroup`, which carries the engine's all-reduce
for small messages); control messages run on the CPU group (gloo), rank 0 deciding and the others following.
A world of one has no groups and every function here is the identity, so a single-process run needs no
torchrun. The groups themselves are in comm/group.py, the choice of all-reduce for small messages in
comm/custom_all_reduce.py, the step message's shared-memory path in comm/shm_channel.py.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tp_engine.comm.custom_all_reduce import _PushAllReduce, enable_fast_all_reduce, failure_report
from tp_engine.comm.group import (PeerLost, StartupError, TPGroup, check_startup, get_tp, gloo_reason,
                                  init_distributed, mark_out_of_step, pick_device, set_tp, shutdown,
                                  world_cpu_group)

__all__ = ["TPGroup", "get_tp", "set_tp", "pick_device", "init_distributed", "shutdown", "mark_out_of_step",
           "StartupError", "PeerLost",
           "check_startup", "gloo_reason", "enable_fast_all_reduce", "failure_report",
           "all_reduce", "all_reduce_add_rmsnorm", "gather_to_rank0",
           "broadcast", "broadcast_ints", "broadcast_object", "all_gather_object", "barrier",
           "all_reduce_min"]


# ---- tensor collectives on the compute device (used inside the model's forward) ----

def all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum `x` over the ranks of `tp` and return the sum: in place with NCCL, a new tensor on the paths below.

    On CUDA: messages up to the fast all-reduce's `max_bytes` go through it when `enable_fast_all_reduce`
    set one up on `tp`; inside a CUDA-graph capture NCCL is called through the functional collectives, which
    replay faster than `dist.all_reduce`.
    """
    if tp.size == 1:
        return x
    if x.is_cuda:
        fast = tp.fast_all_reduce
        if fast is not None and fast.fits(x):
            return fast(x)
        if torch.cuda.is_current_stream_capturing():
            out = torch.ops._c10d_functional.all_reduce(x, "sum", tp.group.group_name)
            return torch.ops._c10d_functional.wait_tensor(out)
    dist.all_reduce(x, group=tp.group)
    return x


def all_reduce_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           tp: TPGroup) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(RMSNorm(all_reduce(x) + residual) * weight, all_reduce(x) + residual) in one kernel, where the push
    all-reduce is set up on `tp` and `x` fits it; otherwise None, and the caller does the two steps."""
    fast = tp.fast_all_reduce if tp.size > 1 and x.is_cuda else None
    if isinstance(fast, _PushAllReduce) and fast.fits_norm(x) and residual.is_contiguous() \
            and weight.dtype == x.dtype == residual.dtype:
        return fast.add_rmsnorm(x, residual, weight, eps)
    return None


def gather_to_rank0(x: torch.Tensor, tp: TPGroup) -> torch.Tensor | None:
    """Each rank's `x` ([B, n]: its slice of the columns) joined along the columns on rank 0, in rank order:
    [B, tp.size * n]. The other ranks get None.

    One all-gather through PyTorch's functional collectives, on CUDA (NCCL) and on CPU (gloo): it runs
    eagerly and inside a CUDA-graph capture alike, so eager and graph decode share it. The other ranks
    receive the shards too, and drop them."""
    if tp.size == 1:
        return x
    b = x.shape[0]
    x = x.contiguous()
    parts = torch.ops._c10d_functional.all_gather_into_tensor(x, tp.size, tp.group.group_name)
    # [tp * B, n]: rank r's x in rows r * B to (r + 1) * B
    parts = torch.ops._c10d_functional.wait_tensor(parts)
    if tp.rank != 0:
        return None
    return parts.view(tp.size, b, -1).permute(1, 0, 2).reshape(b, -1)


def broadcast(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Overwrite `x` on every rank with rank 0's `x`, on the compute device (the sampled tokens, each step).
    On CUDA the host does not wait: the copy is queued on the stream like a kernel."""
    if tp.size > 1:
        dist.broadcast(x, group=tp.group, group_src=0)
    return x


# ---- control messages on the CPU group (rank 0 decides, the others follow) ----

def broadcast_ints(values: torch.Tensor | None, tp: TPGroup | None = None) -> torch.Tensor:
    """Send a 1-D int64 CPU tensor from rank 0 to all ranks (others pass None and receive it)."""
    tp = tp or get_tp()
    if tp.size == 1:
        return values
    if tp.channel is not None:
        got = tp.channel.send(values) if tp.rank == 0 else tp.channel.recv()
        if got is not None:
            return got
        # too large for the shared buffer: this message goes through gloo (the channel said so to all)
    n = torch.tensor([values.numel() if tp.rank == 0 else 0], dtype=torch.int64)
    try:
        dist.broadcast(n, group=tp.cpu_group, group_src=0)
    except RuntimeError as e:  # a follower waited timeout_s for rank 0, or rank 0 is gone: say so in one line
        if tp.rank == 0:
            raise
        raise RuntimeError(f"rank {tp.world_rank}: no step message from rank {tp.world_rank - tp.rank} "
                           "within timeout_s "
                           f"({gloo_reason(e)}); another rank probably failed") from None
    if tp.rank != 0:
        values = torch.empty(int(n.item()), dtype=torch.int64)
    dist.broadcast(values, group=tp.cpu_group, group_src=0)
    return values


def broadcast_object(obj, tp: TPGroup | None = None):
    """Send any picklable object from rank 0 to all ranks."""
    tp = tp or get_tp()
    if tp.size == 1:
        return obj
    box = [obj if tp.rank == 0 else None]
    dist.broadcast_object_list(box, group=tp.cpu_group, group_src=0)
    return box[0]


def all_gather_object(obj, tp: TPGroup | None = None) -> list:
    tp = tp or get_tp()
    if tp.size == 1:
        return [obj]
    out = [None] * tp.size
    dist.all_gather_object(out, obj, group=tp.cpu_group)
    return out


def barrier(tp: TPGroup | None = None) -> None:
    """Every rank of the job meets (all replicas, with data parallelism)."""
    tp = tp or get_tp()
    if tp.size > 1 or tp.dp is not None:
        dist.barrier(group=world_cpu_group(tp))


def all_reduce_min(value: int, tp: TPGroup | None = None, everywhere: bool = False) -> int:
    """The smallest `value` over the ranks of `tp`, or of the whole job (`everywhere`: all replicas)."""
    tp = tp or get_tp()
    if tp.size == 1 and (tp.dp is None or not everywhere):
        return value
    group = world_cpu_group(tp) if everywhere else tp.cpu_group
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())
