"""The sampling settings of one request, by name (the `sampling` keys of the config and `seed`), checked by
the config's rules, for SamplingParams and for a prompt's own `sampling` alike. No torch: the command line
checks prompts before it loads torch."""
from __future__ import annotations

from tp_engine.base.api_args import as_id, as_ids
from tp_engine.base.config import SCHEMA, check_one_constraint, check_value
from tp_engine.base.config_checks import CONSTRAINT_KEYS, constraint_clash

# SamplingParams' fields, in its order
SAMPLING_FIELDS = (*(k.split(".", 1)[1] for k in SCHEMA if k.startswith("sampling.")), "seed")


def check_sampling(values: dict, prefix: str) -> dict:
    """`values` (sampling settings by name) checked by the config's rules, a message starting with `prefix`
    and the name; numpy's and torch's integers (stop_token_ids: a list of them, or a 1-d array or tensor)
    become Python ints, and one stop string a list of one. Returns the values so converted. A seed of None
    (the LLM's, the config's) is left as it is."""
    out = {}
    for name, value in values.items():
        if name == "seed" and value is None:
            out[name] = value
            continue
        key = SCHEMA["seed" if name == "seed" else f"sampling.{name}"]
        if name == "stop" and isinstance(value, str):
            value = [value]
        python = as_ids(value) if name == "stop_token_ids" else as_id(value) if int in key.type else None
        out[name] = value if python is None else python
        check_value(f"{prefix}{name}", key, out[name])
    check_one_constraint(out, prefix)
    return out


def over_constraint(own: dict) -> dict:
    """A prompt's own sampling settings `own` as they go over the run's: when they set an output constraint,
    the other constraint keys as None, since a prompt's own constraint replaces the run's."""
    if not constraint_clash(own):
        return own
    return {**{k: None for k in CONSTRAINT_KEYS}, **own}
