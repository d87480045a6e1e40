"""Data parallelism: tensor_parallel_size below the world size runs several replicas, rank 0 handing out the
prompts and writing every output; the tokens, the output file and resume are those of one replica."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import (GENERATE, ROOT, free_port, hf_generate, make_checkpoint, run_cli, start_job,
                     wait_for_lines, worker_pids)

SHARED = list(range(1, 17))  # a whole KV page (page_size 16) that several prompts start with
PROMPTS = [[5, 17, 300, 42, 8], [1, 2, 3], [250, 9, 77, 13, 101, 4, 3, 2, 1, 0, 66], [7]] + \
    [SHARED + [40 + i, 7 * i + 1] for i in range(8)]
MAX_NEW = 8
SAMPLED = {"temperature": 1.0, "top_k": 50, "max_new_tokens": MAX_NEW, "seed": 7, "n": 2}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("dp") / "m")


def summary_of(err: str) -> dict:
    return json.loads(err.split("summary: ")[1].splitlines()[0])


def served(err: str) -> list[int]:
    """The requests each replica ran, from rank 0's log line."""
    return json.loads(re.search(r"requests served per replica: (\[[\d, ]+\])", err).group(1))


def test_a_tensor_parallel_size_that_does_not_divide_the_world_is_refused(ckpt, monkeypatch):
    """A start-up error naming both numbers, before any collective (no process group is made)."""
    from tp_engine import comm
    from tp_engine.base.config import build_config
    from tp_engine.runtime.engine import Engine
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(comm.StartupError, match=r"tensor_parallel_size 3 does not divide the world size 4"):
        Engine(build_config(model=str(ckpt), device="cpu", tensor_parallel_size=3))


def test_grants_prefer_a_replicas_first_pages_within_an_even_share():
    """Rank 0's coordinator (its threads not started): a grant takes the pending requests whose first page
    the replica was given before, then the earliest; at most an even share of what is pending; it makes at
    most LOOKAHEAD requests ahead; other replicas' results and error requests reach on_done at rank 0's next
    take. A granted request reaches its replica with its settings and think end."""
    from tp_engine.comm.replicas import DPGroup
    from tp_engine.runtime.coordinator import LOOKAHEAD, Coordinator, grant_of, granted
    from tp_engine.runtime.request import RequestOutput
    from tp_engine.sampling.sampler import SamplingParams

    P, Q = [1, 2, 3, 4], [5, 6, 7, 8]
    reqs = [RequestOutput(i, (P if i % 2 == 0 else Q) + [i], SamplingParams()) for i in range(8)]
    reqs[7].finish_reason, reqs[7].error = "error", "bad prompt"
    done = []
    c = Coordinator(DPGroup(0, 2, 1, 0, 5.0), iter(reqs), page_size=4, on_done=done.append)
    assert [r.index for r in c._grant(1, 1)] == [0]
    assert [r.index for r in c.take(1)] == [1]
    assert [r.index for r in c._grant(1, 2)] == [2, 4]  # P's, which replica 1 was given
    assert [r.index for r in c.take(5)] == [3, 5]  # Q's; 2 of the 3 pending
    assert done == [reqs[7]]  # found when the requests were made
    c._collect([(4, 0, [9, 9], "length", None, None, 0, [])])
    assert [r.index for r in c.take(5)] == [6] and c.exhausted and not c.pending
    assert done[1] is reqs[4] and reqs[4].output_ids == [9, 9] and reqs[4].finish_reason == "length"
    think = RequestOutput(9, [1, 2], SamplingParams(choice=["a"]), sample=1, think_end=7)
    again = granted(grant_of(think))  # as another replica makes it: the constraint holds after its </think>
    assert (again.index, again.sample, again.prompt_ids, again.think_end) == (9, 1, [1, 2], 7)
    assert again.params == think.params
    made = []
    many = (made.append(i) or RequestOutput(i, [i], SamplingParams()) for i in range(10 * LOOKAHEAD))
    c = Coordinator(DPGroup(0, 4, 1, 0, 5.0), many, page_size=4, on_done=done.append)
    assert len(c.take(1000)) == LOOKAHEAD // 4 and len(made) == LOOKAHEAD


API_JOB = """
import json, os, sys
sys.path.insert(0, {root!r})
from tp_engine import LLM, SamplingParams
prompts = [{{"input_ids": p}} for p in {prompts!r}]
results = {{}}
for tp in (2, 1):
    llm = LLM(model={model!r}, device="cpu", tensor_parallel_size=tp)
    greedy = llm.generate(prompts, SamplingParams(max_new_tokens={max_new}))
    sampled = llm.generate(prompts, SamplingParams(**{sampled!r}))
    llm.shutdown()
    if os.environ["RANK"] != "0":
        assert greedy is None and sampled is None, (os.environ["RANK"], greedy, sampled)
    results[tp] = [greedy, sampled]
if os.environ["RANK"] == "0":
    json.dump(results, open({out!r}, "w"))
"""


@pytest.mark.slow
def test_replicas_give_transformers_greedy_tokens_and_one_replicas_samples(ckpt, tmp_path):
    """On 4 ranks through the Python API, 2 replicas of TP 2 and then 4 of TP 1 (two calls each): rank 0 gets
    every output, in order, and the other ranks None; greedy tokens equal transformers', sampled ones (n = 2)
    those of a single rank."""
    from tp_engine import LLM, SamplingParams

    script = tmp_path / "job.py"
    script.write_text(API_JOB.format(root=str(ROOT), prompts=PROMPTS, model=str(ckpt), max_new=MAX_NEW,
                                     sampled=SAMPLED, out=str(tmp_path / "results.json")))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
                           "--standalone", str(script)], capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    llm = LLM(model=str(ckpt), device="cpu")  # one rank, one replica
    alone = llm.generate([{"input_ids": p} for p in PROMPTS], SamplingParams(**SAMPLED))
    llm.shutdown()
    want = hf_generate(ckpt, PROMPTS, MAX_NEW)
    for tp, (greedy, sampled) in results.items():
        assert [(o["index"], o["sample"]) for o in greedy] == [(i, 0) for i in range(len(PROMPTS))], tp
        assert [o["output_token_ids"] for o in greedy] == want, tp
        assert [(o["index"], o["sample"]) for o in sampled] == [(i, j) for i in range(len(PROMPTS))
                                                                 for j in range(2)], tp
        assert [o["output_token_ids"] for o in sampled] == [o["output_token_ids"] for o in alone], tp
        assert len({tuple(o["output_token_ids"]) for o in sampled}) > len(PROMPTS)  # really sampled


# the second replica's rank (rank 1 at TP 1) takes 50 ms more for every step
SLOW_REPLICA = """
import os, sys, time
sys.path.insert(0, {root!r})
from tp_engine.runtime import engine
if os.environ["RANK"] == "1":
    real = engine.Engine.forward
    def slow(self, *args):
        time.sleep(0.05)
        return real(self, *args)
    engine.Engine.forward = slow
from tp_engine.cli import main
sys.exit(main())
"""


@pytest.mark.slow
def test_a_slow_replica_serves_fewer_prompts_and_every_line_is_written_once_in_order(ckpt, tmp_path):
    """Two replicas of TP 1, the second slowed down: prompts go to whichever has room, so the fast one serves
    most of them (a static split would give each half). The output file holds every prompt once, in input
    order, a prompt that cannot run as its error line, and the tokens are those of one rank."""
    prompts = [{"input_ids": [i % 500 + 1, 2, 3, i % 7 + 1]} for i in range(30)]
    prompts[11] = {"input_ids": []}
    cfg = {"model": str(ckpt), "prompts": prompts, "output": str(tmp_path / "out.jsonl"), "device": "cpu",
           "tensor_parallel_size": 1, "max_batch_size": 2, "sampling": {"max_new_tokens": 6}}
    script = tmp_path / "slow.py"
    script.write_text(SLOW_REPLICA.format(root=str(ROOT)))
    proc = start_job(cfg, tmp_path, nproc=2, script=script)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    fast, slow = served(err)
    assert fast + slow == 29 and fast > 2 * slow, (fast, slow)
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["index"] for line in lines] == list(range(30))
    assert lines[11]["finish_reason"] == "error" and "empty" in lines[11]["error"]
    assert summary_of(err)["requests"] == 30 and summary_of(err)["errors"] == 1
    _, alone = run_cli({**cfg, "output": str(tmp_path / "alone.jsonl")}, tmp_path, name="alone")
    assert [line["output_token_ids"] for line in lines] == [line["output_token_ids"] for line in alone]


def long_job(ckpt, tmp_path, n=48):
    prompts = [{"input_ids": [i % 500 + 1, 2, 3]} for i in range(n)]
    return {"model": str(ckpt), "prompts": prompts, "output": str(tmp_path / "out.jsonl"), "device": "cpu",
            "tensor_parallel_size": 2, "max_batch_size": 2,
            "sampling": {"max_new_tokens": 32, "ignore_eos": True}}


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_and_resume_with_three_replicas_completes_it(ckpt, tmp_path):
    """Two replicas of TP 2; a rank of the second is killed: the job ends at once, with rank 0 saying where
    the finished lines are, and no traceback of ours. A resume on 3 replicas of TP 1 runs only the rest:
    the file then equals a single rank's, every prompt once."""
    cfg = long_job(ckpt, tmp_path)
    out = Path(cfg["output"])
    proc = start_job(cfg, tmp_path, nproc=4)
    try:
        wait_for_lines(out, 4, proc)
        os.kill(worker_pids(proc.pid)[3], signal.SIGKILL)
        t0 = time.time()
        _, err = proc.communicate(timeout=30)
        assert time.time() - t0 < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert f"finished results are in {out}; run again with resume: true" in err, err[-3000:]
    assert not re.search(r'File ".*(tp_engine|launch)/', err), err[:4000]
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert kept and len({line["index"] for line in kept}) == len(kept) < 48
    assert all(len(line["output_token_ids"]) == 32 for line in kept)
    proc, lines = run_cli({**cfg, "resume": True, "tensor_parallel_size": 1}, tmp_path, nproc=3,
                          name="resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary_of(proc.stderr)["resumed_skipped"] == len(kept)
    assert summary_of(proc.stderr)["requests"] == 48 - len(kept)
    alone_cfg = {**cfg, "output": str(tmp_path / "alone.jsonl"), "tensor_parallel_size": None}
    _, alone = run_cli(alone_cfg, tmp_path, name="alone")
    assert lines == alone


def start_nodes(cfg: dict, tmp_path: Path, name: str) -> list[subprocess.Popen]:
    """Two torchrun launchers of 2 ranks each on this machine, joined by a c10d rendezvous: two nodes. The
    first starts first, so it most likely hosts the rendezvous store and rank 0: the other node's launcher
    going away then stops nothing on it."""
    conf = tmp_path / f"{name}.yaml"
    conf.write_text(yaml.safe_dump(cfg))
    port = free_port()
    return [time.sleep(node) or subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                              "--nproc_per_node=2", f"--node-rank={node}", "--rdzv-backend=c10d",
                              f"--rdzv-endpoint=127.0.0.1:{port}", str(GENERATE), "--config", str(conf)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                             env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
            for node in range(2)]


def wait_nodes(nodes: list[subprocess.Popen], limit: float) -> list[str]:
    try:
        return [node.communicate(timeout=limit)[1] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)


@pytest.mark.slow
def test_two_nodes_on_one_machine(ckpt, tmp_path):
    """Two nodes of 2 ranks as 2 replicas of TP 2 give transformers' greedy tokens, every prompt once and in
    order. Then a rank killed on the node without rank 0 ends both nodes' launchers at once (they do not stop
    each other's ranks), the finished lines kept."""
    cfg = {"model": str(ckpt), "prompts": [{"input_ids": p} for p in PROMPTS], "device": "cpu",
           "output": str(tmp_path / "out.jsonl"), "tensor_parallel_size": 2,
           "sampling": {"max_new_tokens": MAX_NEW}}
    nodes = start_nodes(cfg, tmp_path, "run")
    errs = wait_nodes(nodes, 180)
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(e[-2000:] for e in errs)
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["index"] for line in lines] == list(range(len(PROMPTS)))
    assert [line["output_token_ids"] for line in lines] == hf_generate(ckpt, PROMPTS, MAX_NEW)
    assert sum(served("".join(errs))) == len(PROMPTS)

    cfg = {**long_job(ckpt, tmp_path), "output": str(tmp_path / "long.jsonl")}
    nodes = start_nodes(cfg, tmp_path, "long")
    try:
        wait_for_lines(Path(cfg["output"]), 4, nodes[0])
        ranks = [worker_pids(node.pid) for node in nodes]
        other = ranks[1] if 0 in ranks[0] else ranks[0]
        os.kill(other[min(other)], signal.SIGKILL)
        t0 = time.time()
        errs = wait_nodes(nodes, 30)
        assert time.time() - t0 < 30
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert all(node.returncode != 0 for node in nodes)
    assert "finished results are in" in "".join(errs), "\n".join(e[-2000:] for e in errs)
    kept = [json.loads(line) for line in Path(cfg["output"]).read_text().splitlines()]
    assert kept and len({line["index"] for line in kept}) == len(kept) < 48


@pytest.mark.slow
def test_bench_replicas_workload_runs_every_request_on_two_replicas(ckpt, tmp_path):
    """launch/bench.py --workload replicas under torchrun with two ranks of TP 1: one LLM of two replicas
    runs the throughput workload's requests (each its whole budget: ignore_eos) and reports them."""
    sys.path.insert(0, str(ROOT / "launch"))
    import bench

    out = tmp_path / "bench.json"
    args = ["--model", str(ckpt), "--engine", "ours", "--workload", "replicas", "--set", "device=cpu",
            "--set", "tensor_parallel_size=1", "--num-requests", "6", "--min-len", "4", "--max-len", "12"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "launch" / "bench.py"), *args, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())["replicas"]
    specs = bench.throughput_requests(bench.parse_args(args), 512, 6, 0)
    assert (got["replicas"], got["tensor_parallel_size"], got["requests"], got["errors"]) == (2, 1, 6, 0)
    assert got["prompt_tokens"] == sum(len(ids) for ids, _ in specs)
    assert got["output_tokens"] == sum(new for _, new in specs) and got["output_tok_s"] > 0
