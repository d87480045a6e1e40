"""When to speculate, and how far: the adaptive policy, and the counts a run reports.

Speculating pays where the tokens a request gains per step (its accepted drafts and the target's own token)
outweigh the longer step: drafting, a verifying forward of k + 1 tokens a request, and no overlap of the
host's work with the GPU's. Both sides change with the batch size (at large batches the target's forward is
no longer bound by its weights' bytes, and verifying k + 1 tokens a request costs k + 1 times the compute) and
with the text (acceptance is high in code and low in free prose). So the policy measures instead of
predicting: per batch-size class (powers of two) it keeps, for each number of drafts k (0: a plain step), an
average of the tokens a request gained per second in steps of that k (steps without prompt tokens only:
those measure the prefill, not the decoding; a rate not measured for `PROBE_EVERY` steps is replaced by
the next measure, not averaged with it), and speculates with the best. It measures k = 0 first, then
k = 1, 2, ... while each beats the one before. While speculating wins, one step in `PLAIN_EVERY` of a
class is a plain one and one in `PROBE_EVERY` a neighbouring k, so it follows the text as acceptance drifts
(rarely: where speculating gains 2.3x, a plain step loses more than half a step's tokens).

Acceptance is the same at any batch size, so while the recent drafts (of any class) are accepted less than
`MIN_ACCEPT` of the time, a class not yet measured at k > 0 waits for a look instead of measuring one at
once: no batch size gains from drafts that are not accepted. Such a look, at a batch of several requests,
is a probe: `probe_rows` requests draft (those whose proposers are least behind), which measures the
acceptance for their catch-up alone, and only if their drafts are accepted does the next step look with
every request. So is the first look of a run at a batch of more than `probe_rows` requests, while no draft
has been verified yet: a model proposer's first look catches it up on every request's whole context.

A model proposer that sat out plain steps first catches up on the tokens it missed (a prefill of the draft
over them): a cost of switching, not of speculating, so that step's time does not set k's rate. It is kept
as the switch's cost in plain steps, and the step after it drafts the same k to measure it. While plain
steps win, the policy looks at its best k > 0 again after `PROBE_EVERY` steps, then after twice as many each
time that look loses, up to `LOOK_MOST`, and never sooner than keeps a look's switching (or a probe's
cost, as measured) under `LOOK_SHARE` of the plain steps' time. A probe's cost is the latest probe's, of
any class, so that a class a shrinking batch enters spaces its first probe too.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

PROBE_EVERY = 64
PLAIN_EVERY = 64
LOOK_MOST = 4096
LOOK_SHARE = 0.02  # of the plain steps' time, at most, spent switching to a losing k to look at it
WEIGHT = 0.25  # of a new step in a running average
MIN_ACCEPT = 0.1  # the share of drafts accepted below which speculating pays at no batch size
EMPTY = 0.95  # a step that found nothing to draft: this share of a plain step's rate
PROBE_ROWS = 8  # requests that draft in a probe: enough drafts to tell accepted from not


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
        self.wait: dict[int, int] = {}  # class -> steps between looks at a k > 0 while plain steps win
        self.look_at: dict[int, int] = {}  # class -> its step of the next look, while plain steps win
        self.switch: dict[int, float] = {}  # class -> plain steps' time the latest switch to a k > 0 cost
        self.probe_excess = 0.0  # seconds the latest probe (of any class) took beyond a plain step
        self.hold: tuple[int, int] | None = None  # (class, k): the next step's k, if of that class
        self.updated: dict[tuple[int, int], int] = {}  # (class, k) -> the class's step when k was last timed
        self.accept: float | None = None  # the share of drafts accepted, a running average over steps
        self.probe: int | None = None  # the class whose next step is a probe (`probe_rows` requests draft)
        self.probe_rows = PROBE_ROWS
        self.counts = SpecCounts()

    @staticmethod
    def size_class(batch: int) -> int:
        return max(batch, 1).bit_length()

    def choose(self, batch: int) -> int:
        """Drafts per request for the next step of `batch` decoding requests (0: a plain step)."""
        self.probe = None
        if not self.adaptive:
            return self.k_max
        c = self.size_class(batch)
        rates = self.rate.setdefault(c, {})
        n = self.seen[c] = self.seen.get(c, 0) + 1
        hold, self.hold = self.hold, None  # the step after a switch measures the k switched to
        if hold is not None and hold[0] == c:
            return hold[1]
        if 0 not in rates:
            return 0
        top = max(rates)  # the most drafts measured: one more while each k has beaten the one before
        if top < self.k_max and (top == 0 or rates[top] > rates[top - 1]):
            if top == 0 and self.accept is None and batch > self.probe_rows:
                self.probe = c  # no draft verified yet: a few requests measure the acceptance first
                return 1
            if top or self.accept is None or self.accept >= MIN_ACCEPT:
                return top + 1
        best = max(rates, key=rates.get)
        if best:
            self.wait[c] = PROBE_EVERY
            self.look_at.pop(c, None)
            if n % PROBE_EVERY == 0:  # a neighbour, so that a choice made on old text is looked at again
                near = [k for k in (best - 1, best + 1) if 1 <= k <= self.k_max]
                return near[(n // PROBE_EVERY) % len(near)] if near else best
            return 0 if n % PLAIN_EVERY == PLAIN_EVERY // 2 else best
        # plain steps win: look at the best k > 0 again, less often each time it loses
        wait = self.wait.setdefault(c, PROBE_EVERY)
        probe = batch > 1 and self.accept is not None and self.accept < MIN_ACCEPT
        if c not in self.look_at:  # a probe catches up a few requests: that share of a switch's cost
            cost = self.switch.get(c, 0.0)
            if probe:  # the latest probe's cost (of any class), in this class's plain steps
                cost = max(cost * min(self.probe_rows, batch) / batch, self.probe_excess * rates[0])
            self.look_at[c] = n + max(wait, round(cost / LOOK_SHARE))
        if n < self.look_at[c]:
            return 0
        self.wait[c] = min(2 * wait, LOOK_MOST)
        del self.look_at[c]
        if probe:
            self.probe = c  # drafts not accepted: first measure that again, on one request
        return max((k for k in rates if k), key=rates.get, default=1)

    def record(self, batch: int, k: int, tokens_per_request: float, seconds: float) -> None:
        """A step of `batch` decoding requests with `k` drafts each took `seconds` and gave each request
        `tokens_per_request` tokens on average."""
        if seconds <= 0 or batch <= 0:
            return
        c = self.size_class(batch)
        rates = self.rate.setdefault(c, {})
        now = tokens_per_request / seconds
        n, last = self.seen.get(c, 0), self.updated.get((c, k))
        # a running average; a rate not measured for a while is replaced (the text may have changed since)
        fresh = last is not None and n - last <= PROBE_EVERY
        rates[k] = (1 - WEIGHT) * rates[k] + WEIGHT * now if fresh and k in rates else now
        self.updated[c, k] = n

    def record_switch(self, batch: int, k: int, tokens_per_request: float, seconds: float) -> None:
        """A step of `k` drafts whose proposer first caught up on tokens it had missed took `seconds` and
        gave `tokens_per_request`: what it cost beyond plain steps is the switch's, and the next step drafts
        `k` again to measure it. `seconds` 0: the step was not timed (it carried prompt tokens)."""
        if not self.adaptive or k <= 0 or batch <= 0:
            return
        c = self.size_class(batch)
        plain = self.rate.get(c, {}).get(0)
        if plain and seconds > 0:
            self.switch[c] = max(seconds * plain - tokens_per_request, 0.0)
        self.hold = c, k

    def record_probe(self, batch: int, seconds: float) -> None:
        """A probe at `batch` decoding requests took `seconds`: what it took beyond the plain step it stands
        for keeps the next probes apart, in every class (LOOK_SHARE)."""
        c = self.size_class(batch)
        plain = self.rate.get(c, {}).get(0)
        if plain and seconds > 0:
            self.probe_excess = max(seconds - 1.0 / plain, 0.0)

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
        probe, self.probe = self.probe, None
        if rows and drafted:
            share = accepted / drafted
            # a probe's share replaces the average, which is as old as the probes are far apart
            keep = self.accept is not None and probe is None
            self.accept = (1 - WEIGHT) * self.accept + WEIGHT * share if keep else share
            if probe is not None and share >= MIN_ACCEPT:  # accepted again: a whole look, next step
                self.look_at[probe] = self.seen.get(probe, 0) + 1
        if rows:
            c.spec_steps += 1
            c.drafted += drafted
            c.accepted += accepted
            c.verified_rows += rows
