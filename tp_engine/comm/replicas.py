"""Data parallelism: the world's ranks split into replicas, each a tensor-parallel group of consecutive ranks
with an engine of its own, and the messages between the replicas' first ranks (the leaders) and the job's
coordinator on global rank 0.

Every replica has its TP groups (comm/group.py builds them); besides them, three gloo groups:
- `world_cpu`: all ranks, with timeout_s: start-up checks and the last barrier;
- `leaders`: the replicas' first ranks: rank 0 hands out prompts and takes back results (small pickled
  messages: an int64 length, then the bytes);
- `idle`: one replica's ranks: a replica that has done its share waits there for the end of the call.

A replica waits on the last two for as long as the rest of the job runs, so they have no timeout of their
own (IDLE_TIMEOUT); a rank that dies closes its connections, and whoever waits on it raises at once. Waits
for an answer that comes at once (a leader asking rank 0 for work) are bounded by timeout_s.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

IDLE_TIMEOUT = timedelta(days=30)
OVER, ABORT = 0, 1  # how a call ends, as the leaders tell their replicas' other ranks


@dataclass
class DPGroup:
    """This rank's place among the replicas (present only when there are several)."""
    index: int  # this rank's replica
    count: int  # replicas in the job
    tp_size: int
    world_rank: int
    timeout_s: float
    world_cpu: Any = None  # dist.ProcessGroup: every rank (gloo), timeout_s
    leaders: Any = None  # the replicas' first ranks (gloo), IDLE_TIMEOUT; None on the other ranks
    idle: Any = None  # this replica's ranks (gloo), IDLE_TIMEOUT

    @property
    def leader(self) -> int:
        """The global rank of this replica's first rank."""
        return self.index * self.tp_size

    def leader_of(self, replica: int) -> int:
        return replica * self.tp_size

    def describe(self, replica: int) -> str:
        first = self.leader_of(replica)
        return f"replica {replica} (ranks {first}-{first + self.tp_size - 1})"


def tp_size_for(world: int, tp_size: int | None) -> int:
    """The TP size of a world of `world` ranks; a size that does not divide it is refused, naming both."""
    tp = tp_size or world
    if world % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the world size {world} (ranks): each "
                         "replica needs tensor_parallel_size ranks; use a divisor of the world size")
    return tp


def replica_groups(world: int, rank: int, tp: int, backend: str, timeout_s: float, device_type: str):
    """Collective over the world: (this replica's device group, its CPU group, the DPGroup). Every rank makes
    every group, in the same order, as new_group requires."""
    timeout = timedelta(seconds=timeout_s)
    count = world // tp
    dp = DPGroup(rank // tp, count, tp, rank, timeout_s)
    dp.world_cpu = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    group = cpu_group = None
    for i in range(count):
        ranks = list(range(i * tp, (i + 1) * tp))
        g = dist.new_group(ranks, backend=backend, timeout=timeout)
        c = g if device_type == "cpu" else dist.new_group(ranks, backend="gloo", timeout=timeout)
        idle = dist.new_group(ranks, backend="gloo", timeout=IDLE_TIMEOUT)
        if i == dp.index:
            group, cpu_group, dp.idle = g, c, idle
    leaders = dist.new_group([i * tp for i in range(count)], backend="gloo", timeout=IDLE_TIMEOUT)
    if rank % tp == 0:
        dp.leaders = leaders
    return group, cpu_group, dp


# ---- the leaders' messages ----

def send_obj(obj: Any, dst: int, group, timeout_s: float | None = None) -> None:
    """A picklable object to global rank `dst`: its length, then its bytes."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    for t in (torch.tensor([data.numel()], dtype=torch.int64), data):
        work = dist.isend(t, dst, group=group)
        work.wait(timedelta(seconds=timeout_s)) if timeout_s else work.wait()


def recv_obj(group, src: int | None = None, timeout_s: float | None = None) -> tuple[int, Any]:
    """(sender's global rank, object) of the next message from `src`, or from any rank when None."""
    n = torch.empty(1, dtype=torch.int64)
    work = dist.irecv(n, src, group=group)
    work.wait(timedelta(seconds=timeout_s)) if timeout_s else work.wait()
    sender = src if src is not None else dist.get_global_rank(group, work._source_rank())
    data = torch.empty(int(n.item()), dtype=torch.uint8)
    work = dist.irecv(data, sender, group=group)
    work.wait(timedelta(seconds=timeout_s)) if timeout_s else work.wait()
    return sender, pickle.loads(data.numpy().tobytes())


def end_call(dp: DPGroup, status: int | None = None) -> int:
    """A replica's ranks meet when the call is over for the whole job: the leader passes `status` (OVER or
    ABORT), the others wait for it (as long as the other replicas run) and get it."""
    t = torch.tensor([status if status is not None else -1], dtype=torch.int64)
    dist.broadcast(t, src=dp.leader, group=dp.idle)
    return int(t.item())
