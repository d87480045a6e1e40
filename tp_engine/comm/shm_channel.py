"""The step message's fast path: rank 0 -> the other ranks of one host through a shared-memory mailbox."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


class ShmChannel:
    """Rank 0 -> the other ranks of one host through a shared-memory mailbox they poll.

    The step message goes out every decode step; gloo's two broadcasts cost several hundred microseconds
    on the critical path of every step, a store the followers spin on costs a few. Layout (int64 words):
    [0] sequence number, [1] message length (-1: this one goes through gloo), [8 + r] last sequence rank r
    has read, then the message. Rank 0 writes the message, then the sequence number; a follower reads the
    sequence number, then the message (x86 keeps stores and loads in program order, which this relies on).
    """

    HEADER = 8 + 64  # words: two fields, padding, one ack word per rank (up to 64 ranks)

    # `tp` below is a comm.group.TPGroup; it is not imported here, since comm.group imports this module
    def __init__(self, tp, shm, timeout_s: float) -> None:
        import numpy as np

        self.tp, self.shm, self.timeout_s = tp, shm, timeout_s
        words = np.ndarray((shm.size // 8,), dtype=np.int64, buffer=shm.buf)
        self.head, self.acks, self.data = words[:2], words[8:8 + tp.size], words[self.HEADER:]
        self.seq = 0

    @classmethod
    def create(cls, tp, timeout_s: float, size: int = 16 << 20) -> "ShmChannel | None":
        """Collective over `tp.cpu_group`. None when the ranks are not all on this host or not on x86."""
        import platform
        import socket
        import uuid
        from multiprocessing import shared_memory

        ok = platform.machine() in ("x86_64", "AMD64") and tp.size <= 64
        hosts = [None] * tp.size
        dist.all_gather_object(hosts, (socket.gethostname(), ok), group=tp.cpu_group)
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
        box = [(name, err)]
        dist.broadcast_object_list(box, group=tp.cpu_group, group_src=0)
        name = box[0]
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
        everyone = torch.tensor([ok], dtype=torch.int64)
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=tp.cpu_group)
        if int(everyone.item()) == 0:
            if shm is not None:
                shm.close()
                if tp.rank == 0:
                    shm.unlink()
            return None
        # Every rank has it mapped: its name can go now, so no exit (the command line's os._exit, a crash)
        # leaves the segment behind or a resource_tracker "leaked" warning.
        if tp.rank == 0:
            shm.unlink()
        return cls(tp, shm, timeout_s)

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
                    first = self.tp.world_rank - self.tp.rank
                    raise RuntimeError(f"rank {self.tp.world_rank}: no step message from rank {first} in "
                                       f"{self.timeout_s:.0f} s (timeout_s); another rank probably failed")

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
            self.shm.close()  # its name is gone since create(): the memory goes with the last rank's mapping
        except Exception:
            pass
