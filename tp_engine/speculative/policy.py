"""When to speculate, and how far: the adaptive policy, and the counts a run reports.

Speculating pays where the tokens a request gains per step (its accepted drafts and the target's own token)
outweigh the longer step: drafting, a verifying forward of k + 1 tokens a request, and no overlap of the
host's work with the GPU's. Both sides change with the batch size (at large batches the target's forward is
no longer bound by its weights' bytes, and verifying k + 1 tokens a request costs k + 1 times the compute) and
with the text (acceptance is high in code and low in free prose). So the policy measures instead of
predicting: per batch-size class (powers of two) it keeps, for each number of drafts k (0: a plain step), an
average of the tokens a request gained per second in steps of that k, and speculates with the best. A k not
yet measured in a class is tried once; after that, every `PROBE_EVERY` steps of a class the policy tries a
neighbour of its choice once, so it follows the text as acceptance drifts, at a cost of one step in that many.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

PROBE_EVERY = 64
WEIGHT = 0.25  # of a new step in a running average
EMPTY = 0.95  # a step that found nothing to draft: this share of a plain step's rate


@dataclass
class SpecCounts:
    """What a run's summary line reports of speculation."""
    steps: int = 0  # all steps
    spec_steps: int = 0  # steps that verified drafts
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of those, accepted
    verified_rows: int = 0  # request rows that verified drafts

    def fields(self) -> dict[str, int]:
        return asdict(self)

    def add(self, other: dict[str, int]) -> None:
        """Count in another replica's steps (the summary covers every replica of a data-parallel job)."""
        for name, n in other.items():
            setattr(self, name, getattr(self, name) + n)

    def summary(self) -> dict:
        """`acceptance_rate` (accepted / drafted), `accept_length` (tokens a verifying request gained per
        step, its own included) and `spec_share` (the share of steps that speculated)."""
        return {"acceptance_rate": round(self.accepted / max(self.drafted, 1), 4),
                "accept_length": round(1 + self.accepted / max(self.verified_rows, 1), 3),
                "spec_share": round(self.spec_steps / max(self.steps, 1), 4)}


class SpecPolicy:
    def __init__(self, num_tokens: int, adaptive: bool) -> None:
        self.k_max, self.adaptive = num_tokens, adaptive
        self.rate: dict[int, dict[int, float]] = {}  # class -> k -> tokens a request gains per second
        self.seen: dict[int, int] = {}  # class -> steps chosen in it
        self.counts = SpecCounts()

    @staticmethod
    def size_class(batch: int) -> int:
        return max(batch, 1).bit_length()

    def choose(self, batch: int) -> int:
        """Drafts per request for the next step of `batch` decoding requests (0: a plain step)."""
        if not self.adaptive:
            return self.k_max
        c = self.size_class(batch)
        rates = self.rate.setdefault(c, {})
        n = self.seen[c] = self.seen.get(c, 0) + 1
        untried = [k for k in range(self.k_max + 1) if k not in rates]
        if untried:
            return untried[0]
        best = max(rates, key=rates.get)
        if n % PROBE_EVERY == 0:  # a neighbour, so that a choice made on old text is looked at again
            near = [k for k in (best - 1, best + 1) if 0 <= k <= self.k_max]
            return near[(n // PROBE_EVERY) % len(near)]
        return best

    def record(self, batch: int, k: int, tokens_per_request: float, seconds: float) -> None:
        """A step of `batch` decoding requests with `k` drafts each took `seconds` and gave each request
        `tokens_per_request` tokens on average."""
        if seconds <= 0 or batch <= 0:
            return
        rates = self.rate.setdefault(self.size_class(batch), {})
        now = tokens_per_request / seconds
        rates[k] = now if k not in rates else (1 - WEIGHT) * rates[k] + WEIGHT * now

    def record_empty(self, batch: int, k: int) -> None:
        """A step of `k` drafts found nothing to draft (n-gram lookup without a match): it gains what a plain
        step gains, having waited for the step before, so it counts as a little worse than a plain step."""
        plain = self.rate.get(self.size_class(batch), {}).get(0)
        if plain:  # else nothing to compare with (adaptive off, which tries no k)
            self.record(batch, k, 1.0, 1.0 / (EMPTY * plain))

    def count(self, drafted: int, accepted: int, rows: int) -> None:
        """One step: `rows` requests verified `drafted` draft tokens and accepted `accepted`."""
        c = self.counts
        c.steps += 1
        if rows:
            c.spec_steps += 1
            c.drafted += drafted
            c.accepted += accepted
            c.verified_rows += rows
