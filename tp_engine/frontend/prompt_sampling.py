"""A prompt's own sampling settings: the `sampling` mapping of a prompt object (the run's `sampling` keys and
`seed`), over the run's settings or over the SamplingParams generate() was given for it."""
from __future__ import annotations

import difflib
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

from tp_engine.base.config import ConfigError
from tp_engine.base.sampling_keys import SAMPLING_FIELDS as FIELDS, check_sampling, over_constraint
from tp_engine.frontend.prompts import Prompt, PromptEncoder, PromptError

if TYPE_CHECKING:  # torch is imported only once the config is known to be good
    from tp_engine.sampling.sampler import SamplingParams


def own_sampling(prompt: Prompt) -> dict | None:
    """The prompt object's `sampling`, checked by the config's rules (numpy integers as ints, one stop string
    as a list), or None without one. A key or value the config would refuse raises PromptError."""
    if not isinstance(prompt, dict) or "sampling" not in prompt:
        return None
    own = prompt["sampling"]
    if not isinstance(own, dict):
        raise PromptError(
            f"a prompt's 'sampling' must be a mapping of sampling keys; got {type(own).__name__}")
    for k in own:
        if k not in FIELDS:
            close = difflib.get_close_matches(k, FIELDS, n=1) if isinstance(k, str) else []
            meant = f"; did you mean '{close[0]}'?" if close else ""
            raise PromptError(
                f"unknown key {k!r} in a prompt's sampling{meant} (its keys: {', '.join(FIELDS)})")
    try:
        return check_sampling(own, "the prompt's sampling.")
    except ConfigError as e:
        raise PromptError(str(e)) from None


def params_for(prompt: Prompt, base: SamplingParams, encoder: PromptEncoder) -> SamplingParams | PromptError:
    """The parameters of `prompt`'s requests: `base` with the prompt's own `sampling` over it, or the
    PromptError that says what is wrong with that (stop strings without a tokenizer too)."""
    try:
        own = own_sampling(prompt)
        if own and own.get("stop"):
            encoder.check_stop_strings(own["stop"])
    except (PromptError, ValueError) as e:
        return e if isinstance(e, PromptError) else PromptError(str(e))
    return replace(base, **over_constraint(own)) if own else base


def own_settings(prompts: Sequence[Prompt], encoded: list) -> dict[int, dict]:
    """Each prompt's own `sampling` by index, for the prompts that have one; a bad one becomes the prompt's
    error in `encoded` (its ids, or its PromptError), so that the prompt gets an error line."""
    own = {}
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, dict) and "sampling" in prompt and not isinstance(encoded[i], PromptError):
            try:
                got = own_sampling(prompt)
            except PromptError as e:
                encoded[i] = e
                continue
            if got:
                own[i] = got
    return own


def line_counts(num_prompts: int, n: int, own: dict[int, dict]) -> tuple[int, int]:
    """(output lines: one per prompt and sample, the largest sampling.n) of a run whose sampling.n is `n`."""
    counts = [o["n"] for o in own.values() if "n" in o]
    return num_prompts * n + sum(k - n for k in counts), max([n, *counts])


def has_stop_strings(prompts: Sequence[Any], params: Sequence[SamplingParams]) -> bool:
    """Whether any request of a generate() call may end at a stop string: stop strings are looked for after
    every token only then."""
    def own_stop(p: Any) -> bool:
        return isinstance(p, dict) and isinstance(p.get("sampling"), dict) and bool(p["sampling"].get("stop"))
    return any(p.stop for p in params) or any(own_stop(p) for p in prompts)
