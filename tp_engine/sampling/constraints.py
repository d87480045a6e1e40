"""Output constraints (`sampling.json_schema`, `regex`, `choice`, `grammar`) through xgrammar.

An engine compiles each constraint once and keeps it by (kind, text) (`Grammars`); each constrained request
has a matcher on the rank that samples (`Matcher`), fed the request's output tokens in order, once each; the
step's masks of allowed tokens (grammar_masks.py) set the others to -inf before temperature, top-k and top-p.
xgrammar is imported only when a request has a constraint.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Sequence

import torch

from tp_engine.base.config_checks import CONSTRAINT_KEYS
from tp_engine.sampling.grammar_masks import StepMasks, default_threads

# xgrammar's messages start with a time and a source position: "[22:00:32] /project/cpp/x.cc:94: "
_WHERE = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class ConstraintError(ValueError):
    """A constraint that cannot be used: xgrammar missing, no tokenizer, or what its compiler refused."""


def has_constraint(params: Any) -> bool:
    return (params.json_schema is not None or params.regex is not None or params.choice is not None
            or params.grammar is not None)


def constraint_of(params: Any) -> tuple[str, str] | None:
    """(kind, text) of a request's constraint, the text as it is compiled and cached; None without one."""
    for kind in CONSTRAINT_KEYS:
        v = getattr(params, kind)
        if v is None:
            continue
        if kind == "json_schema":
            return kind, json.dumps({"type": "object"} if v is True else v, sort_keys=True)
        return kind, json.dumps(v) if kind == "choice" else v
    return None


def _choice_grammar(text: str) -> str:
    """EBNF of one of the strings (a JSON list) exactly."""
    return "root ::= " + " | ".join(json.dumps(s) for s in json.loads(text))


class Grammars:
    """One engine's compiled constraints by (kind, text), for every prompt and generate call it runs.
    `tokenizer()` gives (the checkpoint's tokenizer or None, why none); it is read on first use only.
    `stop_ids`: the model's EOS ids, the tokens a grammar may end with. `threads`: how many fill a step's
    masks (grammar_masks.default_threads: this process's share of the node's cores)."""

    def __init__(self, tokenizer: Callable[[], tuple[Any, str]], vocab_size: int,
                 stop_ids: Sequence[int], threads: int | None = None) -> None:
        self._tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, list(stop_ids)
        self._compiler = None
        self._compiled: dict[tuple[str, str], Any] = {}
        self.masks = StepMasks(vocab_size, default_threads(1) if threads is None else threads, take_all)

    def _compiler_for(self, kind: str):
        if self._compiler is None:
            try:
                import xgrammar
            except ImportError:
                raise ConstraintError(f"sampling.{kind} needs xgrammar, which is not installed: "
                                      "pip install xgrammar") from None
            tok, why = self._tokenizer()
            if tok is None:
                raise ConstraintError(f"sampling.{kind} needs the checkpoint's tokenizer: {why}")
            info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size,
                                                           stop_token_ids=self.stop_ids or None)
            self._compiler = xgrammar.GrammarCompiler(info)
        return self._compiler

    def compile(self, kind: str, text: str):
        """The compiled grammar of a constraint; ConstraintError naming the key and what the compiler said."""
        key = (kind, text)
        if key not in self._compiled:
            compiler = self._compiler_for(kind)
            try:
                if kind == "json_schema":
                    got = compiler.compile_json_schema(text, any_whitespace=False)
                elif kind == "regex":
                    got = compiler.compile_regex(text)
                else:
                    got = compiler.compile_grammar(_choice_grammar(text) if kind == "choice" else text)
            except RuntimeError as e:
                raise ConstraintError(f"sampling.{kind}: {_WHERE.sub('', str(e)).strip()}") from None
            self._compiled[key] = got
        return self._compiled[key]

    def matcher(self, params: Any, think_end: int | None = None, think_open: int | None = None) -> Matcher:
        """A fresh matcher of `params`' constraint; with `think_end`, it applies after that token only (and
        with `think_open` too, only if the first output token is that one)."""
        import xgrammar
        compiled = self.compile(*constraint_of(params))
        return Matcher(xgrammar.GrammarMatcher(compiled), think_end, think_open,
                       frozenset(compiled.tokenizer_info.stop_token_ids))

    @property
    def host_s(self) -> dict[str, float]:
        """Rank 0's host seconds over the steps that masked, by part (StepMasks.host_s)."""
        return self.masks.host_s

    @property
    def masked_steps(self) -> int:
        return self.masks.steps


class Matcher:
    """A request's place in its grammar. `fed` counts the output tokens taken so far; with `think_end`, the
    tokens up to that one are free text (a think block) and the grammar holds after it. With `think_open`
    too, the block is the output's to open: its first token may be `think_open` beside what the grammar
    allows; if it is, the block runs to `think_end`, else the grammar holds from the first token.

    Whether the grammar has ended is kept as a flag, refreshed as tokens are taken, so that reading it needs
    no call into xgrammar's matcher while the mask thread fills its mask. A grammar ends only by taking one
    of `stop` (its stop tokens; None: any token may end it), so only those refresh it."""

    def __init__(self, matcher, think_end: int | None = None, think_open: int | None = None,
                 stop: frozenset[int] | None = None) -> None:
        self.m, self.fed, self.stop = matcher, 0, stop
        self.think_open, self._end = think_open, think_end
        self.think_end = think_end if think_open is None else None  # inside a think block: free up to it
        self._terminated = matcher.is_terminated()

    def may_end(self, tok: int) -> bool:
        """Taking `tok` may end the grammar."""
        return self.stop is None or tok in self.stop

    @property
    def active(self) -> bool:
        """The next token is constrained: past the think block, and the grammar has not ended."""
        return self.think_end is None and not self._terminated

    @property
    def ended(self) -> bool:
        """The grammar took its stop token: the output is complete."""
        return self._terminated

    def behind(self, tokens: Sequence[int]) -> tuple[list[int], bool]:
        """Of the output `tokens`: the ones not taken yet, and whether the token after them is still to
        be taken (False when it was taken already, in flight)."""
        return list(tokens[self.fed:]), self.fed <= len(tokens)

    def take(self, tokens: Sequence[int]) -> None:
        """Take the next tokens of the output, in order."""
        for tok in tokens:
            self._take(tok)
        self.fed += len(tokens)

    def catch_up(self, tokens: Sequence[int], pending: int | None = None) -> None:
        """Take tokens[fed:], then `pending`, the token after them (still in flight), unless taken already."""
        rest, wants_next = self.behind(tokens)
        self.take(rest + [pending] if pending is not None and wants_next else rest)

    def _take(self, tok: int) -> None:
        if self.think_open is not None:  # the first output token: it opens a think block, or the grammar's
            opens, self.think_open = tok == self.think_open, None
            if opens:
                self.think_end = self._end
                return
        if self.think_end is not None:
            if tok == self.think_end:
                self.think_end = None
        elif not self._terminated:
            if not self.m.accept_token(tok):
                raise _refused(tok)
            self._took(tok)

    def _took(self, tok: int) -> None:
        """The grammar took `tok`: whether it has ended now (only a stop token can end it)."""
        if self.may_end(tok):
            self._terminated = self.m.is_terminated()

    @property
    def plain(self) -> bool:
        """Its next token goes to the grammar as it is (no think block to open or close; not ended)."""
        return self.think_open is None and self.think_end is None and not self._terminated

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)
        self.allow_opening(bitmask, row)

    def allow_opening(self, bitmask: torch.Tensor, row: int) -> None:
        """The first token may open a think block too, beside what the grammar allows."""
        if self.think_open is not None:
            word, bit = divmod(self.think_open, 32)
            bitmask[row, word] |= (1 << bit) if bit < 31 else -(1 << 31)  # int32 words

    def complete(self) -> bool:
        """The output so far is a whole match of the grammar (the stop token taken or not). Reads the
        matcher: not while the mask thread fills it (StepMasks.settle)."""
        return self.think_end is None and (self._terminated or self.m.is_completed())


def _refused(tok: int) -> RuntimeError:
    return RuntimeError(f"token {tok} is outside the output constraint it was sampled under")


def take_all(feeds: Sequence[tuple[Matcher, list[int]]]) -> None:
    """Each matcher takes its tokens; those that take one token straight into the grammar (the common
    case: a decode step's) do it in one xgrammar call."""
    one = []
    for m, toks in feeds:
        if len(toks) == 1 and m.plain:
            one.append((m, toks[0]))
        else:
            m.take(toks)
    if not one:
        return
    took = _accept_batch([m.m for m, _ in one], [t for _, t in one])
    if 0 in took:  # a sampled token outside its mask: an engine error, named by the first such token
        raise _refused(next(tok for (_, tok), ok in zip(one, took) if not ok))
    for m, tok in one:
        m.fed += 1
        m._took(tok)


def _accept_batch(matchers: list, tokens: list[int]) -> Sequence:
    """xgrammar's BatchGrammarMatcher.batch_accept_token without its public wrapper, which turns the result
    into a list one element at a time, each a call that lets the GIL go: on the mask thread, beside a main
    thread running Python, each return waits for the GIL again (grammar_masks.py), about 2 ms a step at
    256 rows. The result is read whole here (`0 in`). The binding is xgrammar's own module (pinned below 0.3
    in pyproject.toml)."""
    from xgrammar.matcher import _core
    return _core.BatchGrammarMatcher.batch_accept_token([m._handle for m in matchers], tokens, False)
