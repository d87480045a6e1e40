"""Rank 0's progress report: a bar on a terminal, a log line every few seconds otherwise."""
from __future__ import annotations

import os
import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, enabled: bool = True, out: TextIO = sys.stderr,
                 interval_s: float = 10.0) -> None:
        self.total, self.enabled, self.out = total, enabled and total > 0, out
        self.tty = self.enabled and out.isatty()
        self.interval = 0.2 if self.tty else interval_s
        self.done = self.tokens = 0
        self.t0 = self.last = time.perf_counter()

    def token(self) -> None:
        self.tokens += 1
        if self.tokens % 32 == 0:  # called per request per step: look at the clock only now and then
            self._maybe_show()

    def finished(self) -> None:
        self.done += 1
        self._maybe_show(force=self.done == self.total)

    def _maybe_show(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self.last < self.interval):
            return
        self.last = now
        rate = self.tokens / max(now - self.t0, 1e-9)
        if self.tty:
            width = 30
            fill = width * self.done // self.total
            self.out.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} requests | "
                           f"{rate:,.0f} output tok/s ")
            if self.done == self.total:
                self.out.write("\n")
        else:
            self.out.write(f"progress: {self.done}/{self.total} requests, {self.tokens} output tokens, "
                           f"{rate:.0f} tok/s\n")
        self.out.flush()


class Streamer:
    """Prints a single request's text as it is generated: each update's text (a `TokenUpdate`'s, which holds
    back an unfinished character and what could start a stop string) past what is shown already."""

    def __init__(self, out: TextIO = sys.stdout) -> None:
        self.out, self.shown = out, ""

    def update(self, text: str | None, final: bool = False) -> None:
        text = text or ""
        if len(text) > len(self.shown):
            self._write(text[len(self.shown):])
            self.shown = text
        if final:
            self._write("\n")

    def _write(self, text: str) -> None:
        if self.out is None:
            return
        try:
            self.out.write(text)
            self.out.flush()
        except BrokenPipeError:  # the reader left (`| head`): show no more; the run goes on into `output`
            if self.out is sys.stdout:  # and Python's own flush at exit must not fail on it either
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            self.out = None
