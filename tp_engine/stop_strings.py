"""Stop strings: finding them in each request's text as it grows, at a cost per token that does not grow with
the output."""
from __future__ import annotations

import weakref
from typing import Any, Callable


class StopStrings:
    """A stop string that ends at the newest token lies within the last few tokens that have text (each is at
    least a byte; special tokens, and ids past the tokenizer's that the model's padded vocabulary may give,
    decode to nothing). Those are kept per request as tokens arrive, and only they are decoded at each step;
    the whole output is decoded once a stop string shows there."""

    def __init__(self, stops: list[str], decode: Callable[[list[int]], str | None], no_text: frozenset[int],
                 num_tokens: int) -> None:
        """`no_text`: ids below `num_tokens` that decode to nothing (the special tokens)."""
        self.stops, self.decode, self.no_text, self.num_tokens = stops, decode, no_text, num_tokens
        self.need = 4 * max(map(len, stops)) + 4  # text-bearing tokens that hold the longest stop string
        # request -> (output ids seen, last text ids); an entry goes with its request (a job of any length)
        self.tails: weakref.WeakKeyDictionary[Any, tuple[int, list[int]]] = weakref.WeakKeyDictionary()

    def hit(self, req: Any) -> bool:
        """True when `req.output_ids` decode to a text with a stop string; `req.text` is then cut before the
        earliest one."""
        seen, tail = self.tails.get(req, (0, []))
        ids = req.output_ids
        tail += [t for t in ids[seen:] if t < self.num_tokens and t not in self.no_text]
        del tail[:-self.need]
        self.tails[req] = (len(ids), tail)
        if not any(s in (self.decode(tail) or "") for s in self.stops):
            return False
        text = self.decode(ids) or ""
        cut = min((text.find(s) for s in self.stops if s in text), default=-1)
        if cut >= 0:
            req.text = text[:cut]
            return True
        return False
