"""Reading the user's text files: UTF-8 with an error that names the file, line and column; JSONL split on
newlines only; YAML without silently dropped keys. And the canonical JSON of a config, for its hashes."""
from __future__ import annotations

import json
import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml


def decode_utf8(data: bytes, where: str, error: type[Exception] = ValueError) -> str:
    """`data` as text; `error` names `where`, the line and the column of the first byte that is not UTF-8."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise error(f"{where} line {line}: not valid UTF-8 "
                    f"(byte 0x{data[e.start]:02x} at column {column})") from None
    return text.removeprefix("\ufeff")  # a byte-order mark some editors write is not part of the content


def lone_surrogate(text: str) -> str | None:
    """Where `text` is not valid Unicode, or None: a JSON escape such as "\\ud800" alone (half of a surrogate
    pair) gives a character that no tokenizer takes and no decoded text holds."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate \\u{ord(text[e.start]):04x} at character {e.start}"
    return None


def read_bytes(path: str | Path, error: type[Exception] = ValueError) -> bytes:
    """The file's bytes; `error` names the file and why it cannot be read (no permission, a folder, ...)."""
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise error(f"{path}: cannot read it: {e.strerror or e}") from None


def read_utf8(path: str | Path, error: type[Exception] = ValueError) -> str:
    return decode_utf8(read_bytes(path, error), str(path), error)


def read_json_object(path: Path, error: type[Exception] = ValueError) -> dict[str, Any]:
    """A JSON file that must hold one object (config.json, generation_config.json); `error` names the file."""
    try:
        raw = json.loads(read_utf8(path, error))
    except json.JSONDecodeError as e:
        raise error(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise error(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def canonical_json(v: Any) -> str:
    """`v` as JSON with sorted keys, also when a mapping (a prompt object) mixes key types."""
    def keyed(x):
        if isinstance(x, dict):
            return {(k if isinstance(k, str) else f"{type(k).__name__}:{k}"): keyed(y) for k, y in x.items()}
        return [keyed(y) for y in x] if isinstance(x, (list, tuple)) else x
    return json.dumps(keyed(v), sort_keys=True, default=str)


def unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """json.loads' object_pairs_hook for an object whose keys are all different (json.loads would keep the
    last of two); a key given twice raises KeyError naming it."""
    seen: set[str] = set()
    for k, _ in pairs:
        if k in seen:
            raise KeyError(k)
        seen.add(k)
    return dict(pairs)


def jsonl_lines(text: str) -> list[str]:
    """The lines of a JSONL text. Only "\\n" ends a line: `str.splitlines()` also splits on U+2028 and other
    characters that JSON strings may hold raw. A "\\r" before it (Windows line ends) is dropped."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key given twice in one mapping is an error (PyYAML keeps the last one, so a
    second `sampling:` section would silently replace the first), and `1e-3` is a number as in YAML 1.2
    (PyYAML's YAML 1.1 rules read it as a string)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: the loader merges it below
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # as PyYAML reports it, not a TypeError
                raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                        "found unhashable key", key_node.start_mark)
            if key in seen:
                lines = f"lines {seen[key]} and {key_node.start_mark.line + 1}"
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' is given twice ({lines})", key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float",
                                    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                    list("-+0123456789"))


def load_yaml(text: str) -> Any:
    """YAML text as Python values (raises yaml.YAMLError)."""
    return yaml.load(text, Loader=_StrictLoader)
