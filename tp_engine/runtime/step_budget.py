"""How much prompt work one step may still take: tokens (`max_prefill_tokens`, decode rows included) and,
while requests decode, cost (`max_prefill_cost_while_decoding`).

A prompt token at position c costs 1 + c / span: its matmuls, plus its attention over the c tokens before
it, in units of its matmuls (`ModelConfig.attention_span`). Counting tokens alone lets the late chunks of a
long prompt take several times longer than its first ones, and the decoding requests wait on each.
"""
from __future__ import annotations

import math


class StepBudget:
    def __init__(self, tokens: int, cost: float = math.inf, span: float = 4096.0) -> None:
        self.tokens, self.cost, self.span = tokens, cost, span
        self.taken = 0  # prompt tokens granted so far in this step

    @property
    def open(self) -> bool:
        return self.tokens > 0 and self.cost > 0

    def chunk_cost(self, start: int, n: int) -> float:
        """The cost of prompt tokens start .. start + n - 1."""
        return n + (n * start + n * (n - 1) / 2) / self.span

    def take(self, start: int, n: int) -> int:
        """Grant the most of `n` prompt tokens from position `start` that fit, and count them. The step's
        first prompt row gets at least one token whatever its cost, so every prompt advances."""
        n = min(n, self.tokens)
        if n > 0 and self.chunk_cost(start, n) > self.cost:
            # the root of n^2 / (2 span) + n (1 + (start - 1/2) / span) = cost, then exact on either side
            b = 1 + (start - 0.5) / self.span
            m = min(n, int(self.span * (math.sqrt(b * b + 2 * self.cost / self.span) - b)))
            while m > 0 and self.chunk_cost(start, m) > self.cost:
                m -= 1
            while m < n and self.chunk_cost(start, m + 1) <= self.cost:
                m += 1
            n = max(m, 0 if self.taken else 1)
        if n > 0:
            self.tokens -= n
            self.cost -= self.chunk_cost(start, n)
            self.taken += n
        return max(n, 0)
