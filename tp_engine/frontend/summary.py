"""Rank 0's account of a command-line run: the counts of its summary line, and the line on prompts that
ended in error."""
from __future__ import annotations

import json

COUNTS = ("requests", "prompt_tokens", "output_tokens", "cached_prompt_tokens", "errors")


class Summary:
    """Counts of the output lines this run writes (a resume's kept lines are not among them)."""

    def __init__(self, samples: int) -> None:
        self.samples = samples  # sampling.n
        self.counts = dict.fromkeys(COUNTS, 0)
        self.indices: set[int] = set()  # of the prompts with a result, when there are several samples

    def add(self, out: dict) -> None:
        error = out["finish_reason"] == "error"
        c = self.counts
        c["requests"] += 1
        c["prompt_tokens"] += 0 if error else len(out["prompt_token_ids"])  # an error prompt's never ran
        c["output_tokens"] += len(out["output_token_ids"])
        c["cached_prompt_tokens"] += out["cached_prompt_tokens"]
        c["errors"] += error
        if self.samples > 1:
            self.indices.add(out["index"])

    @property
    def errors(self) -> int:
        return self.counts["errors"]

    def line(self, seconds: float, preempted: int, resumed_skipped: int,
             speculation: dict | None = None) -> str:
        """`summary: {...}`; `preempted`, `prompts` and `resumed_skipped` only where they say something;
        `speculation`'s counts (acceptance_rate, accept_length, spec_share) where it is on."""
        summary = {**self.counts, "seconds": round(seconds, 3),
                   "tokens_per_s": round(self.counts["output_tokens"] / max(seconds, 1e-9), 1)}
        if preempted:
            summary["preempted"] = preempted
        if self.samples > 1:
            summary["prompts"] = len(self.indices)
        if resumed_skipped:
            summary["resumed_skipped"] = resumed_skipped
        summary.update(speculation or {})
        return "summary: " + json.dumps(summary)

    def errors_line(self, output: str | None, shown_on_terminal: bool) -> str:
        """How many prompts ended in error, and where their reasons are: `output`, stdout, or shown above
        (`shown_on_terminal`: printed as readable text)."""
        lines = f"their lines in {output}" if output else "their lines on stdout"
        where = "shown above" if shown_on_terminal else f"in the \"error\" field of {lines}"
        return f"{self.errors} of {self.counts['requests']} prompts ended with finish_reason \"error\" " \
            f"(the reasons are {where})"
