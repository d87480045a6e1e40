"""The output file through the real CLI under torchrun: it is never an input or a special file, symlinks are
written through, one run at a time holds it, a failed start leaves it alone, resume keeps only lines this run
would write; workers never outlive torchrun, and Ctrl-C keeps the finished results."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import GENERATE, ROOT, make_checkpoint, run_cli, start_job, wait_for_lines, worker_pids

PROMPTS = [{"input_ids": [5, 17, 300, 42, 8]}, {"input_ids": [1, 2, 3]}, {"input_ids": [9, 9, 9, 9]}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("output") / "m")


def base(ckpt, **kw):
    return {"model": str(ckpt), "prompts": PROMPTS, "sampling": {"max_new_tokens": 8}, "device": "cpu", **kw}


def long_cfg(ckpt, out, n=300, max_new_tokens=40):
    """A job that runs for a while, two requests at a time."""
    prompts = [{"input_ids": [i % 500 + 1, 2, 3]} for i in range(n)]
    return base(ckpt, prompts=prompts, output=str(out) if out else None, max_batch_size=2,
                sampling={"max_new_tokens": max_new_tokens, "ignore_eos": True})


def refused(proc, *needles):
    """Stopped at start-up with one message, before any rank loaded its weights."""
    assert proc.returncode != 0, proc.stderr[-3000:]
    errs = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errs) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in errs[0], errs[0]
    assert "KV cache" not in proc.stderr  # logged once the weights are in
    return errs[0]


def alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_job(proc, pids=()):
    """torchrun and its workers: torchrun detaches them with setsid, so killing torchrun's group is not
    enough."""
    pids = list(pids) + (list(worker_pids(proc.pid).values()) if proc.poll() is None else [])
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- what the output may be ----

@pytest.mark.slow
@pytest.mark.parametrize("case", ["config_file", "prompts_file", "model_file", "symlink_to_device", "fifo",
                                  "stdout_pipe"])
def test_output_that_is_not_a_results_file_is_refused(ckpt, tmp_path, case):
    """A special file (a device, a FIFO, /dev/stdout on a pipe) is refused as such, saying how to get
    stdout."""
    cfg, nproc = base(ckpt), 1
    stdout = 'for stdout, leave \'output\' unset or give "-"'

    if case == "config_file":  # run_cli writes the config to run.yaml
        cfg["output"], nproc, needles = str(tmp_path / "run.yaml"), 2, ["config file"]
    elif case == "prompts_file":
        pf = tmp_path / "prompts.jsonl"
        pf.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
        del cfg["prompts"]
        cfg.update(prompts_file=str(pf), output=str(pf))
        needles = ["prompts_file"]
    elif case == "model_file":
        model = tmp_path / "model"
        shutil.copytree(ckpt, model)
        cfg.update(model=str(model), output=str(model / "model.safetensors"))
        needles = ["inside the model directory"]
    elif case == "symlink_to_device":
        (tmp_path / "out.jsonl").symlink_to("/dev/null")
        cfg["output"], needles = str(tmp_path / "out.jsonl"), ["not a regular file", "/dev/null", stdout]
    elif case == "fifo":
        os.mkfifo(tmp_path / "out.jsonl")
        cfg["output"], needles = str(tmp_path / "out.jsonl"), ["not a regular file", stdout]
    else:  # run_cli reads the rank's stdout through a pipe (it named a lock file under /proc)
        cfg["output"], needles = "/dev/stdout", ["output /dev/stdout is not a regular file;", stdout]
    target = Path(cfg["output"])
    before = target.read_bytes() if target.is_file() else None
    proc, _ = run_cli(cfg, tmp_path, nproc=nproc, read_output=False)
    refused(proc, cfg["output"], *needles)
    if case == "config_file":
        assert yaml.safe_load(target.read_text())["output"] == str(target)
    elif case == "symlink_to_device":
        assert target.is_symlink() and os.readlink(target) == "/dev/null"
    elif case == "fifo":
        assert target.is_fifo()
    elif case != "stdout_pipe":
        assert target.read_bytes() == before


@pytest.mark.slow
def test_output_dash_is_stdout_and_makes_no_file(ckpt, tmp_path):
    """`output: "-"` prints the results to stdout, as no `output` does; no file named "-" is written."""
    conf = tmp_path / "run.yaml"
    conf.write_text(yaml.safe_dump(base(ckpt, output="-")))
    proc = subprocess.run([sys.executable, str(GENERATE), "--config", str(conf)], cwd=tmp_path, timeout=180,
                          capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [json.loads(line)["index"] for line in proc.stdout.splitlines()] == [0, 1, 2]
    assert not (tmp_path / "-").exists()


@pytest.mark.slow
def test_symlinked_output_is_written_through(ckpt, tmp_path):
    real = tmp_path / "results" / "real.jsonl"
    real.parent.mkdir()
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    proc, lines = run_cli(base(ckpt, output=str(link)), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert link.is_symlink() and [line["index"] for line in lines] == [0, 1, 2]
    # next to the target: the results and their settings; no lock or temporary file left behind
    assert sorted(p.name for p in real.parent.iterdir()) == ["real.jsonl", "real.jsonl.run.json"]


FAILS_AT_FIRST_STEP = """
import sys
sys.path.insert(0, {root!r})
from tp_engine.runtime import engine
def forward(self, batch):
    raise RuntimeError("injected fault")
engine.Engine.forward = forward
from tp_engine.cli import main
sys.exit(main())
"""


@pytest.mark.slow
def test_run_that_fails_before_its_first_result_leaves_the_output_alone(ckpt, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"index": 0, "from": "an earlier run"}\n')
    script = tmp_path / "fails.py"
    script.write_text(FAILS_AT_FIRST_STEP.format(root=str(ROOT)))
    proc = start_job(base(ckpt, output=str(out)), tmp_path, nproc=1, script=script)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "injected fault" in err, err[-3000:]
    assert out.read_text() == '{"index": 0, "from": "an earlier run"}\n'
    # refused at start-up, after the lock was taken (a limit the model cannot hold): no lock file is left
    proc, _ = run_cli(base(ckpt, output=str(out), max_model_len=10 ** 6), tmp_path, read_output=False)
    refused(proc, "max_model_len")
    assert out.read_text() == '{"index": 0, "from": "an earlier run"}\n'
    assert not (tmp_path / "out.jsonl.lock").exists()


@pytest.mark.slow
def test_a_run_refused_at_start_up_leaves_no_folder_it_made(ckpt, tmp_path):
    """A run refused at start-up leaves no folder it made for the output path (exit 2 promises that nothing
    changed), and a folder that was already there stays; a run that writes keeps them."""
    (tmp_path / "runs").mkdir()
    out = tmp_path / "runs" / "new" / "deeper" / "out.jsonl"
    proc, _ = run_cli(base(ckpt, output=str(out), max_model_len=10 ** 6), tmp_path, read_output=False)
    refused(proc, "max_model_len")
    assert list((tmp_path / "runs").iterdir()) == []
    # a run that writes keeps them
    proc, _ = run_cli(base(ckpt, output=str(out)), tmp_path, read_output=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(out.read_text().splitlines()) == len(PROMPTS) and not out.with_name("out.jsonl.lock").exists()


# rank 0, at its first forward (the weights are in, no result has finished): a signal, or a failure
STOPPED_EARLY = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from tp_engine.runtime import engine
def forward(self, *args):
    {action}
engine.Engine.forward = forward
from tp_engine.cli import main
sys.exit(main())
"""


@pytest.mark.slow
@pytest.mark.parametrize("action", ["os.kill(os.getpid(), signal.SIGTERM); time.sleep(60)",
                                    "raise RuntimeError('injected fault')"])
def test_a_run_stopped_before_its_first_result_leaves_no_folder_it_made(ckpt, tmp_path, action):
    """A signal or a failure that ends the run before its first result leaves neither the lock file nor the
    folders made for the output behind."""
    (tmp_path / "runs").mkdir()
    out = tmp_path / "runs" / "new" / "out.jsonl"
    script = tmp_path / "stopped.py"
    script.write_text(STOPPED_EARLY.format(root=str(ROOT), action=action))
    proc = start_job(base(ckpt, output=str(out)), tmp_path, nproc=1, script=script)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        kill_job(proc)
    assert proc.returncode != 0
    said = "stopped by SIGTERM: no result had finished" if "kill" in action else "injected fault"
    assert said in err, err[-3000:]
    assert list((tmp_path / "runs").iterdir()) == []


# ---- one run at a time, and never after torchrun ----

@pytest.mark.slow
def test_second_run_on_the_same_output_is_refused_at_once(ckpt, tmp_path):
    out = tmp_path / "out.jsonl"
    first = start_job(long_cfg(ckpt, out), tmp_path)
    try:
        wait_for_lines(out, 1, first)
        holder = worker_pids(first.pid)[0]
        proc, _ = run_cli(base(ckpt, output=str(out)), tmp_path, name="second")
        # at start-up, without waiting for the lock: before any weights load
        refused(proc, str(out), "in use by another run", f"(pid {holder})")
        n = len(out.read_text().splitlines())
        wait_for_lines(out, n + 1, first)  # the first run still writes, to its own file
        assert all(len(line["output_token_ids"]) == 40 for line in read_lines(out)[:n])
    finally:
        kill_job(first)


@pytest.mark.slow
def test_workers_end_soon_after_torchrun_is_killed(ckpt, tmp_path):
    out = tmp_path / "out.jsonl"
    proc = start_job(long_cfg(ckpt, out), tmp_path)
    pids = {}
    try:
        wait_for_lines(out, 1, proc)
        pids = worker_pids(proc.pid)
        assert len(pids) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        t0 = time.time()
        while any(alive(p) for p in pids.values()) and time.time() - t0 < 15:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids.values()), "workers outlived torchrun"
        assert time.time() - t0 < 5
    finally:
        kill_job(proc, pids.values())


@pytest.mark.slow
def test_ctrl_c_without_output_prints_the_finished_results(ckpt, tmp_path):
    log = tmp_path / "stderr.txt"
    with log.open("w") as err_file:
        proc = start_job(long_cfg(ckpt, None, n=2000, max_new_tokens=8), tmp_path, stderr=err_file)
        try:
            t0 = time.time()
            while "KV cache" not in log.read_text():  # loaded: generation starts now
                assert proc.poll() is None and time.time() - t0 < 120, log.read_text()[-3000:]
                time.sleep(0.1)
            time.sleep(3)
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal reaches torchrun's group
            stdout, _ = proc.communicate(timeout=30)
        finally:
            kill_job(proc)
    err = log.read_text()
    lines = [json.loads(line) for line in stdout.splitlines()]
    assert lines, err[-3000:]
    assert [line["index"] for line in lines] == sorted({line["index"] for line in lines})
    assert all(len(line["output_token_ids"]) == 8 for line in lines)
    assert f"stopped by SIGINT: {len(lines)} finished results were printed to stdout" in err


@pytest.mark.slow
def test_ctrl_c_while_the_results_are_printed_lets_them_finish(ckpt, tmp_path):
    """Rank 0 prints the results to stdout at the end; a Ctrl-C then (here while a reader has not yet drained
    the pipe) lets that printing finish: every line once and whole, none printed again from the signal
    handler."""
    cfg = long_cfg(ckpt, None, n=40, max_new_tokens=8)
    cfg["sampling"]["logprobs"] = 20  # about 4 KB a line: more than a pipe holds
    log = tmp_path / "stderr.txt"
    with log.open("w") as err_file:
        proc = start_job(cfg, tmp_path, nproc=1, stderr=err_file)
        try:
            # printing has begun; it waits for the pipe now
            head = os.read(proc.stdout.fileno(), 100).decode()
            time.sleep(1.5)
            os.killpg(proc.pid, signal.SIGINT)
            stdout, _ = proc.communicate(timeout=60)
        finally:
            kill_job(proc)
    lines = [json.loads(line) for line in (head + stdout).splitlines()]
    assert [line["index"] for line in lines] == list(range(40)), log.read_text()[-3000:]
    assert "stopped by SIGINT after the results were printed" in log.read_text()


PRINTER = r"""
import signal
from tp_engine.frontend.results import ResultSink

signal.signal(signal.SIGALRM, lambda *_: None)  # a handler that returns, as Ctrl-C's does while results print
signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)
sink = ResultSink(None, None, {"model": "m"})
for i in range(40):
    sink.add({"index": i, "sample": 0, "prompt_token_ids": [1], "output_token_ids": [100000 + i] * 4000,
              "text": "", "finish_reason": "length", "cached_prompt_tokens": 0})
sink.close()
signal.setitimer(signal.ITIMER_REAL, 0)
"""


def test_results_printed_to_a_pipe_stay_whole_when_signals_interrupt_the_writes():
    """With PYTHONUNBUFFERED=1 (common in job scripts), a write to a full pipe that a signal cuts short goes
    on with the rest of its line: every line arrives whole, in order."""
    proc = subprocess.Popen([sys.executable, "-c", PRINTER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    chunks = []
    while chunk := os.read(proc.stdout.fileno(), 8192):  # a slow reader: the pipe stays full
        chunks.append(chunk)
        time.sleep(0.0005)
    assert proc.wait() == 0, proc.stderr.read().decode()[-2000:]
    lines = b"".join(chunks).decode().splitlines()
    assert [json.loads(line)["index"] for line in lines] == list(range(40))


@pytest.mark.slow
def test_rank0_keeps_no_output_tokens_once_they_are_written(ckpt, tmp_path, monkeypatch):
    """A finished output is not kept once written (in an output list, the result sink or the requests): at
    about 45 bytes a token, a million prompts of 2k tokens would not fit in rank 0's memory."""
    import tracemalloc

    from tp_engine.frontend import results
    from tp_engine.cli import main
    from tp_engine.llm import LLM

    held = {}
    generate, close = LLM.generate, results.ResultSink.close
    monkeypatch.setattr(LLM, "generate",
                        lambda *a, **k: held.__setitem__("start", tracemalloc.get_traced_memory()[0])
                        or generate(*a, **k))
    monkeypatch.setattr(results.ResultSink, "close", lambda self: held.__setitem__(
        "end", tracemalloc.get_traced_memory()[0]) or close(self))

    def job(max_new_tokens: int) -> int:
        """Bytes that the job's Python objects hold once every result is written."""
        cfg = long_cfg(ckpt, tmp_path / f"out{max_new_tokens}.jsonl", n=64, max_new_tokens=max_new_tokens)
        conf = tmp_path / "run.yaml"
        conf.write_text(yaml.safe_dump({**cfg, "max_batch_size": 64, "prefix_cache": False,
                                        "progress": False}))
        assert main(["--config", str(conf), "--quiet"]) == 0
        return held["end"] - held["start"]

    tracemalloc.start()
    try:
        job(4)  # imports and caches
        short, long = job(4), job(132)
    finally:
        tracemalloc.stop()
    assert (long - short) / (64 * 128) < 8, f"{short:,} bytes held for 64 x 4 tokens, {long:,} for 64 x 132"
    lines = [json.loads(line) for line in (tmp_path / "out132.jsonl").read_text().splitlines()]
    assert [(o["index"], len(o["output_token_ids"])) for o in lines] == [(i, 132) for i in range(64)]


LATE_SIGNAL = r"""
import os, signal, sys
from tp_engine import cli
from tp_engine.frontend.results import ResultSink

cli.install_signal_handlers(0)
cli._SINK = ResultSink(None, None, {"model": "m"})
cli._SINK.add({"index": 0, "output_token_ids": [5], "finish_reason": "length"})
cli._SINK.close()  # printed; run() has looked for a late signal already
os.kill(os.getpid(), signal.SIGINT)
print("went on", file=sys.stderr)
"""


def test_a_signal_just_after_the_results_were_printed_still_stops_the_job():
    """A signal taken as "late" (come while the results printed) after run() has looked for one still stops
    the job with its status, rather than being dropped and the job exiting 0."""
    proc = subprocess.run([sys.executable, "-c", LATE_SIGNAL], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr[-2000:]
    assert "stopped by SIGINT after the results were printed" in proc.stderr and "went on" not in proc.stderr
    assert [json.loads(line)["index"] for line in proc.stdout.splitlines()] == [0]


EARLY_SIGNAL = r"""
import os, runpy, signal, sys


class Hook:  # the signal comes as the command line's modules import: a Ctrl-C just after the launch
    def find_spec(self, name, path=None, target=None):
        if name == "tp_engine.cli":
            os.kill(os.getpid(), signal.{sig})
        return None


sys.meta_path.insert(0, Hook())
sys.argv = ["generate.py", "--config", {conf!r}]
runpy.run_path({generate!r}, run_name="__main__")
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_before_the_run_started_is_one_line(ckpt, tmp_path, sig):
    """A Ctrl-C or SIGTERM before main() has set up its handlers ends the rank with one line and the signal's
    status: no KeyboardInterrupt traceback, no silent end, nothing written."""
    conf = tmp_path / "run.yaml"
    conf.write_text(yaml.safe_dump(base(ckpt, output=str(tmp_path / "out.jsonl"))))
    script = EARLY_SIGNAL.format(sig=sig, conf=str(conf), generate=str(GENERATE))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 128 + getattr(signal, sig), proc.stderr[-2000:]
    assert proc.stderr.strip() == f"stopped by {sig} before the run started"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


FAILING_RANK = r"""
import os, signal, sys
from tp_engine import cli
from tp_engine.frontend.results import ResultSink


def run(*args, **kw):
    cli._SINK = ResultSink(None, None, {"model": "m"})
    cli._SINK.add({"index": 0, "output_token_ids": [5], "finish_reason": "length"})
    raise RuntimeError("a kernel failed")


def on_stop(self, real=ResultSink.on_stop):
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun's, as it stops the other ranks
    return real(self)


cli.C.build_config, cli.read_prompts = lambda *a: {}, lambda cfg: []
cli.run, ResultSink.on_stop = run, on_stop
cli.main([])
"""


def test_a_signal_while_a_rank_fails_does_not_hide_why():
    """A rank that fails says why and where the finished results are, then exits. torchrun's SIGTERM, sent as
    the failure reaches it, runs the signal handler in the middle of that: the failure's message and status
    stay, with no traceback from closing the output lock twice."""
    proc = subprocess.run([sys.executable, "-c", FAILING_RANK], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "error: rank 0: RuntimeError: a kernel failed; 1 finished results were printed to stdout" \
        in proc.stderr
    assert "stopped by" not in proc.stderr, proc.stderr[-2000:]
    assert [json.loads(line)["index"] for line in proc.stdout.splitlines()] == [0]


def test_a_failure_after_the_results_were_printed_does_not_say_a_line_may_be_cut(capsys):
    from tp_engine.frontend.results import ResultSink
    sink = ResultSink(None, None, {"model": "m"})
    sink.add({"index": 0, "output_token_ids": [5], "finish_reason": "length"})
    sink.close()
    assert sink.on_stop() == "the results were printed to stdout"
    assert [json.loads(line)["index"] for line in capsys.readouterr().out.splitlines()] == [0]


def test_results_printed_to_a_stdout_without_a_file_are_flushed(monkeypatch):
    """The signal handler leaves with os._exit, so the printed lines are flushed as they are written, not left
    in stdout's buffer."""
    import io
    from tp_engine.frontend.results import print_lines
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw))
    print_lines(['{"index": 0}'])
    assert raw.getvalue() == b'{"index": 0}\n'


# ---- resume ----

@pytest.fixture(scope="module")
def finished(ckpt, tmp_path_factory):
    """The output of a finished sampled run at TP 2, and its config."""
    tmp = tmp_path_factory.mktemp("finished")
    cfg = base(ckpt, output=str(tmp / "out.jsonl"), seed=1,
               sampling={"max_new_tokens": 8, "temperature": 0.7})
    proc, lines = run_cli(cfg, tmp, nproc=2)
    assert proc.returncode == 0 and len(lines) == 3, proc.stderr[-3000:]
    return cfg, Path(cfg["output"])


RESUME_CASES = {
    "sampling": ({"sampling": {"max_new_tokens": 8, "temperature": 0.0}},
                 ["sampling.temperature=0.7, now 0.0", "3 of 3 lines"]),
    "prompt_changed": ({"prompts": [PROMPTS[0], {"input_ids": [1, 2, 4]}, PROMPTS[2]]},
                       ["line 2: prompt 1", "1 of 3 lines"]),
    "fewer_prompts": ({"prompts": PROMPTS[:2]}, ["line 3 is the result of prompt 2", "2 prompts"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_refuses_lines_this_run_would_not_write(finished, tmp_path, case):
    cfg, out = finished
    before = out.read_bytes()
    change, needles = RESUME_CASES[case]
    proc, _ = run_cli({**cfg, **change, "resume": True}, tmp_path)
    refused(proc, f"resume: {out}", "resume: false", *needles)
    assert out.read_bytes() == before  # nothing deleted, nothing mixed in


@pytest.mark.slow
def test_resume_takes_max_model_len_written_out_as_the_default_it_was(finished, tmp_path):
    """`max_model_len: null` means max_position_embeddings: naming that value changes no token."""
    cfg, out = finished
    before = out.read_bytes()
    max_pos = json.loads((Path(cfg["model"]) / "config.json").read_text())["max_position_embeddings"]
    proc, _ = run_cli({**cfg, "max_model_len": max_pos, "resume": True}, tmp_path)
    assert proc.returncode == 0 and '"resumed_skipped": 3' in proc.stderr, proc.stderr[-3000:]
    assert out.read_bytes() == before


@pytest.mark.slow
def test_error_lines_are_retried_on_resume_and_set_the_exit_status(ckpt, tmp_path):
    out = tmp_path / "out.jsonl"
    prompts = [PROMPTS[0], {"input_ids": [7] * 40}, PROMPTS[1]]  # 40 tokens do not fit a pool of 32
    cfg = base(ckpt, prompts=prompts, output=str(out), max_model_len=64,
               kv_cache={"num_pages": 2, "page_size": 16}, fail_on_prompt_error=True)
    conf = tmp_path / "small_pool.yaml"
    conf.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, str(GENERATE), "--config", str(conf)], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 3, proc.stderr[-3000:]  # finished, but a prompt has no result
    assert '1 of 3 prompts ended with finish_reason "error"' in proc.stderr
    first = read_lines(out)
    assert [line["finish_reason"] for line in first] == ["length", "error", "length"]
    summary = json.loads(proc.stderr.split("summary: ")[1].splitlines()[0])
    assert summary["prompt_tokens"] == len(first[0]["prompt_token_ids"]) + len(first[2]["prompt_token_ids"])
    proc, lines = run_cli({**cfg, "resume": True, "kv_cache": {"num_pages": 8, "page_size": 16}}, tmp_path,
                          nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line["finish_reason"] for line in lines] == ["length"] * 3
    assert (lines[0], lines[2]) == (first[0], first[2])  # finished lines are kept as they were
    assert json.loads(proc.stderr.split("summary: ")[1].splitlines()[0])["resumed_skipped"] == 2


def test_resume_reads_a_whole_last_line_without_newline_and_reruns_lines_cut_by_the_request_limit(
        ckpt, tmp_path):
    """A last line without its newline is read, so another tool's file is not replaced silently. A line that
    ended "length" before max_new_tokens was cut by min(max_model_len, KV pool), which a resume with another
    pool changes: it runs again. Replacing the weights in place changes `run`."""
    from tp_engine.base.config import ConfigError, build_config
    from tp_engine.frontend.resume import read_for_resume
    from tp_engine.frontend.results import run_id, run_settings

    model = tmp_path / "m"
    shutil.copytree(ckpt, model)
    settings = run_settings(build_config(model=str(model), prompts=[], sampling={"max_new_tokens": 8}),
                            "float32", 1)
    run = run_id(settings)
    line = {"index": 0, "prompt_token_ids": [1, 2], "output_token_ids": [3] * 8, "finish_reason": "length",
            "run": run}
    cut = {**line, "index": 1, "output_token_ids": [3] * 5}  # max_new_tokens is 8
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(line) + "\r\n" + json.dumps(cut))  # another tool's CRLF, no final newline
    done, retry = read_for_resume(out, "out.jsonl", [[1, 2], [1, 2]], settings)
    assert list(done) == [(0, 0)] and [k for k, _ in retry] == [(1, 0)]
    (start, length), = [span for _, span in retry]
    assert json.loads(out.read_bytes()[start:start + length]) == cut
    assert done[0, 0] == (0, len(json.dumps(line)))  # kept without its CR: the file is rewritten with LF ends
    out.write_text(json.dumps({"loss": 0.5}))  # another tool's file, one line, no final newline
    with pytest.raises(ConfigError, match="line 1 is not a result line"):
        read_for_resume(out, "out.jsonl", [[1, 2]], settings)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes() + b" ")  # a new export written over the old one
    cfg = build_config(model=str(model), prompts=[], sampling={"max_new_tokens": 8})
    assert run_id(run_settings(cfg, "float32", 1)) != run


def test_a_terminal_shows_the_thinking_before_the_answer(monkeypatch, capsys):
    """On a terminal with no output file, the thinking of a chat model is shown before its `text`, also when
    max_new_tokens cut inside it (the answer then empty)."""
    from tp_engine.frontend.results import ResultSink

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    sink = ResultSink(None, None, {"model": "m"}, decode=lambda ids: "PROMPT ")
    line = {"index": 0, "sample": 0, "prompt_token_ids": [1], "output_token_ids": [2] * 12,
            "finish_reason": "length"}
    sink.add({**line, "text": "", "reasoning": "a long plan"})
    sink.add({**line, "index": 1, "text": "the answer", "reasoning": "short"})
    sink.add({**line, "index": 2, "text": "plain"})  # no chat
    sink.close()
    shown = capsys.readouterr().out
    assert "PROMPT \033[2ma long plan\033[0m\n\n\033[1m\033[0m" in shown
    assert "PROMPT \033[2mshort\033[0m\n\n\033[1mthe answer\033[0m" in shown
    assert "PROMPT \033[1mplain\033[0m" in shown


def test_resume_refuses_a_line_whose_output_token_ids_are_not_a_list(ckpt, tmp_path):
    """A hand-edited line with `output_token_ids` a number is refused naming the line, not with a TypeError
    traceback."""
    from tp_engine.base.config import ConfigError, build_config
    from tp_engine.frontend.resume import read_for_resume
    from tp_engine.frontend.results import run_id, run_settings

    settings = run_settings(build_config(model=str(ckpt), prompts=[], sampling={"max_new_tokens": 8}),
                            "float32", 1)
    good = {"index": 0, "prompt_token_ids": [1, 2], "output_token_ids": [3] * 8, "finish_reason": "length",
            "run": run_id(settings)}
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(good) + "\n" + json.dumps({**good, "index": 1, "output_token_ids": 5}) + "\n")
    with pytest.raises(ConfigError, match="line 2 is not a result line"):
        read_for_resume(out, "out.jsonl", [[1, 2], [1, 2]], settings)


def test_a_refused_resume_says_what_changed_in_words(ckpt, tmp_path):
    """A refused resume says what changed in words (weights written again, the same size; logprobs 0, now 2),
    not with the weight files' raw [name, size, mtime_ns] lists or `logprobs=null`."""
    from tp_engine.base.config import ConfigError, build_config
    from tp_engine.frontend.resume import read_for_resume
    from tp_engine.frontend.results import run_id, run_settings, write_settings

    model = tmp_path / "m"
    shutil.copytree(ckpt, model)

    def settings(**sampling):
        return run_settings(build_config(model=str(model), prompts=[],
                                         sampling={"max_new_tokens": 8, **sampling}),
                            "float32", 1)
    before = settings()
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"index": 0, "prompt_token_ids": [1, 2], "output_token_ids": [3] * 8,
                               "finish_reason": "length", "run": run_id(before)}) + "\n")
    write_settings(out, run_id(before), before)
    weights = model / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # copied, touched
    with pytest.raises(ConfigError) as err:
        read_for_resume(out, "out.jsonl", [[1, 2]], settings(logprobs=2))
    assert "other weights: model.safetensors written again (" in str(err.value)
    assert ", the same size)" in str(err.value)
    assert "sampling.logprobs=0, now 2" in str(err.value) and "mtime" not in str(err.value), str(err.value)



def test_fp8_activations_change_the_run(ckpt, tmp_path):
    """advanced.fp8_gemm w8a8 rounds the activations of FP8 matmuls to fp8 (other tokens than weight_only), so
    resume refuses weight_only lines for it. The default adds nothing to the record (older lines keep `run`),
    nor does the key for a model without FP8 weights, whose tokens it cannot change."""
    from tp_engine.base.config import ConfigError, build_config
    from tp_engine.frontend.resume import read_for_resume
    from tp_engine.frontend.results import run_id, run_settings, write_settings

    def settings(mode, fp8=True):
        return run_settings(build_config(model=str(ckpt), prompts=[], sampling={"max_new_tokens": 8},
                                         advanced={"fp8_gemm": mode}), "float32", 1, fp8=fp8)
    assert "advanced.fp8_gemm" not in settings("weight_only")
    assert settings("w8a8", fp8=False) == settings("weight_only", fp8=False)
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"index": 0, "prompt_token_ids": [1, 2], "output_token_ids": [3] * 8,
                               "finish_reason": "length", "run": run_id(settings("weight_only"))}) + "\n")
    write_settings(out, run_id(settings("weight_only")), settings("weight_only"))
    with pytest.raises(ConfigError, match='advanced.fp8_gemm="weight_only", now "w8a8"'):
        read_for_resume(out, "out.jsonl", [[1, 2]], settings("w8a8"))
