"""The docs promise what the code does: every config key documented, the README's commands real, the CI
scripts' arguments checked."""
import re
import subprocess
from pathlib import Path

from tp_engine.base.config import SCHEMA

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_doc_lists_every_key():
    text = (ROOT / "docs" / "configuration.md").read_text()
    missing = [k for k in SCHEMA if f"`{k}`" not in text]
    assert not missing, f"docs/configuration.md does not document: {missing}"


def test_readme_commands_and_links():
    text = (ROOT / "README.md").read_text()
    assert "tp-generate --nproc_per_node=2 --config configs/demo.yaml" in text  # test_demo.py runs it
    # its lower form
    assert "torchrun --nproc_per_node=2 launch/generate.py --config configs/demo.yaml" in text
    assert "python -m pytest -q -n 2 tests" in text
    # CI runs the README's command
    assert "python -m pytest -q -n 2 tests" in (ROOT / ".ci" / "run").read_text()
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).is_file(), link
    for doc in ["architecture", "configuration", "tensor-parallelism", "benchmarks", "troubleshooting"]:
        assert f"docs/{doc}.md" in text


def test_the_floor_lane_tests_the_floors_pyproject_states():
    """Each lower bound in pyproject.toml is the version .ci/floor installs (torch's through FLOOR_TORCH, its
    CPU build being missing on PyPI), and the README's Quick start names it: the floors are tested
    versions."""
    from packaging.version import Version
    deps = re.search(r"^dependencies = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    floors = dict(re.findall(r'"([a-z]+)>=([\d.]+)"', deps))
    # each has a floor
    assert set(floors) == {"torch", "numpy", "safetensors", "transformers", "pyyaml"}, deps
    lane = (ROOT / ".ci" / "floor").read_text()
    pins = dict(re.findall(r"\b([a-z]+)==([\d.]+)", lane))  # numpy, safetensors, transformers, pyyaml
    pins["torch"] = re.search(r"FLOOR_TORCH=([\d.]+) \.ci/floor", lane).group(1)  # the run that tests torch's
    assert {k: Version(v) for k, v in pins.items()} == {k: Version(v) for k, v in floors.items()}, \
        (pins, floors)
    readme = (ROOT / "README.md").read_text()
    names = {"torch": "torch", "numpy": "numpy", "safetensors": "safetensors", "transformers": "transformers",
             "pyyaml": "PyYAML"}
    for name, floor in floors.items():
        assert f"{names[name]} {floor}" in readme, (name, floor)
    assert "python -m pytest -q -n 2 tests" in (ROOT / ".ci" / "run").read_text() and \
        ".ci/floor" in (ROOT / ".ci" / "run").read_text()  # the main lane, then the floor lane


def test_gpu_ci_names_an_unknown_part_before_anything_runs():
    """`.ci/gpu PART...` checks its parts first: an unknown one is named, and it exits 2 without touching a
    GPU or installing anything."""
    proc = subprocess.run(["bash", str(ROOT / ".ci" / "gpu"), "single", "tests"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "unknown part 'tests' (single, multi, bench)" in proc.stderr, proc.stderr
