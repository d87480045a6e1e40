"""Rank 0's host milliseconds per speculating step, by phase: launch/bench.py run as it is, with a timer
around each of the engine's phases below (no synchronization added), printed when the bench ends.

  python launch/bench_phases.py <launch/bench.py's arguments>

A phase's time is host time: where it waits for the GPU (the verify reads its tokens) that wait is in it,
so a phase much longer than its GPU work says the GPU waits for the host there. Nested phases are in their
parents' times too; `calls` counts a phase's calls per speculating step.
"""
from __future__ import annotations

import atexit
import collections
import functools
import importlib
import sys
import time
from typing import Callable

PHASES = (  # (module, owner within it or "", attribute): each wrapped where its callers look it up
    ("tp_engine.runtime.speculation", "Speculation", "step"),
    ("tp_engine.runtime.speculation", "", "reserve_drafts"),
    ("tp_engine.runtime.drafting", "Drafting", "propose"),
    ("tp_engine.runtime.drafting", "Drafting", "_send"),
    ("tp_engine.runtime.drafting", "", "decode_message"),
    ("tp_engine.runtime.drafting", "Drafting", "forward"),
    ("tp_engine.runtime.drafting", "", "draft_draw"),
    ("tp_engine.runtime.drafting", "Drafting", "share"),
    ("tp_engine.runtime.scheduler", "Scheduler", "schedule"),
    ("tp_engine.runtime.speculation", "", "issue_verified"),
    ("tp_engine.runtime.spec_step", "", "decode_message"),
    ("tp_engine.runtime.engine", "Engine", "forward"),
    ("tp_engine.runtime.spec_step", "", "verify"),
    ("tp_engine.runtime.speculation", "", "take_verified"),
    ("tp_engine.runtime.cuda_graph", "GraphRunner", "run"),
)

seconds: collections.Counter = collections.Counter()
calls: collections.Counter = collections.Counter()


def timed(f: Callable, name: str) -> Callable:
    """`f`, its seconds and calls counted under `name`."""
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - start
            calls[name] += 1
    return wrapper


def install() -> None:
    """Wrap every phase of PHASES with a timer."""
    for module, owner, attr in PHASES:
        mod = importlib.import_module(module)
        where = getattr(mod, owner) if owner else mod
        name = f"{module.rsplit('.', 1)[1]}.{owner + '.' if owner else ''}{attr}"
        setattr(where, attr, timed(getattr(where, attr), name))


def table() -> list[tuple[str, float, float]]:
    """(phase, host ms per speculating step, calls per speculating step) of the phases that ran."""
    steps = calls["speculation.Speculation.step"]
    if not steps:
        return []
    return [(name, seconds[name] / steps * 1e3, calls[name] / steps) for name, _ in sorted(calls.items())]


def report() -> None:
    rows = table()
    if rows:
        print(f"host ms per speculating step ({calls['speculation.Speculation.step']} steps):")
        for name, ms, n in rows:
            print(f"  {name:40s} {ms:8.3f} ms  calls {n:5.2f}")


if __name__ == "__main__":
    install()
    atexit.register(report)
    import bench  # launch/, this script's own directory, is on the path
    sys.exit(bench.main(sys.argv[1:]))
