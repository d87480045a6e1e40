"""All communication between ranks, in one place.

Two process groups: `group` carries tensors on the compute device (NCCL on CUDA, gloo on CPU) and
`cpu_group` (gloo) carries the small control messages rank 0 sends each step. A world of one has no
groups and every function here is the identity, so a single-process run needs no torchrun.
"""
from __future__ import annotations

import os
import time
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
    channel: "ShmChannel | None" = None  # fast path of broadcast_ints when all ranks share a host

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
            raise ValueError("config key 'device' is cuda but no CUDA device is visible")
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
    channel = _TP.channel if _TP.size == world else None  # joined before (a tool, then the engine): keep it
    set_tp(TPGroup(rank, world, device, group, cpu_group, channel))
    if device.type == "cuda" and channel is None:
        _TP.channel = ShmChannel.create(_TP, timeout_s)
    return _TP


def shutdown() -> None:
    if dist.is_initialized():
        dist.barrier(group=_TP.cpu_group)  # no rank tears down while another still talks to it
        if _TP.channel is not None:
            _TP.channel.close()
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


def all_reduce_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           tp: TPGroup | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(RMSNorm(all_reduce(x) + residual) * weight, all_reduce(x) + residual) in one kernel, where the push
    all-reduce is set up and `x` fits it; otherwise None, and the caller does the two steps."""
    tp = tp or _TP
    fast = _FAST_AR.get(tp.group) if tp.size > 1 and x.is_cuda else None
    if isinstance(fast, _PushAllReduce) and fast.fits(x) and x.dim() == 2 and residual.is_contiguous() \
            and weight.dtype == x.dtype == residual.dtype:
        return fast.add_rmsnorm(x, residual, weight, eps)
    return None


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
        nbytes = x.numel() * x.element_size()
        return x.dtype == self.dtype and nbytes <= self.max_bytes and nbytes % 16 == 0 and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        view = self.buf[: x.numel()].view(x.shape)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(view, x, "sum", self.name, out)
        return out


class _PushAllReduce(_SymmAllReduce):
    """All-reduce of small messages by one Triton kernel that pushes each rank's values, tagged with the
    call's number, into every rank's symmetric-memory buffer (layers/triton_ops.push_all_reduce)."""

    def __init__(self, tp: TPGroup, dtype: torch.dtype, max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        from tp_engine.layers import triton_ops

        self.ops, self.rank, self.world = triton_ops, tp.rank, tp.size
        self.dtype, self.max_bytes = dtype, max_bytes
        self.slot = max_bytes // torch.empty((), dtype=dtype).element_size()
        # two buffers of one slot per rank, 64-bit words; zeroed (tag 0) before any peer can write
        self.buf = symm_mem.empty(2 * tp.size * self.slot, dtype=torch.int64, device=tp.device)
        self.buf.zero_()
        torch.cuda.synchronize(tp.device)
        handle = symm_mem.rendezvous(self.buf, tp.group.group_name)
        self.ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=tp.device)
        self.state = torch.tensor([1, 0], dtype=torch.int64, device=tp.device)
        self.ss = torch.zeros(self.slot // 32 + 64, dtype=torch.int64, device=tp.device)  # see add_rmsnorm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.push_all_reduce(x, self.ptrs, self.state, self.slot, self.rank, self.world)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.push_all_reduce_add_rmsnorm(x, residual, weight, eps, self.ptrs, self.state, self.ss,
                                                    self.slot, self.rank, self.world)


_FAST_AR: dict = {}
ALL_REDUCE_KINDS = {"push": _PushAllReduce, "symm": _SymmAllReduce}


def _check_all_reduce(fast, tp: TPGroup, dtype: torch.dtype) -> bool:
    """Sums of a few sizes, twice over (both buffers of the push kernel), against the exact result."""
    for n in (4096, 8, 5000, 4096):
        x = (torch.arange(n, device=tp.device) % 7 + tp.rank).to(dtype)
        want = (tp.size * (torch.arange(n, device=tp.device) % 7) + tp.size * (tp.size - 1) // 2).to(dtype)
        if not torch.equal(fast(x), want):
            return False
    if isinstance(fast, _PushAllReduce):  # the fused residual add + RMSNorm, against the two steps
        from tp_engine.layers import fused_ops
        x = (torch.arange(3 * 256, device=tp.device) % 5 + tp.rank).to(dtype).view(3, 256)
        res = torch.ones_like(x)
        w = torch.full((256,), 0.5, device=tp.device, dtype=dtype)
        out, new_res = fast.add_rmsnorm(x, res, w, 1e-6)
        ref, ref_res = fused_ops(tp.device).add_rmsnorm(fast(x), res, w, 1e-6)
        if not (torch.equal(new_res, ref_res) and torch.allclose(out.float(), ref.float(), atol=1e-2, rtol=1e-2)):
            return False
    return True


def enable_fast_all_reduce(tp: TPGroup, dtype: torch.dtype, max_bytes: int = 512 << 10) -> str:
    """Collective: set up the all-reduce for small messages on `tp` and check it; returns the kind in use.

    TP_ENGINE_ALLREDUCE picks it: `push` (the default; layers/triton_ops.push_all_reduce), `symm` (PyTorch's
    one-shot all-reduce over symmetric memory) or `nccl`. A kind that fails its check on any rank falls
    back to the next one, down to NCCL. Only messages up to `max_bytes` (decode batches up to 64 at hidden
    4096) take it; larger ones stay with NCCL."""
    choice = os.environ.get("TP_ENGINE_ALLREDUCE", "push")
    if tp.size == 1 or tp.device.type != "cuda" or choice not in ALL_REDUCE_KINDS:
        return "nccl"
    # Both need peer loads and stores only, not NVLink multicast, which on a shared host can take the GPUs
    # of other users down with it.
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    kinds = ["push", "symm"] if choice == "push" else ["symm"]
    for kind in kinds:
        if kind == "push":  # agree first: the set-up below is collective
            from tp_engine.layers import fused_ops
            if not all_reduce_min(int(fused_ops(tp.device) is not None), tp):
                continue
        ok, fast = 1, None
        try:
            fast = ALL_REDUCE_KINDS[kind](tp, dtype, max_bytes)
            ok = int(_check_all_reduce(fast, tp, dtype))
        except Exception:  # no peer access, no symmetric memory
            ok = 0
        if all_reduce_min(ok, tp):  # every rank takes the same path
            _FAST_AR[tp.group] = fast
            return kind
    return "nccl"


def gather_to_rank0(x: torch.Tensor, tp: TPGroup | None = None) -> torch.Tensor | None:
    """Concatenate each rank's `x` along the last dim on rank 0; other ranks get None."""
    tp = tp or _TP
    if tp.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)] if tp.rank == 0 else None
    dist.gather(x, parts, dst=0, group=tp.group)
    return torch.cat(parts, dim=-1) if tp.rank == 0 else None


def broadcast(x: torch.Tensor, tp: TPGroup | None = None) -> torch.Tensor:
    """Overwrite `x` on every rank with rank 0's `x`, on the compute device (the sampled tokens, each step).
    On CUDA the host does not wait: the copy is queued on the stream like a kernel."""
    tp = tp or _TP
    if tp.size > 1:
        dist.broadcast(x, src=0, group=tp.group)
    return x


# ---- control messages on the CPU group (rank 0 decides, the others follow) ----

def broadcast_ints(values: torch.Tensor | None, tp: TPGroup | None = None) -> torch.Tensor:
    """Send a 1-D int64 CPU tensor from rank 0 to all ranks (others pass None and receive it)."""
    tp = tp or _TP
    if tp.size == 1:
        return values
    if tp.channel is not None:
        got = tp.channel.send(values) if tp.rank == 0 else tp.channel.recv()
        if got is not None:
            return got
        # too large for the shared buffer: this message goes through gloo (the channel said so to all)
    n = torch.tensor([values.numel() if tp.rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(n, src=0, group=tp.cpu_group)
    if tp.rank != 0:
        values = torch.empty(int(n.item()), dtype=torch.int64)
    dist.broadcast(values, src=0, group=tp.cpu_group)
    return values


class ShmChannel:
    """Rank 0 -> the other ranks of one host through a shared-memory mailbox they poll.

    The step message goes out every decode step; gloo's two broadcasts cost several hundred microseconds
    on the critical path of every step, a store the followers spin on costs a few. Layout (int64 words):
    [0] sequence number, [1] message length (-1: this one goes through gloo), [8 + r] last sequence rank r
    has read, then the message. Rank 0 writes the message, then the sequence number; a follower reads the
    sequence number, then the message (x86 keeps stores and loads in program order, which this relies on).
    """

    HEADER = 8 + 64  # words: two fields, padding, one ack word per rank (up to 64 ranks)

    def __init__(self, tp: TPGroup, shm, timeout_s: float, owner: bool) -> None:
        import numpy as np

        self.tp, self.shm, self.timeout_s, self.owner = tp, shm, timeout_s, owner
        words = np.ndarray((shm.size // 8,), dtype=np.int64, buffer=shm.buf)
        self.head, self.acks, self.data = words[:2], words[8:8 + tp.size], words[self.HEADER:]
        self.seq = 0

    @classmethod
    def create(cls, tp: TPGroup, timeout_s: float, size: int = 16 << 20) -> "ShmChannel | None":
        """Collective. None when the ranks are not all on this host, not x86, or TP_ENGINE_SHM=0."""
        import platform
        import socket
        import uuid
        from multiprocessing import shared_memory

        ok = os.environ.get("TP_ENGINE_SHM", "1") != "0" and platform.machine() in ("x86_64", "AMD64") \
            and tp.size <= 64
        hosts = all_gather_object((socket.gethostname(), ok), tp)
        if len({h for h, _ in hosts}) != 1 or not all(o for _, o in hosts):
            return None
        shm, err = None, None
        name = f"tp_engine_{uuid.uuid4().hex[:16]}" if tp.rank == 0 else None
        try:
            if tp.rank == 0:
                shm = shared_memory.SharedMemory(name=name, create=True, size=(cls.HEADER * 8) + size)
                shm.buf[: cls.HEADER * 8] = bytes(cls.HEADER * 8)
        except OSError as e:
            err = str(e)
        name = broadcast_object((name, err), tp)
        if name[1] is not None:
            return None
        try:
            if tp.rank != 0:
                shm = shared_memory.SharedMemory(name=name[0])
                try:  # only rank 0 owns (and unlinks) the segment
                    from multiprocessing import resource_tracker
                    resource_tracker.unregister(shm._name, "shared_memory")
                except Exception:
                    pass
            ok = 1
        except OSError:
            ok = 0
        if all_reduce_min(ok, tp) == 0:
            if shm is not None:
                shm.close()
                if tp.rank == 0:
                    shm.unlink()
            return None
        return cls(tp, shm, timeout_s, tp.rank == 0)

    def _wait(self, ready) -> None:
        deadline = None
        spins = 0
        while not ready():
            spins += 1
            if spins > 20000:  # idle for a while: stop burning a core at full speed
                time.sleep(5e-5)
                if deadline is None:
                    deadline = time.monotonic() + self.timeout_s
                elif time.monotonic() > deadline:
                    raise RuntimeError(f"rank {self.tp.rank}: no step message from rank 0 in {self.timeout_s:.0f} s "
                                       "(timeout_s); another rank probably failed")

    def send(self, values: torch.Tensor) -> torch.Tensor | None:
        n = values.numel()
        seq = self.seq
        self._wait(lambda: bool((self.acks[1:] >= seq).all()))  # everyone has read the previous message
        if n <= self.data.shape[0]:
            self.data[:n] = values.numpy()
            self.head[1] = n
        else:
            self.head[1] = -1
        self.seq = seq + 1
        self.head[0] = self.seq  # publish last
        return values if n <= self.data.shape[0] else None

    def recv(self) -> torch.Tensor | None:
        seq = self.seq + 1
        self._wait(lambda: self.head[0] >= seq)
        n = int(self.head[1])
        out = torch.from_numpy(self.data[:n].copy()) if n >= 0 else None
        self.seq = seq
        self.acks[self.tp.rank] = seq
        return out

    def close(self) -> None:
        try:
            self.head = self.acks = self.data = None
            self.shm.close()
            if self.owner:
                self.shm.unlink()
        except Exception:
            pass


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
