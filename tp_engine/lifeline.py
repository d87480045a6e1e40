"""A rank started by torchrun ends when torchrun dies.

torchrun detaches each worker with setsid, so when torchrun is killed (kill -9, an out-of-memory kill)
nothing else stops the workers: they would run on, and keep writing the output file, with nobody to
collect them. A plain `python launch/generate.py` run is left alone: it must outlive the shell that started
it when the user asks for that (nohup, a closed terminal)."""
from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
CHECK_S = 0.5
_started = False


def exit_with_launcher() -> None:
    """Under torchrun: ask the kernel for SIGTERM when the launcher dies, and watch for it in a thread too
    (prctl is Linux-only, and the kernel's signal follows the launcher's thread, not its process). SIGTERM
    goes through the rank's own handler, which reports and exits; results are already flushed."""
    global _started
    if _started or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    _started = True
    launcher = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the thread below is enough
        pass

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(CHECK_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
