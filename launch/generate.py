"""Generate with a Qwen3 checkpoint across the ranks of a torchrun job (or one process without torchrun).

    torchrun --nproc_per_node=2 launch/generate.py --config configs/demo.yaml
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tp_engine.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
