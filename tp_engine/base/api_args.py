"""The Python API's arguments: numpy and torch integers taken as Python ints, generate()'s prompts as a
list, and what is wrong with a prompt in Python's words (the config's messages speak of YAML and JSON).

Nothing here imports numpy or torch: their scalars are integers by `numbers.Integral` or `__index__`."""
from __future__ import annotations

import numbers
import operator
from typing import Any


def as_id(t: Any) -> int | None:
    """`t` as a Python int when it is an integer: an int, a numpy integer, or a 0-d integer array or tensor.
    None for anything else, bools (True is no token id) and floats included."""
    if type(t) is int:  # the common case first: a job's prompts hold millions of ids
        return t
    if isinstance(t, bool) or "bool" in str(getattr(t, "dtype", "")):  # torch.tensor(True) has an __index__
        return None
    if isinstance(t, numbers.Integral):
        return int(t)
    if getattr(t, "ndim", None) == 0:
        try:
            return operator.index(t)
        except TypeError:  # a float array or tensor
            return None
    return None


def as_ids(v: Any) -> list[int] | None:
    """`v` as a list of Python ints when it is a list of integers (`as_id`) or a 1-d integer array or tensor;
    None for anything else."""
    if getattr(v, "ndim", None) == 1 and hasattr(v, "tolist"):
        v = v.tolist()  # its elements as Python numbers: ints stay ints, floats and bools stay what they are
    if not isinstance(v, list):
        return None
    ids = [as_id(t) for t in v]
    return None if None in ids else ids


def as_list(prompts: Any) -> list:
    """generate()'s argument as a list of prompts: one prompt (a str, a list of token ids or a dict), a list
    of them, or an integer array or tensor (1-d: one prompt's token ids; 2-d: a prompt per row)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if getattr(prompts, "ndim", None) in (1, 2) and hasattr(prompts, "tolist"):
        prompts = prompts.tolist()
    if isinstance(prompts, list):
        return [prompts] if prompts and as_ids(prompts) is not None else prompts
    raise TypeError("generate() takes a prompt (a str, a list of token ids or a dict) or a list of prompts; "
                    f"got {_what(prompts)}")


def prompt_type_problem(prompt: Any) -> str:
    """Why `prompt`, of none of the types a prompt may have, is refused: in Python's words."""
    return f"the prompt is {_what(prompt)}; pass a str, a list of token ids or a dict"


def _what(value: Any) -> str:
    """`value`'s type with its article, and for an integer the list it may have meant: `an int (5; a prompt of
    one token id is [5])`."""
    if value is None:
        return "None"
    name = type(value).__name__
    what = f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
    i = as_id(value)
    return what if i is None else f"{what} ({i}; a prompt of one token id is [{i}])"
