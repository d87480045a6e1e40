"""Counting the Triton kernels compiled during a measured run (launch/bench.py's throughput runs, the
structured workload's runs)."""
from __future__ import annotations

import threading
import time


class KernelCompiles:
    """The Triton kernels compiled, or loaded from Triton's cache on disk, while it is entered, and their
    seconds: a measured run that compiles pays a one-time cost the other run of its pair may not (Triton's
    `jit_cache_hook`, called before each, and `jit_post_compile_hook`, after)."""

    def __init__(self) -> None:
        self.kernels: dict[str, int] = {}
        self.seconds = 0.0
        self._began: dict[int, float] = {}  # thread: when its compile began
        self._saved = None

    def __enter__(self) -> KernelCompiles:
        try:
            from triton import knobs
        except ImportError:  # CPU-only installs: nothing compiles
            return self
        self._saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self.began, self.ended
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            from triton import knobs
            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved

    def began(self, *, fn, **_) -> None:  # None: Triton goes on to compile
        self.kernels[fn.name] = self.kernels.get(fn.name, 0) + 1
        self._began[threading.get_ident()] = time.perf_counter()

    def ended(self, **_) -> None:
        began = self._began.pop(threading.get_ident(), None)
        if began is not None:
            self.seconds += time.perf_counter() - began

    def report(self) -> dict:
        return {"count": sum(self.kernels.values()), "seconds": round(self.seconds, 3),
                "kernels": dict(sorted(self.kernels.items()))}
