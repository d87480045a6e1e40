"""A step's grammar masks: filled on the host over several threads, copied to the device in one transfer,
put on the logits in one kernel.

xgrammar fills one row's mask in tens to hundreds of microseconds (more inside a JSON string, whose closing
tokens it checks one by one), so the rows of a large batch go to one xgrammar call that spreads them over
its threads, as many as this rank's share of the cores. The masks of the step's constrained rows lie one
after another in a host buffer (pinned with a CUDA device), reused from step to step: a step writes into it
only once the copy of the step before has left it.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch

ROWS_PER_THREAD = 4  # at least, so that starting a thread (xgrammar starts them each call) pays


def default_threads(ranks: int) -> int:
    """Threads for one rank's masks: the cores this process may run on, shared by the `ranks` processes
    of an engine on one node (at least 1, at most 32)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(32, cores // max(1, ranks)))


class StepMasks:
    """Rank 0's buffers and threads for the masks of a step's constrained rows (`vocab_size` bits a row)."""

    def __init__(self, vocab_size: int, threads: int) -> None:
        self.words, self.threads = (vocab_size + 31) // 32, max(1, threads)
        self._batches: dict = {}  # threads -> xgrammar's BatchGrammarMatcher, which fills rows on them
        self._host: torch.Tensor | None = None  # int32: the masks, row after row, then the step's slots
        self._copied: torch.cuda.Event | None = None  # recorded after the latest copy out of _host

    def buffer(self, rows: int, batch: int, pinned: bool) -> torch.Tensor:
        """[rows, words] int32 host rows for a step's masks, with room after them for `batch` slots, free to
        write (the latest copy out of them done). Rows are not cleared: a fill writes its row whole."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        need = rows * self.words + batch
        if self._host is None or self._host.numel() < need or self._host.is_pinned() != pinned:
            host = torch.empty(max(need, 2 * (self._host.numel() if self._host is not None else 0)),
                               dtype=torch.int32)
            self._host = host.pin_memory() if pinned else host
        return self._host[:rows * self.words].view(rows, self.words)

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

    def to_device(self, rows: int, slots: list[int],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffer's first `rows` masks and each logits row's slot among them (-1: no mask) on `device`,
        in one copy that does not hold the host up."""
        n, b = rows * self.words, len(slots)
        self._host[n:n + b] = torch.tensor(slots, dtype=torch.int32)
        both = self._host[:n + b]
        if device.type == "cuda":
            both = both.to(device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        # on the CPU the host rows themselves: the step is done with them before the next one fills them
        return both[:n].view(rows, self.words), both[n:]


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
