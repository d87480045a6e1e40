"""The step message rank 0 broadcasts, and the page tables every rank keeps.

Every rank, rank 0 included, keeps each running request's page table (`PageTables`, keyed by the
request's slot, a number the scheduler gives it). A step message carries only what changed: the tables
to drop (requests finished or preempted since the last message) and, per row, how many pages of the
table to keep and the pages to append. Its size depends on the step's tokens and requests, not on the
tokens the requests hold; building the step's page table is then a concatenation of arrays every rank
already has.

Layout (int64): [STEP, is_prefill, B, N, D, P, ids(N), positions(N), kv_slots(N), seq_lens(B),
new_lens(B), slots(B), keep(B), appended(B), dropped slots(D), appended pages(P)].
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from tp_engine.base.batch import Batch

STOP, STEP = 0, 1
HEAD = 6


class PageTables:
    """Page ids of each live request, by slot, as growable int32 arrays (amortised appends)."""

    def __init__(self) -> None:
        self._arrays: dict[int, np.ndarray] = {}
        self._lens: dict[int, int] = {}

    def clear(self) -> None:
        self._arrays.clear()
        self._lens.clear()

    def __len__(self) -> int:
        return len(self._lens)

    def drop(self, slot: int) -> None:
        self._arrays.pop(slot, None)
        self._lens.pop(slot, None)

    def update(self, slot: int, keep: int, new: np.ndarray) -> np.ndarray:
        """Keep the first `keep` pages of `slot`'s table, append `new`; returns the table (a view)."""
        arr = self._arrays.get(slot)
        have = self._lens.get(slot, 0)
        assert keep <= have, f"step message keeps {keep} pages of slot {slot}, which has {have}"
        n = keep + len(new)
        if arr is None or n > len(arr):
            grown = np.empty(max(n, 2 * (0 if arr is None else len(arr)), 4), dtype=np.int32)
            if keep:
                grown[:keep] = arr[:keep]
            arr = self._arrays[slot] = grown
        arr[keep:n] = new
        self._lens[slot] = n
        return arr[:n]

    def table(self, slot: int) -> np.ndarray:
        return self._arrays[slot][:self._lens[slot]]


def encode_step(is_prefill: bool, ids: list[int], pos: list[int], loc: list[int], seq: list[int],
                ext: list[int], slots: list[int], keep: list[int], appended: list[Sequence[int]],
                dropped: list[int]) -> torch.Tensor:
    new = [p for pages in appended for p in pages]
    head = [STEP, int(is_prefill), len(seq), len(ids), len(dropped), len(new)]
    return torch.tensor(head + ids + pos + loc + seq + ext + slots + keep + [len(a) for a in appended]
                        + dropped + new, dtype=torch.int64)


def decode_message(msg: torch.Tensor, tables: PageTables) -> Batch | None:
    """The inverse of `encode_step`, run on every rank: updates `tables`, returns the step's Batch with its token
    rows on the host (`on_device` moves them; a CUDA-graph step copies them into the graph's inputs); None for
    STOP."""
    cmd, is_prefill, B, N, D, P = msg[:HEAD].tolist()
    if cmd == STOP:
        return None
    vals = msg[HEAD:]
    rest = vals[3 * N:].tolist()  # O(B + D + P): no page already sent is sent again
    seq, ext, slots, keep, nnew = (rest[i * B:(i + 1) * B] for i in range(5))
    dropped = rest[5 * B:5 * B + D]
    new = np.asarray(rest[5 * B + D:], dtype=np.int32)
    for s in dropped:
        tables.drop(s)
    page_tables, o = [], 0
    for s, k, n in zip(slots, keep, nnew):
        page_tables.append(tables.update(s, k, new[o:o + n]))
        o += n
    last = torch.from_numpy(np.cumsum(ext, dtype=np.int64) - 1)
    return Batch(bool(is_prefill), vals[:N], vals[N:2 * N], vals[2 * N:3 * N], seq, ext, page_tables, last)


def on_device(batch: Batch, device: torch.device) -> Batch:
    """`batch` with its token rows (ids, positions, KV slots, last rows) on `device`: on CUDA in one
    host-to-device copy, from pinned memory so that it queues behind the GPU's work instead of waiting for it."""
    if device.type == "cpu" or batch.input_ids.is_cuda:
        return batch
    rows = (batch.input_ids, batch.positions, batch.out_loc, batch.last_indices)
    dev = torch.from_numpy(np.concatenate([t.numpy() for t in rows])).pin_memory().to(device, non_blocking=True)
    ids, pos, loc, last = dev.split([len(t) for t in rows])
    return replace(batch, input_ids=ids, positions=pos, out_loc=loc, last_indices=last)


def stop_message() -> torch.Tensor:
    return torch.tensor([STOP] + [0] * (HEAD - 1), dtype=torch.int64)
