"""Rank 0's progress report: a bar on a terminal, a log line every few seconds otherwise."""
from __future__ import annotations

import os
import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, enabled: bool = True, out: TextIO = sys.stderr, interval_s: float = 10.0) -> None:
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
    """Prints a single request's text as it is generated (whole characters only: a token may end mid-character).
    With stop strings, the text that could still turn out to start one is held back, since the final text is
    cut before it."""

    WINDOW = 64  # tokens at the end that each update decodes again; the text before them is settled

    def __init__(self, decode, out: TextIO = sys.stdout, stop: list[str] | tuple = ()) -> None:
        self.decode, self.out, self.shown, self.stop = decode, out, "", list(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.settled, self.settled_ids = "", 0  # the text of the first settled_ids output ids

    def _text(self, ids: list[int]) -> str:
        """decode(ids), decoding only the ids after the settled ones, so an update costs the same however long
        the output has grown. A split is settled only where decoding the two parts apart gives the text of the
        whole (not inside a character, nor where a tokenizer joins tokens' text)."""
        tail = self.decode(ids[self.settled_ids:]) or ""
        text, cut = self.settled + tail, len(ids) - self.WINDOW
        if cut - self.settled_ids >= self.WINDOW:
            head = self.decode(ids[self.settled_ids:cut]) or ""
            if not head.endswith("\ufffd") and head + (self.decode(ids[cut:]) or "") == tail:
                self.settled, self.settled_ids = self.settled + head, cut
        return text

    def update(self, output_ids: list[int], final: bool = False, text: str | None = None) -> None:
        """`text`, with `final`: the request's finished text (cut before a stop string), shown in place of ids'."""
        if text is None:
            text = self._text(output_ids)
            # cut as the finished text is cut, at the earliest stop string (with reasoning apart, the whole output
            # is shown)
            cut = min((text.find(s) for s in self.stop if s in text), default=-1)
            text = text[:cut] if cut >= 0 else text
        if not final:
            if text.endswith("\ufffd"):
                return
            text = text[:max(0, len(text) - self.hold)]
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
