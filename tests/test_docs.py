"""The docs promise what the code does: every config key documented, the README's commands real."""
import re
from pathlib import Path

from tp_engine.config import SCHEMA

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_doc_lists_every_key():
    text = (ROOT / "docs" / "configuration.md").read_text()
    missing = [k for k in SCHEMA if f"`{k}`" not in text]
    assert not missing, f"docs/configuration.md does not document: {missing}"


def test_readme_commands_and_links():
    text = (ROOT / "README.md").read_text()
    assert "torchrun --nproc_per_node=2 launch/generate.py --config configs/demo.yaml" in text
    assert "python -m pytest -q -n 2 tests" in text
    assert "python -m pytest -q -n 2 tests" in (ROOT / ".ci" / "run").read_text()  # CI runs the README's command
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).is_file(), link
    for doc in ["architecture", "configuration", "tensor-parallelism", "benchmarks", "troubleshooting"]:
        assert f"docs/{doc}.md" in text
