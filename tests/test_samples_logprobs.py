"""n samples per prompt, logprobs against transformers, generation_config.json sampling defaults."""
import json
import logging
import shutil

import pytest
import torch

from helpers import make_checkpoint, run_cli
from tp_engine.base.config import ConfigError, build_config, fingerprint
from tp_engine.llm import LLM
from tp_engine.sampling.sampler import SamplingParams

PROMPTS = [{"input_ids": [3, 1, 4, 1, 5, 9, 2, 6]}, {"input_ids": [8]}, {"input_ids": [100, 200, 7]}]
SAMPLED = {"temperature": 1.0, "top_k": 40, "top_p": 0.9, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("samples") / "m", vocab=384)


def by_key(lines):
    return {(line["index"], line["sample"]): line["output_token_ids"] for line in lines}


@pytest.mark.slow
def test_sample_j_depends_on_neither_n_nor_tp_and_lines_are_ordered(ckpt, tmp_path):
    base = {"model": str(ckpt), "prompts": PROMPTS, "seed": 5}
    one = LLM(model=str(ckpt), device="cpu").generate(PROMPTS, SamplingParams(seed=5, **SAMPLED))
    proc, two = run_cli({**base, "sampling": {**SAMPLED, "n": 2}}, tmp_path, name="n2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, four = run_cli({**base, "sampling": {**SAMPLED, "n": 4}}, tmp_path, nproc=2, name="n4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(x["index"], x["sample"]) for x in four] == [(i, j) for i in range(3) for j in range(4)]
    assert '"requests": 12' in proc.stderr and '"prompts": 3' in proc.stderr
    two, four = by_key(two), by_key(four)
    assert all(four[k] == v for k, v in two.items())  # n = 2 at TP 1 is a prefix of n = 4 at TP 2
    # sample 0: the n = 1 stream
    assert [four[i, 0] for i in range(3)] == [o["output_token_ids"] for o in one]
    assert len({tuple(four[0, j]) for j in range(4)}) == 4  # the samples differ
    # resume: the missing (index, sample) lines only, ending with the same file
    out = tmp_path / "n4.jsonl"
    full = out.read_text().splitlines()
    out.write_text("\n".join(full[:5] + full[7:]) + "\n")
    proc, resumed = run_cli({**base, "sampling": {**SAMPLED, "n": 4}, "resume": True}, tmp_path, name="n4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"resumed_skipped": 10' in proc.stderr and out.read_text().splitlines() == full
    # n is not part of the run settings: the n = 2 file resumed with n = 4 runs samples 2 and 3 only
    proc, _ = run_cli({**base, "sampling": {**SAMPLED, "n": 4}, "resume": True}, tmp_path, name="n2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"resumed_skipped": 6' in proc.stderr and (tmp_path / "n2.jsonl").read_text().splitlines() == full


@pytest.mark.slow
def test_greedy_n_gives_equal_lines_and_resume_checks_n(ckpt, tmp_path):
    cfg = {"model": str(ckpt), "prompts": PROMPTS[:1], "sampling": {"max_new_tokens": 4, "n": 3}}
    proc, lines = run_cli(cfg, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(lines) == 3 and len({tuple(x["output_token_ids"]) for x in lines}) == 1
    proc, _ = run_cli({**cfg, "sampling": {"max_new_tokens": 4, "n": 2}, "resume": True}, tmp_path)
    assert proc.returncode != 0 and "is sample 2 of prompt 0, but sampling.n is 2 now" in proc.stderr
    # a file from before `sample` and `logprobs` existed (n = 1, no sample field) resumes: nothing to run
    out = tmp_path / "run.jsonl"
    out.write_text("".join(json.dumps({k: v for k, v in x.items() if k != "sample"}) + "\n"
                           for x in lines[:1]))
    proc, again = run_cli({**cfg, "sampling": {"max_new_tokens": 4}, "resume": True}, tmp_path)
    assert proc.returncode == 0 and '"resumed_skipped": 1' in proc.stderr, proc.stderr[-3000:]


def hf_logprobs(path, prompt, output):
    from transformers import Qwen3ForCausalLM
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits, dim=-1)


def check_logprobs(entries, ref, output, k):
    assert len(entries) == len(output)
    for t, (e, tok) in enumerate(zip(entries, output)):
        assert e["token"] == tok
        assert abs(e["logprob"] - ref[t, tok].item()) < 1e-4
        top = ref[t].topk(k)
        assert [i for i, _ in e["top"]] == top.indices.tolist()
        assert max(abs(v - w) for (_, v), w in zip(e["top"], top.values.tolist())) < 1e-4
        assert e["top"][0][0] == tok  # greedy: the chosen token is the most likely


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_logprobs_equal_transformers_log_softmax(ckpt, tmp_path, tp):
    cfg = {"model": str(ckpt), "prompts": PROMPTS, "sampling": {"max_new_tokens": 6, "logprobs": 5}}
    proc, lines = run_cli(cfg, tmp_path, nproc=tp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for p, line in zip(PROMPTS, lines):
        ref = hf_logprobs(ckpt, p["input_ids"], line["output_token_ids"])
        check_logprobs(line["logprobs"], ref, line["output_token_ids"], 5)


def test_logprobs_stay_aligned_when_a_request_stops_early(ckpt):
    llm = LLM(model=str(ckpt), device="cpu")
    first = llm.generate(PROMPTS, SamplingParams(max_new_tokens=8))
    stop = first[0]["output_token_ids"][2]  # prompt 0 ends there; its token sampled one step late is dropped
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=8, logprobs=2, stop_token_ids=[stop], n=2,
                                                temperature=0.7, top_k=5))
    assert any(o["finish_reason"] == "stop" for o in outs)
    assert [(o["index"], o["sample"]) for o in outs] == [(i, j) for i in range(3) for j in range(2)]
    for o in outs:
        assert [e["token"] for e in o["logprobs"]] == o["output_token_ids"]
        assert all(len(e["top"]) == 2 for e in o["logprobs"])
    assert "logprobs" not in llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))[0]


def with_generation_config(ckpt, tmp_path, content):
    model = tmp_path / "gc"
    shutil.copytree(ckpt, model)
    (model / "generation_config.json").write_text(json.dumps(content))
    return str(model)


QWEN3 = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [1]}


def test_generation_config_fills_the_sampling_keys_not_set(ckpt, tmp_path, caplog):
    model = with_generation_config(ckpt, tmp_path, QWEN3)
    with caplog.at_level(logging.INFO, logger="tp_engine"):
        cfg = build_config(model=model)
    assert {k: cfg["sampling"][k] for k in ("temperature", "top_k", "top_p")} == \
        {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert "temperature=0.6, top_k=20, top_p=0.95" in caplog.text and "generation_config.json" in caplog.text
    cfg = build_config(model=model, overrides=["sampling.temperature=0"])  # explicit: greedy
    assert cfg["sampling"]["temperature"] == 0 and cfg["sampling"]["top_k"] == 20
    # the ranks compare the values in effect
    assert fingerprint(cfg) != fingerprint(build_config(model=model))
    assert build_config(model=model, sampling={"top_p": 1.0})["sampling"]["top_p"] == 1.0
    # transformers' own file (no do_sample) and do_sample false keep greedy decoding
    assert build_config(model=str(ckpt))["sampling"]["temperature"] == 0.0
    off = with_generation_config(ckpt, tmp_path / "off", {**QWEN3, "do_sample": False})
    assert build_config(model=off)["sampling"]["temperature"] == 0.0
    # do_sample alone: transformers' defaults, which it would sample with
    alone = with_generation_config(ckpt, tmp_path / "alone", {"do_sample": True})
    got = build_config(model=alone)["sampling"]
    assert (got["temperature"], got["top_k"], got["top_p"]) == (1.0, 50, 1.0)


@pytest.mark.slow
def test_generation_config_defaults_decide_the_tokens(ckpt, tmp_path):
    model = with_generation_config(ckpt, tmp_path, QWEN3)
    cfg = {"model": model, "prompts": PROMPTS, "sampling": {"max_new_tokens": 8}}
    proc, defaulted = run_cli(cfg, tmp_path, name="a")
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = LLM(model=str(ckpt), device="cpu").generate(
        PROMPTS, SamplingParams(temperature=0.6, top_k=20, top_p=0.95, max_new_tokens=8))
    assert [x["output_token_ids"] for x in defaulted] == [w["output_token_ids"] for w in want]
    proc, greedy = run_cli(cfg, tmp_path, args=("--set", "sampling.temperature=0"), name="b")
    plain = LLM(model=str(ckpt), device="cpu").generate(PROMPTS, SamplingParams(max_new_tokens=8))
    assert [x["output_token_ids"] for x in greedy] == [w["output_token_ids"] for w in plain]
    assert greedy[0]["run"] != defaulted[0]["run"]


def test_generation_config_fields_the_engine_does_not_apply_are_named(ckpt, tmp_path):
    """A repetition_penalty (Qwen2.5's files set 1.05), a min_new_tokens or a suppress_tokens changes
    transformers' tokens, greedy ones too; the engine does not apply them, so the warning names each of them
    that is set."""
    cases = [({**QWEN3, "repetition_penalty": 1.05, "min_p": 0.05},
              "sets repetition_penalty 1.05, min_p 0.05"),
             ({"do_sample": False, "repetition_penalty": 1.05, "min_p": 0.05},
              "sets repetition_penalty 1.05, which"),  # min_p acts only when sampling
             ({**QWEN3, "repetition_penalty": 1, "min_p": None, "typical_p": 1.0}, None),
             # a first EOS held back, tokens suppressed, beam search: each changes transformers' greedy tokens
             ({"do_sample": False, "min_new_tokens": 4, "suppress_tokens": [5], "num_beams": 2, "top_h": 0.5},
              # top_h acts only when sampling
              "sets min_new_tokens 4, suppress_tokens [5], num_beams 2, which"),
             ({**QWEN3, "top_h": 0.5, "forced_eos_token_id": 2}, "sets forced_eos_token_id 2, top_h 0.5"),
             ({**QWEN3, "min_new_tokens": 0, "suppress_tokens": [], "num_beams": 1, "guidance_scale": None},
              None)]
    from tp_engine.base.generation_config import unapplied_warning
    for i, (content, said) in enumerate(cases):
        model = with_generation_config(ckpt, tmp_path / str(i), content)
        warning = unapplied_warning(model)
        if said is None:
            assert warning is None, warning
        else:
            assert said in warning and "which this engine does not apply" in warning, warning


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [0, 2])
def test_the_generation_config_warning_is_said_once_per_run(ckpt, tmp_path, nproc):
    """Rank 0 says it once: every rank builds the config, the command line twice (to check it, then in
    LLM)."""
    model = with_generation_config(ckpt, tmp_path, {"do_sample": False, "repetition_penalty": 1.05})
    cfg = {"model": model, "prompts": [{"input_ids": [5, 6]}], "sampling": {"max_new_tokens": 2}}
    proc, lines = run_cli(cfg, tmp_path, nproc=nproc)
    assert proc.returncode == 0 and len(lines) == 1, proc.stderr[-3000:]
    said = proc.stderr.count("sets repetition_penalty 1.05, which this engine does not apply")
    assert said == 1, proc.stderr


@pytest.mark.parametrize("content,message", [
    ({"do_sample": "yes"}, "field 'do_sample' must be true or false"),
    ({"do_sample": True, "top_k": 2.5}, "field 'top_k' must be an integer >= 0, got 2.5"),
    ({"do_sample": True, "top_p": 0}, "field 'top_p' must be a number in (0, 1], got 0"),
    ({"do_sample": True, "temperature": -1}, "field 'temperature' must be a number >= 0"),
    ([1, 2], "must hold a JSON object"),
])
def test_bad_generation_config_is_refused_naming_file_and_field(ckpt, tmp_path, content, message):
    model = with_generation_config(ckpt, tmp_path, content)
    with pytest.raises(ConfigError) as e:
        build_config(model=model)
    assert message in str(e.value) and "generation_config.json" in str(e.value)


@pytest.mark.parametrize("key,value,message", [
    ("sampling.n", 0, "config key 'sampling.n' must be >= 1; got 0"),
    ("sampling.logprobs", 21, "config key 'sampling.logprobs' must be between 0 and 20; got 21"),
    ("sampling.logprobs", -1, "config key 'sampling.logprobs' must be between 0 and 20; got -1"),
])
def test_n_and_logprobs_are_checked(ckpt, key, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        build_config(model=str(ckpt), overrides=[f"{key}={value}"])
    with pytest.raises(ConfigError, match=f"SamplingParams.{key.split('.')[1]}"):
        SamplingParams(**{key.split(".")[1]: value})


def test_bench_counts_the_kernels_compiled_inside_a_measured_run():
    """The bench's KernelCompiles counts each Triton compile by kernel and adds up the seconds from
    Triton's hook before it to the one after, with the keywords Triton calls them with, leaving Triton to
    compile (the first hook returns None); on leaving it puts back the hooks it found."""
    import time
    from types import SimpleNamespace

    knobs = pytest.importorskip("triton").knobs
    bench = bench_module()
    before = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    with bench.KernelCompiles() as compiles:
        for name in ("_topk_keys_kernel", "_chunk_max_kernel", "_topk_keys_kernel"):
            call = dict(key="k", repr=name, fn=SimpleNamespace(name=name, module="m", jit_function=None),
                        compile={}, is_manual_warmup=False, already_compiled=False)
            assert knobs.runtime.jit_cache_hook(**call) is None
            time.sleep(0.01)
            knobs.runtime.jit_post_compile_hook(**call)
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before
    got = compiles.report()
    assert got["count"] == 3 and got["kernels"] == {"_chunk_max_kernel": 1, "_topk_keys_kernel": 2}
    assert 0.03 <= got["seconds"] < 1


def bench_module():
    import sys

    from helpers import ROOT
    sys.path.insert(0, str(ROOT / "launch"))
    import bench
    return bench


def test_bench_mixed_settings_mix_greedy_and_sampled_with_the_drawn_budgets():
    """launch/bench.py's mixed run: even requests greedy, odd ones the shared setting (temperature, top-k,
    top-p), logprobs on some of each and off on the rest; each keeps its drawn max_new_tokens."""
    bench = bench_module()
    args = bench.parse_args(["--model", "m", "--temperature", "0.7"])
    draws = [o for _, o in bench.throughput_requests(args, 384, 12, args.seed)]
    ps = [bench.mixed_settings(args, 20, 0.95)(k, o) for k, o in enumerate(draws)]
    assert [p.max_new_tokens for p in ps] == draws and all(p.ignore_eos for p in ps)
    assert [(p.temperature, p.top_k, p.top_p) for p in ps[0::2]] == [(0.0, 0, 1.0)] * 6
    assert [(p.temperature, p.top_k, p.top_p) for p in ps[1::2]] == [(0.7, 20, 0.95)] * 6
    for half in (ps[0::2], ps[1::2]):
        assert {p.logprobs for p in half} == {0, 5}


@pytest.mark.slow
def test_bench_sampling_mixed_and_n8_workloads_run_on_cpu(ckpt, tmp_path):
    """launch/bench.py's sampling, mixed and n8 workloads on CPU: each ratio is its two runs' rates (the
    sampling workload's after a warm-up pass of each setting, kept apart); the mixed run has greedy and
    top-k/top-p requests and the same prompts and token budgets as the shared one."""
    import os
    import subprocess
    import sys

    from helpers import ROOT, assert_rate_ratio
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "launch" / "bench.py"), "--model", str(ckpt), "--engine", "ours",
           "--workload", "sampling,mixed,n8", "--num-requests", "4", "--min-len", "8", "--max-len", "16",
           "--n-prompts", "2", "--n-samples", "3", "--n-new-tokens", "8", "--prompt-len", "8",
           "--set", "device=cpu", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    s = res["sampling"]
    assert (s["top_k_top_p"]["top_k"], s["top_k_top_p"]["top_p"], s["temperature_only"]["top_k"]) == \
        (20, 0.95, 0)
    assert_rate_ratio(s["ratio"], s["top_k_top_p"], s["temperature_only"])
    assert set(s["first_runs"]) == {"temperature_only", "top_k_top_p"}  # the warm-up pass, reported apart
    for run in (*s["first_runs"].values(), s["top_k_top_p"], s["temperature_only"]):
        assert run["kernel_compiles"] == {"count": 0, "seconds": 0.0, "kernels": {}}  # no Triton on the CPU
    assert_rate_ratio(res["n8"]["ratio"], res["n8"]["n_samples"], res["n8"]["separate_prompts"])
    assert res["n8"]["n_samples"]["output_tokens"] == res["n8"]["separate_prompts"]["output_tokens"] == 48
    m, bench = res["mixed"], bench_module()
    assert_rate_ratio(m["ratio"], m["mixed"], m["shared"])
    assert (m["shared"]["top_k"], m["shared"]["top_p"]) == (20, 0.95)
    assert (m["mixed"]["greedy_requests"], m["mixed"]["top_k_top_p_requests"]) == (2, 2)
    assert m["mixed"]["logprobs_requests"] == 2  # requests 0 and 3
    specs = bench.throughput_requests(bench.parse_args(["--model", "m", "--min-len", "8", "--max-len", "16"]),
                                      384, 4, 0)
    for run in (m["shared"], m["mixed"]):  # ignore_eos: each request writes its whole budget
        assert (run["requests"], run["prompt_tokens"], run["output_tokens"]) == \
            (4, sum(len(ids) for ids, _ in specs), sum(o for _, o in specs))
