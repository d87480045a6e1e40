"""All communication between ranks, in one place.

Two process groups: `group` carries tensors on the compute device (NCCL on CUDA, gloo on CPU) and
`cpu_group` (gloo) carries the small control messages rank 0 sends each step. A world of one has no
groups and every function here is the identity, so a single-process run needs no torchrun.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")
    group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0


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
            raise RuntimeError("config key 'device' is cuda but no CUDA device is visible")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_s: float = 300.0) -> TPGroup:
    """Join the torchrun world described by RANK/WORLD_SIZE (a plain `python` run is a world of one)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world == 1:
        set_tp(TPGroup(0, 1, device))
        return _TP
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    group = dist.group.WORLD
    cpu_group = group if device.type == "cpu" else dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    set_tp(TPGroup(rank, world, device, group, cpu_group))
    return _TP


def shutdown() -> None:
    if dist.is_initialized():
        dist.barrier(group=_TP.cpu_group)  # no rank tears down while another still talks to it
        dist.destroy_process_group()
    set_tp(TPGroup())


# ---- tensor collectives on the compute device (used inside the model's forward) ----

def all_reduce(x: torch.Tensor, tp: TPGroup | None = None) -> torch.Tensor:
    """Sum `x` over the ranks and return the sum: in place with NCCL, a new tensor on the paths below.

    On CUDA: messages up to `_FAST_AR.max_bytes` go through the one-shot all-reduce over symmetric memory
    when `enable_fast_all_reduce` set it up; inside a CUDA-graph capture NCCL is called through the
    functional collectives, which replay faster than `dist.all_reduce`.
    """
    tp = tp or _TP
    if tp.size == 1:
        return x
    if x.is_cuda:
        fast = _FAST_AR.get(tp.group)
        if fast is not None and fast.fits(x):
            return fast(x)
        if torch.cuda.is_current_stream_capturing():
            out = torch.ops._c10d_functional.all_reduce(x, "sum", tp.group.group_name)
            return torch.ops._c10d_functional.wait_tensor(out)
    dist.all_reduce(x, group=tp.group)
    return x


class _SymmAllReduce:
    """One-shot all-reduce through a symmetric-memory buffer (NVLink peer loads), for small messages."""

    def __init__(self, tp: TPGroup, dtype: torch.dtype, max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.name = tp.group.group_name
        self.dtype, self.max_bytes = dtype, max_bytes
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            try:
                symm_mem.enable_symm_mem_for_group(self.name)
            except Exception:  # deprecated in newer releases; rendezvous alone suffices there
                pass
        self.buf = symm_mem.empty(max_bytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype,
                                  device=tp.device)
        symm_mem.rendezvous(self.buf, self.name)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() * x.element_size() <= self.max_bytes and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        view = self.buf[: x.numel()].view(x.shape)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(view, x, "sum", self.name, out)
        return out


_FAST_AR: dict = {}


def enable_fast_all_reduce(tp: TPGroup, dtype: torch.dtype, max_bytes: int = 4 << 20) -> str:
    """Collective: set up the symmetric-memory all-reduce for `tp` if TP_ENGINE_ALLREDUCE=symm, check it on
    a small sum, and fall back to NCCL on any failure. Returns the kind in use ("nccl" or "symm")."""
    if tp.size == 1 or tp.device.type != "cuda" or os.environ.get("TP_ENGINE_ALLREDUCE", "nccl") != "symm":
        return "nccl"
    ok, fast = 1, None
    try:
        fast = _SymmAllReduce(tp, dtype, max_bytes)
        probe = torch.full((4096,), float(tp.rank + 1), dtype=dtype, device=tp.device)
        got = fast(probe)
        want = tp.size * (tp.size + 1) / 2
        ok = int(bool((got == want).all().item()))
    except Exception:  # no peer access, no symmetric memory: NCCL it is
        ok = 0
    ok = all_reduce_min(ok, tp)  # every rank takes the same path
    if ok:
        _FAST_AR[tp.group] = fast
    return "symm" if ok else "nccl"


def gather_to_rank0(x: torch.Tensor, tp: TPGroup | None = None) -> torch.Tensor | None:
    """Concatenate each rank's `x` along the last dim on rank 0; other ranks get None."""
    tp = tp or _TP
    if tp.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)] if tp.rank == 0 else None
    dist.gather(x, parts, dst=0, group=tp.group)
    return torch.cat(parts, dim=-1) if tp.rank == 0 else None


# ---- control messages on the CPU group (rank 0 decides, the others follow) ----

def broadcast_ints(values: torch.Tensor | None, tp: TPGroup | None = None) -> torch.Tensor:
    """Send a 1-D int64 CPU tensor from rank 0 to all ranks (others pass None and receive it)."""
    tp = tp or _TP
    if tp.size == 1:
        return values
    n = torch.tensor([values.numel() if tp.rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(n, src=0, group=tp.cpu_group)
    if tp.rank != 0:
        values = torch.empty(int(n.item()), dtype=torch.int64)
    dist.broadcast(values, src=0, group=tp.cpu_group)
    return values


def broadcast_object(obj, tp: TPGroup | None = None):
    """Send any picklable object from rank 0 to all ranks."""
    tp = tp or _TP
    if tp.size == 1:
        return obj
    box = [obj if tp.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
    return box[0]


def all_gather_object(obj, tp: TPGroup | None = None) -> list:
    tp = tp or _TP
    if tp.size == 1:
        return [obj]
    out = [None] * tp.size
    dist.all_gather_object(out, obj, group=tp.cpu_group)
    return out


def barrier(tp: TPGroup | None = None) -> None:
    tp = tp or _TP
    if tp.size > 1:
        dist.barrier(group=tp.cpu_group)


def all_reduce_min(value: int, tp: TPGroup | None = None) -> int:
    tp = tp or _TP
    if tp.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return int(t.item())


class StartupError(RuntimeError):
    """Raised on every rank when any rank failed to start, with that rank's message."""


def check_startup(error: BaseException | None, fingerprint: str, tp: TPGroup | None = None) -> None:
    """Every rank reports its start-up outcome and config fingerprint; all raise if any failed or differ.

    Called before the first collective of the run, so a rank that failed to load cannot leave the others
    waiting in a collective it will never join.
    """
    tp = tp or _TP
    mine = (None if error is None else str(error), fingerprint, int(os.environ.get("WORLD_SIZE", "1")))
    reports = all_gather_object(mine, tp)
    for r, (msg, _, _) in enumerate(reports):
        if msg is not None:
            raise StartupError(msg if r == 0 or msg == reports[0][0] else f"rank {r}: {msg}")
    if len({fp for _, fp, _ in reports}) > 1:
        raise StartupError("ranks were started with different configurations: "
                           + ", ".join(f"rank {r}: {fp}" for r, (_, fp, _) in enumerate(reports)))
    if len({w for _, _, w in reports}) > 1:
        raise StartupError("ranks disagree on WORLD_SIZE: " + ", ".join(str(w) for _, _, w in reports))
