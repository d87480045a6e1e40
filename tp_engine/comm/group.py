"""The ranks of a run: joining the torchrun world, its process groups, leaving it, and the start-up check.

Two process groups: `group` carries tensors on the compute device (NCCL on CUDA, gloo on CPU) and
`cpu_group` (gloo) carries the small control messages rank 0 sends each step. A world of one has no
groups, so a single-process run needs no torchrun. With data parallelism (tensor_parallel_size below the
world size) both are the groups of this rank's replica, and `rank` is its rank there (comm/replicas.py).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tp_engine.comm.replicas import DPGroup, replica_groups, tp_size_for
from tp_engine.comm.shm_channel import ShmChannel

log = logging.getLogger("tp_engine")


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")
    group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    channel: ShmChannel | None = None  # fast path of broadcast_ints when all ranks share a host
    # the small-message all-reduce its engine set up at start-up (comm/custom_all_reduce.py), or None: NCCL
    fast_all_reduce: Any = None
    dp: DPGroup | None = None  # this rank's replica among several; None: the world is one TP group

    @property
    def is_first(self) -> bool:
        """The group's first rank: it schedules, samples and sends the step messages."""
        return self.rank == 0

    @property
    def world_rank(self) -> int:
        return self.dp.world_rank if self.dp is not None else self.rank


_TP = TPGroup()


def get_tp() -> TPGroup:
    return _TP


def set_tp(tp: TPGroup) -> None:
    """Install the group the layers communicate through (tests use this to swap groups)."""
    global _TP
    _TP = tp


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("config key 'device' is cuda but no CUDA device is visible")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


_GROUPS_MADE = 0  # process groups this process has made (init_distributed)
_WORLD_TIMEOUT_S = 0.0  # the timeout_s of the world group this process joined
_CHANNELS: list[ShmChannel] = []  # step channels made since, closed when leaving the world


def init_distributed(device: torch.device, timeout_s: float = 300.0, step_channel: str = "auto",
                     tp_size: int | None = None) -> TPGroup:
    """Join the torchrun world described by RANK/WORLD_SIZE (a plain `python` run is a world of one), as one
    of its world / tp_size replicas (tp_size None: the whole world is one TP group); a tp_size that does not
    divide the world raises ValueError before any collective.

    step_channel (config key advanced.step_channel): how `broadcast_ints` carries rank 0's step messages.
    shm: a shared-memory mailbox when all ranks of the TP group share one x86 host, else gloo (with a
    warning); gloo: the CPU group; auto: shm on CUDA where it can be set up, gloo otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    tp = tp_size_for(world, tp_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world == 1:
        set_tp(TPGroup(0, 1, device))
        return _TP
    global _GROUPS_MADE, _WORLD_TIMEOUT_S
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        # Each group its own keys in torchrun's store: one made again after shutdown() would otherwise
        # read the last one's addresses, and gloo would connect to closed sockets. Every rank makes its
        # groups in step.
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        _GROUPS_MADE += 1
        dist.init_process_group(backend, store=dist.PrefixStore(f"tp_engine/{_GROUPS_MADE}", store),
                                rank=rank, world_size=world, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
        _WORLD_TIMEOUT_S = timeout_s
    wants = step_channel == "shm" or (step_channel == "auto" and device.type == "cuda")
    keep = _TP.channel if _TP.size == tp and wants else None  # joined before (a tool, then the engine)
    # Decided alike on every rank, so the collectives below stay in step even when the ranks were given
    # different settings (check_startup then says so): a later engine with another timeout_s gets groups of
    # its own, and the step channel is kept only with this engine's timeout_s (an earlier engine keeps it
    # either way).
    votes = torch.tensor([timeout_s != _WORLD_TIMEOUT_S, keep is None or keep.timeout_s != timeout_s,
                          not wants, tp, -tp], dtype=torch.int32, device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX)
    new_groups, new_channel, no_channel, most, least = votes.tolist()
    if most != -least:  # the groups below would not match: say so on every rank before making them
        raise StartupError(
            f"ranks were started with different tensor_parallel_size (from {-least} to {most})")
    dp = None
    if tp < world:
        group, cpu_group, dp = replica_groups(world, rank, tp, dist.get_backend(), timeout_s, device.type)
    else:
        timeout = timedelta(seconds=timeout_s)
        group = dist.new_group(backend=dist.get_backend(), timeout=timeout) if new_groups else \
            dist.group.WORLD
        cpu_group = group if device.type == "cpu" else dist.new_group(backend="gloo", timeout=timeout)
    channel = None if new_channel or no_channel or dp is not None else keep
    set_tp(TPGroup(rank % tp, tp, device, group, cpu_group, channel, dp=dp))
    if _TP.channel is None and not no_channel:
        _TP.channel = ShmChannel.create(_TP, timeout_s)
        if _TP.channel is not None:
            _CHANNELS.append(_TP.channel)
        elif step_channel == "shm" and rank == 0:
            log.warning("advanced.step_channel is shm, but the ranks do not all share one x86 host (or the "
                        "shared memory could not be set up): step messages go through gloo")
    return _TP


_OUT_OF_STEP: list[str] = []  # failures inside a step the ranks share, by any engine of this process


def mark_out_of_step(why: str) -> str:
    """Record that this process's ranks may be out of step (a failure inside a shared step); returns `why`."""
    _OUT_OF_STEP.append(why)
    return why


def shutdown(tp: TPGroup | None = None) -> None:
    """Leave the process group, after a barrier over `tp` (by default the latest engine's group), with its
    timeout; not once the ranks may be out of step (they would never meet there), whichever engine broke."""
    if _OUT_OF_STEP:
        return
    if dist.is_initialized():
        dist.barrier(group=world_cpu_group(tp or _TP))  # no rank tears down while another still talks to it
        for channel in _CHANNELS:
            channel.close()
        _CHANNELS.clear()
        dist.destroy_process_group()
    set_tp(TPGroup())


def world_cpu_group(tp: TPGroup):
    """The CPU group of every rank of the job: the TP group's, unless there are several replicas."""
    return tp.dp.world_cpu if tp.dp is not None else tp.cpu_group


class PeerLost(RuntimeError):
    """Another rank of the job failed or is gone; the message says which and how. Where this rank was
    waiting (its traceback) tells nothing more."""


class StartupError(RuntimeError):
    """Raised on every rank when any rank failed to start, with that rank's message."""


def gloo_reason(e: RuntimeError) -> str:
    """gloo's own words for a failed collective (a timeout, a peer gone), without its source file and C++
    trace."""
    return str(e).splitlines()[0].rsplit("] ", 1)[-1].split(". ", 1)[0][:160]  # its first sentence


def check_startup(error: BaseException | None, fingerprint: str, tp: TPGroup | None = None) -> None:
    """Every rank reports its start-up outcome and config fingerprint; all raise if any failed or differ.

    Called before the first collective of the run, so a rank that failed to load cannot leave the others
    waiting in a collective it will never join.
    """
    tp = tp or _TP
    mine = (None if error is None else str(error), fingerprint, int(os.environ.get("WORLD_SIZE", "1")))
    reports = [mine]
    world = tp.size * (tp.dp.count if tp.dp is not None else 1)
    if world > 1:
        reports = [None] * world
        try:
            dist.all_gather_object(reports, mine, group=world_cpu_group(tp))
        except RuntimeError as e:  # gloo's timeout, or a peer gone: one line instead of a C++ trace
            raise StartupError(f"not every rank reported at start-up within timeout_s ({gloo_reason(e)}); "
                               "rank 0 encodes all prompts first: a very large prompts_file needs a larger "
                               "timeout_s, else another rank failed") from None
    for r, (msg, _, _) in enumerate(reports):
        if msg is not None:
            raise StartupError(msg if r == 0 or msg == reports[0][0] else f"rank {r}: {msg}")
    if len({fp for _, fp, _ in reports}) > 1:
        raise StartupError("ranks were started with different configurations: "
                           + ", ".join(f"rank {r}: {fp}" for r, (_, fp, _) in enumerate(reports)))
    if len({w for _, _, w in reports}) > 1:
        raise StartupError("ranks disagree on WORLD_SIZE: " + ", ".join(str(w) for _, _, w in reports))
