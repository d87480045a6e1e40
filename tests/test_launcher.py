"""The launchers, through the real commands: no rank outlives its launcher, killed at any moment."""
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from helpers import GENERATE, ROOT, make_checkpoint, start_job, worker_pids


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


# ---- no rank outlives its launcher ----

STALL = """
import os, sys, time
sys.path.insert(0, {root!r})
from tp_engine.lifeline import start_rank
start_rank()  # as launch/generate.py
import tp_engine.comm, tp_engine.engine
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
    "loading": ("tp_engine.engine", "load_checkpoint"),
    "first_step": ("tp_engine.engine.Engine", "forward"),
}


CASES = [("torchrun", moment) for moment in MOMENTS]


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
        proc = start_job(long_cfg(ckpt, tmp_path / "out.jsonl"), tmp_path, script=script, stderr=err)
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
from tp_engine.lifeline import start_rank
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
