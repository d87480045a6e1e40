"""The value checks that config.SCHEMA's keys name: each gets a value of the key's type and returns what is
wrong with it (the words after the key's name in the message), or None."""
from __future__ import annotations

import math


def _positive(v):
    return None if v >= 1 else "must be >= 1"


def _non_negative(v):
    return None if v >= 0 else "must be >= 0"


def _temperature(v):
    return None if 0 <= v < math.inf else "must be a finite number >= 0"


def _timeout(v):
    # far beyond it, torch's and gloo's timers overflow: a rank spins or fails with a C++ trace
    return None if 1 <= v <= MAX_TIMEOUT_S else f"must be between 1 and {MAX_TIMEOUT_S} (30 days)"


def _fraction(v):
    return None if 0 < v <= 1 else "must be in (0, 1]"


def _logprobs(v):
    return None if 0 <= v <= MAX_LOGPROBS else f"must be between 0 and {MAX_LOGPROBS}"


def _seed(v):
    return None if 0 <= v < SEED_LIMIT else "must be in [0, 2**32)"


def _id_list(v):
    return None if all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v) else "must be a list of non-negative integers"


def _str_list(v):
    return None if all(isinstance(x, str) and x for x in v) else "must be a list of non-empty strings"


def _template_kwargs(v):
    if not all(isinstance(k, str) for k in v):
        return "must have string keys (the template's variable names)"
    taken = sorted(set(v) & RESERVED_TEMPLATE_ARGS)
    return f"cannot set {', '.join(taken)}: apply_chat_template's own arguments, not template variables" if taken else None


MAX_LOGPROBS = 20
MAX_TIMEOUT_S = 30 * 86400
# apply_chat_template's own arguments: set in prompts.py, or acting only when it tokenizes (it never does here)
RESERVED_TEMPLATE_ARGS = {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict",
                          "continue_final_message", "padding", "truncation", "max_length", "return_tensors",
                          "return_assistant_tokens_mask", "tokenizer_kwargs"}
SEED_LIMIT = 2**32  # the engine draws with seed * 1_000_003 + index in int64: far from overflow below this
