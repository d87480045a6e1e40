"""The Python API, CLI conveniences and a two-node run on localhost."""
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from helpers import GENERATE, ROOT, free_port, hf_generate, make_checkpoint, run_cli

PROMPTS = [{"input_ids": [5, 17, 300, 42, 8]}, {"input_ids": [1, 2, 3]}]

API_SCRIPT = """
import json, sys
sys.path.insert(0, {root!r})
from tp_engine import LLM, SamplingParams
llm = LLM(model={model!r}, device="cpu")
outs = llm.generate({prompts!r}, SamplingParams(max_new_tokens=6))
with open({out!r} + str(llm.tp.rank), "w") as f:  # one file per rank: stdout lines of ranks can interleave
    json.dump(outs, f)
llm.shutdown()
"""


@pytest.mark.slow
def test_python_api_under_torchrun(tmp_path):
    model = make_checkpoint(tmp_path / "m")
    script = tmp_path / "user_script.py"
    script.write_text(API_SCRIPT.format(root=str(ROOT), model=str(model), prompts=PROMPTS,
                                        out=str(tmp_path / "rank")))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--standalone", str(script)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "rank1").read_text()) is None  # other ranks follow rank 0 and get None
    outs = json.loads((tmp_path / "rank0").read_text())
    assert [o["output_token_ids"] for o in outs] == hf_generate(model, [p["input_ids"] for p in PROMPTS], 6)


NO_SHUTDOWN = """
import atexit, os, sys
sys.path.insert(0, {root!r})
import torch.distributed as dist
from tp_engine import LLM, SamplingParams
# after LLM's; one write
atexit.register(lambda: os.write(1, f"group at exit: {{dist.is_initialized()}}\\n".encode()))
llm = LLM(model={model!r}, device="cpu")
llm.generate({prompts!r}, SamplingParams(max_new_tokens=4))
"""


@pytest.mark.slow
def test_a_script_that_forgets_shutdown_leaves_the_group_at_exit(tmp_path):
    """Without shutdown(), gloo's threads met interpreter teardown: some runs aborted after their results."""
    script = tmp_path / "no_shutdown.py"
    script.write_text(NO_SHUTDOWN.format(root=str(ROOT),
                                         model=str(make_checkpoint(tmp_path / "m")), prompts=PROMPTS))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--standalone", str(script)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("group at exit: False") == 2, proc.stdout


RECOVERS = """
import json, sys
sys.path.insert(0, {root!r})
from tp_engine import LLM, SamplingParams
llm = LLM(model={model!r}, device="cpu", timeout_s=20)
params = SamplingParams(max_new_tokens=6)
finished = []
def on_finish(out):
    finished.append(out["index"])
    if len(finished) == 1:
        raise RuntimeError("callback failed")
caught = None
try:
    llm.generate({prompts!r}, params, on_finish=on_finish)
except RuntimeError as e:
    caught = str(e)
again = llm.generate({prompts!r}, params)
with open({out!r} + str(llm.tp.rank), "w") as f:
    json.dump({{"caught": caught, "again": again}}, f)
llm.shutdown()
"""


def run_script(tmp_path, text, timeout=120):
    script = tmp_path / "user_script.py"
    script.write_text(text)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--standalone", str(script)], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.slow
def test_exception_between_steps_leaves_every_rank_ready_for_the_next_generate(tmp_path):
    model = make_checkpoint(tmp_path / "m")
    out = str(tmp_path / "rank")
    proc = run_script(tmp_path, RECOVERS.format(root=str(ROOT), model=str(model), prompts=PROMPTS, out=out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}").read_text()) for r in (0, 1))
    assert rank0["caught"] == "callback failed" and rank1 == {"caught": None, "again": None}
    from tp_engine import LLM, SamplingParams
    want = LLM(model=str(model), device="cpu").generate(PROMPTS, SamplingParams(max_new_tokens=6))
    assert [o["output_token_ids"] for o in rank0["again"]] == [w["output_token_ids"] for w in want]


def test_generate_from_a_callback_is_refused_and_the_engine_stays_usable(tmp_path):
    """A generate() called from an on_finish callback raises RuntimeError, since it would take the running
    call's KV pages and page tables, and the engine stays usable: the next generate gives transformers'
    tokens. The options: a model folder given as a Path is taken; overrides given as one string are refused,
    not read a character at a time."""
    from pathlib import Path

    from tp_engine import LLM, SamplingParams
    model = make_checkpoint(tmp_path / "m")
    with pytest.raises(TypeError, match="overrides must be a list of 'key=value' strings; got the string"):
        LLM(model=str(model), device="cpu", overrides="sampling.temperature=0.7")
    # the long prompts still run when 0 ends
    llm = LLM(model=Path(model), device="cpu", max_prefill_tokens=16)
    params = SamplingParams(max_new_tokens=6)
    prompts = [{"input_ids": [1, 2, 3]}] + [{"input_ids": list(range(7 + i, 47 + i))} for i in range(3)]

    def again(out):
        if out["index"] == 0:
            llm.generate(PROMPTS[:1], params)

    with pytest.raises(RuntimeError,
                       match="generate.. was called from a callback of a generate.. call that is still"):
        llm.generate(prompts, params, on_finish=again)
    want = hf_generate(model, [p["input_ids"] for p in prompts], 6)
    assert [o["output_token_ids"] for o in llm.generate(prompts, params)] == want
    llm.shutdown()


def test_a_lone_rank_interrupted_inside_a_step_can_generate_again(tmp_path, monkeypatch):
    """At TP 1 no other rank can be out of step: after Ctrl-C in the middle of a step (a notebook user
    stopping a long generate), the next generate runs and gives transformers' tokens."""
    from tp_engine import LLM, SamplingParams
    from tp_engine.runtime import engine
    model = make_checkpoint(tmp_path / "m")
    # pages the prefix cache keeps
    prompts = [{"input_ids": list(range(5, 45))}, {"input_ids": list(range(5, 40))}]
    llm = LLM(model=str(model), device="cpu", kv_cache={"page_size": 8})
    forward, calls = engine.Engine.forward, []

    def interrupted(self, batch):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return forward(self, batch)
    monkeypatch.setattr(engine.Engine, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, SamplingParams(max_new_tokens=6))
    again = llm.generate(prompts, SamplingParams(max_new_tokens=6))
    assert [o["output_token_ids"] for o in again] == hf_generate(model, [p["input_ids"] for p in prompts], 6)
    llm.shutdown()


def test_outputs_do_not_share_lists_with_the_caller_or_each_other(tmp_path):
    """Each output's `prompt_token_ids` is a list of its own: appending to the caller's input_ids (to build
    the next turn) or to one sample's list changes no other output."""
    from tp_engine import LLM, SamplingParams
    llm = LLM(model=str(make_checkpoint(tmp_path / "m")), device="cpu")
    ids = [5, 6, 7]
    first, second = llm.generate({"input_ids": ids}, SamplingParams(max_new_tokens=2, n=2))
    ids.append(8)
    first["prompt_token_ids"].append(9)
    assert second["prompt_token_ids"] == [5, 6, 7]
    llm.shutdown()


CYCLE = """
import gc, sys, weakref
sys.path.insert(0, {root!r})
import tp_engine.llm as L
first = L.LLM(model={model!r}, device="cpu")
first.engine.me = first.engine  # a reference cycle: only the collector frees it
dropped = weakref.ref(first.engine)
seen = []
make = L.Engine
L.Engine = lambda *a, **k: seen.append(dropped() is not None) or make(*a, **k)
gc.disable()  # no collection but the engine's own
del first
assert dropped() is not None
second = L.LLM(model={model!r}, device="cpu")
print("alive when the next engine started:", seen)
second.shutdown()
"""


@pytest.mark.slow
def test_a_dropped_llm_is_freed_before_the_next_one_starts(tmp_path):
    """An LLM the caller drops may keep its memory (on a GPU: weights, KV cache, CUDA graphs) in reference
    cycles until the garbage collector runs. A new LLM collects first, so it sizes its KV pool with that
    memory free and no collection frees old CUDA graphs in the middle of its own capture."""
    model = str(make_checkpoint(tmp_path / "m"))
    proc = subprocess.run([sys.executable, "-c", CYCLE.format(root=str(ROOT), model=model)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "alive when the next engine started: [False]" in proc.stdout, proc.stdout


BREAKS = """
import json, os, sys
sys.path.insert(0, {root!r})
from tp_engine import LLM, SamplingParams
from tp_engine.runtime import engine
if os.environ["RANK"] == "1":  # rank 1 fails inside a step: rank 0 waits in that step's all-reduce
    def forward(self, batch):
        raise RuntimeError("injected fault")
    engine.Engine.forward = forward
llm = LLM(model={model!r}, device="cpu", timeout_s=5)
errors = []
for attempt in range(2):
    try:
        llm.generate({prompts!r}, SamplingParams(max_new_tokens=4))
        errors.append(None)
    except Exception as e:
        errors.append(f"{{type(e).__name__}}: {{e}}")
with open({out!r} + str(llm.tp.rank), "w") as f:
    json.dump(errors, f)
llm.shutdown()
os._exit(0)
"""


@pytest.mark.slow
def test_failure_inside_a_step_makes_every_later_generate_refuse(tmp_path):
    model = make_checkpoint(tmp_path / "m")
    out = str(tmp_path / "rank")
    proc = run_script(tmp_path, BREAKS.format(root=str(ROOT), model=str(model), prompts=PROMPTS, out=out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        first, second = json.loads((tmp_path / f"rank{rank}").read_text())
        assert first is not None and second is not None, (rank, first, second)
        assert "cannot run again" in second and "out of step" in second, second
    assert json.loads((tmp_path / "rank1").read_text())[0] == "RuntimeError: injected fault"


DROPPED = """
import gc, os, sys
sys.path.insert(0, {root!r})
from tp_engine import LLM, SamplingParams
from tp_engine.runtime import engine
if os.environ["RANK"] == "1":  # rank 1 fails inside a step
    def forward(self, batch):
        raise RuntimeError("injected fault")
    engine.Engine.forward = forward
llm = LLM(model={model!r}, device="cpu", timeout_s=5)
try:
    llm.generate({prompts!r}, SamplingParams(max_new_tokens=4))
except Exception:
    pass
del llm  # dropped without shutdown(); the script then ends normally
gc.collect()
"""


@pytest.mark.slow
def test_a_broken_llm_dropped_without_shutdown_does_not_wait_for_its_ranks_at_exit(tmp_path):
    """The exit handler of a dropped LLM whose ranks fell out of step (a fault inside a step on rank 1) does
    not wait at a barrier they would never meet together: the script exits 0 with no error at exit."""
    model = make_checkpoint(tmp_path / "m")
    proc = run_script(tmp_path, DROPPED.format(root=str(ROOT), model=str(model), prompts=PROMPTS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Exception ignored" not in proc.stderr, proc.stderr[-3000:]


AGAIN = """
import json, os, sys, time
sys.path.insert(0, {root!r})
from tp_engine import LLM, SamplingParams
outs = []
for i in range(3):
    if os.environ["RANK"] == "0":
        time.sleep(1)  # rank 1 makes the next process group first
    llm = LLM(model={model!r}, device="cpu", timeout_s=30)
    outs.append(llm.generate({prompts!r}, SamplingParams(max_new_tokens=6)))
    llm.shutdown()
with open({out!r} + str(os.environ["RANK"]), "w") as f:
    json.dump(outs, f)
"""


@pytest.mark.slow
def test_an_llm_after_shutdown_in_the_same_processes(tmp_path):
    """LLMs made one after another in the same processes, each after the last one's shutdown(), all give
    transformers' tokens: each process group has its own keys in torchrun's store, so gloo never connects to
    the closed socket of an earlier group."""
    want, outs = hf_and_rank0_runs(tmp_path, AGAIN)
    assert [[o["output_token_ids"] for o in run] for run in outs] == [want] * 3
    assert json.loads((tmp_path / "rank1").read_text()) == [None] * 3


def hf_and_rank0_runs(tmp_path, script: str) -> tuple[list, list]:
    """Run a two-rank `script` (formatted with root, model, prompts, out) that writes each rank's outputs of
    its generate calls to out + rank: (transformers' tokens for PROMPTS, rank 0's outputs)."""
    model = make_checkpoint(tmp_path / "m")
    proc = run_script(tmp_path, script.format(root=str(ROOT), model=str(model), prompts=PROMPTS,
                                              out=str(tmp_path / "rank")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = hf_generate(model, [p["input_ids"] for p in PROMPTS], 6)
    return want, json.loads((tmp_path / "rank0").read_text())


TWO_LLMS = """
import atexit, json, os, sys
sys.path.insert(0, {root!r})
import torch.distributed as dist
from tp_engine import LLM, SamplingParams
# after LLM's; one write
atexit.register(lambda: os.write(1, f"group at exit: {{dist.is_initialized()}}\\n".encode()))
params = SamplingParams(max_new_tokens=6)
first, second, dropped = (LLM(model={model!r}, device="cpu", timeout_s=30) for _ in range(3))
del dropped  # never shut down: the exit handler counts it
first.generate({prompts!r}, params)
first.shutdown()
outs = second.generate({prompts!r}, params)  # second is shut down at exit
with open({out!r} + os.environ["RANK"], "w") as f:
    json.dump(outs, f)
"""


@pytest.mark.slow
def test_shutting_one_llm_down_leaves_the_others_usable(tmp_path):
    """The LLMs of a process share its process group: shutting the first down leaves the second's generate
    working ('Group ... is not registered' otherwise), and the last one leaves the group, at exit too."""
    model = make_checkpoint(tmp_path / "m")
    proc = run_script(tmp_path, TWO_LLMS.format(root=str(ROOT), model=str(model), prompts=PROMPTS,
                                                out=str(tmp_path / "rank")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = hf_generate(model, [p["input_ids"] for p in PROMPTS], 6)
    assert [o["output_token_ids"] for o in json.loads((tmp_path / "rank0").read_text())] == want
    assert proc.stdout.count("group at exit: False") == 2, proc.stdout



OWN_TIMEOUT = """
import json, os, sys, time
sys.path.insert(0, {root!r})
from tp_engine import LLM, SamplingParams
params, rank, out = SamplingParams(max_new_tokens=6), int(os.environ["RANK"]), {out!r}
patient = LLM(model={model!r}, device="cpu", timeout_s=300)
hasty = LLM(model={model!r}, device="cpu", timeout_s=2)
# patient's ranks wait for each other longer than hasty's timeout_s: for the step message (rank 0 late), then
# in the all-reduces of the first layer's attention and the norm after it (rank 1 late)
attn = patient.engine.model.model.layers[0].self_attn
late = [rank == 1]
def slow(*args, forward=attn.forward):
    if late and late.pop():
        time.sleep(3)
    return forward(*args)
attn.forward = slow
if rank == 0:
    time.sleep(3)
outs = patient.generate({prompts!r}, params)
t0 = time.time()
if rank == 0:  # until rank 1 has given up on hasty's first step (or for a minute)
    while not os.path.exists(out + "1") and time.time() - t0 < 60:
        time.sleep(0.1)
try:
    hasty.generate({prompts!r}, params)
    error = None
except RuntimeError as e:
    error = str(e)
with open(out + str(rank) + ".tmp", "w") as f:
    json.dump({{"waited": time.time() - t0, "error": error, "outs": outs}}, f)
os.rename(out + str(rank) + ".tmp", out + str(rank))
os._exit(0)
"""


@pytest.mark.slow
def test_each_llm_of_a_process_waits_its_own_timeout(tmp_path):
    """Two LLMs in the same processes each wait their own timeout_s: the second's followers give up after its
    2 s, not the first's 300 s, and the first keeps its own group (its norms all-reduce there), waiting out
    delays longer than the second's timeout_s."""
    model = make_checkpoint(tmp_path / "m")
    out = str(tmp_path / "rank")
    proc = run_script(tmp_path,
                      OWN_TIMEOUT.format(root=str(ROOT), model=str(model), prompts=PROMPTS, out=out))
    assert (tmp_path / "rank1").is_file(), proc.stderr[-3000:]  # not there: patient failed
    follower = json.loads((tmp_path / "rank1").read_text())
    assert follower["error"] is not None and "timeout_s" in follower["error"], (follower, proc.stderr[-3000:])
    assert follower["waited"] < 20, follower
    want = hf_generate(model, [p["input_ids"] for p in PROMPTS], 6)  # patient waited out both delays
    assert [o["output_token_ids"] for o in json.loads((tmp_path / "rank0").read_text())["outs"]] == want


LAST_SHUTDOWN = """
import os, sys, time
sys.path.insert(0, {root!r})
from tp_engine import LLM, SamplingParams
patient = LLM(model={model!r}, device="cpu", timeout_s=300)
hasty = LLM(model={model!r}, device="cpu", timeout_s=2)
hasty.shutdown()
patient.generate({prompts!r}, SamplingParams(max_new_tokens=3))
if os.environ["RANK"] == "0":
    time.sleep(4)  # rank 1 waits in patient's shutdown
patient.shutdown()
os.write(1, b"shut down\\n")
"""


@pytest.mark.slow
def test_the_last_shutdown_waits_with_its_own_llms_timeout(tmp_path):
    """The barrier of the last shutdown() waits with the timeout_s of the LLM being shut down, not that of the
    LLM made last (2 s, shut down first): rank 1 waits there while rank 0 is still busy."""
    model = make_checkpoint(tmp_path / "m")
    proc = run_script(tmp_path, LAST_SHUTDOWN.format(root=str(ROOT), model=str(model), prompts=PROMPTS))
    assert proc.returncode == 0 and proc.stdout.count("shut down") == 2, proc.stdout + proc.stderr[-3000:]


MISMATCH = """
import os, sys
sys.path.insert(0, {root!r})
from tp_engine import LLM
rank = int(os.environ["RANK"])
first = LLM(model={model!r}, device="cpu", timeout_s=20)
try:
    LLM(model={model!r}, device="cpu", timeout_s=20 if rank == 0 else 10)
except Exception as e:
    os.write(1, f"rank {{rank}}: {{type(e).__name__}}: {{e}}\\n".encode())
os._exit(0)
"""


@pytest.mark.slow
def test_a_later_llm_started_differently_on_each_rank_says_so(tmp_path):
    """A later LLM whose timeout_s differs between the ranks fails on every rank with the start-up check's
    message, not with a store timeout of process groups that only one rank made."""
    model = make_checkpoint(tmp_path / "m")
    proc = run_script(tmp_path, MISMATCH.format(root=str(ROOT), model=str(model)))
    for rank in (0, 1):
        said = f"rank {rank}: StartupError: ranks were started with different configurations"
        assert said in proc.stdout, proc.stdout + proc.stderr[-3000:]


CHANNELS = """
import json, os, sys
sys.path.insert(0, {root!r})
from tp_engine import LLM, SamplingParams
params = SamplingParams(max_new_tokens=6)
shm = LLM(model={model!r}, device="cpu", advanced={{"step_channel": "shm"}})
gloo = LLM(model={model!r}, device="cpu", advanced={{"step_channel": "gloo"}})
outs = [shm.generate({prompts!r}, params), gloo.generate({prompts!r}, params)]
with open({out!r} + os.environ["RANK"], "w") as f:
    json.dump(outs, f)
"""


@pytest.mark.slow
def test_an_llm_with_another_step_channel_leaves_the_first_ones_channel_open(tmp_path):
    """A second LLM with another step channel (gloo) leaves the first one's shared-memory channel open: both
    give transformers' tokens."""
    want, outs = hf_and_rank0_runs(tmp_path, CHANNELS)
    assert [[o["output_token_ids"] for o in run] for run in outs] == [want] * 2


def test_help_lists_every_key_and_print_config_merges(tmp_path):
    from tp_engine.base.config import SCHEMA
    out = subprocess.run([sys.executable, str(GENERATE), "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    for key in SCHEMA:
        assert f"  {key} = " in out, key
    assert "--set" in out and "sampling.temperature=0.7" in out
    conf = tmp_path / "c.yaml"
    conf.write_text(yaml.safe_dump({"model": str(tmp_path), "prompts": ["hi"], "sampling": {"top_k": 5}}))
    proc = subprocess.run([sys.executable, str(GENERATE), "--config", str(conf), "--print-config",
                           "--set", "sampling.temperature=0.7", "--set", "kv_cache.num_pages=12"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    merged = yaml.safe_load(proc.stdout)
    assert merged["sampling"] == {**merged["sampling"], "temperature": 0.7, "top_k": 5}
    assert merged["kv_cache"]["num_pages"] == 12 and merged["kv_cache"]["page_size"] == 16  # defaults kept


@pytest.mark.slow
def test_two_nodes_on_localhost_equal_transformers(tmp_path):
    model = make_checkpoint(tmp_path / "m")
    cfg = {"model": str(model), "prompts": PROMPTS, "sampling": {"max_new_tokens": 8}, "device": "cpu"}
    port = free_port()
    procs = []
    for node in range(2):
        conf = tmp_path / f"node{node}.yaml"
        conf.write_text(yaml.safe_dump({**cfg, "output": str(tmp_path / "nodes.jsonl")}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}", str(GENERATE),
               "--config", str(conf)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=dict(os.environ, OMP_NUM_THREADS="1")))
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "nodes.jsonl").read_text().splitlines()]
    assert [x["output_token_ids"] for x in lines] == hf_generate(model, [p["input_ids"] for p in PROMPTS], 8)


@pytest.mark.slow
def test_shared_memory_step_channel_gives_the_same_tokens(tmp_path):
    """advanced.step_channel: shm sends the step messages through the shared-memory mailbox, on CPU too."""
    model = make_checkpoint(tmp_path / "m")
    cfg = {"model": str(model), "prompts": PROMPTS * 3, "sampling": {"max_new_tokens": 8}}
    proc, shm = run_cli({**cfg, "advanced": {"step_channel": "shm"}}, tmp_path, nproc=2, name="shm")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step messages go through gloo" not in proc.stderr  # the mailbox was set up
    assert "leaked shared_memory" not in proc.stderr  # the ranks exit without tearing down: nothing is left
    want = hf_generate(model, [p["input_ids"] for p in PROMPTS * 3], 8)
    assert [x["output_token_ids"] for x in shm] == want
    # a start-up refusal (here of a resume) leaves no mailbox behind either, and says one thing
    proc, _ = run_cli({**cfg, "advanced": {"step_channel": "shm"}, "resume": True, "seed": 1}, tmp_path,
                      nproc=2, name="shm")
    assert proc.returncode != 0 and "resume:" in proc.stderr
    assert "leaked shared_memory" not in proc.stderr


@pytest.mark.slow
def test_progress_lines_and_quiet(tmp_path):
    model = make_checkpoint(tmp_path / "m")
    cfg = {"model": str(model), "prompts": PROMPTS, "sampling": {"max_new_tokens": 8}}
    proc, _ = run_cli(cfg, tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "progress: 2/2 requests, 16 output tokens" in proc.stderr  # not a terminal: log lines
    assert proc.stderr.count("progress:") == 1  # from rank 0 only
    proc, _ = run_cli(cfg, tmp_path, nproc=2, args=("--quiet",), name="quiet")
    assert proc.returncode == 0 and "progress:" not in proc.stderr and "KV cache" not in proc.stderr


@pytest.mark.slow
def test_dummy_weights_from_config_alone(tmp_path):
    src = make_checkpoint(tmp_path / "m")
    cfg_only = tmp_path / "shape"
    cfg_only.mkdir()
    (cfg_only / "config.json").write_text((src / "config.json").read_text())  # no weights, no tokenizer
    cfg = {"model": str(cfg_only), "load_format": "dummy", "prompts": PROMPTS,
           "sampling": {"max_new_tokens": 5}}
    proc, lines = run_cli(cfg, tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [len(x["output_token_ids"]) for x in lines] == [5, 5]
    proc, _ = run_cli({**cfg, "load_format": "auto"}, tmp_path, name="auto")
    assert proc.returncode != 0 and "no *.safetensors weights" in proc.stderr


def test_kv_pool_with_its_scratch_page_stays_within_the_byte_budget(tmp_path, monkeypatch):
    """The pool sized from a byte budget (CPU_KV_BYTES here; the GPU's share of free memory the same way)
    counts the scratch page the padded rows write to: all of it fits the budget, and requests get one page
    less."""
    from tp_engine import LLM
    from tp_engine.attention import kv_cache
    from tp_engine.attention.kv_cache import KVCache

    model = make_checkpoint(tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    per_page = KVCache.bytes_per_page(cfg["num_hidden_layers"], 16, cfg["num_key_value_heads"],
                                      cfg["head_dim"], torch.float32)
    monkeypatch.setattr(kv_cache, "CPU_KV_BYTES", 10 * per_page)
    llm = LLM(model=str(model), device="cpu")
    kv = llm.engine.kv
    assert kv.data.numel() * kv.data.element_size() <= 10 * per_page
    assert kv.num_pages == 9
    llm.shutdown()
