"""The range and content checks of the config's keys (`check` in config_schema.SCHEMA): each takes a value of
its key's type and says what is wrong with it, or returns None."""
from __future__ import annotations

import math

from tp_engine.base.textio import lone_surrogate

MAX_LOGPROBS = 20
MAX_TIMEOUT_S = 30 * 86400
# apply_chat_template's own arguments: set in prompts.py, or acting only when it tokenizes (never here)
RESERVED_TEMPLATE_ARGS = {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict",
                          "continue_final_message", "padding", "truncation", "max_length", "return_tensors",
                          "return_assistant_tokens_mask", "tokenizer_kwargs"}
SEED_LIMIT = 2**32  # the engine draws with seed * 1_000_003 + index in int64: far from overflow below this


def positive(v):
    return None if v >= 1 else "must be >= 1"


def non_negative(v):
    return None if v >= 0 else "must be >= 0"


def temperature(v):
    return None if 0 <= v < math.inf else "must be a finite number >= 0"


def timeout(v):
    # far beyond it, torch's and gloo's timers overflow: a rank spins or fails with a C++ trace
    return None if 1 <= v <= MAX_TIMEOUT_S else f"must be between 1 and {MAX_TIMEOUT_S} (30 days)"


def fraction(v):
    return None if 0 < v <= 1 else "must be in (0, 1]"


def logprobs(v):
    return None if 0 <= v <= MAX_LOGPROBS else f"must be between 0 and {MAX_LOGPROBS}"


def seed(v):
    return None if 0 <= v < SEED_LIMIT else "must be in [0, 2**32)"


def id_list(v):
    ok = all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
    return None if ok else "must be a list of non-negative integers"


def stop_strings(v):
    if not all(isinstance(x, str) and x for x in v):
        return "must be a list of non-empty strings"
    for i, x in enumerate(v):
        bad = lone_surrogate(x)
        if bad:  # half of a surrogate pair: decoded text never holds one, so it could never match
            return f"item {i} is not valid Unicode ({bad}): no output text can hold it"
    return None


# the keys that constrain a request's output; a request takes at most one
CONSTRAINT_KEYS = ("json_schema", "regex", "choice", "grammar")


def json_schema(v):
    ok = isinstance(v, dict) or v is True
    return None if ok else "must be a JSON schema (a mapping), or true for any object"


def non_empty_text(v):
    return None if v.strip() else "must not be empty"


def choices(v):
    if not v or not all(isinstance(x, str) and x for x in v):
        return "must be a non-empty list of non-empty strings"
    return None


def spec_method(v):
    if v not in ("eagle3", "draft", "ngram"):
        return "must be one of eagle3, draft, ngram, or null (off)"


def spec_tokens(v):
    if not 1 <= v <= 16:
        return "must be between 1 and 16"


def constraint_clash(values: dict) -> list[str]:
    """The constraint keys set (not None) in `values`, sampling settings by name (two or more: an error)."""
    return [k for k in CONSTRAINT_KEYS if values.get(k) is not None]


def template_kwargs(v):
    if not all(isinstance(k, str) for k in v):
        return "must have string keys (the template's variable names)"
    taken = sorted(set(v) & RESERVED_TEMPLATE_ARGS)
    if taken:
        return f"cannot set {', '.join(taken)}: apply_chat_template's own arguments, not template variables"
    return None
