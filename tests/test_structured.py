"""Output constraints (sampling.json_schema, regex, choice, grammar) against transformers with xgrammar's own
logits processor on the same weights and the same compiled grammar, on a tiny random checkpoint with the demo
model's byte-level BPE tokenizer."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, make_checkpoint, run_cli
from tp_engine import LLM, SamplingParams
from tp_engine.sampling.constraints import constraint_of

SCHEMA = {"type": "object",
          "properties": {"name": {"enum": ["ann", "bob"]},
                         "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 2},
                         "pos": {"type": "object", "properties": {"x": {"type": "boolean"}},
                                 "required": ["x"]}},
          "required": ["name", "tags", "pos"], "additionalProperties": False}
CONSTRAINTS = {"json_schema": SCHEMA, "regex": r"[0-9]{1,3}-(ab|cd)", "choice": ["yes", "no way", "maybe"],
               "grammar": 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "none"'}
PROMPTS = ["The capital of France is", "Hello there, my friend"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("structured") / "m", vocab=2048, eos=0)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "configs" / "models" / "demo" / f, path / f)
    return path


@pytest.fixture(scope="module")
def llm(ckpt):
    llm = LLM(model=str(ckpt), device="cpu")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def hf(ckpt):
    """transformers on the same checkpoint, in fp32."""
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def hf_constrained(model, grammar, ids: list[int], new_tokens: int, eos: int) -> list[int]:
    """transformers' greedy continuation of `ids` on `model` (on its device) under xgrammar's logits processor
    for `grammar`, one the engine compiled; `eos` ends it."""
    from xgrammar.contrib.hf import LogitsProcessor

    x = torch.tensor([ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=0, logits_processor=[LogitsProcessor(grammar)])
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_greedy_equals_transformers_with_xgrammar(llm, hf, kind):
    """Each kind of constraint gives, greedily, transformers' tokens under xgrammar's processor, token for
    token; an output that ends on EOS is a complete match, one cut by max_new_tokens an incomplete one."""
    params = SamplingParams(max_new_tokens=48, **{kind: CONSTRAINTS[kind]})
    outs = llm.generate(PROMPTS, params)
    grammar = llm.engine.grammars.compile(*constraint_of(params))
    for out in outs:
        assert out["output_token_ids"] == hf_constrained(hf, grammar, out["prompt_token_ids"], 48, eos=0)
        ended = out["output_token_ids"][-1] == 0
        assert (out["finish_reason"], out["constraint"]) == (("stop", "complete") if ended
                                                             else ("length", "incomplete"))
    assert any(o["constraint"] == "complete" for o in outs)


def check_output(out: dict, kind: str) -> None:
    if out["constraint"] == "incomplete":
        assert out["finish_reason"] == "length"
        return
    text = out["text"]
    if kind == "json_schema":
        import jsonschema  # here: the GPU machines, which collect this file, lack it

        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "choice":
        assert text in CONSTRAINTS["choice"]
    elif kind == "regex":
        import re
        assert re.fullmatch(CONSTRAINTS["regex"], text)


@pytest.mark.parametrize("kind", ["json_schema", "regex", "choice"])
def test_sampled_outputs_match_their_constraint(llm, kind):
    """Sampled outputs (temperature, top-k, top-p, several seeds) are whole matches of their constraint:
    JSON that validates against the schema, a string of the choice, a full match of the regex."""
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=s, n=3,
                                                 max_new_tokens=64, **{kind: CONSTRAINTS[kind]})
                                  for s in (1, 2)])
    for out in outs:
        check_output(out, kind)
    assert sum(o["constraint"] == "complete" for o in outs) >= 3


def test_cut_short_is_incomplete(llm):
    """A constrained output that reaches max_new_tokens before its grammar can end says it is incomplete."""
    out, = llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, json_schema=SCHEMA))
    assert (out["finish_reason"], out["constraint"]) == ("length", "incomplete")
    assert '{"name": '.startswith(out["text"])  # the schema's start, cut short


def test_per_prompt_constraints_beside_unconstrained(llm):
    """Prompts with their own constraint share batches with unconstrained ones: each gets what it gets
    alone; unconstrained lines carry no `constraint`."""
    base = SamplingParams(max_new_tokens=24)
    alone = llm.generate(PROMPTS, base)
    own = [{"prompt": PROMPTS[0], "sampling": {"regex": CONSTRAINTS["regex"]}}, PROMPTS[0],
           {"prompt": PROMPTS[1], "sampling": {"choice": CONSTRAINTS["choice"]}}, PROMPTS[1]]
    mixed = llm.generate(own, base)
    unconstrained = [mixed[1]["output_token_ids"], mixed[3]["output_token_ids"]]
    assert unconstrained == [a["output_token_ids"] for a in alone]
    assert "constraint" not in mixed[1] and "constraint" not in mixed[3]
    reg = llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=24, regex=CONSTRAINTS["regex"]))[0]
    ch = llm.generate(PROMPTS[1:], SamplingParams(max_new_tokens=24, choice=CONSTRAINTS["choice"]))[0]
    assert mixed[0]["output_token_ids"] == reg["output_token_ids"]
    assert mixed[2]["output_token_ids"] == ch["output_token_ids"]


def test_grammar_end_stops_with_ignore_eos(llm):
    """With ignore_eos, a request still ends ("stop") once its grammar has taken its stop token."""
    out, = llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=32, ignore_eos=True,
                                                    choice=CONSTRAINTS["choice"]))
    assert (out["finish_reason"], out["constraint"]) == ("stop", "complete")
    assert out["text"] in CONSTRAINTS["choice"]


def test_compiled_grammars_are_cached(llm):
    """A constraint compiles once per LLM, whichever prompt or generate call uses it."""
    params = SamplingParams(regex="[ab]+")
    first = llm.engine.grammars.compile(*constraint_of(params))
    llm.generate(PROMPTS, SamplingParams(max_new_tokens=4, regex="[ab]+"))
    assert llm.engine.grammars.compile(*constraint_of(params)) is first


def test_preempted_requests_keep_their_constraint(ckpt, llm):
    """Requests preempted and recomputed (a pool of few pages) give the same constrained tokens: their
    matchers follow their output ids, no token fed twice."""
    params = SamplingParams(max_new_tokens=60, json_schema=SCHEMA)
    want = llm.generate(PROMPTS * 2, params)
    small = LLM(model=str(ckpt), device="cpu", kv_cache={"num_pages": 10, "page_size": 8})
    try:
        got = small.generate(PROMPTS * 2, params)
        assert small.engine.num_preempted > 0
    finally:
        small.shutdown()
    assert [o["output_token_ids"] for o in got] == [o["output_token_ids"] for o in want]


@pytest.mark.slow
def test_tp2_run_default_and_own_constraints(ckpt, llm, tmp_path):
    """At TP 2 through the command line, the run's constraint and a prompt's own give TP 1's tokens and
    `constraint` fields."""
    prompts = [PROMPTS[0], {"prompt": PROMPTS[1], "sampling": {"choice": CONSTRAINTS["choice"]}}]
    cfg = {"model": str(ckpt), "prompts": prompts,
           "sampling": {"max_new_tokens": 40, "json_schema": SCHEMA}}
    proc, lines = run_cli(cfg, tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = [llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=40, json_schema=SCHEMA))[0],
            llm.generate(PROMPTS[1:], SamplingParams(max_new_tokens=40, choice=CONSTRAINTS["choice"]))[0]]
    assert [(o["output_token_ids"], o["constraint"]) for o in lines] == \
        [(o["output_token_ids"], o["constraint"]) for o in want]


def test_one_constraint_at_most(ckpt):
    """Two constraints in one mapping are a config error naming both, in the config, a prompt's own sampling
    and SamplingParams; `json_schema: false` is refused."""
    from tp_engine.base.config import ConfigError, build_config
    from tp_engine.frontend.prompt_sampling import own_sampling
    from tp_engine.frontend.prompts import PromptError

    with pytest.raises(ConfigError, match="'sampling.regex' and 'sampling.choice' are both set"):
        build_config(None, ["sampling.regex=a+", "sampling.choice=[a]"], model=str(ckpt))
    with pytest.raises(ConfigError, match="SamplingParams.json_schema and SamplingParams.grammar are both"):
        SamplingParams(json_schema=True, grammar="root ::= \"a\"")
    with pytest.raises(PromptError, match="sampling.regex and the prompt's sampling.choice are both set"):
        own_sampling({"prompt": "x", "sampling": {"regex": "a", "choice": ["a"]}})
    with pytest.raises(ConfigError, match="json_schema must be a JSON schema"):
        SamplingParams(json_schema=False)


def test_missing_xgrammar_names_the_key(llm, monkeypatch):
    """Without xgrammar installed, a constraint fails with one message naming its key and the install."""
    import sys

    from tp_engine.sampling.constraints import ConstraintError, Grammars

    monkeypatch.setitem(sys.modules, "xgrammar", None)
    grammars = Grammars(lambda: (llm.tokenizer, ""), 2048, [0])
    with pytest.raises(ConstraintError, match=r"sampling.regex needs xgrammar.*pip install xgrammar"):
        grammars.compile("regex", "a+")


def test_bad_constraint_of_a_prompt_is_its_error_line(llm):
    """A constraint that does not compile, in a prompt's own sampling, is that prompt's error line with the
    compiler's message; the other prompts run."""
    outs = llm.generate([{"prompt": PROMPTS[0], "sampling": {"regex": "[0-9"}},
                         {"prompt": PROMPTS[0], "sampling": {"json_schema": {"type": "foo"}}},
                         {"prompt": PROMPTS[0], "sampling": {"grammar": "root ::= x"}}, PROMPTS[1]],
                        SamplingParams(max_new_tokens=4))
    assert [o["finish_reason"] for o in outs] == ["error"] * 3 + ["length"]
    assert outs[0]["error"] == "sampling.regex: Regex parsing error at position 5: Unclosed '['"
    assert outs[1]["error"].startswith("sampling.json_schema: Unsupported type")
    assert outs[2]["error"].startswith("sampling.grammar: EBNF parser error") and "x" in outs[2]["error"]


def test_bad_run_constraint_is_a_config_error(ckpt, tmp_path):
    """A run's constraint that does not compile stops the command line at start-up (status 2), naming the
    key and what the compiler said."""
    cfg = {"model": str(ckpt), "prompts": ["a"], "sampling": {"regex": "(ab"}}
    proc, lines = run_cli(cfg, tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config key sampling.regex: Regex parsing error" in proc.stderr and lines == []


def test_constraint_is_part_of_a_lines_run(ckpt, tmp_path):
    """The constraint is part of each line's settings: a resume with another constraint is refused."""
    cfg = {"model": str(ckpt), "prompts": [{"prompt": "a", "sampling": {"regex": "[ab]+"}}, "b"],
           "sampling": {"max_new_tokens": 4}}
    proc, lines = run_cli(cfg, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert lines[0]["run"] != lines[1]["run"] and lines[0]["constraint"] in ("complete", "incomplete")
    cfg["prompts"][0]["sampling"]["regex"] = "[ac]+"
    proc, _ = run_cli({**cfg, "resume": True}, tmp_path)
    assert proc.returncode == 2 and "prompt 0's own sampling differs" in proc.stderr, proc.stderr[-2000:]


def test_openai_batch_response_format_and_guided_fields(tmp_path):
    """OpenAI batch bodies: response_format json_object / json_schema and vLLM's guided_* fields become the
    prompt's own constraint, not warned about as ignored; a bad response_format is the line's error."""
    from tp_engine.frontend.openai_batch import BatchFile

    batch = BatchFile(tmp_path / "b.jsonl")
    bodies = [{"response_format": {"type": "json_object"}},
              {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
              {"guided_json": json.dumps(SCHEMA)}, {"guided_regex": "[0-9]+"}, {"guided_choice": ["a", "b"]},
              {"guided_grammar": 'root ::= "a"'}, {"response_format": {"type": "text"}},
              {"response_format": {"type": "xml"}}]
    for n, body in enumerate(bodies):
        batch.add(n + 1, {"custom_id": str(n), "method": "POST", "url": "/v1/completions",
                          "body": {"prompt": "hi", **body}})
    owns = [p.get("sampling") for p in batch[:7]]
    assert owns == [{"json_schema": True}, {"json_schema": SCHEMA}, {"json_schema": SCHEMA},
                    {"regex": "[0-9]+"}, {"choice": ["a", "b"]}, {"grammar": 'root ::= "a"'}, None]
    assert "response_format.type must be" in batch.requests[7]["error"]
    assert batch.warning() is None


def test_a_first_token_that_may_open_a_think_block_is_allowed_beside_the_grammars():
    """The output's first token may be <think> beside what the grammar allows, whichever bit of its 32-bit
    word it is (bit 31 is the int32's sign); once another token comes first, the grammar holds alone."""
    from tp_engine.sampling.constraints import Matcher

    class Grammar:  # allows nothing; takes every token
        def fill_next_token_bitmask(self, bitmask, row):
            bitmask[row] = 0

        def accept_token(self, tok):
            return True

        def is_terminated(self):
            return False

        def is_completed(self):
            return False
    for think_open in (63, 40):
        m = Matcher(Grammar(), think_end=7, think_open=think_open)
        bitmask = torch.zeros(2, 4, dtype=torch.int32)
        m.fill(bitmask, 1)
        allowed = [t for t in range(128) if (int(bitmask[1, t // 32]) >> (t % 32)) & 1]
        assert allowed == [think_open] and not bitmask[0].any()
        m.catch_up([5])  # not <think>: the grammar from here on
        m.fill(bitmask, 1)
        assert not bitmask[1].any() and m.active and m.think_end is None


def test_masks_filled_on_threads_equal_row_by_row(llm):
    """One xgrammar call fills a step's masks on several threads (ROWS_PER_THREAD rows a thread at least):
    the same bits as one matcher at a time, for each of the four kinds at several places in its grammar, a
    first token that may open a think block included, into rows that a step before left dirty."""
    from tp_engine.sampling.grammar_masks import ROWS_PER_THREAD, StepMasks

    grammars = llm.engine.grammars

    def matchers() -> list:
        out = []
        for kind, value in CONSTRAINTS.items():
            for steps in range(3):  # at the grammar's start, and after one and two tokens it allows
                opening = kind == "choice" and steps == 0
                m = grammars.matcher(SamplingParams(**{kind: value}), *((7, 63) if opening else ()))
                taken: list[int] = []
                for _ in range(steps):
                    allowed = torch.zeros(1, 64, dtype=torch.int32)
                    m.fill(allowed, 0)
                    taken.append(next(t for t in range(2048) if (int(allowed[0, t // 32]) >> (t % 32)) & 1))
                    m.catch_up(taken)
                out.append(m)
        return out
    rows = matchers()
    assert len(rows) >= 3 * ROWS_PER_THREAD  # three threads
    one = torch.zeros(len(rows), 64, dtype=torch.int32)
    for i, m in enumerate(rows):
        m.fill(one, i)
    masks = StepMasks(2048, threads=3)
    # what a step before left: every row is written whole
    many = torch.full((len(rows), masks.words), 0x5A5A5A5A, dtype=torch.int32)
    masks.fill(many, list(enumerate(rows)))
    assert torch.equal(one, many)
    assert len({tuple(r.tolist()) for r in one}) > len(CONSTRAINTS)  # rows differ: a wrong row would show


def test_mask_logits_keeps_each_rows_allowed_tokens():
    """Row b keeps the tokens of mask slots[b] (bit j of word w: token 32 w + j, bit 31 the int32's sign)
    and is -inf elsewhere, vocabulary padding past the mask's words included; a row without a slot and
    the logits themselves stay as they are."""
    from tp_engine.sampling.grammar_masks import mask_logits

    logits = torch.randn(3, 100)
    masks = torch.zeros(2, 3, dtype=torch.int32)  # 96 tokens: 96..99 are padding
    masks[0, 0] = 1 << 5
    masks[0, 2] = -(1 << 31)  # token 95
    masks[1, 1] = 1 << 0  # token 32
    got = mask_logits(logits, masks, torch.tensor([1, -1, 0], dtype=torch.int32))
    kept = [torch.isfinite(row).nonzero().flatten().tolist() for row in got]
    assert kept == [[32], list(range(100)), [5, 95]]
    assert torch.equal(got[1], logits[1]) and torch.equal(got[2, [5, 95]], logits[2, [5, 95]])
    assert torch.isfinite(logits).all()


@pytest.mark.slow
def test_bench_structured_workload_reports_each_target(tmp_path):
    """launch/bench.py --workload structured on the demo model's shapes (random weights): latency and
    throughput runs with and without JSON schemas, the constrained ones as long as asked (random weights
    rarely close a string) and each output under its constraint, with the host's milliseconds a masked step
    by part and the kernels compiled inside each run; the 20-field schema's compile times; a PASS or FAIL
    line per target on stderr."""
    out, new = tmp_path / "bench.json", 24
    demo = ROOT / "configs" / "models" / "demo"
    cmd = [sys.executable, str(ROOT / "launch" / "bench.py"), "--model", str(demo), "--engine", "ours",
           "--workload", "structured", "--set", "device=cpu", "--num-requests", "16",
           "--new-tokens", str(new), "--prompt-len", "16", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())["structured"]
    for name, n in (("latency", 1), ("throughput", 16)):
        constrained, plain = res[name]["constrained"], res[name]["unconstrained"]
        assert constrained["requests"] == plain["requests"] == n
        assert constrained["complete"] + constrained["incomplete"] == n
        assert plain["complete"] + plain["incomplete"] == 0
        assert constrained["output_tokens"] >= 0.9 * new * n, res[name]
        # the host's share of a masked step, by part: every step of the run after the first masks
        assert new - 1 <= constrained["masked_steps"] <= constrained["output_tokens"], constrained
        assert constrained["mask_host_ms_per_step"].keys() == {"wait", "take", "fill", "apply"}
        assert all(v >= 0 for v in constrained["mask_host_ms_per_step"].values())
        assert constrained["mask_host_ms_per_step"]["fill"] > 0 and "masked_steps" not in plain
        for run in (constrained, plain):  # no Triton kernel runs on the CPU
            assert run["kernel_compiles"] == {"count": 0, "seconds": 0.0, "kernels": {}}
    assert res["compile"]["fields"] == 20 and res["compile"]["first_ms"] > res["compile"]["cached_ms"] > 0
    assert res["targets"].keys() == {"latency", "throughput", "compile_cached_ms"}
    for name, target in res["targets"].items():
        assert f"structured {name}: {'PASS' if target['pass'] else 'FAIL'} " in proc.stderr


def test_bench_masks_times_each_row_each_thread_count_and_the_take(tmp_path):
    """launch/bench_masks.py on the demo model's tokenizer: each row's fill on its own (quantiles in order),
    xgrammar's batch fill on each thread count asked for, and the take of a token a row."""
    out = tmp_path / "masks.json"
    demo = ROOT / "configs" / "models" / "demo"
    cmd = [sys.executable, str(ROOT / "launch" / "bench_masks.py"), "--model", str(demo), "--rows", "24",
           "--threads", "1,2", "--repeat", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["rows"] == 24 and res["walk_tokens_median"] > 0
    fill = res["row_fill_us"]
    assert 0 < fill["p10"] <= fill["p50"] <= fill["p90"] <= fill["max"]
    assert res["batch_fill_ms_by_threads"].keys() == {"1", "2"}
    assert all(v > 0 for v in res["batch_fill_ms_by_threads"].values()) and res["take_ms"] > 0


def test_a_mask_thread_error_reaches_the_run_once_and_the_flag_rises(llm):
    """A matcher that refuses a token fails its step on the mask thread: the error reaches the main thread
    (once: the next step starts clean), and the flag a waiting stream watches rises all the same."""
    from tp_engine.sampling.constraints import take_all
    from tp_engine.sampling.grammar_masks import ROWS_PER_THREAD, StepMasks

    grammars = llm.engine.grammars
    params = SamplingParams(choice=CONSTRAINTS["choice"])
    allowed = torch.zeros(1, 64, dtype=torch.int32)
    grammars.matcher(params).fill(allowed, 0)
    refused = next(t for t in range(2048) if not (int(allowed[0, t // 32]) >> (t % 32)) & 1)
    masks = StepMasks(2048, threads=1, take=take_all)
    cpu = torch.device("cpu")
    rows = ROWS_PER_THREAD  # enough for the mask thread (fewer are filled in place)
    with pytest.raises(RuntimeError, match=f"token {refused} is outside the output constraint"):
        masks.submit([(grammars.matcher(params), [], 1) for _ in range(rows)], list(range(rows)),
                     lambda: [7, refused], cpu)
    assert int(masks._flag[0]) == masks._seq == 1
    got, slots = masks.submit([(grammars.matcher(params), [], None) for _ in range(rows)],
                              [-1, *range(rows)], None, cpu)
    assert slots.tolist() == [-1, *range(rows)] and int(masks._flag[0]) == 2
    assert all(torch.equal(row, allowed[0]) for row in got)


def test_a_decode_step_takes_its_tokens_in_one_call_read_whole(llm, monkeypatch):
    """A decode step's matchers take their tokens in one xgrammar call whose result is read whole, not one
    element at a time (each element read lets the GIL go, and under a busy main thread waits to get it
    back). A refused token is named."""
    import xgrammar

    from tp_engine.sampling.constraints import take_all

    grammars = llm.engine.grammars
    params = SamplingParams(choice=CONSTRAINTS["choice"])
    allowed = torch.zeros(1, 64, dtype=torch.int32)
    grammars.matcher(params).fill(allowed, 0)
    ok = next(t for t in range(2048) if (int(allowed[0, t // 32]) >> (t % 32)) & 1)
    refused = next(t for t in range(2048) if not (int(allowed[0, t // 32]) >> (t % 32)) & 1)
    core, reads = xgrammar.matcher._core.BatchGrammarMatcher, []

    class Result(list):  # counts the per-element reads of the binding's result
        def __getitem__(self, i):
            reads.append(i)
            return super().__getitem__(i)

    class Counting:
        @staticmethod
        def batch_accept_token(handles, tokens, debug):
            return Result(core.batch_accept_token(handles, tokens, debug))

    matchers = [grammars.matcher(params) for _ in range(8)]
    monkeypatch.setattr(xgrammar.matcher._core, "BatchGrammarMatcher", Counting)
    take_all([(m, [ok]) for m in matchers])
    assert [m.fed for m in matchers] == [1] * 8 and reads == []
    with pytest.raises(RuntimeError, match=f"token {refused} is outside the output constraint"):
        take_all([(grammars.matcher(params), [t]) for t in (ok, refused, ok)])


def test_the_main_thread_waits_for_the_mask_thread_only_after_a_stop_token(llm):
    """While the mask thread has yet to feed a step's tokens to its matchers, taking in that step reads no
    matcher whose newest token cannot end its grammar (no wait), and waits for the mask thread where it can
    (a stop token), then ends the request whose grammar took it."""
    import threading
    import types

    from tp_engine.runtime.constrained import follow_tokens
    from tp_engine.runtime.request import RequestOutput, RequestState

    grammars = llm.engine.grammars
    masks = grammars.masks
    sched = types.SimpleNamespace(retire=lambda rs: list(rs))
    eos = min(grammars.matcher(SamplingParams(choice=["a"])).stop)

    def request(params: SamplingParams, outputs: list[int]) -> RequestState:
        r = RequestState(RequestOutput(0, [1], params, output_ids=outputs), slot=0)
        r.matcher = grammars.matcher(params)
        return r
    choice = SamplingParams(choice=CONSTRAINTS["choice"])
    allowed = torch.zeros(1, 64, dtype=torch.int32)
    r = request(choice, [])
    r.matcher.fill(allowed, 0)
    first = next(t for t in range(2048) if (int(allowed[0, t // 32]) >> (t % 32)) & 1)
    r.out.output_ids.append(first)
    masks._busy, masks._fed = {id(r.matcher)}, threading.Event()  # a step whose tokens it has not fed
    try:
        took: list = []
        first_look = threading.Thread(target=lambda: took.append(follow_tokens(sched, [r], grammars)),
                                      daemon=True)
        first_look.start()
        first_look.join(5)
        assert took == [[]] and r.matcher.fed == 0  # it read nothing and waited for nothing
        a = llm.tokenizer.encode("a", add_special_tokens=False)[0]
        whole = request(SamplingParams(regex="a"), [])
        whole.matcher.take([a])
        whole.out.output_ids += [a, eos]
        masks._busy = {id(r.matcher), id(whole.matcher)}
        threading.Timer(0.2, lambda: (whole.matcher.take([eos]), masks._fed.set())).start()
        assert follow_tokens(sched, [whole], grammars) == [whole] and whole.out.finish_reason == "stop"
        assert whole.matcher.ended and masks._fed.is_set()
    finally:  # the engine's next step finds the mask thread done
        masks._busy = set()
        masks._fed.set()


def test_mask_threads_leave_a_core_to_the_main_thread(monkeypatch):
    """A rank's mask threads: its share of the node's cores less one, which the main thread uses beside the
    fill (one at least, 32 at most)."""
    import os

    from tp_engine.sampling.grammar_masks import default_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert [default_threads(n) for n in (1, 2, 4, 16)] == [15, 7, 3, 1]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(96)), raising=False)
    assert default_threads(1) == 32


def test_a_run_with_the_mask_thread_switches_threads_often_then_restores(llm, monkeypatch):
    """While the mask thread fills a step's masks, the interpreter's switch interval is SWITCH_INTERVAL_S
    (a return from xgrammar or a wait then waits that long at most for the main thread's GIL, not the
    default 5 ms); after the run, after a run that a callback ended, and after a step whose mask thread
    failed, it is what it was before."""
    import sys

    from tp_engine.sampling.grammar_masks import ROWS_PER_THREAD, SWITCH_INTERVAL_S, StepMasks

    seen = []
    fill_step = StepMasks._fill_step

    def spy(self, *args):
        seen.append(sys.getswitchinterval())
        return fill_step(self, *args)
    monkeypatch.setattr(StepMasks, "_fill_step", spy)
    params = SamplingParams(max_new_tokens=4, choice=CONSTRAINTS["choice"])
    prompts = [f"{p} {i}" for i in range(ROWS_PER_THREAD) for p in PROMPTS]
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.003)
        outs = llm.generate(prompts, params)
        assert all(o.get("error") is None for o in outs)
        assert seen and all(s == pytest.approx(SWITCH_INTERVAL_S) for s in seen)
        assert sys.getswitchinterval() == pytest.approx(0.003)

        def stop(update):
            if seen:
                raise KeyboardInterrupt
        seen.clear()
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, params, on_token=stop)
        assert seen and sys.getswitchinterval() == pytest.approx(0.003)

        def fail(feeds):
            raise RuntimeError("a matcher failed")
        masks = StepMasks(2048, threads=1, take=fail)
        rows = ROWS_PER_THREAD
        with pytest.raises(RuntimeError, match="a matcher failed"):
            masks.submit([(None, [], None)] * rows, list(range(rows)), None, torch.device("cpu"))
        assert sys.getswitchinterval() == pytest.approx(0.003)
    finally:
        sys.setswitchinterval(before)
