"""The docs promise what the code does: every config key documented, every link and path of the README real,
its test commands the ones CI runs, the floors it names the ones CI tests, the CI scripts' arguments
checked."""
import re
import shlex
import subprocess
import sys
from pathlib import Path

from helpers import shell_lines
from tp_engine.base.config import SCHEMA

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_configuration_doc_lists_every_key():
    text = (ROOT / "docs" / "configuration.md").read_text()
    missing = [k for k in SCHEMA if f"`{k}`" not in text]
    assert not missing, f"docs/configuration.md does not document: {missing}"


def test_every_link_between_the_docs_reaches_a_file_and_heading():
    """Each relative link of README.md and docs/*.md names a file that exists and, after `#`, a heading of
    it."""
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
                if anchor not in {slug(h) for h in headings}:
                    broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, broken


def test_every_path_the_readme_names_exists():
    """The paths in the README's text and commands (tp_engine/..., launch/..., configs/..., .ci/...), and the
    files its project layout table names inside each package, are in the tree."""
    text = (ROOT / "README.md").read_text()
    named = re.findall(r"(?<![\w/.-])((?:tp_engine|launch|configs|docs|tests)/[\w./-]*|\.ci/\w+)", text)
    assert len(named) > 20, named  # the pattern finds the layout table's paths
    missing = [p for p in named if not (ROOT / p.rstrip(".,")).exists()]
    for row in re.findall(r"^\| `([\w/.]+)`.*\|(.*)\|$", text, re.M):
        folder = ROOT / row[0] if row[0].endswith("/") else (ROOT / row[0]).parent
        missing += [f"{folder.name}/{f}" for f in re.findall(r"`(\w+\.py)`", row[1])
                    if not (folder / f).is_file()]
    assert not missing, f"README.md names paths that do not exist: {missing}"


def test_the_readme_test_commands_are_what_ci_runs_and_select_tests():
    """The README's full test command is a line of .ci/run; its quick one is the same with `-m "not slow"`,
    a marker pyproject.toml declares, and it leaves out some tests but not all of them."""
    lines = [line for line in shell_lines((ROOT / "README.md").read_text()) if " pytest " in line]
    full = [line for line in lines if "-m" not in shlex.split(line)[3:]]  # after `python -m pytest`
    quick = [shlex.split(line) for line in lines if "-m" in shlex.split(line)[3:]]
    assert len(full) == 1 and len(quick) == 1, lines
    assert full[0] in (ROOT / ".ci" / "run").read_text().splitlines(), full[0]
    args = quick[0]
    marker = args.index("-m", 3)
    assert args[marker + 1] == "not slow" and args[:marker] + args[marker + 2:] == shlex.split(full[0]), args
    assert re.search(r'^\s*"slow: ', (ROOT / "pyproject.toml").read_text(), re.M)
    # the quick command as written, collecting only (and without -n: no workers to start)
    workers = args.index("-n")
    cmd = [sys.executable, *args[1:workers], *args[workers + 2:], "--collect-only", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    chosen, collected = map(int, re.search(r"(\d+)/(\d+) tests collected", proc.stdout).groups())
    assert 0 < chosen < collected, proc.stdout[-300:]


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
    # the main lane, then the floor lane
    assert ".ci/floor" in (ROOT / ".ci" / "run").read_text().splitlines()


def test_gpu_ci_names_an_unknown_part_before_anything_runs():
    """`.ci/gpu PART...` checks its parts first: an unknown one, or a share past the number of shares, is
    named, and it exits 2 without touching a GPU or installing anything."""
    def run(*parts: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(ROOT / ".ci" / "gpu"), *parts], capture_output=True, text=True,
                              timeout=60)
    proc = run("single", "tests")
    assert proc.returncode == 2, proc.stderr
    assert "unknown part 'tests' (single, single:I/N, multi, bench)" in proc.stderr, proc.stderr
    proc = run("single:1/2", "single:3/2")
    assert proc.returncode == 2, proc.stderr
    assert "'single:3/2': the share is past the number of shares" in proc.stderr, proc.stderr
