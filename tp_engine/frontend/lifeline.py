"""A rank's first moments: signals before the run's own handlers, and a rank ends when its launcher dies.

torchrun (and tp-generate) detaches each worker with setsid, so when the launcher is killed (kill -9, an
out-of-memory kill) nothing else stops the workers: they would run on, and keep writing the output file, with
nobody to collect them. The watch starts in a rank's first lines, before torch's import (seconds): a watch
started later would take init, which adopts the orphan, for its launcher. A plain `python launch/generate.py`
run is left alone: it must outlive the shell that started it when the user asks for that (nohup, a closed
terminal). Nothing here imports torch."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
CHECK_S = 0.5
_started = False


def start_rank() -> None:
    """What an entry point (launch/generate.py, `python -m tp_engine`) does first, before anything slow: a
    Ctrl-C or SIGTERM now ends the rank with one line, and so does its launcher's death."""
    signal.signal(signal.SIGINT, stop_early)
    signal.signal(signal.SIGTERM, stop_early)
    exit_with_launcher()


def stop_early(signum: int, frame) -> None:
    """A Ctrl-C or SIGTERM before the command line sets up its own handlers (a Ctrl-C just after the launch):
    nothing is written before then, so say so once and leave, instead of a KeyboardInterrupt's traceback on
    every rank."""
    if os.environ.get("RANK", "0") == "0":
        print(f"stopped by {signal.Signals(signum).name} before the run started", file=sys.stderr)
    os._exit(128 + signum)


def exit_with_launcher() -> None:
    """Under a launcher: ask the kernel for SIGTERM when it dies, and watch for it in a thread too (prctl is
    Linux-only, and the kernel's signal follows the launcher's thread, not its process). SIGTERM goes through
    the rank's own handler, which reports and exits; results are already flushed."""
    global _started
    if _started or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    _started = True
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the thread below is enough
        pass
    launcher = os.getppid()  # read after prctl: a launcher that dies from now on sends the signal
    if adopted(launcher):  # it died before: nothing will send it
        os.kill(os.getpid(), signal.SIGTERM)
        return

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(CHECK_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def adopted(parent: int) -> bool:
    """Whether a rank's parent is init, which adopted it when its launcher died, rather than the launcher.

    A launcher is a Python process (torchrun, tp-generate, a script that calls torch's launch API); it is
    pid 1 only as a container's first process. A subreaper that adopts the rank in init's place is not told
    apart: the rank then ends only when its launcher dies after the prctl above."""
    if parent != 1:
        return False
    try:
        exe = os.path.basename(os.readlink("/proc/1/exe"))
    except OSError:  # another user's process (the system's init): not a launcher of this rank's
        return True
    return not exe.startswith("python")
