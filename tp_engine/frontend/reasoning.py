"""Thinking output of chat templates that emit `<think>...</think>` (Qwen3): the reasoning apart from the
answer.

On when `chat: true` and the tokenizer's chat template writes `<think>`, with `<think>` and `</think>`
single, non-special tokens (so decoding keeps them in the text, as Qwen3's tokenizer does); off otherwise.
"""
from __future__ import annotations

from typing import Callable, Sequence

from tp_engine.frontend.prompts import PromptError, skipped_ids

THINK_START, THINK_END = "<think>", "</think>"


def think_tags(tokenizer) -> tuple[int, int] | None:
    """The ids of `<think>` and `</think>` when the tokenizer's chat template thinks; else None."""
    template = getattr(tokenizer, "chat_template", None)
    if tokenizer is None or not isinstance(template, str) or THINK_START not in template:
        return None
    vocab = tokenizer.get_vocab()
    skipped = skipped_ids(tokenizer)  # tags that decoding drops leave no block to split at
    if any(t not in vocab or vocab[t] in skipped for t in (THINK_START, THINK_END)):
        return None
    return vocab[THINK_START], vocab[THINK_END]


def opens_thinking(prompt_ids: list[int], tags: tuple[int, int],
                   decode: Callable[[list[int]], str | None]) -> bool:
    """Whether the generation prompt opens a think block (templates that end it with `<think>`): the
    prompt's last think tag is `<think>` with only blank text after it. A `<think>` the user wrote
    mid-prompt does not count, as the rest of the conversation follows it."""
    last = next((i for i in range(len(prompt_ids) - 1, -1, -1) if prompt_ids[i] in tags), None)
    return (last is not None and prompt_ids[last] == tags[0]
            and not (decode(prompt_ids[last + 1:]) or "").strip())


def closes_thinking(prompt_ids: list[int], tags: tuple[int, int],
                    decode: Callable[[list[int]], str | None]) -> bool:
    """Whether the generation prompt ends a think block already (thinking turned off: the template writes an
    empty `<think></think>`): the prompt's last think tag is `</think>` with only blank text after it."""
    last = next((i for i in range(len(prompt_ids) - 1, -1, -1) if prompt_ids[i] in tags), None)
    return (last is not None and prompt_ids[last] == tags[1]
            and not (decode(prompt_ids[last + 1:]) or "").strip())


class ThinkEnds:
    """Per prompt of one call, for an output constraint to hold after the think block: (None, `</think>`'s
    id) when the prompt is a chat one that opens a think block; (`<think>`'s, `</think>`'s) when the output
    may open one (Qwen3's template with thinking on leaves `<think>` to the model); (None, None) when the
    prompt is no chat one or ends a think block already. Found once per prompt. `tags()`: the think tags'
    ids or None; `chat(i)`: prompt i went through the chat template."""

    def __init__(self, tags: Callable[[], tuple[int, int] | None], decode: Callable[[list[int]], str | None],
                 chat: Callable[[int], bool]) -> None:
        self.tags, self.decode, self.chat, self.ends = tags, decode, chat, {}

    def __call__(self, i: int, ids: Sequence[int]) -> tuple[int | None, int | None]:
        if i not in self.ends:
            tags = self.tags() if self.chat(i) else None
            if not tags or closes_thinking(list(ids), tags, self.decode):
                self.ends[i] = (None, None)
            elif opens_thinking(list(ids), tags, self.decode):
                self.ends[i] = (None, tags[1])
            else:
                self.ends[i] = tags
        return self.ends[i]

    def find_all(self, encoded: list[Sequence[int] | PromptError]) -> None:
        """Every prompt's at once, on this thread (a thread that must not use the tokenizer reads them)."""
        for i, ids in enumerate(encoded):
            self(i, [] if isinstance(ids, PromptError) else ids)


def split_reasoning(text: str, open_think: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of an output's text: the reasoning is what lies inside `<think>...</think>`,
    stripped; the answer what follows `</think>`, without its leading blank lines (or the spaces before it on
    the tag's line), its first line's indentation kept. A think block that never ends (the length limit came
    first) is all reasoning; an output that does not think (neither the prompt nor the output opens a block)
    is all answer, a `</think>` in it included. `<think>` written inside the reasoning stays."""
    if not (open_think or text.lstrip().startswith(THINK_START)):
        return "", text
    head, closed, tail = text.partition(THINK_END)
    head = head.strip()
    if head.startswith(THINK_START):  # the tag that opens the block, not one written inside it
        head = head[len(THINK_START):]
    lead = len(tail) - len(tail.lstrip())
    cut = tail.rfind("\n", 0, lead) + 1 or lead  # after the last line break among the leading blanks
    return head.strip(), tail[cut:] if closed and tail.strip() else ""  # blanks alone: no answer
