"""N-gram prompt lookup: draft tokens copied from earlier in the request's own tokens.

For n from n_max down to n_min, the last n tokens (the suffix) are looked up among the earlier n-grams; the
first n that recurs wins, and its most recent earlier occurrence that does not overlap the suffix (it ends
at or before the suffix starts) gives the draft: the tokens that followed it, at most k. With `window`, only
occurrences that start within the last `window` tokens count. Non-overlapping occurrences always leave at
least min(k, n) tokens to propose.

`propose` is the reference (a scan of the tokens per call); `NgramIndex` gives the same drafts from an index
fed the request's tokens as they are appended, in a few dict lookups per call."""
from __future__ import annotations

from collections.abc import Iterable, Sequence


def _check(k: int, n_max: int, n_min: int, window: int | None) -> None:
    if k < 0:
        raise ValueError(f"ngram: k must be >= 0; got {k}")
    if not 1 <= n_min <= n_max:
        raise ValueError(f"ngram: need 1 <= n_min <= n_max; got n_min={n_min}, n_max={n_max}")
    if window is not None and window < 1:
        raise ValueError(f"ngram: window must be >= 1 or None; got {window}")


def propose(tokens: Sequence[int], k: int, n_max: int = 4, n_min: int = 1,
            window: int | None = None) -> list[int]:
    """Up to k draft tokens for a request whose tokens (prompt + output) are `tokens`: for n from n_max down
    to n_min, find the most recent earlier occurrence of the last n tokens that does not overlap them and
    propose the tokens that followed it (at most k, fewer near the end); [] when no n-gram recurs."""
    _check(k, n_max, n_min, window)
    tokens = list(tokens)
    size = len(tokens)
    lowest = 0 if window is None else max(0, size - window)
    if k == 0:
        return []
    for n in range(n_max, n_min - 1, -1):
        suffix = tokens[size - n:]
        for start in range(size - 2 * n, lowest - 1, -1):  # start + n <= size - n: no overlap
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


class NgramIndex:
    """A request's tokens and, for each n in [n_min, n_max], the latest start of every n-gram that a suffix
    lookup may use. At length L an occurrence starting at i may serve the suffix of length n only if
    i + n <= L - n, so the n-gram starting at L - 2n enters the index when the L-th token arrives; the
    dict keeps the latest start of each n-gram, which is the occurrence `propose` picks.

    Per appended token: one dict store per n (in bulk: a prompt of 50k tokens takes tens of ms). Per
    `propose`: one lookup per n and a slice of k tokens.
    Memory: about one dict entry per token and n (distinct n-grams only)."""

    def __init__(self, tokens: Iterable[int] = (), n_max: int = 4, n_min: int = 1,
                 window: int | None = None) -> None:
        _check(0, n_max, n_min, window)
        self.n_max, self.n_min, self.window = n_max, n_min, window
        self.tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram (its length is n) -> latest usable start
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append the request's new tokens (prompt or accepted output), in order."""
        toks = self.tokens
        old = len(toks)
        toks.extend(tokens)
        for n in range(self.n_min, self.n_max + 1):
            # the n-grams that became usable: those starting in [old - 2n + 1, len - 2n], in order, so that
            # a later start overwrites an earlier one
            lo, hi = max(0, old - 2 * n + 1), len(toks) - 2 * n + 1
            if lo < hi:
                grams = zip(*(toks[lo + j:hi + j] for j in range(n)))
                self._latest.update(zip(grams, range(lo, hi)))

    def propose(self, k: int) -> list[int]:
        """What `propose(self.tokens, k, n_max, n_min, window)` gives."""
        _check(k, self.n_max, self.n_min, self.window)
        toks, size = self.tokens, len(self.tokens)
        lowest = 0 if self.window is None else size - self.window
        if k == 0:
            return []
        for n in range(self.n_max, self.n_min - 1, -1):
            if 2 * n > size:
                continue
            start = self._latest.get(tuple(toks[size - n:]))
            if start is not None and start >= lowest:
                return toks[start + n:start + n + k]
        return []
