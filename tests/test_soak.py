"""A shortened soak: thousands of short requests through one LLM keep its host memory and open files constant.

It runs launch/bench_soak.py's workload (the benchmark's `soak`, with fewer requests) on the demo model.
Speed is the benchmark's to judge, not a test's: timings on shared CPUs vary too much.
"""
import json
import subprocess
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "launch"))

from bench_soak import run_soak  # noqa: E402
from tp_engine import LLM  # noqa: E402

DEMO = ROOT / "configs" / "models" / "demo"
REQUESTS = 2400
# Live Python objects between generate calls move by tens over the run; a leak of one object per finished
# request, or per step, adds over 2,000.
OBJECTS_BOUND = 1000
# What the allocators have handed out and not had back, as a trend over the ten tenths (the median of the
# slopes between every two of them, which one jump does not move). Host RSS is not the measure here: it moves
# by megabytes with no leak (the allocator's arenas, pages of the libraries' code), to trends of over 3 MiB
# on a shared CI machine with the live objects flat. The C heap (tensors' storage, large buffers) ends one
# step of 0.55 MiB above the first tenth when nothing leaks; with a tensor that keeps 32 bytes a sampled
# token its trend is 2.1 MiB (and RSS's under 3 MiB). Python's small blocks move by thousands between tenths,
# their trend by about 1,000; with an int kept per sampled token it is 53,000.
HEAP_BOUND = 1 << 20
BLOCKS_BOUND = 10_000


def trend(rows: list[dict], key: str) -> float:
    """Growth of rows' `key` over the run after the first tenth, from the median slope between every two
    tenths (Theil-Sen): a steady leak sets it, a single jump of an allocator does not."""
    slopes = sorted((b[key] - a[key]) / (b["requests"] - a["requests"])
                    for i, a in enumerate(rows) for b in rows[i + 1:])
    mid = len(slopes) // 2
    median = slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2
    return median * (rows[-1]["requests"] - rows[0]["requests"])


@pytest.mark.slow
def test_thousands_of_requests_hold_host_memory_and_open_files():
    """After the first tenth of the run, live Python objects stay put, the trends of the C heap and of
    Python's small blocks stay under their bounds and the open file descriptors are the same at the end; the
    run did all its work, with prefix-cache hits in a pool that evicts."""
    llm = LLM(model=DEMO, device="cpu", kv_cache={"num_pages": 128}, seed=0)
    try:
        res = run_soak(llm, REQUESTS)
    finally:
        llm.shutdown()
    (ends,) = res["per_rank"]
    objects = ends["at_end"]["objects"] - ends["after_first_tenth"]["objects"]
    assert objects < OBJECTS_BOUND, f"{objects} more live objects at the end: {res['tenths']}"
    heap, blocks = trend(res["tenths"], "heap"), trend(res["tenths"], "blocks")
    assert heap < HEAP_BOUND, f"the C heap grew by {heap:.0f} bytes over the run: {res['tenths']}"
    assert blocks < BLOCKS_BOUND, f"Python's small blocks grew by {blocks:.0f} over the run: {res['tenths']}"
    assert ends["at_end"]["fds"] == ends["after_first_tenth"]["fds"], res["tenths"]
    assert [t["requests"] for t in res["tenths"]] == [REQUESTS * k // 10 for k in range(1, 11)]
    assert res["output_tokens"] >= 16 * REQUESTS
    assert res["tenths"][-1]["cached_prompt_tokens"] > 0
    # ~4 full pages a request: the 128 pages fill and are evicted over and over
    assert res["tenths"][-1]["cached_pages"] > res["kv_pages"] // 2


@pytest.mark.slow
def test_bench_soak_workload_reports_each_target(tmp_path):
    """launch/bench.py --workload soak: the figures of every tenth in the JSON line, and a PASS or FAIL line
    per target on stderr."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "launch" / "bench.py"), "--model", str(DEMO), "--workload", "soak",
           "--engine", "ours", "--set", "device=cpu", "--set", "kv_cache.num_pages=32",
           "--num-requests", "55", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    soak = json.loads(out.read_text())["soak"]
    assert soak["requests"] == 55 and len(soak["tenths"]) == 10 and soak["tenths"][-1]["requests"] == 55
    assert soak["targets"].keys() == {"speed", "rss", "fds"}
    for name, target in soak["targets"].items():
        assert f"soak {name}: {'PASS' if target['pass'] else 'FAIL'} " in proc.stderr
