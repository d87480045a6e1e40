"""Short steps as one-token rows (runtime/cuda_graph.token_rows): how the CUDA graphs run a verifying step
(each request's newest token and its drafts) and a proposer's catch-up. On CPU a stand-in for the graph runner
takes the runner's own choice of rows and runs them eagerly: greedy output with each proposer is still
transformers' own, so each row attends to the tokens before it and no further, and the step's logits are
picked back in the order of its rows."""
from __future__ import annotations

import pytest

from test_speculative import PROMPTS, NEW, models, hf, spec_of  # noqa: F401 (fixtures)
from tp_engine import LLM, SamplingParams
from tp_engine.base.batch import forward_context
from tp_engine.runtime.cuda_graph import GraphRunner
from tp_engine.runtime.step_tokens import resolve


class EagerRows:
    """The graph runner's `rows`, run eagerly through `step` (a model's forward over a planned batch)."""

    def __init__(self, attn, step, max_bs: int = 64) -> None:
        self.attn, self.step, self.max_bs = attn, step, max_bs
        self.split = 0  # steps that ran as one-token rows of longer requests

    def rows(self, batch):
        out = GraphRunner.rows(self, batch)
        self.split += out is not None and out is not batch
        return out

    def run(self, batch):
        self.attn.prepare(batch)
        return self.step(batch)


def target_rows(engine) -> EagerRows:
    def step(batch):
        resolve(batch.input_ids, engine.last_tokens)
        with forward_context(batch, engine.kv, engine.attn, engine.capture) as ctx:
            logits = engine.model(batch.input_ids, fp32=False)
            if ctx.aux:
                engine.spec.store(batch, ctx.aux)
        return logits
    return EagerRows(engine.attn, step)


def drafting_rows(drafting) -> EagerRows:
    def step(batch):
        refs = -1 - batch.input_ids
        resolve(batch.input_ids, drafting.last)
        return drafting.proposer.step(batch, refs)
    return EagerRows(drafting.proposer.attn, step)


def run(paths: dict, method: str, split: bool) -> tuple[list, list, tuple]:
    """Greedy outputs, every step's drafts, and the split counts (target, proposer) of a run with `method`,
    its short steps as one-token rows (`split`) or as the engine runs them on CPU."""
    llm = LLM(model=str(paths["target"]), device="cpu", speculative=spec_of(paths, method))
    drafts: list = []
    try:
        engine = llm.engine
        drafting = engine.spec.drafting
        if split:
            engine.graphs = target_rows(engine)
            if drafting is not None:
                drafting.graphs = drafting_rows(drafting)
        if drafting is not None:
            propose = drafting.propose
            drafting.propose = lambda *a: drafts.append(list((out := propose(*a))[0].values())) or out
        outs = llm.generate([{"input_ids": p} for p in PROMPTS], SamplingParams(max_new_tokens=NEW))
    finally:
        llm.shutdown()
    counts = (getattr(engine.graphs, "split", 0), getattr(drafting and drafting.graphs, "split", 0))
    return [o["output_token_ids"] for o in outs], drafts, counts


@pytest.mark.parametrize("method", ["ngram", "draft", "draft_self", "eagle3"])
def test_steps_as_one_token_rows_keep_output_and_drafts(models, hf, method):  # noqa: F811
    """With every verifying step and every short drafting forward run as one-token rows, greedy output equals
    transformers' and each step's drafts are those of the usual steps (a proposer reads its own output at
    each request's last token)."""
    outs, drafts, (target, proposer) = run(models, method, split=True)
    assert outs == hf
    assert target > 0  # verifying steps ran as one-token rows
    if method != "ngram":
        assert proposer > 0
        assert drafts == run(models, method, split=False)[1]
