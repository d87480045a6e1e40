"""Stop strings: finding them in each request's text as it grows, at a cost per token that does not grow with
the output."""
from __future__ import annotations

import weakref
from typing import Any, Callable


class StopStrings:
    """A stop string that ends at the newest token lies within the last few tokens that have text (each is at
    least a byte; special tokens, and ids past the tokenizer's that the model's padded vocabulary may give,
    decode to nothing). Those are kept per request as tokens arrive, and only they are decoded at each step;
    the whole output is decoded once a stop string shows there.

    A stop string that is a special token's text (`<|im_end|>`) would never show in the text, which skips
    special tokens: it ends the request at that token instead, the text cut before it as another's is."""

    def __init__(self, stops: list[str], decode: Callable[[list[int]], str | None], no_text: frozenset[int],
                 num_tokens: int, special: dict[str, int] | None = None) -> None:
        """`no_text`: ids below `num_tokens` that decode to nothing (the special tokens); `special`: their
        texts and ids."""
        special = special or {}
        self.decode, self.no_text, self.num_tokens = decode, no_text, num_tokens
        self.texts = [s for s in stops if s not in special]  # those looked for in the text
        self.stop_ids = frozenset(special[s] for s in stops if s in special)
        self.need = 4 * max(map(len, self.texts), default=0) + 4  # text-bearing tokens that hold the longest
        # request -> (output ids seen, last text ids); an entry goes with its request (a job of any length)
        self.tails: weakref.WeakKeyDictionary[Any, tuple[int, list[int]]] = weakref.WeakKeyDictionary()

    def hit(self, req: Any) -> bool:
        """True when `req.output_ids` decode to a text with a stop string, or end in a stop string's special
        token; `req.text` is then cut before the earliest one."""
        seen, tail = self.tails.get(req, (0, []))
        ids = req.output_ids
        if self.stop_ids:
            at = next((i for i in range(seen, len(ids)) if ids[i] in self.stop_ids), None)
            if at is not None:
                self.tails[req] = (len(ids), tail)
                req.text = self._cut(self.decode(ids[:at]) or "")
                return True
        if not self.texts:
            return False
        tail += [t for t in ids[seen:] if t < self.num_tokens and t not in self.no_text]
        del tail[:-self.need]
        self.tails[req] = (len(ids), tail)
        if not any(s in (self.decode(tail) or "") for s in self.texts):
            return False
        text = self.decode(ids) or ""
        cut = self._cut(text)
        if len(cut) < len(text):
            req.text = cut
            return True
        return False

    def _cut(self, text: str) -> str:
        """`text` before its earliest stop string."""
        return text[:min((text.find(s) for s in self.texts if s in text), default=len(text))]


class RequestStops:
    """Each request's own stop strings (its `params.stop`): one StopStrings per distinct list, made by `make`
    on first use, so that requests with other stop strings share a batch."""

    def __init__(self, make: Callable[[list[str]], StopStrings]) -> None:
        self.make = make
        self.sets: dict[tuple[str, ...], StopStrings] = {}

    def of(self, req: Any) -> StopStrings | None:
        stop = req.params.stop
        if not stop:
            return None
        found = self.sets.get(tuple(stop))
        if found is None:
            found = self.sets[tuple(stop)] = self.make(list(stop))
        return found

    def hit(self, req: Any) -> bool:
        """StopStrings.hit with the request's own stop strings; False for a request without any."""
        stops = self.of(req)
        return stops is not None and stops.hit(req)

    def texts(self, req: Any) -> list[str]:
        """The request's stop strings that are looked for in its text."""
        stops = self.of(req)
        return stops.texts if stops is not None else []
