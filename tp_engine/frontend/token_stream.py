"""What `generate(on_token=fn)` hands `fn` as each request gets a token: a `TokenUpdate`, whose text grows
with the output but never shows what a stop string will cut off."""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TokenUpdate:
    """One request's output as it stood when it got a token (on rank 0). `token_ids` and `text` are computed
    when read (an update nobody reads costs no decoding), for the output as it stood then.

    `text` is the output's text so far (special tokens skipped; a think block included), without what could
    still turn into a stop string (the part a stop string could start with) or an unfinished character; at the
    last token (`finish_reason` set) it is all of it, cut before a stop string as the output's `text` is
    (apart from `reasoning`, which this text still holds). None when the checkpoint has no tokenizer."""

    index: int  # the prompt's position in generate's list
    sample: int  # which of its sampling.n samples
    num_tokens: int  # output tokens so far, this one included
    finish_reason: str | None  # None while the request runs; "stop" or "length" at its last token
    _texts: TextStreams = field(repr=False, compare=False)
    _out: Any = field(repr=False, compare=False)  # the request's output (runtime.request.RequestOutput)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The output token ids so far (the one that ended the request included)."""
        return tuple(self._out.output_ids[:self.num_tokens])

    @property
    def text(self) -> str | None:
        return self._texts.text(self._out, self.num_tokens, self.finish_reason is not None)


class TextStreams:
    """Each request's text as it grows, decoding only its last WINDOW-odd tokens at a time: a split of the ids
    is settled once decoding the parts apart gives the text of the whole (not inside a character, nor where a
    tokenizer joins tokens' text), so an update costs the same however long the output has grown."""

    WINDOW = 64

    def __init__(self, decode: Callable[[list[int]], str | None],
                 stops: list[str] | Callable[[Any], list[str]]) -> None:
        """`stops`: the stop strings looked for in the text, or a function giving a request's own."""
        self.decode = decode
        self.stops = stops if callable(stops) else lambda req: stops
        # request -> [settled text, its ids, last n, last text]; an entry goes with its request
        self.state: weakref.WeakKeyDictionary[Any, list] = weakref.WeakKeyDictionary()

    def update(self, req: Any, finish_reason: str | None) -> TokenUpdate:
        return TokenUpdate(req.index, req.sample, len(req.output_ids), finish_reason, self, req)

    def text(self, req: Any, n: int, final: bool) -> str | None:
        if final and req.text is not None:  # cut before a stop string already
            return req.text
        whole = self._decoded(req, n)
        if whole is None:
            return None
        stops = self.stops(req)
        text = whole[:min((whole.find(s) for s in stops if s in whole), default=len(whole))]
        if final:
            return text
        text = text.rstrip("\ufffd")  # a character whose bytes are not all there yet
        return text[:len(text) - held_back(text, stops)]

    def _decoded(self, req: Any, n: int) -> str | None:
        """decode(output_ids[:n]); from the settled text on when n is at or past this request's latest."""
        ids = req.output_ids
        state = self.state.get(req)
        if state is None:
            state = self.state[req] = ["", 0, -1, None]
        elif n < state[2]:  # an update read after a later one: decode it whole
            return self.decode(ids[:n])
        settled, settled_ids, last, last_text = state
        if n == last:
            return last_text
        tail = self.decode(ids[settled_ids:n])
        if tail is None:
            return None
        text, cut = settled + tail, n - self.WINDOW
        if cut - settled_ids >= self.WINDOW:
            head = self.decode(ids[settled_ids:cut]) or ""
            if not head.endswith("\ufffd") and head + (self.decode(ids[cut:n]) or "") == tail:
                state[0], state[1] = settled + head, cut
        state[2], state[3] = n, text
        return text


def held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` could be the start of a stop string."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)
