"""The step message rank 0 broadcasts, and the page tables every rank keeps.

Every rank, rank 0 included, keeps each running request's page table (`PageTables`, keyed by the
request's slot, a number the scheduler gives it). A step message carries only what changed: the tables
to drop (requests finished or preempted since the last message) and, per row, how many pages of the
table to keep and the pages to append. Its size depends on the step's tokens and requests, not on the
tokens the requests hold; building the step's page table is then a concatenation of arrays every rank
already has.

Layout (int64): [command, is_prefill, B, N, D, P, V, ids(N), positions(N), kv_slots(N), seq_lens(B),
new_lens(B), slots(B), keep(B), appended(B), dropped slots(D), appended pages(P)]. The command is STEP
(the target model's forward), DRAFT_FIRST or DRAFT_NEXT (a proposer's forward: speculative/drafting.py), or
STOP. V: the leading rows that verify drafts, every token of which gets logits (others: their last token's).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from tp_engine.base.batch import Batch

STOP, STEP, DRAFT_FIRST, DRAFT_NEXT = 0, 1, 2, 3
HEAD = 7


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


@dataclass
class StepMessage:
    """One step as every rank runs it: the token rows (N), the requests' rows (B) and the page-table changes.
    Rank 0 builds it from lists (step_plan.step_message); `decode` gives the token rows as int64 tensors
    (views of the message) and each row's appended pages as an int32 array."""
    is_prefill: bool  # a prompt row is in the step
    ids: list[int] | torch.Tensor  # [N] input token ids; negative: the last step's (step_plan.ref_token)
    positions: list[int] | torch.Tensor  # [N]
    kv_slots: list[int] | torch.Tensor  # [N] where each token's K/V goes: page * page_size + offset
    seq_lens: list[int]  # [B] each row's KV length after the step
    new_lens: list[int]  # [B] each row's tokens in the step
    slots: list[int]  # [B] each row's page table (PageTables)
    keep: list[int]  # [B] pages of that table that stay
    appended: list[Sequence[int]]  # [B] pages appended to it after those
    dropped: list[int]  # [D] tables deleted first: requests finished or preempted since the last message
    verify: int = 0  # V: leading rows whose every token gets logits (a target step verifying drafts)
    command: int = STEP  # whose forward: the target's (STEP) or the proposer's (DRAFT_FIRST, DRAFT_NEXT)

    def encode(self) -> torch.Tensor:
        """The int64 message (module docstring); the token rows must be lists here."""
        pages = [p for a in self.appended for p in a]
        head = [self.command, int(self.is_prefill), len(self.seq_lens), len(self.ids), len(self.dropped),
                len(pages), self.verify]
        return torch.tensor(head + self.ids + self.positions + self.kv_slots + self.seq_lens + self.new_lens
                            + self.slots + self.keep + [len(a) for a in self.appended] + self.dropped + pages,
                            dtype=torch.int64)

    @staticmethod
    def decode(msg: torch.Tensor) -> StepMessage | None:
        """The inverse of `encode` (None for STOP): O(B + D + P) values become Python ints, no token row."""
        cmd, is_prefill, B, N, D, P, V = msg[:HEAD].tolist()
        if cmd == STOP:
            return None
        vals = msg[HEAD:]
        rest = vals[3 * N:].tolist()  # no page already sent is sent again
        seq, new_lens, slots, keep, counts = (rest[i * B:(i + 1) * B] for i in range(5))
        pages = np.asarray(rest[5 * B + D:], dtype=np.int32)
        appended, o = [], 0
        for n in counts:
            appended.append(pages[o:o + n])
            o += n
        return StepMessage(bool(is_prefill), vals[:N], vals[N:2 * N], vals[2 * N:3 * N], seq, new_lens, slots,
                           keep, appended, rest[5 * B:5 * B + D], V, cmd)

    def to_batch(self, tables: PageTables) -> Batch:
        """Apply the page-table changes to `tables` and return the step's Batch, its token rows on the host
        (`on_device` moves them; a CUDA-graph step copies them into the graph's inputs). Run on a decoded
        message, on every rank."""
        for s in self.dropped:
            tables.drop(s)
        page_tables = [tables.update(s, k, a) for s, k, a in zip(self.slots, self.keep, self.appended)]
        ends = np.cumsum(self.new_lens, dtype=np.int64)
        V = self.verify
        rows = ends - 1 if not V else np.concatenate([np.arange(ends[V - 1]), ends[V:] - 1])
        return Batch(self.is_prefill, self.ids, self.positions, self.kv_slots, self.seq_lens, self.new_lens,
                     page_tables, torch.from_numpy(rows), draft=self.command - STEP, verify=V)


def decode_message(msg: torch.Tensor, tables: PageTables) -> Batch | None:
    """The step's Batch of a message (`StepMessage.decode`, then `to_batch`); None for STOP."""
    step = StepMessage.decode(msg)
    return None if step is None else step.to_batch(tables)


def on_device(batch: Batch, device: torch.device) -> Batch:
    """`batch` with its token rows (ids, positions, KV slots, last rows) on `device`: on CUDA in one
    host-to-device copy, from pinned memory so that it queues behind the GPU's work instead of waiting for
    it."""
    if device.type == "cpu" or batch.input_ids.is_cuda:
        return batch
    rows = (batch.input_ids, batch.positions, batch.out_loc, batch.logit_rows)
    host = torch.from_numpy(np.concatenate([t.numpy() for t in rows])).pin_memory()
    dev = host.to(device, non_blocking=True)
    ids, pos, loc, last = dev.split([len(t) for t in rows])
    return replace(batch, input_ids=ids, positions=pos, out_loc=loc, logit_rows=last)


def device_rows(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Row indices (int64, on the host) on `device`, without waiting for the device's work."""
    if device.type == "cpu" or rows.is_cuda:
        return rows
    return rows.pin_memory().to(device, non_blocking=True)


def stop_message() -> torch.Tensor:
    return torch.tensor([STOP] + [0] * (HEAD - 1), dtype=torch.int64)
