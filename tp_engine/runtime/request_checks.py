"""Why a request cannot run on an engine: its prompt ids (`prompt_problem`), its output constraint
(`constraint_problem`). Rank 0 asks before the request is made, so a bad one gets an error line and the
others run."""
from __future__ import annotations

from typing import Any

from tp_engine.sampling.constraints import ConstraintError, constraint_of


def prompt_problem(engine: Any, ids: list[int]) -> str | None:
    """Why these ids cannot run on `engine`, or None."""
    vocab = engine.model_cfg.vocab_size
    if not ids:
        return "empty prompt: it has no tokens"
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        return f"token id {bad[0]} is outside the vocabulary [0, {vocab})"
    limit = engine.max_request_len
    if len(ids) >= limit:
        return (f"prompt has {len(ids)} tokens; the longest that can run is {limit - 1} "
                f"(max_model_len {engine.max_model_len}, "
                f"KV pool {engine.kv.num_pages * engine.kv.page_size} tokens)")
    return None


def constraint_problem(engine: Any, params: Any) -> str | None:
    """What is wrong with `params`' output constraint on `engine` (xgrammar missing, no tokenizer, what its
    compiler said), or None; the compiled grammar stays in the engine's cache for the request."""
    kind_text = constraint_of(params)
    if kind_text is None:
        return None
    try:
        engine.grammars.compile(*kind_text)
    except ConstraintError as e:
        return str(e)
    return None
