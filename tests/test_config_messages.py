"""The config errors a new user meets first: a key written without its section or under a misspelt section,
and a `model` that is a file or a relative path that is not there. Each message names what to write
instead."""

import pytest

from helpers import ROOT
from tp_engine.base.config import ConfigError, build_config

DEMO = ROOT / "configs" / "models" / "demo"


def error(*overrides, path=None):
    with pytest.raises(ConfigError) as err:
        build_config(path, [f"model={DEMO}", "prompts=[a]", *overrides])
    return str(err.value)


@pytest.mark.parametrize("given, meant", [
    ("top_p=0.9", "sampling.top_p"),  # the sampling keys as other engines spell them, flat
    ("n=2", "sampling.n"),
    ("stop=[x]", "sampling.stop"),
    ("page_size=8", "kv_cache.page_size"),
    ("top_q=0.9", "sampling.top_p"),
    ("sample={temperature: 0.7}", "sampling"),  # a misspelt section: not 'sampling.n'
    ("kvcache={num_pages: 8}", "kv_cache"),
    ("advance={all_reduce: nccl}", "advanced"),
    ("temprature=0.7", "sampling.temperature"),  # as before
    ("sampling.temprature=0.7", "sampling.temperature"),
    ("seeds=1", "seed"),
])
def test_unknown_key_suggests_the_key_meant(given, meant):
    name = given.split("=")[0]
    assert error(given) == f"unknown config key '{name}'; did you mean '{meant}'?"


@pytest.mark.parametrize("given", ["tp=2", "num_gpus=2", "num_samples=2", "num_beams=2", "stop_strings=[x]",
                                   "pad_token_id=0"])
def test_unknown_key_suggests_no_unrelated_key(given):
    """A bare name gets no suggestion that only looks alike: not 'sampling.stop' for 'tp',
    'kv_cache.num_pages' for 'num_gpus', nor 'sampling.stop_token_ids' for 'stop_strings' (transformers' name
    for sampling.stop)."""
    assert error(given) == f"unknown config key '{given.split('=')[0]}'"


def test_misspelt_section_in_a_file_suggests_the_section(tmp_path):
    conf = tmp_path / "run.yaml"
    conf.write_text(f"model: {DEMO}\nprompts: [a]\nsample:\n  temperature: 0.7\n")
    with pytest.raises(ConfigError) as err:
        build_config(str(conf))
    assert str(err.value) == "unknown config key 'sample'; did you mean 'sampling'?"


def test_model_that_is_a_file_is_called_a_file():
    msg = error(f"model={DEMO / 'config.json'}")
    assert msg == f"config key 'model': {DEMO / 'config.json'} is a file; give the checkpoint's folder " \
        "(config.json, *.safetensors)"


def test_relative_model_not_found_says_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert error("model=models/demo") == (f"config key 'model': directory not found: models/demo (looked for "
                                          f"from {tmp_path}; a path in the config file also from its folder)")
