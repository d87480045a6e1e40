"""GPU: output constraints on the GPU path (flashinfer, the fused kernels, CUDA graphs). Greedy under a nested
JSON schema, a regex, a choice and an EBNF grammar keeps parity with transformers under xgrammar's own logits
processor, on the same weights and the same compiled grammar (equal tokens, or a near tie in the fp32
reference where they part), with every decode step a replay of a captured graph; constrained and
unconstrained prompts share batches; finished outputs match their constraint.

Needs a CUDA GPU (marker `gpu`) and xgrammar. The checkpoint is the tiny Qwen3 of gpu_helpers that knows its
sequences by heart (tiny_ckpt), with the demo model's tokenizer beside it; its EOS is token 1.
"""
from __future__ import annotations

import json
import re
import shutil

import pytest

from gpu_helpers import (BF16, DEV, HAS_CUDA, PARITY_PROMPTS, assert_parity, hf_greedy, llm,
                         needs_flashinfer)
from helpers import ROOT
from test_structured import CONSTRAINTS, SCHEMA, hf_constrained
from tp_engine.sampling.constraints import constraint_of
from tp_engine.sampling.sampler import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
EOS, NEW = 1, 64  # 64 new tokens hold the longest output of SCHEMA, the regex and the choice
FULL_MATCH = {"regex": CONSTRAINTS["regex"], "grammar": r"\((?:[a-c]|none)(?:,(?:[a-c]|none))*\)"}


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("structured") / "m"
    shutil.copytree(tiny_ckpt, path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "configs" / "models" / "demo" / f, path / f)
    return str(path)


@pytest.fixture(scope="module")
def engine(ckpt):
    """The engine on the GPU path: flashinfer's attention, the fused kernels, CUDA graphs."""
    needs_flashinfer()
    pytest.importorskip("xgrammar", reason="xgrammar is not installed")
    from tp_engine.attention.flashinfer_backend import FlashInferBackend
    m = llm(ckpt)
    e = m.engine
    assert isinstance(e.attn, FlashInferBackend) and e.ops is not None and e.graphs is not None
    yield m
    m.shutdown()


@pytest.fixture(scope="module")
def hf_bf16(ckpt):
    """transformers on the same checkpoint in bf16: the greedy tokens to match."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=BF16).to(DEV).eval()


def count_steps(engine, monkeypatch) -> dict:
    """From here on, counts the engine's decode steps (forwards of batches without prompt tokens) and its
    replays of captured graphs."""
    n = {"decode": 0, "replays": 0}
    forward = engine.forward

    class Counted:
        def __init__(self, graph) -> None:
            self.graph = graph

        def replay(self) -> None:
            n["replays"] += 1
            self.graph.replay()

    def step(batch):
        n["decode"] += not batch.is_prefill
        return forward(batch)

    monkeypatch.setattr(engine, "forward", step)
    monkeypatch.setattr(engine.graphs, "graphs", {k: Counted(g) for k, g in engine.graphs.graphs.items()})
    return n


def reference(model, m, prompt: list[int], kind: str | None) -> list[int]:
    """transformers' greedy tokens for `prompt`: up to NEW under xgrammar's processor with the engine's
    compiled grammar of `kind`'s constraint, or 24 without one."""
    if kind is None:
        return hf_greedy(model, [prompt], 24)[0]
    grammar = m.engine.grammars.compile(*constraint_of(SamplingParams(**{kind: CONSTRAINTS[kind]})))
    return hf_constrained(model, grammar, prompt, NEW, EOS)


def assert_matches(out: dict, kind: str) -> None:
    """A finished output is a whole match of its constraint, and all but the grammar's (a list of any length)
    finish within NEW tokens. JSON validates against SCHEMA through jsonschema where it is installed (not on
    the GPU machines: there it parses, with the schema's keys)."""
    if out["constraint"] == "incomplete" and kind == "grammar":
        assert out["finish_reason"] == "length"
        return
    assert (out["finish_reason"], out["constraint"], out["output_token_ids"][-1]) == ("stop", "complete", EOS)
    text = out["text"]
    if kind == "json_schema":
        data = json.loads(text)
        try:
            import jsonschema
        except ImportError:
            assert sorted(data) == sorted(SCHEMA["required"]), text
        else:
            jsonschema.validate(data, SCHEMA)
    elif kind == "choice":
        assert text in CONSTRAINTS["choice"]
    else:
        assert re.fullmatch(FULL_MATCH[kind], text), text


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_constrained_greedy_keeps_parity_in_cuda_graphs(engine, hf_bf16, hf_ref, monkeypatch, kind):
    """Greedy under each kind of constraint gives transformers' tokens under xgrammar's processor with the
    engine's compiled grammar, up to near ties; every decode step replays a graph; outputs match."""
    steps = count_steps(engine.engine, monkeypatch)
    outs = engine.generate([{"input_ids": p} for p in PARITY_PROMPTS],
                           SamplingParams(max_new_tokens=NEW, **{kind: CONSTRAINTS[kind]}))
    theirs = [reference(hf_bf16, engine, p, kind) for p in PARITY_PROMPTS]
    assert_parity(hf_ref, PARITY_PROMPTS, [o["output_token_ids"] for o in outs], theirs)
    assert steps["decode"] > 0 and steps["replays"] == steps["decode"], steps
    for out in outs:
        assert_matches(out, kind)


def test_constrained_and_unconstrained_prompts_share_graph_batches(engine, hf_bf16, hf_ref, monkeypatch):
    """Prompts with each kind of constraint (NEW tokens at most) between prompts without one (24 tokens, in
    what the model knows by heart), in one batch of graph-replayed decode steps: each gets, up to near ties,
    what transformers gets for it alone, under xgrammar's processor where it has a constraint; constrained
    outputs match it, and only they carry `constraint`."""
    kinds = [k for kind in CONSTRAINTS for k in (kind, None)]
    prompts = [{"input_ids": p, **({"sampling": {k: CONSTRAINTS[k], "max_new_tokens": NEW}} if k else {})}
               for p, k in zip(PARITY_PROMPTS, kinds)]
    steps = count_steps(engine.engine, monkeypatch)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    theirs = [reference(hf_bf16, engine, p, k) for p, k in zip(PARITY_PROMPTS, kinds)]
    assert_parity(hf_ref, PARITY_PROMPTS, [o["output_token_ids"] for o in outs], theirs)
    assert steps["decode"] > 0 and steps["replays"] == steps["decode"], steps
    for out, k in zip(outs, kinds):
        if k is None:
            assert "constraint" not in out and len(out["output_token_ids"]) == 24
        else:
            assert_matches(out, k)


def test_mask_kernel_equals_the_torch_masking():
    """The fused kernel puts a step's masks on the logits as the torch code does, bit for bit: rows with
    and without a mask, a mask of fewer words than the padded vocabulary needs, every bit of a word
    (bit 31 the int32's sign), fp32 and bf16 logits; the logits stay as they are."""
    import torch

    from tp_engine.kernels import grammar_mask
    from tp_engine.sampling.grammar_masks import mask_logits

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(5, 151936, generator=g).to(dtype)
        masks = torch.randint(-2**31, 2**31, (3, 4740), generator=g, dtype=torch.int64).to(torch.int32)
        slots = torch.tensor([2, -1, 0, 1, -1], dtype=torch.int32)
        want = mask_logits(logits, masks, slots)
        got = grammar_mask.mask_logits(logits.to(DEV), masks.to(DEV), slots.to(DEV))
        assert torch.equal(got.cpu(), want), dtype
        assert torch.isinf(want[0, 32 * 4740:]).all() and torch.equal(want[1], logits[1])


def test_the_stream_waits_for_the_host_flag():
    """kernels/grammar_mask.wait_for_host holds the work queued behind it until a host thread raises the
    pinned flag, and the host goes on meanwhile; a flag raised already lets it pass at once."""
    import threading
    import time

    import torch

    from tp_engine.kernels import grammar_mask

    flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    x = torch.zeros(1, device=DEV)
    x += 1  # every kernel of this test loaded before a stream waits
    torch.cuda.synchronize()
    for n, target in enumerate((1, 2, 17), start=2):
        grammar_mask.wait_for_host(flag, target)
        x += 1
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.05)
        assert not done.query(), target  # held
        threading.Thread(target=lambda t=target: flag.__setitem__(0, t)).start()
        done.synchronize()
        assert x.item() == n
    grammar_mask.wait_for_host(flag, 5)  # below the flag
    torch.cuda.synchronize()


def test_a_slow_mask_thread_holds_the_sampler_not_the_tokens(engine, hf_bf16, hf_ref, monkeypatch):
    """The host does not wait for a step's masks: the stream does. With the mask thread slowed down (its
    tokens taken 10 ms late, so the main thread meets matchers not yet fed, and each fill 20 ms late), the
    stream waits once a step of ROWS_PER_THREAD constrained rows or more (fewer are filled in place), and
    greedy under each kind of constraint still gives transformers' tokens under xgrammar's processor, up to
    near ties, each output ending where its grammar does."""
    import time

    from tp_engine.sampling.grammar_masks import ROWS_PER_THREAD, StepMasks

    kinds = list(CONSTRAINTS) * 2
    prompts = [{"input_ids": p, "sampling": {k: CONSTRAINTS[k], "max_new_tokens": NEW}}
               for p, k in zip(PARITY_PROMPTS, kinds)]
    ops, masks = engine.engine.ops, engine.engine.grammars.masks
    waits, sizes = [], []
    real_wait, real_fill, real_submit = ops.wait_for_host, StepMasks.fill, StepMasks.submit

    def submit(self, feeds, *args, **kwargs):
        sizes.append(len(feeds))
        return real_submit(self, feeds, *args, **kwargs)

    def wait_for_host(flag, target):
        waits.append(target)
        real_wait(flag, target)

    def slow_fill(self, buffer, rows):
        time.sleep(0.02)
        real_fill(self, buffer, rows)

    def slow_take(feeds, take=masks._take):
        time.sleep(0.01)
        take(feeds)
    monkeypatch.setattr(ops, "wait_for_host", wait_for_host)
    monkeypatch.setattr(StepMasks, "fill", slow_fill)
    monkeypatch.setattr(masks, "_take", slow_take)
    monkeypatch.setattr(StepMasks, "submit", submit)
    outs = engine.generate(prompts, SamplingParams())
    theirs = [reference(hf_bf16, engine, p, k) for p, k in zip(PARITY_PROMPTS, kinds)]
    assert_parity(hf_ref, PARITY_PROMPTS[:len(kinds)], [o["output_token_ids"] for o in outs], theirs)
    assert len(waits) == sum(n >= ROWS_PER_THREAD for n in sizes) > 0
    for out, k in zip(outs, kinds):
        assert_matches(out, k)
