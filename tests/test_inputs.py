"""Inputs read defensively, and the Python API as strict as the config: UTF-8 and JSONL lines, config.json
field types, SamplingParams by the config's own rules, generate() with one prompt. In-process: no torchrun."""
import json

import pytest

from helpers import ROOT
from tp_engine.cli import main
from tp_engine.config import ConfigError, build_config
from tp_engine.model_config import ModelConfig, ModelError

DEMO = ROOT / "configs" / "models" / "demo"


def cli(capsys, *args):
    code = main(list(args))
    return code, capsys.readouterr().err


def config_with_prompts_file(tmp_path, data: bytes):
    pf = tmp_path / "prompts.jsonl"
    pf.write_bytes(data)
    conf = tmp_path / "run.yaml"
    conf.write_text(f"model: {DEMO}\nprompts_file: {pf}\n")
    return conf, pf


# ---- YAML and JSONL ----

def test_config_file_that_is_not_utf8_names_file_line_and_column(tmp_path, capsys):
    conf = tmp_path / "run.yaml"
    conf.write_bytes(f"model: {DEMO}\nprompts:\n  - caf\xe9 au lait\n".encode("latin-1"))
    code, err = cli(capsys, "--config", str(conf), "--print-config")
    assert code == 2
    assert f"error: {conf} line 3: not valid UTF-8 (byte 0xe9 at column 8)" in err


def test_prompts_file_that_is_not_utf8_names_file_line_and_column(tmp_path, capsys):
    conf, pf = config_with_prompts_file(tmp_path, b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    code, err = cli(capsys, "--config", str(conf), "--print-config")
    assert code == 2
    assert f"error: {pf} line 2: not valid UTF-8 (byte 0xe9 at column 16)" in err


def test_prompts_file_lines_end_at_newlines_only(tmp_path, capsys):
    # U+2028 may stand raw inside a JSON string; str.splitlines() would cut the line there. CRLF ends are fine.
    conf, pf = config_with_prompts_file(tmp_path, '{"prompt": "one\u2028two"}\r\n{"input_ids": [1, 2]}\n'.encode())
    code, err = cli(capsys, "--config", str(conf), "--print-config")
    assert code == 0, err
    from tp_engine.prompts import read_prompts
    assert read_prompts(build_config(str(conf))) == [{"prompt": "one\u2028two"}, {"input_ids": [1, 2]}]


# ---- config.json ----

CONFIG_JSON_CASES = {
    "string_for_int": ({"num_attention_heads": "4"}, "field 'num_attention_heads' must be an integer >= 1, got \"4\""),
    "null_for_float": ({"rms_norm_eps": None}, "field 'rms_norm_eps' must be a positive number, got null"),
    "bool_for_int": ({"hidden_size": True}, "field 'hidden_size' must be an integer >= 1, got true"),
    "string_for_bool": ({"tie_word_embeddings": "false"}, "field 'tie_word_embeddings' must be true or false"),
    "not_an_object": ([1, 2], "must hold a JSON object, got list"),
}


@pytest.mark.parametrize("case", list(CONFIG_JSON_CASES))
def test_config_json_fields_are_type_checked(tmp_path, case):
    change, needle = CONFIG_JSON_CASES[case]
    raw = change if isinstance(change, list) else {**json.loads((DEMO / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelError) as err:
        ModelConfig.from_dir(str(tmp_path))
    assert str(tmp_path / "config.json") in str(err.value) and needle in str(err.value)


# ---- the Python API ----

BAD_SAMPLING = [("temperature", "0.7"), ("max_new_tokens", 1.5), ("stop_token_ids", 5), ("top_k", True),
                ("top_p", 0), ("stop", [""]), ("seed", 2**32), ("seed", -1)]


@pytest.mark.parametrize("name,value", BAD_SAMPLING)
def test_sampling_params_follow_the_config_rules(name, value):
    from tp_engine.sampler import SamplingParams
    key = "seed" if name == "seed" else f"sampling.{name}"
    with pytest.raises(ConfigError) as from_config:
        build_config(model=str(DEMO), prompts=[], **({name: value} if name == "seed" else {"sampling": {name: value}}))
    with pytest.raises(ConfigError) as from_api:
        SamplingParams(**{name: value})
    assert str(from_api.value) == str(from_config.value).replace(f"config key '{key}'", f"SamplingParams.{name}")


def test_generate_takes_one_prompt_and_stop_as_one_string():
    from tp_engine.llm import LLM
    from tp_engine.sampler import SamplingParams
    llm = LLM(model=str(DEMO), device="cpu")
    params = SamplingParams(max_new_tokens=40, stop=" sister")
    assert params.stop == [" sister"]
    (out,) = llm.generate("Alice was beginning to get very tired", params)  # one prompt, not one per character
    assert (out["finish_reason"], out["text"]) == ("stop", " of sitting by her")  # cut at the string, not a letter
    (again,) = llm.generate(out["prompt_token_ids"], SamplingParams(max_new_tokens=3))  # one list of ids
    assert again["prompt_token_ids"] == out["prompt_token_ids"] and len(again["output_token_ids"]) == 3
    with pytest.raises(TypeError):
        llm.generate(5)
    llm.shutdown()
