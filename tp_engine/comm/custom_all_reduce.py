"""Choosing the all-reduce for small messages on CUDA, and making every rank agree on it.

NCCL's latency dominates the small all-reduces of a decode step. Two replacements over PyTorch's
symmetric memory (NVLink peer loads and stores): the push all-reduce (comm/push_all_reduce.py), optionally
fused with the residual add and RMSNorm that follow it, and PyTorch's one-shot all-reduce.

Every rank must take the same path, or one rank waits in a kernel its peers never launch. So each step of
the set-up that can fail on one rank alone (allocation, the rendezvous, the check on test sums) is followed
by an agreement over the CPU group, and a kind is used only if it passed on every rank. The check runs
every one of its calls on every rank whatever the earlier ones gave, and its waits give up after a few
seconds instead of hanging, so a broken path costs a fallback, never a hang.
"""
from __future__ import annotations

import logging
import os
import weakref

import torch
import torch.distributed as dist

from tp_engine.comm.group import TPGroup

log = logging.getLogger("tp_engine")
CHECK_TIMEOUT_S = 10.0  # waits of the start-up check give up after this (in use: config key timeout_s)


def _all_ranks(ok: bool, tp: TPGroup) -> bool:
    """Collective over the CPU group: True when `ok` holds on every rank."""
    t = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return bool(t.item())


def _attempt(fn, tp: TPGroup, what: str):
    """Run this rank's part of one set-up step; (its result, whether it succeeded on every rank)."""
    try:
        out, err = fn(), None
    except Exception as e:  # no peer access, no symmetric memory, a kernel that does not build
        out, err = None, e
        log.debug("rank %d: %s failed: %s", tp.rank, what, e)
    return out, _all_ranks(err is None, tp)


class _SymmAllReduce:
    """One-shot all-reduce through a symmetric-memory buffer (NVLink peer loads), for small messages."""

    def __init__(self, tp: TPGroup, dtype: torch.dtype, max_bytes: int, timeout_s: float) -> None:
        """This rank's buffer only; `connect` (collective) joins the ranks' buffers."""
        import torch.distributed._symmetric_memory as symm_mem

        self.symm, self.name = symm_mem, tp.group.group_name
        self.dtype, self.max_bytes = dtype, max_bytes
        self.buf = symm_mem.empty(max_bytes // _itemsize(dtype), dtype=dtype, device=tp.device)

    def connect(self) -> None:
        if hasattr(self.symm, "enable_symm_mem_for_group"):
            try:
                self.symm.enable_symm_mem_for_group(self.name)
            except Exception:  # deprecated in newer releases; rendezvous alone suffices there
                pass
        self.symm.rendezvous(self.buf, self.name)

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return x.dtype == self.dtype and nbytes <= self.max_bytes and nbytes % 16 == 0 and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        view = self.buf[: x.numel()].view(x.shape)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(view, x, "sum", self.name, out)
        return out

    def in_use(self, timeout_s: float) -> None:
        """Checked and agreed: from here on the engine's own calls."""

    def failure(self) -> str | None:
        return None


class _PushAllReduce(_SymmAllReduce):
    """All-reduce of small messages by one Triton kernel that pushes each rank's values, tagged with the
    call's number, into every rank's symmetric-memory buffer (comm/push_all_reduce.py)."""

    def __init__(self, tp: TPGroup, dtype: torch.dtype, max_bytes: int, timeout_s: float) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from tp_engine.comm import push_all_reduce as push

        self.push, self.symm, self.tp = push, symm_mem, tp
        self.dtype, self.max_bytes = dtype, max_bytes
        self.slot = max_bytes // _itemsize(dtype)
        # two halves of one slot per rank, 64-bit words, zero (a tag no call has) before any peer can write
        self.buf = symm_mem.empty(2 * tp.size * self.slot, dtype=torch.int64, device=tp.device)
        self.buf.zero_()
        torch.cuda.synchronize(tp.device)
        self.st = None

    def connect(self) -> None:
        handle = self.symm.rendezvous(self.buf, self.tp.group.group_name)
        ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=self.tp.device)
        # the start-up check: waits that give up, and say so, instead of stopping the GPU
        self.st = self.push.PushState.create(ptrs, self.slot, self.tp.rank, self.tp.size, self.tp.device,
                                             CHECK_TIMEOUT_S, trap=False)
        self.st.keep = (self.buf, handle)

    def fits(self, x: torch.Tensor) -> bool:
        return super().fits(x) and self.st.programs(x, False) <= self.st.max_programs

    def fits_norm(self, x: torch.Tensor) -> bool:
        return super().fits(x) and x.dim() == 2 and self.st.programs(x, True) <= self.st.max_programs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.push.push_all_reduce(x, self.st)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.push.push_all_reduce_add_rmsnorm(x, residual, weight, eps, self.st)

    def in_use(self, timeout_s: float) -> None:
        """From here on a wait that runs out stops the kernel (the rank then fails with `failure()`)."""
        self.st.trap, self.st.timeout_ns = True, int(timeout_s * 1e9)

    def failure(self) -> str | None:
        return None if self.st is None else self.st.failure()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# The fast all-reduces in use in this process, for `failure_report` alone (the engines' groups hold them)
_IN_USE: weakref.WeakSet = weakref.WeakSet()
ALL_REDUCE_KINDS = {"push": _PushAllReduce, "symm": _SymmAllReduce}


def _check(fast, tp: TPGroup, dtype: torch.dtype) -> bool:
    """Sums of a few sizes (both halves of the push buffers), and the fused norm, against exact results.
    Every rank makes every call, whatever the earlier ones gave: the calls are collective."""
    ok = True
    for n in (4096, 8, 5000, 4096):
        x = (torch.arange(n, device=tp.device) % 7 + tp.rank).to(dtype)
        want = (tp.size * (torch.arange(n, device=tp.device) % 7) + tp.size * (tp.size - 1) // 2).to(dtype)
        ok &= torch.equal(fast(x), want)
    if isinstance(fast, _PushAllReduce):  # the fused residual add + RMSNorm, against the two steps
        from tp_engine.kernels import norm
        x = (torch.arange(3 * 4096, device=tp.device) % 5 + tp.rank).to(dtype).view(3, 4096)
        res = torch.ones_like(x)
        w = torch.full((4096,), 0.5, device=tp.device, dtype=dtype)
        out, new_res = fast.add_rmsnorm(x, res, w, 1e-6)
        ref, ref_res = norm.add_rmsnorm(fast(x), res, w, 1e-6)
        ok &= torch.equal(new_res, ref_res) and torch.allclose(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    torch.cuda.synchronize(tp.device)
    return ok and fast.failure() is None


def enable_fast_all_reduce(tp: TPGroup, dtype: torch.dtype, fused: bool, choice: str = "auto",
                           timeout_s: float = 300.0, max_bytes: int = 512 << 10) -> str:
    """Collective: set up the all-reduce for small messages on `tp` (the engine's group, whose
    `fast_all_reduce` it becomes: comm.all_reduce takes it there); returns the kind every rank uses.

    `choice` (config key advanced.all_reduce): `push` (comm/push_all_reduce.py; needs the fused kernels on
    every rank: `fused` says whether this rank's engine runs them), `symm` (PyTorch's one-shot all-reduce
    over symmetric memory), `nccl`, or `auto`: push, else symm, at TP=2, and NCCL above (the push all-reduce
    is written for any number of ranks and its protocol is tested for up to 8 on one GPU, but on hardware only
    two GPUs were available to prove it). A kind that fails on any rank falls back to the next, down to NCCL.
    Only messages up to `max_bytes` (decode batches up to 64 at hidden 4096) take it; larger ones stay with
    NCCL."""
    if tp.size == 1 or tp.device.type != "cuda" or choice == "nccl":
        return "nccl"
    if choice == "auto" and tp.size > 2:
        if tp.is_first:
            log.info("all-reduce: NCCL at TP=%d (the push all-reduce is proven on 2 GPUs; "
                     "advanced.all_reduce: push takes it anyway)", tp.size)
        return "nccl"
    # Both need peer loads and stores only, not NVLink multicast, which on a shared host can take the GPUs
    # of other users down with it.
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    kinds = ["push", "symm"] if choice in ("auto", "push") else [choice]
    for kind in kinds:
        if kind == "push" and not _all_ranks(fused, tp):
            continue
        fast, ok = _attempt(lambda: ALL_REDUCE_KINDS[kind](tp, dtype, max_bytes, timeout_s), tp,
                            f"{kind} buffers")
        if ok:
            _, ok = _attempt(fast.connect, tp, f"{kind} rendezvous")
        if ok:
            passed, ok = _attempt(lambda: _check(fast, tp, dtype), tp, f"{kind} check")
            ok = _all_ranks(ok and bool(passed), tp)
        if ok:
            fast.in_use(timeout_s)
            tp.fast_all_reduce = fast
            _IN_USE.add(fast)
            return kind
        if tp.is_first:
            log.warning("all-reduce: %s failed its start-up check on some rank%s", kind,
                        "" if kind == kinds[-1] else f"; trying {kinds[kinds.index(kind) + 1]}")
    if tp.is_first:
        log.warning("all-reduce: NCCL for every message (advanced.all_reduce is %s)", choice)
    return "nccl"


def failure_report() -> str | None:
    """Why a fast all-reduce stopped this rank, if one did (its kernels leave a record in host memory)."""
    for fast in list(_IN_USE):
        msg = fast.failure()
        if msg:
            return msg
    return None
