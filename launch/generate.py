"""Generate with a Qwen3 checkpoint across the ranks of a torchrun job (or one process without torchrun).

    torchrun --nproc_per_node=2 launch/generate.py --config configs/demo.yaml

The lower-level form of `tp-generate` (tp_engine/launcher.py), whose ranks run `python -m tp_engine`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tp_engine.frontend.lifeline import start_rank  # noqa: E402  (no torch: nothing slow comes before it)

if __name__ == "__main__":
    start_rank()  # first: the imports below take seconds (torch), and the launcher may die meanwhile
    from tp_engine.cli import main
    sys.exit(main())
