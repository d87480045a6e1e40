"""The push all-reduce's protocol on one GPU: W ranks emulated by W kernels on W streams of one device.

Each emulated rank has its own buffer, call counter and status word, exactly as a real rank has; the W
kernels of one call run at the same time on W streams and store into each other's buffers through plain
device pointers instead of NVLink. This proves the protocol (tags, the two halves, the bounded waits, the
fused norm) for any W on a single GPU; the last test checks it against NCCL on two GPUs.

The emulated ranks launch without the cooperative attribute, since cooperative kernels do not run beside
each other on one GPU, and with waits that give up (after 5 s) rather than trap, so that a failure names
itself instead of taking the GPU context down with it. A rank of its own (W=1) checks the cooperative launch,
eagerly and in a CUDA graph.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
DEV = torch.device("cuda", 0) if HAS_CUDA else None
BF16 = torch.bfloat16
SLOT = 1 << 16  # values per rank and half: messages up to 64 Ki values


def group(world: int, start_call: int = 1, timeout_s: float = 5.0, trap: bool = False,
          cooperative: bool = False):
    """W emulated ranks: (their PushState, a stream each)."""
    from tp_engine.comm.push_all_reduce import PushState
    bufs = [torch.zeros(2 * world * SLOT, dtype=torch.int64, device=DEV) for _ in range(world)]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=DEV)
    states = [PushState.create(ptrs, SLOT, r, world, DEV, timeout_s, trap, start_call, cooperative)
              for r in range(world)]
    for s in states:
        s.keep = bufs  # the buffers live as long as any rank's state
    torch.cuda.synchronize()
    return states, [torch.cuda.Stream(DEV) for _ in range(world)]


def on_all(states, streams, fn, skew_cycles=None):
    """Launch fn(rank) on every rank's stream at once (after an optional sleep on some); returns the outputs.
    Every rank's kernel is compiled and loaded first (fn(rank, False)): in one process, loading a module can
    wait for the kernels still running, and a kernel already waiting for its peers would wait for ever."""
    main = torch.cuda.current_stream(DEV)
    outs = [None] * len(states)
    order = list(range(len(states)))
    random.shuffle(order)
    for r in order:
        fn(r, False)
    for r in order:
        streams[r].wait_stream(main)
        with torch.cuda.stream(streams[r]):
            if skew_cycles and skew_cycles[r]:
                torch.cuda._sleep(skew_cycles[r])
            outs[r] = fn(r)
    for s in streams:
        main.wait_stream(s)
    torch.cuda.synchronize(DEV)
    failed = [st.failure() for st in states if st.failure()]
    assert not failed, failed
    return outs


def rank_order_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """What every rank must return: the fp32 sum in rank order, rounded once to the dtype."""
    acc = torch.zeros_like(xs[0], dtype=torch.float32)
    for x in xs:
        acc += x.float()
    return acc.to(xs[0].dtype)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_push_all_reduce_any_world_skewed(world):
    """Hundreds of calls of random sizes, some ranks held back by up to ~50 us, every rank exact."""
    from tp_engine.comm.push_all_reduce import push_all_reduce
    states, streams = group(world)
    gen = torch.Generator(device=DEV).manual_seed(world)
    random.seed(world)
    for call in range(300):
        n = random.choice([1, 7, 512, 513, 4096, 5000, SLOT // world, SLOT])
        xs = [torch.randn(n, device=DEV, generator=gen).to(BF16) for _ in range(world)]
        skew = [random.choice([0, 0, 20_000, 100_000]) for _ in range(world)]
        outs = on_all(states, streams, lambda r, go=True: push_all_reduce(xs[r], states[r], go), skew)
        want = rank_order_sum(xs)
        for r in range(world):
            assert torch.equal(outs[r], want), (call, n, r)



@pytest.mark.parametrize("world", [2, 4])
def test_push_all_reduce_rmsnorm_any_world(world):
    """The fused all-reduce + residual add + RMSNorm equals the all-reduce followed by kernels.add_rmsnorm."""
    from tp_engine.comm.push_all_reduce import push_all_reduce_add_rmsnorm
    from tp_engine.kernels import norm
    states, streams = group(world)
    gen = torch.Generator(device=DEV).manual_seed(10 + world)
    random.seed(world)
    for call in range(100):
        rows, hidden = random.choice([1, 3, 12]), random.choice([1024, 4096, 5120])
        xs = [torch.randn(rows, hidden, device=DEV, generator=gen).to(BF16) for _ in range(world)]
        res = torch.randn(rows, hidden, device=DEV, generator=gen).to(BF16)
        w = (torch.rand(hidden, device=DEV, generator=gen) + 0.5).to(BF16)
        skew = [random.choice([0, 50_000]) for _ in range(world)]
        outs = on_all(states, streams,
                      lambda r, go=True: push_all_reduce_add_rmsnorm(xs[r], res, w, 1e-6, states[r], go),
                      skew)
        ref_out, ref_res = norm.add_rmsnorm(rank_order_sum(xs), res, w, 1e-6)
        for r in range(world):
            assert torch.equal(outs[r][1], ref_res), (call, r)
            torch.testing.assert_close(outs[r][0], ref_out)  # the norm's sum of squares is added in chunks
            assert (outs[r][0] == outs[0][0]).all()  # and every rank computes the same value


def test_push_all_reduce_across_the_tag_wrap():
    """Calls numbered across 2**32, on fresh (zeroed) buffers, with rank 1 late: no call may take the
    zeros of an unwritten slot for its peer's values (a tag of 0 would)."""
    from tp_engine.comm.push_all_reduce import push_all_reduce
    states, streams = group(2, start_call=(1 << 32) - 3)
    gen = torch.Generator(device=DEV).manual_seed(3)
    for call in range(8):
        xs = [torch.randn(4096, device=DEV, generator=gen).to(BF16) + 1 for _ in range(2)]
        outs = on_all(states, streams, lambda r, go=True: push_all_reduce(xs[r], states[r], go),
                      [0, 2_000_000])
        want = rank_order_sum(xs)
        assert torch.equal(outs[0], want) and torch.equal(outs[1], want), call
    assert int(states[0].state[0]) == (1 << 32) + 5


def test_push_all_reduce_long_run_in_a_cuda_graph():
    """Thousands of calls replayed from a CUDA graph (as decode runs them), W=2, against the exact sum."""
    from tp_engine.comm.push_all_reduce import push_all_reduce
    states, streams = group(2)
    gen = torch.Generator(device=DEV).manual_seed(4)
    xs = [torch.zeros(4096, device=DEV, dtype=BF16) for _ in range(2)]
    for r in range(2):  # compile and load before the capture
        push_all_reduce(xs[r], states[r], launch=False)
    capture = torch.cuda.Stream(DEV)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=capture, capture_error_mode="thread_local"):
        outs = [[None, None] for _ in range(16)]
        for i in range(16):  # both ranks' kernels as parallel branches of one graph
            forks = [torch.cuda.Stream(DEV) for _ in range(2)]
            for r in range(2):
                forks[r].wait_stream(capture)
                with torch.cuda.stream(forks[r]):
                    outs[i][r] = push_all_reduce(xs[r], states[r])
            for f in forks:
                capture.wait_stream(f)
    for rep in range(200):  # 3,200 calls
        for x in xs:
            x.copy_(torch.randn(4096, device=DEV, generator=gen))
        g.replay()
        want = rank_order_sum(xs)
        for i in range(16):
            assert torch.equal(outs[i][0], want) and torch.equal(outs[i][1], want), (rep, i)
    assert all(s.failure() is None for s in states), [s.failure() for s in states]


def test_push_all_reduce_cooperative_launch_eager_and_in_a_graph():
    """The launch the engine uses (cooperative, trapping waits) at W=1: eagerly, and captured and replayed."""
    from tp_engine.comm.push_all_reduce import push_all_reduce, push_all_reduce_add_rmsnorm
    from tp_engine.kernels import norm
    (st,), _ = group(1, timeout_s=20.0, trap=True, cooperative=True)
    gen = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(3, 4096, device=DEV, generator=gen).to(BF16)
    res = torch.randn(3, 4096, device=DEV, generator=gen).to(BF16)
    w = (torch.rand(4096, device=DEV, generator=gen) + 0.5).to(BF16)
    assert torch.equal(push_all_reduce(x, st), x)
    ref_out, ref_res = norm.add_rmsnorm(x, res, w, 1e-6)
    out, new_res = push_all_reduce_add_rmsnorm(x, res, w, 1e-6, st)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(out, ref_out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        g_sum = push_all_reduce(x, st)
        g_out, g_res = push_all_reduce_add_rmsnorm(x, res, w, 1e-6, st)
    for _ in range(50):
        x.copy_(torch.randn(3, 4096, device=DEV, generator=gen))
        graph.replay()
        assert torch.equal(g_sum, x)
        ref_out, ref_res = norm.add_rmsnorm(x, res, w, 1e-6)
        assert torch.equal(g_res, ref_res)
        torch.testing.assert_close(g_out, ref_out)
    assert st.failure() is None


def test_push_all_reduce_wait_is_bounded_without_trap():
    """Start-up check mode: a peer that never calls makes the wait give up and say so; no hang, no trap."""
    from tp_engine.comm.push_all_reduce import push_all_reduce
    states, _ = group(2, timeout_s=0.5)
    push_all_reduce(torch.ones(1000, device=DEV, dtype=BF16), states[0])  # rank 1 never calls
    torch.cuda.synchronize()
    msg = states[0].failure()
    assert msg is not None and "push all-reduce" in msg and "rank 1" in msg, msg


TRAP_SCRIPT = """
import torch, sys
sys.path.insert(0, {repo!r})
from tp_engine.comm.push_all_reduce import PushState, push_all_reduce
dev = torch.device("cuda", 0)
bufs = [torch.zeros(2 * 2 * 4096, dtype=torch.int64, device=dev) for _ in range(2)]
ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=dev)
st = PushState.create(ptrs, 4096, 0, 2, dev, 1.0, True, 1)
push_all_reduce(torch.ones(1000, device=dev, dtype=torch.bfloat16), st)  # rank 1 never calls
try:
    torch.cuda.synchronize()
    print("no error")
except Exception as e:
    print("cuda error:", type(e).__name__)
print("failure:", st.failure())
"""


def test_push_all_reduce_timeout_stops_the_rank_and_names_the_collective(tmp_path):
    """In use (trap mode), a wait that runs out stops the kernel with a CUDA error, and the record left in
    host memory names the collective, the call and the peer that never came."""
    script = tmp_path / "trap.py"
    script.write_text(TRAP_SCRIPT.format(repo=str(REPO)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ))
    out = proc.stdout
    assert "cuda error:" in out, out + proc.stderr[-2000:]
    assert "failure: push all-reduce" in out and "rank 1" in out and "call 1" in out, out


# ---- two GPUs: the real thing, over NVLink, against NCCL ----

NCCL_SCRIPT = """
import os, random, time
import torch, torch.distributed as dist
from tp_engine import comm
from tp_engine.kernels import norm, select

dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
tp = comm.init_distributed(dev)
fused = select(dev, "on") is not None  # the push all-reduce runs where the fused kernels pass their self-test
# timeout_s: a stuck wait fails within the test
assert comm.enable_fast_all_reduce(tp, torch.bfloat16, fused, timeout_s=60.0) == "push"
fast = tp.fast_all_reduce
g = torch.Generator(device=dev).manual_seed(tp.rank)
random.seed(1234)  # the same sizes on both ranks
with torch.inference_mode():
    for call in range(4000):  # many calls, random sizes, one rank or the other held back
        n = random.choice([1, 7, 512, 4096, 5000, 65536, 262144])
        x = torch.randn(n, device=dev, generator=g).to(torch.bfloat16)
        # every rank draws the same numbers in the same order, so the sizes stay equal; only the rank
        # named by `who` waits
        held, who, cycles = random.random() < 0.3, random.randrange(2), random.choice([10_000, 200_000])
        if held and who == tp.rank:
            torch.cuda._sleep(cycles)
            if call % 50 == 0:
                time.sleep(0.002)
        ref = x.clone()
        dist.all_reduce(ref, group=tp.group)  # NCCL
        assert torch.equal(fast(x), ref), (call, n)
    for rows in (1, 3, 64):
        x = torch.randn(rows, 4096, device=dev, generator=g).to(torch.bfloat16)
        res = torch.randn(rows, 4096, device=dev, generator=g).to(torch.bfloat16)
        w = torch.rand(4096, device=dev, generator=g).to(torch.bfloat16) + 0.5
        out, new_res = comm.all_reduce_add_rmsnorm(x, res, w, 1e-6, tp)
        ref = x.clone()
        dist.all_reduce(ref, group=tp.group)
        ref_out, ref_res = norm.add_rmsnorm(ref, res, w, 1e-6)
        assert torch.equal(new_res, ref_res), rows
        torch.testing.assert_close(out, ref_out)
    # inside a CUDA graph, replayed with new inputs
    xs = [torch.zeros(4096, device=dev, dtype=torch.bfloat16) for _ in range(8)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outs = [fast(x) for x in xs]
    for _ in range(100):
        for x in xs:
            x.copy_(torch.randn(4096, device=dev, generator=g))
        graph.replay()
        for x, o in zip(xs, outs):
            ref = x.clone()
            dist.all_reduce(ref, group=tp.group)
            assert torch.equal(o, ref)
torch.cuda.synchronize()
assert fast.failure() is None
print("all-reduce ok", tp.rank)
comm.shutdown()
"""


@pytest.mark.multi_gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_push_all_reduce_equals_nccl_long_run(tmp_path):
    """Two GPUs: 4,000 push all-reduces of random sizes with one rank or the other held back, the fused
    norm, and 800 calls replayed from a CUDA graph, each equal to NCCL's sum (exact for two ranks)."""
    script = tmp_path / "all_reduce_check.py"
    script.write_text(NCCL_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", str(script)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert proc.stdout.count("all-reduce ok") == 2
