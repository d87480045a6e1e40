"""Bad input and faults, through the real CLI under torchrun: one clear message, a line per prompt, no
hangs."""
import json
import re
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import GENERATE, free_port, make_checkpoint, run_cli, start_job, wait_for_lines, worker_pids

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [{"input_ids": [5, 17, 300, 42, 8]}, {"input_ids": [1, 2, 3]}, {"input_ids": [9, 9, 9, 9]}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("faults") / "m")


def base(ckpt, **kw):
    return {"model": str(ckpt), "prompts": PROMPTS, "sampling": {"max_new_tokens": 8}, **kw}


def error_lines(proc):
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def assert_fails_once(proc, *needles, took=None):
    assert proc.returncode != 0
    errs = error_lines(proc)
    assert len(errs) == 1, proc.stderr[-3000:]  # printed once, not once per rank
    for needle in needles:
        assert needle in errs[0], errs[0]
    # no traceback from our code on any rank
    assert not re.search(r'File ".*(tp_engine|launch)/', proc.stderr)
    if took is not None:
        assert took < 60


def variant(tmp_path, ckpt, name):
    """A copy of the checkpoint to break."""
    dst = tmp_path / name
    dst.mkdir()
    for f in ckpt.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# ---- configuration ----

CONFIG_CASES = {
    "unknown_key": ({"sampling": {"temprature": 0.5, "max_new_tokens": 8}},
                    ["sampling.temprature", "sampling.temperature"]),
    "wrong_type": ({"sampling": {"max_new_tokens": "ten"}}, ["sampling.max_new_tokens", "integer", "ten"]),
    "negative_temperature": ({"sampling": {"temperature": -0.5}}, ["sampling.temperature", ">= 0", "-0.5"]),
    "top_p_out_of_range": ({"sampling": {"top_p": 1.5}}, ["sampling.top_p", "(0, 1]"]),
    "max_new_tokens_zero": ({"sampling": {"max_new_tokens": 0}}, ["sampling.max_new_tokens", ">= 1"]),
    "bad_choice": ({"dtype": "float8"}, ["dtype", "float8"]),
    "missing_model_dir": ({"model": "/nonexistent/model"}, ["/nonexistent/model", "not found"]),
    "both_prompt_sources": ({"prompts_file": "x.jsonl"}, ["both"]),
    "cuda_without_gpu": ({"device": "cuda"}, ["cuda", "no CUDA device"]),
    "flashinfer_on_cpu": ({"attention_backend": "flashinfer"}, ["flashinfer", "cuda"]),
    "max_model_len_past_rope_table": ({"max_model_len": 100000}, ["100000", "max_position_embeddings 512"]),
    "bad_advanced_choice": ({"advanced": {"all_reduce": "fast"}},
                            ["advanced.all_reduce", "auto, push, symm, nccl", "fast"]),
    "fused_kernels_on_cpu": ({"advanced": {"fused_kernels": "on"}}, ["advanced.fused_kernels", "CUDA only"]),
    "seed_out_of_range": ({"seed": 2**32}, ["seed", "[0, 2**32)", "4294967296"]),
}


# Every rank finds these alike, so most run as one plain process; these also under torchrun with two ranks
# (the message once, not once per rank): one found before torch loads, one after, one from the model's config
TWO_RANKS = ("unknown_key", "cuda_without_gpu", "max_model_len_past_rope_table")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_errors(ckpt, tmp_path, case):
    extra, needles = CONFIG_CASES[case]
    t0 = time.time()
    proc, _ = run_cli(base(ckpt, **extra), tmp_path, nproc=2 if case in TWO_RANKS else 0)
    assert_fails_once(proc, *needles, took=time.time() - t0)


@pytest.mark.parametrize("key", ["all_reduce", "fused_kernels", "step_channel"])
def test_advanced_keys_take_only_their_choices(ckpt, key):
    from tp_engine.base.config import SCHEMA, ConfigError, build_config
    with pytest.raises(ConfigError,
                       match=rf"config key 'advanced\.{key}' must be one of auto, .*; got 'fast'"):
        build_config(model=str(ckpt), advanced={key: "fast"})
    if "off" in SCHEMA[f"advanced.{key}"].choices:  # YAML reads a bare off as false
        assert build_config(model=str(ckpt), overrides=[f"advanced.{key}=false"])["advanced"][key] == "off"
    else:
        with pytest.raises(ConfigError, match=rf"config key 'advanced\.{key}' must be a string"):
            build_config(model=str(ckpt), overrides=[f"advanced.{key}=false"])
    for choice in SCHEMA[f"advanced.{key}"].choices:
        assert build_config(model=str(ckpt), advanced={key: choice})["advanced"][key] == choice


def test_neither_prompt_source(ckpt, tmp_path):
    cfg = base(ckpt)
    del cfg["prompts"]
    proc, _ = run_cli(cfg, tmp_path, nproc=2)
    assert_fails_once(proc, "neither")


def test_malformed_prompts_file_names_the_line(ckpt, tmp_path):
    pf = tmp_path / "p.jsonl"
    pf.write_text('{"prompt": "a"}\n{"input_ids": [1, 2]}\n{"input_ids": [1, 2\n')
    cfg = base(ckpt, prompts_file=str(pf))
    del cfg["prompts"]
    proc, _ = run_cli(cfg, tmp_path, nproc=2)
    assert_fails_once(proc, "p.jsonl line 3")


def test_set_override_with_unknown_key(ckpt, tmp_path):
    proc, _ = run_cli(base(ckpt), tmp_path, args=("--set", "kv_cache.num_page=4"))
    assert_fails_once(proc, "kv_cache.num_page", "kv_cache.num_pages")


# ---- model ----

def edit_config(path, change):
    c = json.loads((path / "config.json").read_text())
    change(c)
    (path / "config.json").write_text(json.dumps(c))


@pytest.mark.slow
def test_tp_that_cannot_split_heads(ckpt, tmp_path):
    t0 = time.time()
    proc, _ = run_cli(base(ckpt), tmp_path, nproc=3)  # 4 heads, 2 KV heads, 3 ranks
    assert_fails_once(proc, "num_attention_heads=4", "3", took=time.time() - t0)


@pytest.mark.slow
def test_tp_that_cannot_split_the_mlp(tmp_path):
    path = make_checkpoint(tmp_path / "odd", inter=129)
    proc, _ = run_cli(base(path), tmp_path, nproc=2)
    assert_fails_once(proc, "intermediate_size=129", "2")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["architecture", "rope_scaling", "missing_field"])
def test_model_config_errors(ckpt, tmp_path, case):
    path = variant(tmp_path, ckpt, case)
    change, needles = {
        "architecture": (lambda c: c.update(architectures=["LlamaForCausalLM"], model_type="llama"),
                         ["LlamaForCausalLM"]),
        "rope_scaling": (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                             "rope_theta": 1e4}),
                         ["yarn"]),
        "missing_field": (lambda c: c.pop("hidden_size"), ["hidden_size"]),
    }[case]
    edit_config(path, change)
    proc, _ = run_cli(base(path), tmp_path, nproc=2 if case == "architecture" else 0)
    assert_fails_once(proc, "config.json", *needles)


# ---- checkpoint ----

def rewrite_tensors(path, change):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    change(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def poison(tensors, name, value):
    tensors[name] = tensors[name].clone()
    tensors[name][3, 5] = value


CKPT_CASES = {
    "missing": (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
                ["missing", "model.layers.1.mlp.up_proj.weight"]),
    "int8": (lambda t: t.update({"model.layers.0.mlp.up_proj.weight":
                                 t["model.layers.0.mlp.up_proj.weight"].to(torch.int8)}),
             ["model.layers.0.mlp.up_proj.weight", "dtype I8"]),
    "bool": (lambda t: t.update({"model.norm.weight": t["model.norm.weight"] > 0}),
             ["model.norm.weight", "dtype BOOL"]),
    "nan": (lambda t: poison(t, "model.layers.1.self_attn.o_proj.weight", float("nan")),
            ["model.layers.1.self_attn.o_proj.weight", "NaN or infinite"]),
    "unexpected": (lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}),
                   ["unexpected", "model.layers.0.mlp.extra.weight"]),
    "wrong_shape": (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 64)}),
                    ["model.layers.0.self_attn.k_proj.weight", "[64, 64]", "[32, 64]"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CKPT_CASES))
def test_checkpoint_tensor_errors(ckpt, tmp_path, case):
    path = variant(tmp_path, ckpt, case)
    change, needles = CKPT_CASES[case]
    rewrite_tensors(path, change)
    t0 = time.time()
    # one plain process, as the configuration errors above; the shard-dependent checks also at two ranks
    proc, _ = run_cli(base(path), tmp_path, nproc=2 if case in ("missing", "wrong_shape") else 0)
    assert_fails_once(proc, *needles, took=time.time() - t0)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_corrupt_safetensors_names_the_file(ckpt, tmp_path, how):
    path = variant(tmp_path, ckpt, how)
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if how == "truncated" else b"\x07" * 64 + data[64:])
    proc, _ = run_cli(base(path), tmp_path, nproc=2 if how == "truncated" else 0)
    assert_fails_once(proc, "model.safetensors")


@pytest.mark.slow
def test_dtype_not_supported_on_device(ckpt, tmp_path):
    proc, _ = run_cli(base(ckpt, dtype="float16"), tmp_path, nproc=2)
    assert_fails_once(proc, "float16", "CPU")


# ---- per-prompt errors ----

@pytest.mark.slow
def test_bad_prompts_get_error_lines_and_the_rest_complete(ckpt, tmp_path):
    good = [{"input_ids": [5, 17, 300, 42, 8]}, {"input_ids": [1, 2, 3]}]
    prompts = [good[0], {"input_ids": []}, {"input_ids": [3, 512, 4]}, {"input_ids": list(range(1, 70))},
               "text but no tokenizer", {"input_ids": [7] * 40}, good[1]]
    cfg = base(ckpt, prompts=prompts, max_model_len=64, kv_cache={"num_pages": 2, "page_size": 16})
    proc, lines = run_cli(cfg, tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]  # finished: the error lines are results too
    assert 'warning: 5 of 7 prompts ended with finish_reason "error"' in proc.stderr
    assert [line["index"] for line in lines] == list(range(len(prompts)))  # one line each, in order
    reasons = [line["finish_reason"] for line in lines]
    assert reasons == ["length", "error", "error", "error", "error", "error", "length"]
    assert "empty" in lines[1]["error"]
    assert "512" in lines[2]["error"] and "vocabulary" in lines[2]["error"]
    assert "69 tokens" in lines[3]["error"]
    assert "tokenizer" in lines[4]["error"]
    assert "40 tokens" in lines[5]["error"] and "KV pool 32 tokens" in lines[5]["error"]
    _, clean = run_cli(base(ckpt, prompts=good), tmp_path, name="clean")
    assert [lines[0]["output_token_ids"], lines[6]["output_token_ids"]] == \
        [c["output_token_ids"] for c in clean]


@pytest.mark.slow
def test_any_failure_to_encode_a_prompt_is_that_prompts_error(tmp_path):
    demo = ROOT / "configs" / "models" / "demo"  # has a tokenizer and a chat template
    ok = {"messages": [{"role": "user", "content": "Hi"}]}
    prompts = ["Alice was beginning", {"messages": "hello"}, {"messages": [{"content": "Hi"}]},
               {"messages": [{"role": "user", "content": 5}]}, ok, {"input_ids": [1, True, 3]}]
    cfg = {"model": str(demo), "prompts": prompts, "sampling": {"max_new_tokens": 4}}
    proc, lines = run_cli(cfg, tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reasons = ["length", "error", "error", "error", "length", "error"]
    assert [line["finish_reason"] for line in lines] == reasons
    assert "non-empty list" in lines[1]["error"]
    assert "'role'" in lines[2]["error"] and "'content' must be a string" in lines[3]["error"]
    assert "input_ids" in lines[5]["error"]


@pytest.mark.slow
def test_a_bad_prompt_among_good_ones_leaves_the_job_successful(ckpt, tmp_path):
    """Under torchrun, a finished batch with one bad prompt exits 0, as a scheduler needs to keep the job:
    every prompt has its line, and one stderr line says how many ended in error and where the reasons are."""
    prompts = [PROMPTS[0], {"input_ids": []}, PROMPTS[1], PROMPTS[2]]
    proc, lines = run_cli(base(ckpt, prompts=prompts), tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(line["index"], line["finish_reason"]) for line in lines] == \
        [(0, "length"), (1, "error"), (2, "length"), (3, "length")]
    assert "empty" in lines[1]["error"]
    assert not error_lines(proc), proc.stderr[-3000:]
    out = tmp_path / "run.jsonl"
    said = [line for line in proc.stderr.splitlines() if "ended with finish_reason" in line]
    assert said == [f'warning: 1 of 4 prompts ended with finish_reason "error" (the reasons are in the '
                    f'"error" field of their lines in {out}); exit status 0 (fail_on_prompt_error: true '
                    'makes it 3)'], said
    assert json.loads(proc.stderr.split("summary: ")[1].splitlines()[0])["errors"] == 1


@pytest.mark.slow
def test_fail_on_prompt_error_gives_status_3_and_a_resume_may_change_it(ckpt, tmp_path):
    """fail_on_prompt_error: true turns a finished run with an error line into exit status 3, with one error
    line. It decides no token, so a resume that turns it off keeps the finished lines instead of refusing."""
    prompts = [PROMPTS[0], {"input_ids": []}, PROMPTS[1], PROMPTS[2]]
    proc, lines = run_cli(base(ckpt, prompts=prompts, fail_on_prompt_error=True), tmp_path)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert error_lines(proc) == ['error: 1 of 4 prompts ended with finish_reason "error" (the reasons are in '
                                 f'the "error" field of their lines in {tmp_path / "run.jsonl"})'], \
        proc.stderr[-3000:]
    assert [line["finish_reason"] for line in lines] == ["length", "error", "length", "length"]
    proc, again = run_cli(base(ckpt, prompts=prompts, resume=True), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stderr.split("summary: ")[1].splitlines()[0])["resumed_skipped"] == 3
    assert again == lines  # the finished lines kept; the bad prompt run again, to the same error
    assert 'warning: 1 of 1 prompts ended with finish_reason "error"' in proc.stderr


def test_the_summary_counts_lines_and_the_errors_line_says_where_the_reasons_are():
    """The summary counts lines (prompts x n), leaves out an error prompt's tokens, counts prompts with
    several samples; the errors line points at the output file, stdout, or the text shown on the terminal."""
    from tp_engine.frontend.summary import Summary
    s = Summary(samples=2)
    for i, reason in [(0, "length"), (0, "length"), (1, "error"), (1, "error")]:
        s.add({"index": i, "finish_reason": reason, "prompt_token_ids": [1, 2, 3], "cached_prompt_tokens": 0,
               "output_token_ids": [] if reason == "error" else [4, 5]})
    line = json.loads(s.line(2.0, preempted=0, resumed_skipped=1).removeprefix("summary: "))
    assert line == {"requests": 4, "prompt_tokens": 6, "output_tokens": 4, "cached_prompt_tokens": 0,
                    "errors": 2, "seconds": 2.0, "tokens_per_s": 2.0, "prompts": 2, "resumed_skipped": 1}
    ended = '2 of 4 prompts ended with finish_reason "error" (the reasons are '
    assert s.errors_line("out.jsonl", False) == ended + 'in the "error" field of their lines in out.jsonl)'
    assert s.errors_line(None, False) == ended + 'in the "error" field of their lines on stdout)'
    assert s.errors_line(None, True) == ended + "shown above)"


# ---- memory pressure ----

@pytest.mark.slow
def test_tiny_kv_pool_gives_the_same_tokens(ckpt, tmp_path):
    prompts = [{"input_ids": [(7 * i + j) % 500 + 1 for j in range(10 + 3 * i)]} for i in range(8)]
    sampling = {"max_new_tokens": 24}
    _, roomy = run_cli(base(ckpt, prompts=prompts, sampling=sampling), tmp_path, nproc=2, name="roomy")
    proc, tight = run_cli(base(ckpt, prompts=prompts, sampling=sampling,
                               kv_cache={"num_pages": 5, "page_size": 16}),
                          tmp_path, nproc=2, name="tight")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stderr.split("summary: ")[1].splitlines()[0])
    assert summary.get("preempted", 0) > 0  # the pool really was too small for the batch
    assert [t["output_token_ids"] for t in tight] == [r["output_token_ids"] for r in roomy]
    assert all(t["finish_reason"] == "length" for t in tight)


# ---- nothing lost, no hangs ----

def long_job(ckpt, tmp_path):
    out = tmp_path / "out.jsonl"
    prompts = [{"input_ids": [i % 500 + 1, 2, 3]} for i in range(300)]
    cfg = base(ckpt, prompts=prompts, output=str(out), max_batch_size=2, device="cpu",
               sampling={"max_new_tokens": 40, "ignore_eos": True})
    return cfg, out


def check_results_file(out, n_prompts):
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines, "finished results were lost"
    assert all(line["finish_reason"] == "length" and len(line["output_token_ids"]) == 40 for line in lines)
    assert len({line["index"] for line in lines}) == len(lines) < n_prompts
    return lines


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_killed_worker_ends_the_job_fast_and_keeps_results(ckpt, tmp_path, victim):
    cfg, out = long_job(ckpt, tmp_path)
    proc = start_job(cfg, tmp_path)
    try:
        wait_for_lines(out, 2, proc)
        os.kill(worker_pids(proc.pid)[victim], signal.SIGKILL)
        t0 = time.time()
        proc.wait(timeout=30)
        assert time.time() - t0 < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    check_results_file(out, 300)
    err = proc.stderr.read()
    if victim == 1:  # rank 0 says where the finished results are, not in gloo's words alone
        assert f"finished results are in {out}; run again with resume: true" in err, err[-3000:]
        assert not re.search(r'File ".*(tp_engine|launch)/', err), err[-3000:]  # one line, not our traceback


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_then_resume_completes(ckpt, tmp_path, sig):
    cfg, out = long_job(ckpt, tmp_path)
    cfg["prompts"] = cfg["prompts"][:16]
    proc = start_job(cfg, tmp_path)
    try:
        wait_for_lines(out, 3, proc)
        os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)  # Ctrl-C hits the group
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "resume" in err
    partial = check_results_file(out, 16)
    if sig == signal.SIGINT:  # resuming does not depend on how the run stopped: once is enough
        return
    with out.open("a") as f:
        f.write('{"index": 15, "prompt_tok')  # a line torn by a crash is ignored on resume
    cfg["max_batch_size"] = 16  # the tokens do not depend on the batch
    proc2, lines = run_cli({**cfg, "resume": True}, tmp_path, nproc=2, name="resume")
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert [line["index"] for line in lines] == list(range(16))
    assert json.loads(proc2.stderr.split("summary: ")[1].splitlines()[0])["resumed_skipped"] == len(partial)
    _, fresh = run_cli({**cfg, "output": str(tmp_path / "fresh.jsonl")}, tmp_path, name="fresh")
    assert lines == fresh


def on_call(target: str, rank: str, call: int, action: str) -> str:
    """A CLI script that runs `action` (lines of Python) on rank `rank` at the `call`-th call of `target`
    (package.module.Class.method in tp_engine), before the call itself; str.format fills {root} and the
    action's fields."""
    package, module, cls, method = target.split(".")
    body = textwrap.indent(textwrap.dedent(action).strip(), " " * 12)
    return f"""
import os, sys, time
sys.path.insert(0, {{root!r}})
from tp_engine.{package} import {module}
if os.environ["RANK"] == "{rank}":
    real, calls = {module}.{cls}.{method}, [0]
    def patched(self, *args):
        calls[0] += 1
        if calls[0] == {call}:
{body}
        return real(self, *args)
    {module}.{cls}.{method} = patched
from tp_engine.cli import main
sys.exit(main())
"""


# rank 1 stops taking part at its 150th step; rank 0 blocks in its next collective
STUCK = on_call("runtime.engine.Engine.forward", "1", 150, 'open({marker!r}, "w").close()\ntime.sleep(600)')


@pytest.mark.slow
def test_sigterm_ends_a_rank_blocked_in_a_collective(ckpt, tmp_path):
    """SIGTERM to a rank that waits in a collective for a stuck peer: it leaves at once (not after
    timeout_s), and torchrun then ends the stuck one."""
    marker = tmp_path / "stuck"
    script = tmp_path / "stuck.py"
    script.write_text(STUCK.format(root=str(ROOT), marker=str(marker)))
    cfg, out = long_job(ckpt, tmp_path)
    proc = start_job(cfg, tmp_path, script=script)
    try:
        t0 = time.time()
        while not marker.exists():
            assert proc.poll() is None and time.time() - t0 < 120, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        time.sleep(1.0)  # rank 0 is now inside a collective that rank 1 never joins
        os.kill(worker_pids(proc.pid)[0], signal.SIGTERM)
        t0 = time.time()
        _, err = proc.communicate(timeout=25)
        assert time.time() - t0 < 25
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "stopped by SIGTERM" in err
    check_results_file(out, 300)


def run_patched(cfg, tmp_path, source: str, limit: float, **fields) -> tuple[int, str]:
    """The CLI at TP=2 through a script that patches the engine first: (exit status, stderr)."""
    script = tmp_path / "patched.py"
    script.write_text(source.format(root=str(ROOT), **fields))
    proc = start_job(cfg, tmp_path, script=script)
    try:
        _, err = proc.communicate(timeout=limit)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err


@pytest.mark.slow
@pytest.mark.parametrize("rank", ["0", "1"])
def test_exception_on_one_rank_stops_the_job(ckpt, tmp_path, rank):
    cfg, out = long_job(ckpt, tmp_path)
    faulty = on_call("runtime.engine.Engine.forward", rank, 150, 'raise RuntimeError("injected fault")')
    code, err = run_patched(cfg, tmp_path, faulty, 60)
    assert code != 0
    assert f"error: rank {rank}: RuntimeError: injected fault" in err
    check_results_file(out, 300)


@pytest.mark.slow
def test_ranks_with_different_configs_are_detected(ckpt, tmp_path):
    import yaml
    port = free_port()
    procs = []
    for rank in range(2):
        conf = tmp_path / f"r{rank}.yaml"
        conf.write_text(yaml.safe_dump(base(ckpt, device="cpu", seed=rank)))
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(GENERATE), "--config", str(conf)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=60)[1] for p in procs]
    assert all(p.returncode != 0 for p in procs)
    assert "different configurations" in errs[0]


SLOW_PREFLIGHT = """
import sys, time
sys.path.insert(0, {root!r})
from tp_engine import cli
def slow(self, device):
    time.sleep(60)  # rank 0 encoding a huge prompts_file
cli.Preflight.__call__ = slow
sys.exit(cli.main())
"""


@pytest.mark.slow
def test_rank_waiting_past_timeout_s_at_start_up_says_so_in_one_line(ckpt, tmp_path):
    code, err = run_patched(base(ckpt, device="cpu", timeout_s=2), tmp_path, SLOW_PREFLIGHT, 50)
    assert code != 0
    assert "error: rank 1: not every rank reported at start-up within timeout_s" in err, err[-3000:]
    assert "(Timed out waiting 2000ms for send operation to complete)" in err
    assert "a very large prompts_file needs a larger timeout_s" in err
    assert not re.search(r'File ".*(tp_engine|launch)/', err) and "C++" not in err, err[-3000:]


# rank 0 busy between two steps: rank 1 waits for the step message
SLOW_RANK_0 = on_call("runtime.scheduler.Scheduler.commit", "0", 5, "time.sleep(60)")


@pytest.mark.slow
def test_rank_waiting_past_timeout_s_for_a_step_message_says_so_in_one_line(ckpt, tmp_path):
    """A follower waiting past timeout_s for a step message through gloo (the CPU's step channel) ends in one
    line naming timeout_s and the likely cause, not in gloo's bare 'Timed out waiting ...'."""
    cfg, _ = long_job(ckpt, tmp_path)
    code, err = run_patched({**cfg, "timeout_s": 5}, tmp_path, SLOW_RANK_0, 50)
    assert code != 0
    assert ("error: rank 1: RuntimeError: rank 1: no step message from rank 0 within timeout_s (Timed out "
            "waiting 5000ms for recv operation to complete); another rank probably failed") in err, \
        err[-3000:]


# rank 0 stops before a step's forward: rank 1, which has the step, waits in the first all-reduce
STALLED_RANK_0 = on_call("runtime.engine.Engine.forward", "0", 150, "time.sleep(60)")


@pytest.mark.slow
def test_rank_waiting_past_timeout_s_in_a_collective_says_so_in_one_line(ckpt, tmp_path):
    """A rank waiting past timeout_s in a collective ends in one line naming timeout_s, without gloo's C++
    source path or a traceback; the finished results are in the output file."""
    cfg, out = long_job(ckpt, tmp_path)
    code, err = run_patched({**cfg, "timeout_s": 5}, tmp_path, STALLED_RANK_0, 50)
    assert code != 0
    assert ("error: rank 1: another rank did not join a collective within timeout_s (5 s; Timed out waiting "
            "5000ms for recv operation to complete): it is stuck or stopped") in err, err[-3000:]
    assert not re.search(r'File ".*(tp_engine|launch)/', err) and ".cc:" not in err, err[-3000:]
    check_results_file(out, 300)
