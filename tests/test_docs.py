"""The docs promise what the code does: every config key documented, the README's commands real, the CI
scripts' arguments checked."""
import re
import subprocess
from pathlib import Path

from tp_engine.config import SCHEMA

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_doc_lists_every_key():
    text = (ROOT / "docs" / "configuration.md").read_text()
    missing = [k for k in SCHEMA if f"`{k}`" not in text]
    assert not missing, f"docs/configuration.md does not document: {missing}"


def test_readme_commands_and_links():
    text = (ROOT / "README.md").read_text()
    assert "tp-generate --nproc_per_node=2 --config configs/demo.yaml" in text  # test_demo.py runs it
    assert "torchrun --nproc_per_node=2 launch/generate.py --config configs/demo.yaml" in text  # its lower form
    assert "python -m pytest -q -n 2 tests" in text
    assert "python -m pytest -q -n 2 tests" in (ROOT / ".ci" / "run").read_text()  # CI runs the README's command
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).is_file(), link
    for doc in ["architecture", "configuration", "tensor-parallelism", "benchmarks", "troubleshooting"]:
        assert f"docs/{doc}.md" in text


def test_gpu_ci_names_an_unknown_part_before_anything_runs():
    """`.ci/gpu PART...` checks its parts first: an unknown one is named, and it exits 2 without touching a GPU
    or installing anything."""
    proc = subprocess.run(["bash", str(ROOT / ".ci" / "gpu"), "single", "tests"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "unknown part 'tests' (single, multi, bench)" in proc.stderr, proc.stderr
