"""The push all-reduce: a small all-reduce in one kernel, over buffers every rank can write (symmetric
memory).

The protocol, for W ranks (any W >= 2; docs/tensor-parallelism.md has the argument in full):
- Every rank owns a buffer of 2 halves x W slots x `slot` 64-bit words, mapped into every other rank.
- Calls are numbered the same on every rank by a counter on the device (`state[0]`); call k uses half k % 2.
- Rank r stores each of its values into slot r of half k % 2 of every rank's buffer, as one 64-bit word:
  tag(k) << 32 | the value's fp32 bits, with tag(k) = 1 + k mod (2**32 - 1), never 0.
- Each rank then sums the W slots of its own buffer, in rank order, taking a word once its tag is tag(k).

Invariants:
1. Tag and value travel in one aligned 64-bit store and are read by one 64-bit load, both relaxed at system
   scope (single-copy atomic in the PTX memory model): a reader never pairs a tag with another call's value,
   and no order between different words is needed.
2. No tag equals the zero of a fresh buffer, and the tags of two calls fewer than 2**32 - 1 apart differ; a
   slot holds the words of call k - 2 until call k overwrites it, and a reader rejects them.
3. Rank s writes call k + 2 into rank r's half only after its call k + 1 finished, which took rank r's
   words of call k + 1, which rank r stored after its call k kernel, reads included, had ended (stream
   order). So no word is overwritten before its reader has taken it.
4. Every wait is bounded: after `timeout_ns` a program records (call, rank, peer) in host memory and traps
   (or, for the start-up check, gives up), so a stuck peer becomes an error that names this collective.
5. Launched cooperatively: the driver refuses a grid whose programs cannot all be resident at once, so no
   program waits on one that cannot run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tp_engine.kernels import _warps, triton

# values per program and row of the fused kernel (0: whole rows);
# launch/bench.py --push-chunk sets it to measure
PUSH_NORM_CHUNK = 512
# with at most 2 warps a program, 4 fit on an SM whatever their registers (4 x 64 x 255 < 64 Ki)
PROGRAMS_PER_SM = 4


if triton is not None:
    import triton.language as tl
    from triton.language.extra.cuda import globaltimer

    from tp_engine.kernels import _round, _rsqrt

    @triton.jit
    def _tag(call):
        return (1 + call % 4294967295).to(tl.uint64)

    @triton.jit
    def _store_sys(ptr, word, m):
        """One relaxed, system-scope 64-bit store per element where `m`."""
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p st.relaxed.sys.global.b64 [$1], $3; mov.b32 $0, 0; }",
            "=r,l,r,l", [ptr, m.to(tl.int32), word], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _load_sys(ptr, m):
        """One relaxed, system-scope 64-bit load per element where `m` (0 elsewhere)."""
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b64 $0, 0; @p ld.relaxed.sys.global.b64 $0, [$1]; }",
            "=l,l,r", [ptr, m.to(tl.int32)], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def _fail(status_ptr, call, rank, peer, TRAP: tl.constexpr):
        """Record which wait ran out (in host memory, which survives the trap), then stop this kernel."""
        if TRAP:
            tl.inline_asm_elementwise(
                "st.relaxed.sys.global.b64 [$1], $2; st.relaxed.sys.global.b64 [$1+8], $3; "
                "st.relaxed.sys.global.b64 [$1+16], $4; fence.sc.sys; st.relaxed.sys.global.b64 [$1+24], 1; "
                "fence.sc.sys; trap; mov.b32 $0, 0;",
                "=r,l,l,l,l", [status_ptr, call, call * 0 + rank, call * 0 + peer], dtype=tl.int32,
                is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "st.relaxed.sys.global.b64 [$1], $2; st.relaxed.sys.global.b64 [$1+8], $3; "
                "st.relaxed.sys.global.b64 [$1+16], $4; fence.sc.sys; st.relaxed.sys.global.b64 [$1+24], 1; "
                "mov.b32 $0, 0;",
                "=r,l,l,l,l", [status_ptr, call, call * 0 + rank, call * 0 + peer], dtype=tl.int32,
                is_pure=False, pack=1)

    @triton.jit
    def _wait_tagged(addr, m, tag, deadline, status_ptr, call, rank, peer, TRAP: tl.constexpr):
        """The words at `addr` (where `m`) once all carry `tag`; on timeout, _fail (and zeros)."""
        w = _load_sys(addr, m)
        late = tl.max(tl.where(m & ((w.to(tl.uint64, bitcast=True) >> 32) != tag), 1, 0), axis=0)
        while late > 0:
            if globaltimer() > deadline:
                _fail(status_ptr, call, rank, peer, TRAP)
                w = tl.zeros_like(w)
                late = 0
            else:
                w = _load_sys(addr, m)
                late = tl.max(tl.where(m & ((w.to(tl.uint64, bitcast=True) >> 32) != tag), 1, 0), axis=0)
        return w

    @triton.jit
    def _word_value(w):
        return (w & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)

    @triton.jit
    def _push_sum(x, offs, m, call, deadline, ptrs_ptr, status_ptr, slot, RANK: tl.constexpr,
                  WORLD: tl.constexpr, TRAP: tl.constexpr):
        """The sum over the ranks of `x` (this program's values, at `offs` of the message), in fp32, rank
        order."""
        tag = _tag(call)
        base = (call % 2) * WORLD * slot
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True).to(tl.uint64)
        word = ((tag << 32) | bits).to(tl.int64, bitcast=True)
        for p in tl.static_range(WORLD):
            peer = tl.load(ptrs_ptr + p).to(tl.pointer_type(tl.int64))
            _store_sys(peer + base + RANK * slot + offs, word, m)
        mine = tl.load(ptrs_ptr + RANK).to(tl.pointer_type(tl.int64))
        acc = tl.zeros(x.shape, dtype=tl.float32)
        for r in tl.static_range(WORLD):  # rank order: every rank adds the same numbers in the same order
            w = _wait_tagged(mine + base + r * slot + offs, m, tag, deadline, status_ptr, call, RANK, r, TRAP)
            acc += _word_value(w)
        return acc

    @triton.jit
    def _next_call(state_ptr, call):
        """The last program of the kernel to get here numbers the next call (all have read this one's)."""
        if tl.atomic_add(state_ptr + 1, 1) == tl.num_programs(0) * tl.num_programs(1) - 1:
            tl.store(state_ptr + 1, 0)
            tl.store(state_ptr, call + 1)

    @triton.jit
    def _push_all_reduce_kernel(x_ptr, out_ptr, ptrs_ptr, state_ptr, status_addr, timeout_ns, n, slot,
                                RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                                TRAP: tl.constexpr):
        deadline = globaltimer() + timeout_ns
        status_ptr = status_addr.to(tl.pointer_type(tl.int64))
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        call = tl.load(state_ptr)
        x = tl.load(x_ptr + offs, mask=m, other=0.0)
        acc = _push_sum(x, offs, m, call, deadline, ptrs_ptr, status_ptr, slot, RANK, WORLD, TRAP)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=m)
        _next_call(state_ptr, call)

    @triton.jit
    def _push_all_reduce_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, ptrs_ptr, state_ptr,
                                        ss_ptr, status_addr, timeout_ns, n_cols, inv_n, eps, slot,
                                        RANK: tl.constexpr, WORLD: tl.constexpr, CHUNK: tl.constexpr,
                                        NCHUNK: tl.constexpr, NCHUNK_P2: tl.constexpr, TRAP: tl.constexpr):
        # grid (rows, NCHUNK): a row's chunks travel in parallel; the norm's sum of squares of the whole row
        # is then gathered from the row's programs through `ss_ptr`, tagged like the values (all are
        # resident: the launch is cooperative)
        deadline = globaltimer() + timeout_ns
        status_ptr = status_addr.to(tl.pointer_type(tl.int64))
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        m = cols < n_cols
        offs = row * n_cols + cols
        call = tl.load(state_ptr)
        x = tl.load(x_ptr + offs, mask=m, other=0.0)
        DT = x.dtype
        s = _round(_push_sum(x, offs, m, call, deadline, ptrs_ptr, status_ptr, slot, RANK, WORLD, TRAP), DT)
        # from here the arithmetic of kernels.norm.add_rmsnorm
        r = tl.load(res_ptr + offs, mask=m, other=0.0)
        xf = _round(s + r.to(tl.float32), DT)
        tl.store(res_out_ptr + offs, xf.to(DT), mask=m)
        ss = tl.sum(xf * xf, axis=0)
        if NCHUNK > 1:
            tag = _tag(call)
            word = ((tag << 32) | ss.to(tl.uint32, bitcast=True).to(tl.uint64)).to(tl.int64, bitcast=True)
            _store_sys(ss_ptr + row * NCHUNK + c, word, c >= 0)
            k = tl.arange(0, NCHUNK_P2)
            v = _wait_tagged(ss_ptr + row * NCHUNK + k, k < NCHUNK, tag, deadline, status_ptr, call, RANK,
                             RANK, TRAP)
            ss = tl.sum(tl.where(k < NCHUNK, _word_value(v), 0.0), axis=0)
        rstd = _rsqrt(ss * inv_n + eps)
        y = _round(xf * rstd, DT)
        w = tl.load(w_ptr + cols, mask=m, other=0.0)
        tl.store(out_ptr + offs, _round(w.to(tl.float32) * y, DT).to(DT), mask=m)
        _next_call(state_ptr, call)


@dataclass
class PushState:
    """One rank's view of a push all-reduce group: what its kernels read and write besides the message."""

    ptrs: torch.Tensor  # [world] int64 on the device: the address of every rank's buffer
    slot: int  # values per rank and half of a buffer: the largest message
    rank: int
    world: int
    timeout_ns: int  # longest wait for a peer's words
    trap: bool  # on a timeout, stop the kernel (in use) or only record it (the start-up check)
    state: torch.Tensor  # [2] int64 on the device: the number of the next call, programs done with this one
    ss: torch.Tensor  # int64 on the device: the fused norm's per-chunk sums of squares
    status: torch.Tensor  # [4] int64 in pinned host memory: call, rank, peer, 1 once a wait ran out
    max_programs: int  # the most programs one launch may have, all resident at once
    cooperative: bool = True  # launch attribute; off only where several ranks share one GPU (the tests)
    keep: object = field(default=None, repr=False)  # whatever must live as long as `ptrs` point into it

    @classmethod
    def create(cls, ptrs: torch.Tensor, slot: int, rank: int, world: int, device: torch.device,
               timeout_s: float, trap: bool = True, first_call: int = 1,
               cooperative: bool = True) -> "PushState":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return cls(ptrs, slot, rank, world, int(timeout_s * 1e9), trap,
                   torch.tensor([first_call, 0], dtype=torch.int64, device=device),
                   torch.zeros(slot // 32 + 64, dtype=torch.int64, device=device),
                   torch.zeros(4, dtype=torch.int64, pin_memory=True), PROGRAMS_PER_SM * sms, cooperative)

    def failure(self) -> str | None:
        """What went wrong, if a wait of this rank's kernels ran out (readable after a trap: host memory)."""
        call, rank, peer, failed = self.status.tolist()
        if not failed:
            return None
        whose = (f"rank {peer}'s values" if peer != rank
                 else "the other programs of its own fused-norm kernel (not all of them could run at once)")
        return (f"push all-reduce: rank {rank} waited {self.timeout_ns / 1e9:g} s in call {call} for "
                f"{whose}; a rank stopped calling the collective or its GPU is busy with other work "
                "(set advanced.all_reduce: nccl to take NCCL instead)")

    def programs(self, x: torch.Tensor, norm: bool) -> int:
        """Programs one launch for `x` takes (the plain kernel, or the one fused with RMSNorm)."""
        if not norm:
            return max(1, triton.cdiv(x.numel(), PLAIN_BLOCK))
        n = x.shape[-1]
        return (x.numel() // n) * triton.cdiv(n, _norm_chunk(n))


PLAIN_BLOCK = 512


def _norm_chunk(n: int) -> int:
    full = triton.next_power_of_2(n)
    return full if PUSH_NORM_CHUNK <= 0 else min(PUSH_NORM_CHUNK, full)


def _start(kernel, grid: tuple, args: tuple, kwargs: dict, launch: bool) -> None:
    if launch:
        kernel[grid](*args, **kwargs)
    else:  # compile and load only: loading a module can wait for kernels still running, a peer's among them
        kernel.run(*args, grid=grid, warmup=True, **kwargs)._init_handles()


def push_all_reduce(x: torch.Tensor, st: PushState, launch: bool = True) -> torch.Tensor:
    """Sum of `x` over the ranks (custom_all_reduce._PushAllReduce owns the buffers behind `st`).
    launch=False only compiles and loads the kernel for these arguments (used where ranks share a GPU)."""
    n = x.numel()
    assert x.is_contiguous() and n <= st.slot and st.programs(x, False) <= st.max_programs
    out = torch.empty_like(x)
    _start(_push_all_reduce_kernel, (max(1, triton.cdiv(n, PLAIN_BLOCK)),),
           (x, out, st.ptrs, st.state, st.status.data_ptr(), st.timeout_ns, n, st.slot),
           dict(RANK=st.rank, WORLD=st.world, BLOCK=PLAIN_BLOCK, TRAP=st.trap, num_warps=2,
                launch_cooperative_grid=st.cooperative), launch)
    return out


def push_all_reduce_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                st: PushState, launch: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rmsnorm(push_all_reduce(x), residual, weight, eps)` in one kernel. Each row is cut into chunks of
    PUSH_NORM_CHUNK values, one program each; a row's programs exchange their sums of squares through
    `st.ss`."""
    n = x.shape[-1]
    assert x.is_contiguous() and residual.is_contiguous() and x.numel() <= st.slot
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    rows = x.numel() // n
    if rows:
        chunk = _norm_chunk(n)
        nchunk = triton.cdiv(n, chunk)
        assert rows * nchunk <= min(st.ss.numel(), st.max_programs)
        _start(_push_all_reduce_rmsnorm_kernel, (rows, nchunk),
               (x, residual, weight, out, res_out, st.ptrs, st.state, st.ss, st.status.data_ptr(),
                st.timeout_ns, n, 1.0 / n, eps, st.slot),
               dict(RANK=st.rank, WORLD=st.world, CHUNK=chunk, NCHUNK=nchunk,
                    NCHUNK_P2=triton.next_power_of_2(nchunk), TRAP=st.trap, num_warps=min(2, _warps(chunk)),
                    launch_cooperative_grid=st.cooperative),
               launch)
    return out, res_out
