"""Choosing the all-reduce for small messages on CUDA, and making every rank agree on it.

NCCL's latency dominates the small all-reduces of a decode step. Two replacements over PyTorch's
symmetric memory (NVLink peer loads and stores): the push all-reduce (comm/push_all_reduce.py), optionally
fused with the residual add and RMSNorm that follow it, and PyTorch's one-shot all-reduce. Each is
checked on test sums at start-up; a kind that fails on any rank is not used on any.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from tp_engine.comm.group import TPGroup

log = logging.getLogger("tp_engine")


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
    call's number, into every rank's symmetric-memory buffer (comm/push_all_reduce.py)."""

    def __init__(self, tp: TPGroup, dtype: torch.dtype, max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        from tp_engine.comm import push_all_reduce

        self.ops, self.rank, self.world = push_all_reduce, tp.rank, tp.size
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


_FAST_AR: dict = {}  # device group -> the small-message all-reduce set up on it (comm.all_reduce reads it)
ALL_REDUCE_KINDS = {"push": _PushAllReduce, "symm": _SymmAllReduce}


def _check_all_reduce(fast, tp: TPGroup, dtype: torch.dtype) -> bool:
    """Sums of a few sizes, twice over (both buffers of the push kernel), against the exact result."""
    for n in (4096, 8, 5000, 4096):
        x = (torch.arange(n, device=tp.device) % 7 + tp.rank).to(dtype)
        want = (tp.size * (torch.arange(n, device=tp.device) % 7) + tp.size * (tp.size - 1) // 2).to(dtype)
        if not torch.equal(fast(x), want):
            return False
    if isinstance(fast, _PushAllReduce):  # the fused residual add + RMSNorm, against the two steps
        from tp_engine.kernels import fused_ops
        x = (torch.arange(3 * 256, device=tp.device) % 5 + tp.rank).to(dtype).view(3, 256)
        res = torch.ones_like(x)
        w = torch.full((256,), 0.5, device=tp.device, dtype=dtype)
        out, new_res = fast.add_rmsnorm(x, res, w, 1e-6)
        ref, ref_res = fused_ops(tp.device).add_rmsnorm(fast(x), res, w, 1e-6)
        if not (torch.equal(new_res, ref_res) and torch.allclose(out.float(), ref.float(), atol=1e-2, rtol=1e-2)):
            return False
    return True


def _all_ranks(ok: bool, tp: TPGroup) -> bool:
    """Collective over the CPU group: True when `ok` holds on every rank."""
    t = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return bool(t.item())


def enable_fast_all_reduce(tp: TPGroup, dtype: torch.dtype, choice: str = "auto", max_bytes: int = 512 << 10) -> str:
    """Collective: set up the all-reduce for small messages on `tp` and check it; returns the kind in use.

    `choice` (config key advanced.all_reduce): `push` (comm/push_all_reduce.py; needs the fused kernels on
    every rank), `symm` (PyTorch's one-shot all-reduce over symmetric memory), `nccl`, or `auto`: push, else
    symm. A kind that fails its check on any rank falls back to the next one, down to NCCL. Only messages up
    to `max_bytes` (decode batches up to 64 at hidden 4096) take it; larger ones stay with NCCL."""
    if tp.size == 1 or tp.device.type != "cuda" or choice == "nccl":
        return "nccl"
    # Both need peer loads and stores only, not NVLink multicast, which on a shared host can take the GPUs
    # of other users down with it.
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    kinds = ["push", "symm"] if choice == "auto" else [choice]
    for kind in kinds:
        if kind == "push":  # agree first: the set-up below is collective
            from tp_engine.kernels import fused_ops
            if not _all_ranks(fused_ops(tp.device) is not None, tp):
                continue
        ok, fast = 1, None
        try:
            fast = ALL_REDUCE_KINDS[kind](tp, dtype, max_bytes)
            ok = int(_check_all_reduce(fast, tp, dtype))
        except Exception:  # no peer access, no symmetric memory
            ok = 0
        if _all_ranks(ok, tp):  # every rank takes the same path
            _FAST_AR[tp.group] = fast
            return kind
    if choice != "auto" and tp.is_first:
        log.warning("advanced.all_reduce is %s, but it failed its start-up check on some rank: NCCL does every "
                    "all-reduce", choice)
    return "nccl"
