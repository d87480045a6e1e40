"""One request, in two parts: what its caller sees (`RequestOutput`: the prompt, the sampling parameters and
what it produced, read by the callbacks and the output dicts) and what the scheduler keeps of it on rank 0
(`RequestState`: its KV pages and page table, how many of its tokens are computed, tokens still in flight).
The state points at the output and fills it in; nothing the callbacks see points back at the state."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tp_engine.sampling.sampler import SamplingParams


@dataclass(eq=False)  # equal only to itself: finding one among thousands must not compare fields
class RequestOutput:
    """A request and its result, filled in as it runs."""
    index: int  # the prompt's position in the caller's list
    prompt_ids: list[int]
    params: SamplingParams
    sample: int = 0  # which of the prompt's `n` samples this request is
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "error"
    error: str | None = None
    text: str | None = None  # the output's text when a stop string cut it (stop_strings.py)
    cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache (at the last admission)
    logprobs: list[dict] = field(default_factory=list)  # one entry per output token, with sampling.logprobs
    constraint: str | None = None  # with an output constraint, once finished: "complete" or "incomplete"
    # an output constraint holds after `think_end`, the id ending the think block its prompt opens, or that
    # `think_open`, when it is the first output token, opens
    think_end: int | None = None
    think_open: int | None = None


@dataclass(eq=False)
class RequestState:
    """The scheduler's bookkeeping of one request (rank 0); `out` is the request and its result."""
    out: RequestOutput
    slot: int  # the request's page table on every rank (step_message.PageTables)
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache, or will be once the issued steps ran
    pending: int = 0  # tokens sampled by issued steps but not yet appended to output_ids
    out_row: int = 0  # row of this request in the newest issued step's sampled tokens
    sent_pages: int = 0  # how many of `pages` the other ranks' table of this slot holds
    keys: list[bytes] = field(default_factory=list, repr=False)  # content keys of the pages it registered
    chain: list[bytes] = field(default_factory=list, repr=False)  # keys of its first full pages, for good
    matcher: Any = None  # its output constraint's state (sampling.constraints.Matcher), fed its output_ids
    spec_cached: int = 0  # positions whose K/V the proposer's own cache holds (a draft model, an EAGLE head)

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens on the host (called per request per step)."""
        return len(self.out.prompt_ids) + len(self.out.output_ids)

    @property
    def num_outputs(self) -> int:
        """Output tokens including those still on the device."""
        return len(self.out.output_ids) + self.pending

    @property
    def todo(self) -> int:
        """Tokens whose K/V are still to be computed (the pending one included)."""
        return self.num_tokens + self.pending - self.num_cached

    @property
    def decoding(self) -> bool:
        """Its prompt is computed, and of its tokens only the newest is not: `todo` is 1 (inlined: a few calls
        per request per step)."""
        out, computed = self.out, self.num_cached
        P = len(out.prompt_ids)
        return computed >= P and P + len(out.output_ids) + self.pending - computed == 1

    def tokens(self, start: int, n: int) -> list[int]:
        """(prompt_ids + output_ids)[start:start + n] without building that list."""
        prompt, output = self.out.prompt_ids, self.out.output_ids
        P = len(prompt)
        if start >= P:
            return output[start - P:start - P + n]
        if start + n <= P:
            return prompt[start:start + n]
        return prompt[start:] + output[:start + n - P]
