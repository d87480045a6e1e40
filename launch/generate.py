"""Generate with a Qwen3 checkpoint across the ranks of a torchrun job (or one process without torchrun).

    torchrun --nproc_per_node=2 launch/generate.py --config configs/demo.yaml
"""
import os
import signal
import sys
from pathlib import Path


def stop_early(signum, frame):
    """A Ctrl-C or SIGTERM before main() sets up its own handlers (a Ctrl-C just after the launch): nothing is
    written before then, so say so once and leave, instead of a KeyboardInterrupt's traceback on every rank."""
    if os.environ.get("RANK", "0") == "0":
        print(f"stopped by {signal.Signals(signum).name} before the run started", file=sys.stderr)
    os._exit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, stop_early)
    signal.signal(signal.SIGTERM, stop_early)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tp_engine.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
