"""launch/bench_phases.py: bench.py's run with the speculating step's phases timed on rank 0's host; the table
names each phase once, per speculating step, the drafting phases inside the step's time."""
import re
import subprocess
import sys

import pytest

from helpers import ROOT


@pytest.mark.slow
def test_phases_of_a_speculating_latency_run():
    demo = ROOT / "configs" / "models"
    cmd = [sys.executable, str(ROOT / "launch" / "bench_phases.py"), "--model", str(demo / "demo"),
           "--workload", "latency", "--engine", "ours", "--set", "device=cpu", "--new-tokens", "24",
           "--set", "speculative.method=draft", "--set", f"speculative.model={demo / 'demo-draft'}",
           "--set", "speculative.adaptive=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    head = re.search(r"host ms per speculating step \((\d+) steps\):", proc.stdout)
    assert head and 0 < int(head.group(1)) <= 24, proc.stdout[-2000:]
    rows = {m[1]: (float(m[2]), float(m[3]))
            for m in re.finditer(r"^  (\S+)\s+([\d.]+) ms  calls\s+([\d.]+)$", proc.stdout, re.M)}
    step, propose = rows["speculation.Speculation.step"], rows["drafting.Drafting.propose"]
    assert step[1] == 1.0 and propose[1] == 1.0, rows
    assert 0 < propose[0] < step[0], rows
    assert rows["drafting.Drafting.forward"][1] > 1 and rows["speculation.issue_verified"][1] > 0, rows
