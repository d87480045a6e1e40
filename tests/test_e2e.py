"""End to end under torchrun: greedy tokens equal transformers' Qwen3 `generate`, for each checkpoint variant
at TP 1, 2 and 4. One variant goes through the real CLI (launch/generate.py) at each TP; the others through
the Python API, all of them in one torchrun job per TP (a job per variant spent most of its time starting
processes), at TP 1 in the test's process."""
import pytest

from helpers import api_outputs, hf_generate, make_checkpoint, run_cli

PROMPTS = [[5, 17, 300, 42, 8], [1, 2, 3], [250, 9, 77, 13, 101, 4, 3, 2, 1, 0, 66], [7]]
MAX_NEW = 12

VARIANTS = {
    "untied": {},
    "tied": {"tie": True},
    "vocab_not_divisible": {"vocab": 1001},  # 1001 = 7 * 11 * 13: never a multiple of the TP size
    "sharded_index": {"shard": True},  # several safetensors files + model.safetensors.index.json
    "head_dim_not_hidden_over_heads": {"hidden": 48, "heads": 4, "head_dim": 16},  # 4 * 16 != 48
    "transformers_4x_config": {"v4_style": True},
    "kv_heads_1": {"kv_heads": 1, "heads": 4},  # replicated on every rank at TP 2 and 4
    "attention_bias": {"attention_bias": True},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    made = {}
    for name, kw in VARIANTS.items():
        path = make_checkpoint(root / name, **kw)
        made[name] = (path, hf_generate(path, PROMPTS, MAX_NEW))
    return made


CLI_VARIANT = "sharded_index"


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_greedy_equals_transformers(checkpoints, tp, tmp_path):
    cfg = {"model": str(checkpoints[CLI_VARIANT][0]), "prompts": [{"input_ids": p} for p in PROMPTS],
           "sampling": {"max_new_tokens": MAX_NEW}}
    proc, lines = run_cli(cfg, tmp_path, nproc=tp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    models = {name: path for name, (path, _) in checkpoints.items() if name != CLI_VARIANT}
    results = {CLI_VARIANT: lines, **api_outputs(models, PROMPTS, {"max_new_tokens": MAX_NEW}, tp, tmp_path)}
    for variant, (_, expected) in checkpoints.items():
        lines = results[variant]
        assert [line["index"] for line in lines] == list(range(len(PROMPTS))), variant
        for line, want in zip(lines, expected):
            assert line["output_token_ids"] == want, (variant, tp, line["index"])
            assert line["finish_reason"] == "length", variant
            assert line["text"] is None, variant  # these checkpoints have no tokenizer


@pytest.mark.slow
def test_eos_from_generation_config_stops_like_transformers(tmp_path):
    probe = make_checkpoint(tmp_path / "probe")
    free_run = hf_generate(probe, PROMPTS[:1], MAX_NEW)[0]
    eos = free_run[3]  # a token greedy decoding reaches, so both engines must stop on it
    path = make_checkpoint(tmp_path / "eos", eos=eos)
    want = hf_generate(path, PROMPTS, MAX_NEW)
    cfg = {"model": str(path), "prompts": [{"input_ids": p} for p in PROMPTS],
           "sampling": {"max_new_tokens": MAX_NEW}}
    proc, lines = run_cli(cfg, tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line["output_token_ids"] for line in lines] == want
    assert lines[0]["finish_reason"] == "stop" and lines[0]["output_token_ids"][-1] == eos
    # ignore_eos runs on to max_new_tokens, through the EOS token
    proc, lines = run_cli({**cfg, "sampling": {"max_new_tokens": MAX_NEW, "ignore_eos": True}},
                          tmp_path, name="ign")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert lines[0]["output_token_ids"] == free_run and lines[0]["finish_reason"] == "length"
    # stop_token_ids end a request like EOS
    stop = free_run[1]
    proc, lines = run_cli({**cfg, "sampling": {"max_new_tokens": MAX_NEW, "ignore_eos": True,
                                               "stop_token_ids": [stop]}},
                          tmp_path, name="stopids")
    assert lines[0]["output_token_ids"] == free_run[:2] and lines[0]["finish_reason"] == "stop"
