"""The launchers, through the real commands: tp-generate ends a failed job in the failing rank's own words and
exit status, with no launcher traceback or log lines; no rank outlives its launcher, killed at any moment."""
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import yaml

from helpers import GENERATE, ROOT, TP_GENERATE, make_checkpoint, start_job, wait_for_lines, worker_pids


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("launcher") / "m")


def base(ckpt, **kw):
    return {"model": str(ckpt), "prompts": [{"input_ids": [5, 17, 300, 42, 8]}], "device": "cpu",
            "sampling": {"max_new_tokens": 8}, **kw}


def long_cfg(ckpt, out):
    """A job that runs for a while, two requests at a time: an orphaned rank would still be at work."""
    prompts = [{"input_ids": [i % 500 + 1, 2, 3]} for i in range(300)]
    return base(ckpt, prompts=prompts, output=str(out), max_batch_size=2,
                sampling={"max_new_tokens": 40, "ignore_eos": True})


def tp_generate(*args, env=None):
    return subprocess.run([*TP_GENERATE, *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))


def alive(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---- tp-generate: the rank's words and status ----

@pytest.mark.parametrize("nproc", [1, 2])
def test_config_error_is_the_ranks_one_line_and_status(ckpt, tmp_path, nproc):
    """A typo in a config key ends in the rank's one `error:` line and status 2, and nothing else: no
    traceback, no ChildFailedError summary, no log lines (one rank runs in the launcher's process)."""
    conf = tmp_path / "run.yaml"
    conf.write_text(yaml.safe_dump(base(ckpt, sampling={"temprature": 0.5})))
    proc = tp_generate(f"--nproc_per_node={nproc}", "--config", str(conf))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "error: unknown config key 'sampling.temprature'; did you mean 'sampling.temperature'?"]


CRASH = """
import os
if os.environ.get("RANK") == "1":  # an unexpected exception on rank 1, as a bug would raise
    from tp_engine import cli
    def run(*args, **kw):
        raise ZeroDivisionError("injected crash")
    cli.run = run
"""


@pytest.mark.slow
def test_a_crash_keeps_its_traceback(ckpt, tmp_path):
    """A rank's unexpected exception: its traceback stays, the job exits with the rank's status 1."""
    (tmp_path / "sitecustomize.py").write_text(CRASH)  # imported at start-up by every process of the job
    conf = tmp_path / "run.yaml"
    conf.write_text(yaml.safe_dump(base(ckpt)))
    path = os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    proc = tp_generate("--nproc_per_node=2", "--config", str(conf), env={"PYTHONPATH": path})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback (most recent call last)" in proc.stderr
    assert 'raise ZeroDivisionError("injected crash")' in proc.stderr
    assert "error: rank 1: ZeroDivisionError: injected crash" in proc.stderr
    assert "ChildFailedError" not in proc.stderr and "FAILED" not in proc.stderr


def test_job_status_is_the_first_failed_ranks(capsys):
    """The job's status is the first failed rank's; a rank killed by a signal other than the launcher's
    SIGTERM (which stops the others) comes first and gets a line, since it could not say why itself."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    from tp_engine.launcher import job_status

    def failures(*codes):  # in the order the launcher found them
        return {rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
                for rank, code in codes}

    assert job_status(failures((0, 2), (1, 143))) == 2  # a config error; rank 1 stopped by the launcher
    assert job_status(failures((1, 1), (0, 143))) == 1
    assert job_status(failures((0, 2), (1, -signal.SIGTERM))) == 2  # stopped before it had set its handlers
    assert capsys.readouterr().err == ""
    assert job_status(failures((0, 1), (1, -signal.SIGKILL))) == 128 + signal.SIGKILL
    assert capsys.readouterr().err == "error: rank 1 (pid 101) was killed by SIGKILL\n"


def test_a_ranks_error_file_is_whole_or_absent(tmp_path, monkeypatch, capsys):
    """torchrun reads a rank's error file the moment another rank's exit stops the job: while the rank
    writes it, the file is not there at all (never there and empty), and then it holds the whole message."""
    import json

    from tp_engine import cli

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    seen = []
    dump = json.dump

    def watched(obj, f):
        seen.append(path.exists())
        dump(obj, f)
    monkeypatch.setattr(json, "dump", watched)
    assert cli.fail(0, "unknown config key 'x'", 2) == 2
    assert seen == [False]
    assert json.loads(path.read_text())["message"]["message"] == "unknown config key 'x'"
    assert capsys.readouterr().err == "error: unknown config key 'x'\n"


@pytest.mark.slow
def test_ctrl_c_ends_the_job_in_the_ranks_words(ckpt, tmp_path):
    """Ctrl-C reaches the launcher (the ranks have sessions of their own): it stops the ranks, rank 0 says
    where the finished results are, and the job exits 130, without a SignalException traceback."""
    out = tmp_path / "out.jsonl"
    proc = start_job(long_cfg(ckpt, out), tmp_path, tp_generate=True)
    ranks = {}
    try:
        wait_for_lines(out, 1, proc)
        ranks = worker_pids(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        kill_all([proc.pid, *ranks.values()])
    assert proc.returncode == 130, err[-3000:]
    assert f"stopped by SIGINT: finished results are in {out}" in err
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    assert len(ranks) == 2 and not any(alive(pid) for pid in ranks.values())


@pytest.mark.slow
def test_launcher_usage_errors_and_help(tmp_path):
    """A bad launcher option or an unknown option is one message, before any rank starts; --help lists the
    launcher's options and the command line's."""
    proc = tp_generate("--nproc_per_node=abc", "--config", "run.yaml")
    assert proc.returncode == 2 and proc.stderr == "error: launcher: Unsupported nproc_per_node value: abc\n"
    proc = tp_generate("--nproc_per_node=2", "--confg", "run.yaml")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith("tp-generate: error: unrecognized arguments: --confg run.yaml\n"), proc.stderr
    out = tp_generate("--help").stdout
    for text in ("--nproc-per-node", "--nnodes", "--master-addr", "--config", "--set KEY=VALUE",
                 "--print-config", "  sampling.temperature = "):
        assert text in out, text
    assert "--no-python" not in out and "--module" not in out  # tp-generate chooses what the ranks run


def test_options_go_to_the_launcher_or_to_the_ranks():
    from tp_engine.launcher import make_parser, split
    p, launcher = make_parser()
    argv = ["--nproc-per-node", "2", "--config", "run.yaml", "--master_port=29501", "--set", "seed=1", "-r3",
            "--print-config", "--standalone"]
    ours, ranks = split(argv, p, launcher)
    assert ours == ["--nproc-per-node", "2", "--master_port=29501", "-r3", "--standalone"]
    assert ranks == ["--config", "run.yaml", "--set", "seed=1", "--print-config"]


def test_console_script_is_the_launcher():
    """pyproject.toml's tp-generate names the launcher's main."""
    from tp_engine import launcher
    m = re.search(r'^tp-generate = "tp_engine\.(\w+):(\w+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert m and m.groups() == ("launcher", "main") and callable(launcher.main)


# ---- no rank outlives its launcher ----

STALL = """
import os, sys, time
sys.path.insert(0, {root!r})
from tp_engine.frontend.lifeline import start_rank
start_rank()  # as launch/generate.py
import tp_engine.comm, tp_engine.runtime.engine
if os.environ["RANK"] == "0":  # rank 0 stops here; rank 1 waits for it in a collective
    def stalled(*args, **kw):
        open({marker!r}, "w").close()
        time.sleep(600)
    setattr({owner}, {name!r}, stalled)
from tp_engine.cli import main
sys.exit(main())
"""

MOMENTS = {  # seconds after the ranks appear: their interpreter's start-up, before the entry's first line ...
    "spawned": 0.0,
    "imports_0.3s": 0.3,  # ... and their imports (the config and prompts are read in between)
    "imports_1s": 1.0,
    "rendezvous": ("tp_engine.comm", "init_distributed"),  # or where rank 0 stops (STALL)
    "loading": ("tp_engine.models", "load_checkpoint"),
    "first_step": ("tp_engine.runtime.engine.Engine", "forward"),
}


CASES = [("torchrun", moment) for moment in MOMENTS] + [("tp-generate", "imports_1s")]


@pytest.mark.slow
@pytest.mark.parametrize("launcher, moment", CASES)
def test_no_rank_outlives_its_killed_launcher(ckpt, tmp_path, launcher, moment):
    """The launcher killed with SIGKILL at a moment of the start-up or the first step: every rank has ended
    10 s later (an orphaned rank would wait minutes for the others at start-up, or run the whole job)."""
    marker, script, when = tmp_path / "stalled", GENERATE, MOMENTS[moment]
    if isinstance(when, tuple):
        script = tmp_path / "stall.py"
        script.write_text(STALL.format(root=str(ROOT), marker=str(marker), owner=when[0], name=when[1]))
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:
        proc = start_job(long_cfg(ckpt, tmp_path / "out.jsonl"), tmp_path, script=script, stderr=err,
                         tp_generate=launcher == "tp-generate")
    ranks = {}
    try:
        t0 = time.time()
        while len(ranks) < 2 or (isinstance(when, tuple) and not marker.exists()):
            assert proc.poll() is None and time.time() - t0 < 120, log.read_text()[-3000:]
            ranks = ranks if len(ranks) == 2 else worker_pids(proc.pid)
            time.sleep(0.005)
        time.sleep(0.5 if isinstance(when, tuple) else when)  # stalled: rank 1 is now waiting for rank 0
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        t0 = time.time()
        while any(alive(pid) for pid in ranks.values()) and time.time() - t0 < 10:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in ranks.values()), f"ranks outlived {launcher} killed at {moment}"
    finally:
        kill_all([proc.pid, *ranks.values()])


ORPHAN = """
import sys, time
sys.path.insert(0, {root!r})
time.sleep(1)  # its launcher exits meanwhile
from tp_engine.frontend.lifeline import start_rank
start_rank()
time.sleep(60)
"""


def test_a_rank_whose_launcher_died_before_its_first_line_ends(tmp_path):
    """The kernel's signal at the launcher's death is asked for in the rank's first line: a launcher that died
    before that sends none, and the rank, adopted by init, sees it and ends at once with the early line."""
    log = tmp_path / "stderr.txt"
    code = ORPHAN.format(root=str(ROOT))
    command = f"{shlex.quote(sys.executable)} -c {shlex.quote(code)} 2>{log} & echo $!"  # bash exits at once
    launcher = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30,
                              env=dict(os.environ, TORCHELASTIC_RUN_ID="test", RANK="0"))
    rank = int(launcher.stdout)
    try:
        t0 = time.time()
        while alive(rank) and time.time() - t0 < 10:
            time.sleep(0.05)
        assert not alive(rank), "the rank outlived its launcher"
    finally:
        kill_all([rank])
    assert log.read_text() == "stopped by SIGTERM before the run started\n"
