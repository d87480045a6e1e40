"""The output file through the real CLI under torchrun: workers never outlive torchrun."""
import os
import signal
import time
from pathlib import Path

import pytest

from helpers import make_checkpoint, start_job, wait_for_lines, worker_pids

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


def alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_job(proc, pids=()):
    """torchrun and its workers: torchrun detaches them with setsid, so killing torchrun's group is not enough."""
    pids = list(pids) + (list(worker_pids(proc.pid).values()) if proc.poll() is None else [])
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


# ---- never after torchrun ----

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
