"""A step's grammar masks: filled on the host by a thread of their own, over several of xgrammar's threads,
copied to the device in one transfer, put on the logits in one kernel.

xgrammar fills one row's mask in tens to hundreds of microseconds (more inside a JSON string, whose closing
tokens it checks one by one), so the rows of a large batch go to one xgrammar call that spreads them over
its threads, as many as this rank's share of the cores. The masks of step N + 1 need the tokens of step N,
which reach the host only when the GPU has sampled them. So the main thread does not wait for them: it
hands the step's rows to the mask thread and queues, behind the step's forward, a kernel that holds the
GPU until the mask thread raises a flag in pinned host memory, then the copy of the masks and the masking
kernel. The mask thread waits for step N's tokens, feeds them to the matchers, fills the masks and raises
the flag, while the main thread takes in step N and plans the next step. A step's masks lie one after
another in a host buffer (pinned with a CUDA device), reused from step to step: the mask thread writes it
only once the copy of the step before has left it.

Who touches a matcher when: the mask thread, from `submit` until it has fed its step's tokens (`wait_fed`);
the main thread otherwise. Whether its grammar has ended is a flag kept in Python, so reading it never calls
into xgrammar while the mask thread fills; what does call into it waits for the fill first (`settle`).

The two threads share the GIL. The mask thread's waits and xgrammar's calls release it, and each return
then waits for the main thread to let it go, which a thread running Python does only every switch interval
(5 ms by default): a step's mask chain would wait that long several times over. So while a mask
thread's job runs, from `submit` to its flag, the interpreter switches every SWITCH_INTERVAL_S, and the
mask thread writes its buffers through numpy, which keeps the GIL, rather than through torch's operators,
which let it go.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

ROWS_PER_THREAD = 4  # at least, so that starting a thread (xgrammar starts them each call) pays
SWITCH_INTERVAL_S = 1e-4  # the interpreter's switch interval while a mask thread runs (module docstring)


class _QuickSwitches:
    """The interpreter's switch interval: short while any mask thread's job runs, as it was once none does
    (counted: a step's job is submitted before the step before's is done, and engines may run side by side
    in one process)."""

    def __init__(self) -> None:
        self._lock, self._users, self._saved = threading.Lock(), 0, 0.0

    def enter(self) -> None:
        with self._lock:
            if self._users == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, SWITCH_INTERVAL_S))
            self._users += 1

    def leave(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                sys.setswitchinterval(self._saved)


_SWITCHES = _QuickSwitches()


def default_threads(ranks: int) -> int:
    """Threads for one rank's masks: the cores this process may run on, shared by the `ranks` processes
    of an engine on one node, less one for the main thread, which runs beside the fill (at least 1, at
    most 32): a fill waits for its slowest thread, and one that shares a core is the slowest."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(32, cores // max(1, ranks) - 1))


class StepMasks:
    """Rank 0's buffers and threads for the masks of a step's constrained rows (`vocab_size` bits a row)."""

    def __init__(self, vocab_size: int, threads: int, take: Callable[[list], None] | None = None) -> None:
        """take([(matcher, tokens), ...]): the matchers take their tokens (constraints.take_all)."""
        self.words, self.threads, self._take = (vocab_size + 31) // 32, max(1, threads), take
        self._busy: set[int] = set()  # ids of the matchers of the latest step's masks
        self._batches: dict = {}  # threads -> xgrammar's BatchGrammarMatcher, which fills rows on them
        self._host: torch.Tensor | None = None  # int32: the masks, row after row, then the step's slots
        self._copied: torch.cuda.Event | None = None  # recorded after the latest copy out of _host
        self._pool: ThreadPoolExecutor | None = None  # the mask thread, started on first use
        self._job: Future | None = None  # the latest step's masks
        self._fed = threading.Event()  # set once the latest step's matchers have taken their tokens
        self._fed.set()
        self._flag: torch.Tensor | None = None  # pinned int32 [1]: the latest step whose masks are ready
        self._seq = 0
        # the host's seconds over the steps that masked, by part: the main thread waiting for the mask
        # thread, the matchers taking their tokens, filling the masks (the mask thread), and the masks'
        # copy and kernel queued (the main thread)
        self.host_s = dict.fromkeys(("wait", "take", "fill", "apply"), 0.0)
        self.steps = 0

    def submit(self, feeds: Sequence[tuple[Any, list[int], int | None]], slots: list[int],
               in_flight: Callable[[], list[int]] | None, device: torch.device,
               ops=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Start a step's masks on the mask thread. feeds[j]: row j's matcher, the output tokens it has
        not taken, and the row of the step in flight whose token comes after them (None: none);
        `in_flight()` waits for that step's tokens and returns them. slots[b]: the mask row of the step's
        logits row b (-1: none). Returns (masks [rows, words], slots [B]) int32 on `device`, to be read in
        stream order: with the fused kernels (`ops`) on CUDA the stream waits for the mask thread; else the
        host waits here. Fewer than ROWS_PER_THREAD rows (a fill of a fraction of a millisecond) are filled
        here, on the main thread: no thread to wake, no stream to hold. The caller has waited for the step
        before's matchers (`wait_fed`)."""
        rows, batch, cuda = len(feeds), len(slots), device.type == "cuda"
        host = self._buffer(rows * self.words + batch, cuda)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
            self._flag = torch.zeros(1, dtype=torch.int32, pin_memory=cuda)
        self._seq += 1
        self._fed = threading.Event()
        self._busy = {id(m) for m, _, _ in feeds}
        self.steps += 1
        masks = host[:rows * self.words].view(rows, self.words)  # here, as torch lets the GIL go
        job = (self._seq, host, masks, feeds, slots, in_flight, self._copied, self._fed)
        inline = rows < ROWS_PER_THREAD
        if inline:
            self.wait()  # the mask thread is done with the step before's matchers
            self._fill_step(*job)
        else:
            _SWITCHES.enter()
            try:
                self._job = self._pool.submit(self._threaded_step, *job)
            except BaseException:
                _SWITCHES.leave()
                raise
        start = time.perf_counter()
        both = host[:rows * self.words + batch]
        if not inline and cuda and ops is not None:
            ops.wait_for_host(self._flag, self._seq)  # in stream order, ahead of the copy
        elif not inline:
            self.wait()
        if cuda:
            both = both.to(device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        # on the CPU the host rows themselves: the step is done with them before the next one fills them
        self.host_s["apply"] += time.perf_counter() - start
        return both[:rows * self.words].view(rows, self.words), both[rows * self.words:]

    def wait_fed(self) -> None:
        """Wait until the latest step's matchers have taken their tokens; raise what the mask thread
        raised."""
        if not self._fed.is_set():
            start = time.perf_counter()
            self._fed.wait()
            self.host_s["wait"] += time.perf_counter() - start
        if self._job is not None and self._job.done():
            self._settle()

    def wait(self, quiet: bool = False) -> None:
        """Wait until the latest step's masks are filled; raise what the mask thread raised (`quiet`: not,
        for a caller that is raising an error of its own)."""
        if self._job is not None:
            start = time.perf_counter()
            try:
                self._settle()
            except Exception:
                if not quiet:
                    raise
            self.host_s["wait"] += time.perf_counter() - start

    def feeding(self, matcher: Any) -> bool:
        """The mask thread has yet to feed `matcher` its latest step's tokens."""
        return id(matcher) in self._busy and not self._fed.is_set()

    def settle(self, matcher: Any) -> None:
        """Wait for the mask thread if it may be filling `matcher`'s mask, so that the caller may read it."""
        if id(matcher) in self._busy:
            self.wait()

    def _settle(self) -> None:
        """The latest step's outcome, once: its error is raised by one wait, not by every later one."""
        job, self._job = self._job, None
        job.result()

    def _buffer(self, need: int, pinned: bool) -> torch.Tensor:
        """A host buffer of at least `need` int32: the one in use, or a larger one (the old one stays alive
        as long as a copy or the mask thread still holds it)."""
        if self._host is None or self._host.numel() < need or self._host.is_pinned() != pinned:
            host = torch.empty(max(need, 2 * (self._host.numel() if self._host is not None else 0)),
                               dtype=torch.int32)
            self._host = host.pin_memory() if pinned else host
            self._copied = None  # a fresh buffer: no copy out of it to wait for
        return self._host

    def _threaded_step(self, *job) -> None:
        """`_fill_step` on the mask thread, its switch interval given back at its end (`submit` took it)."""
        try:
            self._fill_step(*job)
        finally:
            _SWITCHES.leave()

    def _fill_step(self, seq: int, host: torch.Tensor, masks: torch.Tensor, feeds, slots: list[int],
                   in_flight: Callable[[], list[int]] | None, copied: torch.cuda.Event | None,
                   fed: threading.Event) -> None:
        """The mask thread's part of a step: the tokens in, the masks (`masks`: the rows of `host` they
        take) and slots out, then the flag up."""
        try:
            tokens = in_flight() if in_flight is not None else None
            if copied is not None and not copied.query():
                copied.synchronize()  # the step before's masks have left the buffer
            start = time.perf_counter()
            rows, flat = len(feeds), host.numpy()  # numpy's writes keep the GIL (module docstring)
            self._take([(m, toks if ref is None else [*toks, tokens[ref]]) for m, toks, ref in feeds])
            active = []  # (its row of the masks, matcher) of the rows whose next token the grammar decides
            for j, (m, _, _) in enumerate(feeds):
                if m.active:
                    active.append((j, m))
                else:  # free text (a think block), or a token the request drops: every token allowed
                    flat[j * self.words:(j + 1) * self.words] = -1
            fed.set()
            filled = time.perf_counter()
            self.fill(masks, active)
            flat[rows * self.words:rows * self.words + len(slots)] = slots
            self.host_s["take"] += filled - start
            self.host_s["fill"] += time.perf_counter() - filled
        finally:
            fed.set()
            self._flag.numpy()[0] = seq

    def fill(self, buffer: torch.Tensor, rows: Sequence[tuple[int, Any]]) -> None:
        """Each (j, matcher)'s allowed tokens into row j of `buffer`: in one xgrammar call over up to
        `threads` threads, ROWS_PER_THREAD rows a thread at least; row by row where that is one thread."""
        threads = min(self.threads, len(rows) // ROWS_PER_THREAD)
        if threads <= 1:
            for j, m in rows:
                m.fill(buffer, j)
            return
        if threads not in self._batches:
            import xgrammar
            self._batches[threads] = xgrammar.BatchGrammarMatcher(threads)
        self._batches[threads].batch_fill_next_token_bitmask([m.m for _, m in rows], buffer,
                                                             [j for j, _ in rows])
        for j, m in rows:
            m.allow_opening(buffer, j)


def mask_logits(logits: torch.Tensor, masks: torch.Tensor, slots: torch.Tensor, ops=None) -> torch.Tensor:
    """A copy of `logits` [B, V] in which row b, if slots[b] >= 0, keeps only the tokens its mask
    masks[slots[b]] ([W] int32: bit j of word w is token 32 w + j) allows, the others -inf (columns past
    32 W, vocabulary padding, too). The logits themselves are left as they are (logprobs are the model's).
    With the fused kernels (`ops`), one kernel on the device."""
    if ops is not None and logits.is_cuda:
        return ops.mask_logits(logits, masks, slots)
    V, W = logits.shape[-1], masks.shape[-1]
    rows = (slots >= 0).nonzero().flatten()
    ids = torch.arange(V, device=logits.device)
    words = masks[slots[rows].long()][:, (ids >> 5).clamp(max=W - 1)]
    allowed = ((words >> (ids & 31)) & 1).bool() & (ids < 32 * W)
    out = logits.clone()
    out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
    return out
