"""Per-prompt settings: a prompt object's own `sampling`, and a list of SamplingParams in the API. Requests
with different settings share batches and get what each gets alone; resume compares each line's settings."""
import json
from dataclasses import fields

import pytest

from helpers import ROOT, hf_generate, run_cli
from tp_engine.base.sampling_keys import SAMPLING_FIELDS
from tp_engine.llm import LLM
from tp_engine.sampling.sampler import SamplingParams

DEMO = ROOT / "configs" / "models" / "demo"  # a tokenizer, for text prompts and stop strings
ALICE = "Alice was beginning to get very tired"
RUN = {"max_new_tokens": 8}  # the run's sampling section
# greedy and sampled, each kind of draw (plain, top-k, top-p), other lengths, stop strings and ids, n and
# logprobs
MIXED = [
    ALICE,
    {"prompt": "Alice was", "sampling": {"temperature": 1.0, "top_k": 20, "n": 2, "max_new_tokens": 6,
                                         "seed": 3}},
    {"prompt": ALICE, "sampling": {"stop": [" sister"], "max_new_tokens": 30, "logprobs": 3}},
    {"prompt": "The Queen", "sampling": {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 12,
                                         "logprobs": 2, "stop_token_ids": [11]}},
    {"prompt": "Alice", "sampling": {"temperature": 1.5}},
    {"prompt": "'Curiouser and curiouser!' cried Alice", "sampling": {"max_new_tokens": 3, "n": 3}},
]


def plain(prompt):
    """The prompt without its own settings."""
    return {k: v for k, v in prompt.items() if k != "sampling"} if isinstance(prompt, dict) else prompt


def own(prompt):
    return prompt.get("sampling", {}) if isinstance(prompt, dict) else {}


def alone(llm, prompts, i, settings):
    """Prompt i's lines when it runs by itself (the others skipped: its index, so its seed, stays) with
    `settings` as the whole call's."""
    skip = {j for j in range(len(prompts)) if j != i}
    return llm.generate([plain(p) for p in prompts], SamplingParams(**settings), skip=skip)


def same_output(got, want):
    """The same tokens, text, finish and top-logprob ids; logprob values within 1e-4, as against transformers
    (a batch of another shape may change the logits' last bits)."""
    for key in ("index", "sample", "prompt_token_ids", "output_token_ids", "text", "finish_reason"):
        assert got[key] == want[key], (key, got, want)
    assert ("logprobs" in got) == ("logprobs" in want)
    for a, b in zip(got.get("logprobs", []), want.get("logprobs", [])):
        assert a["token"] == b["token"] and [i for i, _ in a["top"]] == [i for i, _ in b["top"]]
        assert abs(a["logprob"] - b["logprob"]) < 1e-4
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a["top"], b["top"])), (a, b)


@pytest.fixture(scope="module")
def llm():
    llm = LLM(model=str(DEMO), device="cpu", seed=7)
    yield llm
    llm.shutdown()


@pytest.mark.slow
def test_a_batch_of_mixed_settings_gives_each_prompt_its_output_alone(llm, tmp_path):
    """One run whose prompts carry their own settings (YAML `prompts:`) writes, for every prompt, the lines
    that prompt gets alone with those settings as the run's; its greedy prompts equal transformers'."""
    proc, lines = run_cli({"model": str(DEMO), "prompts": MIXED, "sampling": RUN, "seed": 7}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = [own(p).get("n", 1) for p in MIXED]
    assert [(x["index"], x["sample"]) for x in lines] == [(i, j) for i, n in enumerate(counts)
                                                          for j in range(n)]
    by_prompt = {i: [x for x in lines if x["index"] == i] for i in range(len(MIXED))}
    for i, p in enumerate(MIXED):
        want = alone(llm, MIXED, i, {**RUN, **own(p)})
        assert len(want) == len(by_prompt[i]) == counts[i]
        for got, w in zip(by_prompt[i], want):
            same_output({k: v for k, v in got.items() if k != "run"}, w)
    assert len({tuple(x["output_token_ids"]) for x in by_prompt[1]}) == 2  # its two samples differ
    assert by_prompt[2][0]["finish_reason"] == "stop" and by_prompt[2][0]["text"] == " of sitting by her"
    assert "logprobs" not in by_prompt[0][0] and len(by_prompt[3][0]["logprobs"][0]["top"]) == 2
    for i in (0, 2, 5):  # greedy: transformers' tokens, up to where a stop string ended the request
        got = by_prompt[i][0]["output_token_ids"]
        max_new = own(MIXED[i]).get("max_new_tokens", RUN["max_new_tokens"])
        ref = hf_generate(DEMO, [by_prompt[i][0]["prompt_token_ids"]], max_new)[0]
        assert got == (ref[:len(got)] if by_prompt[i][0]["finish_reason"] == "stop" else ref), i
    runs = {x["run"] for x in lines}
    assert len(runs) == 6  # the run's own, and one per prompt with settings of its own


def test_generate_takes_a_list_of_sampling_params_one_per_prompt(llm):
    """A list of SamplingParams gives each prompt its own; a prompt object's `sampling` goes over its item;
    a list of another length is refused naming both lengths, and the engine runs on."""
    prompts = [ALICE, "Alice was", {"prompt": "The Queen", "sampling": {"max_new_tokens": 2}}]
    params = [SamplingParams(max_new_tokens=5, stop=" sister"),
              SamplingParams(temperature=1.0, top_k=20, max_new_tokens=4, n=2, logprobs=1),
              SamplingParams(max_new_tokens=9, temperature=0.9)]
    outs = llm.generate(prompts, params)
    assert [(o["index"], o["sample"]) for o in outs] == [(0, 0), (1, 0), (1, 1), (2, 0)]
    singles = [alone(llm, prompts, 0, {"max_new_tokens": 5, "stop": " sister"}),
               alone(llm, prompts, 1, {"temperature": 1.0, "top_k": 20, "max_new_tokens": 4, "n": 2,
                                       "logprobs": 1}),
               alone(llm, prompts, 2, {"max_new_tokens": 2, "temperature": 0.9})]
    for got, want in zip(outs, [w for single in singles for w in single]):
        same_output(got, want)
    assert len(outs[3]["output_token_ids"]) == 2
    with pytest.raises(ValueError, match="sampling_params is a list of 2 SamplingParams for 3 prompts"):
        llm.generate(prompts, params[:2])
    assert tuple(f.name for f in fields(SamplingParams)) == SAMPLING_FIELDS  # the keys a prompt's own take
    with pytest.raises(TypeError, match="a list holding dict"):
        llm.generate(prompts[:1], [{"max_new_tokens": 2}])
    assert len(llm.generate(prompts[:1], params[:1])[0]["output_token_ids"]) == 5


BAD = [
    ({"sampling": {"temprature": 0.5}},
     "unknown key 'temprature' in a prompt's sampling; did you mean 'temperature'? (its keys: temperature, "
     "top_k, top_p, max_new_tokens, ignore_eos, stop_token_ids, stop, n, logprobs, json_schema, regex, "
     "choice, grammar, seed)"),
    ({"sampling": {"top_p": 1.5}}, "the prompt's sampling.top_p must be in (0, 1]; got 1.5"),
    ({"sampling": {"max_new_tokens": "ten"}},
     "the prompt's sampling.max_new_tokens must be an integer, got 'ten' (str)"),
    ({"sampling": {"seed": -1}}, "the prompt's sampling.seed must be in [0, 2**32); got -1"),
    ({"sampling": [1]}, "a prompt's 'sampling' must be a mapping of sampling keys; got list"),
]


def test_a_bad_key_or_value_in_a_prompts_sampling_is_its_error_line(llm):
    """Each is that prompt's error line, with the config's own message (the closest key for a misspelt
    one); the other prompts run."""
    prompts = [{"prompt": ALICE, **bad} for bad, _ in BAD] + [{"prompt": ALICE, "sampling": {"n": 2}}]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=3))
    assert [o.get("error") for o in outs[:len(BAD)]] == [message for _, message in BAD]
    assert [o["finish_reason"] for o in outs] == ["error"] * len(BAD) + ["length"] * 2


def write_prompts(path, prompts):
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))


@pytest.mark.slow
def test_resume_compares_each_lines_own_settings(tmp_path):
    """A prompts_file whose lines carry settings: bad ones are error lines in a finished run; a resume keeps
    the lines whose settings are unchanged and runs the missing ones, giving the file of one whole run; a
    prompt whose own settings changed (or that gained some) refuses the resume, naming it."""
    prompts = [{"prompt": ALICE}, {"prompt": "Alice was", "sampling": {"temperature": 1.0, "n": 2}},
               {"prompt": "The Queen", "sampling": {"max_new_tokens": 4, "stop": ["."]}},
               {"prompt": ALICE, "sampling": {"top_k": -1}}, {"prompt": ALICE, "sampling": {"tmp": 1}}]
    pf = tmp_path / "prompts.jsonl"
    write_prompts(pf, prompts)
    cfg = {"model": str(DEMO), "prompts_file": str(pf), "sampling": RUN}
    proc, lines = run_cli(cfg, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [x["finish_reason"] for x in lines][-2:] == ["error", "error"]
    assert lines[-2]["error"] == "the prompt's sampling.top_k must be >= 0; got -1"
    assert lines[-1]["error"].startswith("unknown key 'tmp' in a prompt's sampling")
    assert '"requests": 6' in proc.stderr
    out = tmp_path / "run.jsonl"
    full = out.read_text().splitlines()
    out.write_text("\n".join(full[:1] + full[2:]) + "\n")  # sample 0 of prompt 1 is missing
    proc, _ = run_cli({**cfg, "resume": True}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"resumed_skipped": 3' in proc.stderr  # the two error lines ran again
    assert out.read_text().splitlines() == full
    write_prompts(pf, [prompts[0], {**prompts[1], "sampling": {"temperature": 0.5, "n": 2}}, *prompts[2:]])
    proc, _ = run_cli({**cfg, "resume": True}, tmp_path)
    assert proc.returncode == 2 and "line 2 was produced with other settings (run " in proc.stderr
    assert "the run's settings are the same: prompt 1's own sampling differs (2 of 6 lines" in proc.stderr
    write_prompts(pf, [{**prompts[0], "sampling": {"max_new_tokens": 5}}, *prompts[1:]])
    proc, _ = run_cli({**cfg, "resume": True}, tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "line 1: prompt 0, with its own sampling, was produced with sampling.max_new_tokens=8, now 5 " \
           "(1 of 6 lines differ)" in proc.stderr
    assert out.read_text().splitlines() == full  # nothing was changed
