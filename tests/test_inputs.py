"""Inputs read defensively, and the Python API as strict as the config: UTF-8 and JSONL lines, config.json
field types, SamplingParams by the config's own rules, generate() with one prompt. In-process: no torchrun."""
import json
import os
from array import array
import re
from pathlib import Path

import pytest

from helpers import ROOT, run_cli
from tp_engine.cli import main
from tp_engine.base.config import ConfigError, build_config
from tp_engine.checkpoint.model_config import ModelConfig, ModelError

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


def test_help_and_a_bad_config_answer_before_torch_loads(tmp_path):
    """torch takes seconds to import, on every rank at once: the command line loads it only once the config is
    good, so --help, --print-config and a mistyped key answer at once."""
    import subprocess
    import sys
    conf = tmp_path / "run.yaml"
    conf.write_text(f"model: {DEMO}\nprompts: [hi]\nsampling: {{top_p: 3.0}}\n")
    script = f"""import sys
from tp_engine.cli import main
try:
    main(["--help"])
except SystemExit as e:
    print("help", e.code, "torch" in sys.modules)
main(["--config", {str(conf)!r}, "--set", "sampling.top_p=0.5", "--print-config"])
print("print-config", "torch" in sys.modules)
print("bad", main(["--config", {str(conf)!r}]), "torch" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert "must be in (0, 1]; got 3.0" in proc.stderr, proc.stderr[-2000:]
    said = [line for line in proc.stdout.splitlines() if line.startswith(("help ", "print-config ", "bad "))]
    assert said == ["help 0 False", "print-config False", "bad 2 False"], proc.stdout[-2000:]


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
    # U+2028 may stand raw inside a JSON string; str.splitlines() would cut the line there.
    # CRLF ends are fine.
    conf, pf = config_with_prompts_file(tmp_path,
                                        '{"prompt": "one\u2028two"}\r\n{"input_ids": [1, 2]}\n'.encode())
    code, err = cli(capsys, "--config", str(conf), "--print-config")
    assert code == 0, err
    from tp_engine.frontend.prompts import read_prompts
    assert read_prompts(build_config(str(conf))) == [{"prompt": "one\u2028two"},
                                                     {"input_ids": array("i", [1, 2])}]


def test_unreadable_config_or_prompts_file_is_one_message(tmp_path, capsys, monkeypatch):
    """A file the user may not read, or a folder given as one: one line and exit 2, not a traceback."""
    conf, pf = config_with_prompts_file(tmp_path, b'{"prompt": "a"}\n')
    real = Path.read_bytes
    # as a user without read permission sees it (tests may run as root, which may read)
    for denied in (pf, conf):
        def read_bytes(path, denied=denied):
            if Path(path) == denied:
                raise PermissionError(13, "Permission denied", str(path))
            return real(path)
        monkeypatch.setattr(Path, "read_bytes", read_bytes)
        code, err = cli(capsys, "--config", str(conf), "--print-config")
        assert (code, err) == (2, f"error: {denied}: cannot read it: Permission denied\n")
    monkeypatch.undo()
    code, err = cli(capsys, "--config", str(conf), "--print-config", "--set", f"prompts_file={tmp_path}")
    assert (code, err) == (2, f"error: config key 'prompts_file': not a regular file: {tmp_path}\n")


def test_rank0_holds_a_jobs_prompt_ids_in_a_few_bytes_a_token(tmp_path, monkeypatch):
    """Rank 0 holds every prompt of a job while it runs: the ids read from prompts_file and their encoded copy
    take a few bytes a token, not the 45 of Python ints (a million prompts of 500 tokens: 22 GB)."""
    import random
    import tracemalloc
    from tp_engine.llm import LLM
    held = {}

    def at_start(*args, **kwargs):
        held["start"] = tracemalloc.get_traced_memory()[0]
    monkeypatch.setattr(LLM, "generate", at_start)

    def job(length: int) -> int:
        """Bytes held when generation starts, for 1,000 prompts of `length` ids."""
        random.seed(length)
        lines = [{"input_ids": [random.randrange(300, 1900) for _ in range(length)]} for _ in range(1000)]
        conf, _ = config_with_prompts_file(tmp_path, "".join(json.dumps(x) + "\n" for x in lines).encode())
        tracemalloc.start()
        try:
            assert main(["--config", str(conf), "--quiet"]) == 0
        finally:
            tracemalloc.stop()
        return held["start"]
    job(4)  # imports and caches
    short, long = job(4), job(204)
    assert (long - short) / (1000 * 200) < 12, \
        f"{short:,} bytes held for 1,000 x 4 ids, {long:,} for 1,000 x 204"


def test_a_jobs_texts_are_tokenized_in_batches_with_the_ids_of_one_at_a_time(monkeypatch):
    """The command line tokenized a job's prompts one call each before any weight loaded; batches let a fast
    tokenizer use its threads. Ids and errors must be those of each prompt alone, also when a batch fails."""
    from transformers import AutoTokenizer
    from tp_engine.frontend.prompts import TOKENIZE_BATCH, PromptEncoder, PromptError
    tok = AutoTokenizer.from_pretrained(str(DEMO))
    words = "the rabbit hole went straight on like a tunnel and then dipped suddenly down".split()
    texts = [" ".join(words[i % 7:i % 11 + 3]) + f" {i}" for i in range(TOKENIZE_BATCH + 300)]
    prompts = [*texts, {"messages": [{"role": "user", "content": "Hi"}]},
               {"input_ids": [3, 4]}, "bad \ud800", 5]
    enc = PromptEncoder(str(DEMO))
    calls = []
    real = type(enc.tokenizer).__call__
    monkeypatch.setattr(type(enc.tokenizer), "__call__",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    got = enc.encode_all(prompts)
    expected = [tok.encode(t, add_special_tokens=False) for t in texts]
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert [list(x) for x in got[:-2]] == [*expected, tok.encode(chat, add_special_tokens=False), [3, 4]]
    assert isinstance(got[-2], PromptError) and "lone surrogate" in str(got[-2])
    assert isinstance(got[-1], PromptError)
    assert len(calls) == 2  # two batches, not a call per prompt
    monkeypatch.setattr(type(enc.tokenizer), "__call__", lambda self, *a, **k: 1 / 0)  # a batch that fails
    assert [list(x) for x in enc.encode_all(texts[:5])] == expected[:5]


def test_encoding_a_jobs_texts_holds_a_batch_of_them_as_python_ints(monkeypatch):
    """encode_all makes each batch's ids compact before it tokenizes the next: at its peak it holds one batch
    as Python ints (about 45 bytes a token), not all of a job's."""
    import tracemalloc
    from tp_engine.frontend import prompts as P
    monkeypatch.setattr(P, "TOKENIZE_BATCH", 64)
    enc = P.PromptEncoder(str(DEMO))
    words = "the rabbit hole went straight on like a tunnel and then dipped suddenly down".split()

    def peak(n_words: int) -> tuple[int, int]:
        """(bytes at the peak of encoding 2,000 texts of `n_words` words, their tokens)"""
        texts = [" ".join(words[(i + j) % len(words)] for j in range(n_words)) for i in range(2000)]
        tracemalloc.start()
        try:
            ids = enc.encode_all(texts)
            return tracemalloc.get_traced_memory()[1], sum(map(len, ids))
        finally:
            tracemalloc.stop()
    enc.encode_all(["warm up"])
    (short, short_tokens), (long, long_tokens) = peak(3), peak(150)
    assert (long - short) / (long_tokens - short_tokens) < 15, f"{short:,} bytes at the peak, then {long:,}"


def test_input_ids_given_as_an_array_of_floats_are_refused():
    from tp_engine.frontend.prompts import PromptEncoder, PromptError
    got = PromptEncoder(str(DEMO)).encode_all([{"input_ids": array("d", [5.0, 6.5])},
                                               {"input_ids": array("i", [5])}])
    assert isinstance(got[0], PromptError) and "input_ids must be a list of integers" in str(got[0])
    assert list(got[1]) == [5]


def test_a_key_given_twice_in_a_prompts_file_line_is_refused(tmp_path, capsys):
    conf, pf = config_with_prompts_file(tmp_path, b'{"prompt": "a"}\n{"prompt": "b", "prompt": "c"}\n')
    code, err = cli(capsys, "--config", str(conf), "--print-config")
    assert (code, err) == (2, f"error: {pf} line 2: key 'prompt' is given twice in one object\n")


def test_prompts_and_prompts_file_are_one_choice_that_a_later_layer_replaces(tmp_path):
    """--set wins over the file: its `prompts` replaces the file's `prompts_file`, and the other way round."""
    conf, pf = config_with_prompts_file(tmp_path, b'{"prompt": "a"}\n')
    cfg = build_config(str(conf), overrides=["prompts=[hello]"])
    assert (cfg["prompts"], cfg["prompts_file"]) == (["hello"], None)
    conf.write_text(f"model: {DEMO}\nprompts: [hi]\n")
    cfg = build_config(str(conf), overrides=[f"prompts_file={pf}"])
    assert (cfg["prompts"], cfg["prompts_file"]) == (None, str(pf))
    from tp_engine.frontend.prompts import read_prompts
    with pytest.raises(ConfigError, match="both are set"):  # one layer giving both is still a contradiction
        read_prompts(build_config(str(conf), overrides=["prompts=[hello]", f"prompts_file={pf}"]))


@pytest.mark.slow
def test_prompt_objects_with_odd_keys_or_lone_surrogates_fail_alone(tmp_path):
    """Each is that prompt's error, and the others run on every rank: a key a prompt object does not take
    (not a string, an option that goes inside `sampling`, a typo: named with the key meant), two prompt keys
    in one object, a lone surrogate (the tokenizer's TypeError otherwise)."""
    prompts = [{"prompt": "Alice", 1: "x"}, {"prompt": "a", "input_ids": [1, 2]}, {"prompt": "hi \ud83d"},
               {"messages": [{"role": "user", "content": "x\ud800"}]}, "Bob",
               {"prompt": "Alice", "max_tokens": 3}, {"promt": "Alice"}]
    proc, lines = run_cli({"model": str(DEMO), "prompts": prompts, "sampling": {"max_new_tokens": 2}},
                          tmp_path, nproc=1)
    assert proc.returncode == 0, proc.stderr[-2000:]  # finished: every prompt has its line
    assert [line["finish_reason"] for line in lines] == ["error"] * 4 + ["length"] + ["error"] * 2
    known = "(its keys: 'prompt', 'input_ids', 'messages', 'sampling')"
    assert lines[0]["error"] == f"unknown key 1 in a prompt object {known}"
    assert lines[5]["error"] == f"unknown key 'max_tokens' in a prompt object {known}"
    assert lines[6]["error"] == f"unknown key 'promt' in a prompt object; did you mean 'prompt'? {known}"
    assert lines[1]["error"] == "a prompt object takes one of 'prompt', 'input_ids' and 'messages'; got " \
                                "['prompt', 'input_ids']"
    assert lines[2]["error"] == "the prompt is not valid Unicode: a lone surrogate \\ud83d at character 3"
    assert lines[3]["error"] == \
        "message 0's content is not valid Unicode: a lone surrogate \\ud800 at character 1"


# ---- config.json ----

CONFIG_JSON_CASES = {
    "string_for_int": ({"num_attention_heads": "4"},
                       "field 'num_attention_heads' must be an integer >= 1, got \"4\""),
    "null_for_float": ({"rms_norm_eps": None}, "field 'rms_norm_eps' must be a positive number, got null"),
    "bool_for_int": ({"hidden_size": True}, "field 'hidden_size' must be an integer >= 1, got true"),
    "string_for_bool": ({"tie_word_embeddings": "false"},
                        "field 'tie_word_embeddings' must be true or false"),
    "not_an_object": ([1, 2], "must hold a JSON object, got list"),
    "string_for_window_layers": ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": "1"},
                                 "field 'max_window_layers' must be an integer >= 0, got \"1\""),
    # refused here, not inside the first step (a shape mismatch) or run with no keys at all (8 KV heads for 4)
    "kv_heads_not_dividing": ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of "
                                                          "num_key_value_heads=3"),
    "more_kv_heads_than_heads": ({"num_key_value_heads": 8}, "num_attention_heads=4 is not a multiple of "
                                                             "num_key_value_heads=8"),
    "odd_head_dim": ({"head_dim": 33}, "head_dim=33 must be even"),
    # these named the architecture, which is supported, as unsupported, and not model_type
    "model_type_of_another_arch": ({"model_type": "qwen3_moe"}, "model_type 'qwen3_moe' does not match "
                                                                "architectures ['Qwen3ForCausalLM']"),
    "unsupported_model_type": ({"model_type": "qwen2"}, "unsupported model_type 'qwen2'"),
    "unsupported_architecture": ({"architectures": ["LlamaForCausalLM"]}, "unsupported architecture "
                                                                          "['LlamaForCausalLM']"),
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
                ("top_p", 0), ("stop", [""]), ("seed", 2**32), ("seed", -1), ("stop", ["ok", "x\udc00"])]


@pytest.mark.parametrize("name,value", BAD_SAMPLING)
def test_sampling_params_follow_the_config_rules(name, value):
    from tp_engine.sampling.sampler import SamplingParams
    key = "seed" if name == "seed" else f"sampling.{name}"
    with pytest.raises(ConfigError) as from_config:
        build_config(model=str(DEMO), prompts=[],
                     **({name: value} if name == "seed" else {"sampling": {name: value}}))
    with pytest.raises(ConfigError) as from_api:
        SamplingParams(**{name: value})
    assert str(from_api.value) == str(from_config.value).replace(f"config key '{key}'",
                                                                 f"SamplingParams.{name}")
    if name == "temperature":  # as the docs quote it: "a number", not "an integer or a number"
        assert str(from_api.value) == "SamplingParams.temperature must be a number, got '0.7' (str)"


def test_a_checkpoint_without_eos_is_warned_about(tmp_path, caplog):
    """transformers 5's Qwen3Config() writes eos_token_id null: chat outputs then never stop at <|im_end|>."""
    import logging
    from helpers import make_checkpoint
    from tp_engine.llm import LLM
    ckpt = make_checkpoint(tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").unlink(missing_ok=True)
    with caplog.at_level(logging.WARNING, logger="tp_engine"):
        LLM(model=str(ckpt), device="cpu").shutdown()
    assert f"{ckpt}/config.json and generation_config.json name no eos_token_id" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tp_engine"):
        LLM(model=str(make_checkpoint(tmp_path / "e", eos=7)), device="cpu").shutdown()
    assert "eos_token_id" not in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [0, 2])
def test_a_model_too_large_for_memory_is_one_start_up_error_naming_its_sizes(tmp_path, nproc):
    """A model too large for the device (here a vocab_size of 1e11) is one start-up error naming config.json,
    its sizes and what to do (the rank exits 2), not an allocator traceback on every rank."""
    from helpers import make_checkpoint
    ckpt = make_checkpoint(tmp_path / "m")
    raw = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**raw, "vocab_size": 10**11}))
    proc, _ = run_cli({"model": str(ckpt), "prompts": [{"input_ids": [1, 2]}]}, tmp_path, nproc=nproc)
    assert proc.returncode == (2 if nproc == 0 else 1), proc.stderr[-3000:]  # torchrun: 1 when a rank fails
    assert "alloc_cpu" not in proc.stderr and (nproc == 0 or re.search(r"exitcode\s*: 2\b", proc.stderr))
    assert f"{ckpt}/config.json: the model does not fit in cpu memory" in proc.stderr
    assert "vocab_size 100000000000, hidden_size" in proc.stderr
    assert "use more ranks or FP8 weights" in proc.stderr


def test_a_kv_pool_shorter_than_max_model_len_is_said_at_start_up(caplog, monkeypatch):
    """Requests longer than the pool end with finish_reason length: the start-up line says where the limit
    is."""
    import logging
    from tp_engine.runtime import memory_plan
    from tp_engine.llm import LLM
    # as a small default pool on the CPU would be
    monkeypatch.setattr(memory_plan, "budget_pages", lambda *a: 4)
    with caplog.at_level(logging.INFO, logger="tp_engine"):
        LLM(model=str(DEMO), device="cpu").shutdown()
    assert ("KV cache: 4 pages of 16 tokens = 64 tokens per rank; a request holds at most 64 of "
            "max_model_len 512 tokens (kv_cache.num_pages sets the pool)") in caplog.text


def test_llm_says_which_keys_only_the_command_line_reads(tmp_path, caplog):
    import logging
    from tp_engine.llm import LLM
    with caplog.at_level(logging.WARNING, logger="tp_engine"):
        LLM(model=str(DEMO), device="cpu", output=str(tmp_path / "o.jsonl"), stream=True,
            fail_on_prompt_error=True).shutdown()
    assert "config keys output, stream, fail_on_prompt_error are read by the command line only: " \
           "LLM ignores them" in caplog.text


def test_sampling_params_without_a_seed_take_the_llms():
    """A SamplingParams that names no seed samples with the LLM's seed (LLM(seed=5)), not with seed 0."""
    from tp_engine.llm import LLM
    from tp_engine.sampling.sampler import SamplingParams
    llm = LLM(model=str(DEMO), device="cpu", seed=5, sampling={"temperature": 1.0, "max_new_tokens": 12})

    def ids(params=None):
        return llm.generate(["Alice was"], params)[0]["output_token_ids"]
    own = ids()
    assert ids(SamplingParams(temperature=1.0, max_new_tokens=12)) == own
    assert ids(SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)) == own
    assert ids(SamplingParams(temperature=1.0, max_new_tokens=12, seed=0)) != own
    llm.shutdown()


def test_generate_takes_one_prompt_and_stop_as_one_string():
    from tp_engine.llm import LLM
    from tp_engine.sampling.sampler import SamplingParams
    llm = LLM(model=str(DEMO), device="cpu")
    params = SamplingParams(max_new_tokens=40, stop=" sister")
    assert params.stop == [" sister"]
    # one prompt, not one per character
    (out,) = llm.generate("Alice was beginning to get very tired", params)
    # cut at the string, not a letter
    assert (out["finish_reason"], out["text"]) == ("stop", " of sitting by her")
    (again,) = llm.generate(out["prompt_token_ids"], SamplingParams(max_new_tokens=3))  # one list of ids
    assert again["prompt_token_ids"] == out["prompt_token_ids"] and len(again["output_token_ids"]) == 3
    with pytest.raises(TypeError):
        llm.generate(5)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="this LLM was shut down; create a new LLM"):
        llm.generate("Alice")


def test_stop_strings_keep_nothing_of_a_finished_request():
    """The stop-string window of a request goes with the request: generate keeps none by id to its end, which
    would hold memory for every request of the job, and a new request with a finished one's id would take its
    window over."""
    import gc
    from transformers import AutoTokenizer
    from tp_engine.frontend.prompts import PromptEncoder
    from tp_engine.frontend.stop_strings import StopStrings
    tok, enc = AutoTokenizer.from_pretrained(str(DEMO)), PromptEncoder(str(DEMO))
    stops = StopStrings([","], enc.decode, enc.special_ids, enc.num_tokens)
    for _ in range(100):
        req = _request(tok.encode(" a long way down the rabbit hole", add_special_tokens=False))
        assert not stops.hit(req)
        del req
    gc.collect()
    assert len(stops.tails) == 0
    req = _request(tok.encode(",", add_special_tokens=False))
    assert stops.hit(req) and req.text == ""


def test_generate_runs_the_prompts_it_was_given_and_keeps_none_after_a_failed_call():
    """Requests are made as the scheduler has room, yet generate runs the prompts it was given: a change to
    the caller's list from on_finish changes nothing that runs, and after a failed call the scheduler keeps no
    half-read list to the next."""
    import gc
    import weakref
    from tp_engine.llm import LLM
    from tp_engine.sampling.sampler import SamplingParams

    class Prompt(dict):  # a prompt that a weak reference can follow
        pass
    llm = LLM(model=str(DEMO), device="cpu", max_batch_size=1)
    params = SamplingParams(max_new_tokens=2)
    prompts = [{"input_ids": [5, 6]}, {"input_ids": [7, 8]}, {"input_ids": [9]}]
    outs = llm.generate(prompts, params, on_finish=lambda out: prompts.__setitem__(2, {"input_ids": [1]}))
    assert [o["prompt_token_ids"] for o in outs] == [[5, 6], [7, 8], [9]]
    late = Prompt(input_ids=[3, 4])
    alive = weakref.ref(late)

    def fail(out):
        raise KeyError("from on_finish")
    with pytest.raises(KeyError):
        llm.generate([{"input_ids": [5, 6]}, late], params, on_finish=fail)
    del late
    gc.collect()
    assert alive() is None
    assert [o["prompt_token_ids"] for o in llm.generate([[2, 3]], params)] == [[2, 3]]
    llm.shutdown()


# ---- mistakes in the config's structure, and values no run can use ----

def test_a_key_given_twice_in_the_config_file_is_refused(tmp_path, capsys):
    # PyYAML alone keeps the second section: temperature 0.7 would be lost unsaid
    conf = tmp_path / "run.yaml"
    conf.write_text(f"model: {DEMO}\nsampling:\n  temperature: 0.7\nprompts: [hi]\n"
                    "sampling:\n  max_new_tokens: 4\n")
    code, err = cli(capsys, "--config", str(conf), "--print-config")
    assert code == 2 and "key 'sampling' is given twice (lines 2 and 5)" in err, err
    # in its section and by its dotted name: the later one won, either way round, without a word
    for order in ((0, 1), (1, 0)):
        two = [("sampling:\n  temperature: 0.5\n", "'temperature' in section 'sampling'"),
               ("sampling.temperature: 0.9\n", "'sampling.temperature'")]
        first, second = (two[i] for i in order)
        conf.write_text(f"model: {DEMO}\nprompts: [hi]\n{first[0]}{second[0]}")
        code, err = cli(capsys, "--config", str(conf), "--print-config")
        assert code == 2 and f"config key 'sampling.temperature' is given twice: as {first[1]} and as " \
            f"{second[1]}" in err, err
    conf.write_text(f"model: {DEMO}\nprompts: [hi]\n")  # --set twice: the last one, as on any command line
    cfg = build_config(str(conf), overrides=["sampling.temperature=0.3", "sampling.temperature=0.4"])
    assert cfg["sampling"]["temperature"] == 0.4


def test_yaml_merge_keys_are_read_and_unhashable_keys_refused(tmp_path, capsys):
    conf = tmp_path / "run.yaml"  # `<<: *anchor` is plain YAML, which the duplicate-key check lets through
    conf.write_text(f"model: {DEMO}\nprompts: [&p {{messages: [{{role: user, content: hi}}]}}, {{<<: *p}}]\n")
    first, second = build_config(str(conf))["prompts"]
    assert first == second == {"messages": [{"role": "user", "content": "hi"}]}
    # a key that is a list: one message, no traceback
    conf.write_text(f"model: {DEMO}\nprompts: [hi]\n[a]: 1\n")
    code, err = cli(capsys, "--config", str(conf), "--print-config")
    assert code == 2 and "is not valid YAML" in err and "found unhashable key" in err, err
    with pytest.raises(ConfigError, match="--set prompts"):
        build_config(model=str(DEMO), overrides=["prompts=[{[1]: 2}]"])


SECTION_CASES = {  # --set values (as YAML) -> the effective value, or the error
    "section_as_mapping": (["sampling={temperature: 0.5, top_k: 3}"],
                           ("sampling", {"temperature": 0.5, "top_k": 3})),
    "pool_as_mapping": (["kv_cache={num_pages: 4}"], ("kv_cache", {"num_pages": 4})),
    "entry_of_a_mapping_key": (["chat_template_kwargs={a: 1}", "chat_template_kwargs.enable_thinking=false"],
                               ("chat_template_kwargs", {"a": 1, "enable_thinking": False})),
    "exponent_without_a_point": (["sampling.temperature=1e-3"], ("sampling", {"temperature": 0.001})),
    # YAML: false
    "bare_off_in_yaml": (["advanced.fused_kernels=off"], ("advanced", {"fused_kernels": "off"})),
    "bare_on_in_yaml": (["advanced.fused_kernels=on"], ("advanced", {"fused_kernels": "on"})),
    "home_folder": (["output=~/runs/out.jsonl"], ("output", str(Path.home() / "runs" / "out.jsonl"))),
    "section_as_number": (["kv_cache=4"], "config key 'kv_cache' must be a mapping of its keys (such as "
                                          "'kv_cache.page_size'); got 4"),
    "endless_timeout": (["timeout_s=99999999999"], "config key 'timeout_s' must be between 1 and 2592000"),
    "infinite_temperature": (["sampling.temperature=.inf"],
                             "config key 'sampling.temperature' must be a finite"),
    "template_argument_of_the_engine": (["chat_template_kwargs={add_generation_prompt: false}"],
                                        "cannot set add_generation_prompt: apply_chat_template's own "
                                        "arguments"),
    "template_argument_with_no_effect": (["chat_template_kwargs={max_length: 8, truncation: true}"],
                                         "cannot set max_length, truncation: apply_chat_template's own "
                                         "arguments"),
    "resume_without_output": (["resume=true"], "config key 'resume' needs 'output'"),
    # refused at start-up, not on every prompt
    "template_variable_not_a_string": (["chat_template_kwargs={1: x}"],
                                       "config key 'chat_template_kwargs' must have string keys"),
    # an empty output is a mistake (a shell variable left unset, say), not stdout; "-" is stdout, no file "-"
    "empty_output": (["output="], "config key 'output' is an empty string: give a file path, or \"-\" (or no "
                                  "'output') for stdout"),
    "dash_output": (["output=-"], ("output", None)),
    "quoted_dash_output": (['output="-"'], ("output", None)),
    # half of a surrogate pair: no decoded text holds one, so it could never match
    "stop_with_a_lone_surrogate": (['sampling.stop=["ok", "\\ud800"]'],
                                   "config key 'sampling.stop' item 1 is not valid Unicode (a lone surrogate "
                                   "\\ud800 at character 0): no output text can hold it"),
}


@pytest.mark.parametrize("case", list(SECTION_CASES))
def test_config_structure_and_ranges(case):
    overrides, expected = SECTION_CASES[case]
    if isinstance(expected, str):
        with pytest.raises(ConfigError) as err:
            build_config(model=str(DEMO), overrides=overrides)
        assert expected in str(err.value), str(err.value)
        return
    key, value = expected
    cfg = build_config(model=str(DEMO), overrides=overrides)
    assert cfg[key] == ({**cfg[key], **value} if isinstance(value, dict) else value)
    if key == "kv_cache":
        assert cfg[key]["page_size"] == 16  # the section's other keys keep their defaults


def test_a_config_without_model_says_it_is_required():
    with pytest.raises(ConfigError) as err:  # before the type check's "must be a string, got None"
        build_config(overrides=["prompts=[hi]"])
    assert str(err.value) == "config key 'model' is required: the checkpoint directory"


def test_a_section_left_empty_keeps_its_defaults(tmp_path):
    conf = tmp_path / "run.yaml"
    conf.write_text(f"model: {DEMO}\nprompts: [hi]\nsampling:\n  # temperature: 0.7\n")
    assert build_config(str(conf))["sampling"]["max_new_tokens"] == 64


@pytest.mark.parametrize("prompts", ["prompts: []", "prompts_file: {pf}"])
def test_a_run_with_no_prompts_is_refused_before_it_touches_the_output(tmp_path, capsys, prompts):
    pf = tmp_path / "prompts.jsonl"
    pf.write_text("\n  \n")
    out = tmp_path / "out.jsonl"
    out.write_text('{"index": 0, "from": "an earlier run"}\n')
    conf = tmp_path / "run.yaml"
    conf.write_text(f"model: {DEMO}\ndevice: cpu\noutput: {out}\n{prompts.format(pf=pf)}\n")
    code, err = cli(capsys, "--config", str(conf))
    assert code == 2 and "nothing to generate" in err, err
    assert out.read_text() == '{"index": 0, "from": "an earlier run"}\n'


def test_results_file_is_left_alone_when_a_run_has_no_result(tmp_path):
    from tp_engine.frontend.results import ResultSink
    out = tmp_path / "out.jsonl"
    out.write_text('{"index": 0, "from": "an earlier run"}\n')
    ResultSink(out, str(out), {"model": "m"}).close()
    assert out.read_text() == '{"index": 0, "from": "an earlier run"}\n'
    assert not (tmp_path / "out.jsonl.run.json").exists()


def test_output_that_cannot_be_written_or_named_is_refused_at_start_up(tmp_path, monkeypatch):
    """An output that cannot be written (read-only), whose name is too long for the files written beside it,
    or that ends in a slash is refused at start-up, before a run that would replace it at the first result and
    then fail."""
    from tp_engine.frontend import output_file
    from tp_engine.frontend.output_file import check_target
    ro = tmp_path / "ro.jsonl"
    ro.write_text("kept\n")
    ro.chmod(0o444)
    real = os.access  # as a user other than root sees a read-only file
    monkeypatch.setattr(output_file.os, "access",
                        lambda p, m: real(p, m) and not (Path(p) == ro and m & os.W_OK))
    with pytest.raises(ConfigError, match=f"output {ro}: no permission to write {ro}"):
        check_target(str(ro), {}, str(DEMO))
    with pytest.raises(ConfigError, match="ends in '/': it must name a file"):
        check_target(str(tmp_path / "new") + "/", {}, str(DEMO))
    assert not (tmp_path / "new").exists()
    limit = os.pathconf(tmp_path, "PC_NAME_MAX") - len(".") - len(".run.json.XXXXXXXX.tmp")
    check_target(str(tmp_path / ("r" * (limit - 6) + ".jsonl")), {}, str(DEMO))
    with pytest.raises(ConfigError, match="the file name is too long.*shorten it by 1$"):
        check_target(str(tmp_path / ("r" * (limit - 5) + ".jsonl")), {}, str(DEMO))


def test_an_output_folder_this_user_may_not_write_in_is_refused_at_start_up(tmp_path, monkeypatch):
    """Every write goes through a temporary file and a rename in the output's folder: a writable output in a
    folder the user may not write in (or may not create) is refused at start-up, not at the first result."""
    from tp_engine.frontend import output_file
    from tp_engine.frontend.output_file import check_target
    ro = tmp_path / "ro"
    ro.mkdir()
    out = ro / "out.jsonl"
    out.write_text("kept\n")
    real = os.access  # as a user other than root sees a read-only folder
    monkeypatch.setattr(output_file.os, "access",
                        lambda p, m: real(p, m) and not (Path(p) == ro and m & os.W_OK))
    with pytest.raises(ConfigError, match=f"^output {out}: no permission to write in its folder {ro}$"):
        check_target(str(out), {}, str(DEMO))
    deeper = ro / "a" / "b" / "out.jsonl"
    with pytest.raises(ConfigError,
                       match=f"^output {deeper}: no permission to create its folder {deeper.parent} "
                             f"in {ro}$"):
        check_target(str(deeper), {}, str(DEMO))
    assert out.read_text() == "kept\n" and not (ro / "a").exists()


def test_an_output_of_another_user_in_a_sticky_folder_is_refused_at_start_up(tmp_path, monkeypatch):
    """In a sticky folder such as /tmp only a file's owner may replace it: another user's output (or its
    .run.json), though writable, is refused at start-up, not at the first result."""
    from tp_engine.frontend import output_file
    from tp_engine.frontend.output_file import check_target
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o1777)
    out = folder / "out.jsonl"
    check_target(str(out), {}, str(DEMO))  # a new file: the run makes it, and owns it
    out.write_text("theirs\n")
    monkeypatch.setattr(output_file.os, "geteuid", lambda: os.stat(out).st_uid + 1)  # as another user
    with pytest.raises(ConfigError,
                       match=f"^output {out}: {out} belongs to another user, and in {folder} \\(sticky\\)"):
        check_target(str(out), {}, str(DEMO))
    folder.chmod(0o777)
    check_target(str(out), {}, str(DEMO))


def test_an_output_lock_refused_takes_away_only_the_folders_it_made(tmp_path, monkeypatch):
    """The folders made for an output go again when its lock cannot be taken; one that another process made
    in the meantime stays."""
    from tp_engine.frontend import output_file
    target = tmp_path / "a" / "b" / "c" / "out.jsonl"
    real_mkdir, real_open = os.mkdir, os.open

    def mkdir(path, *args):
        real_mkdir(path, *args)
        if Path(path) == tmp_path / "a" / "b":  # another process made it first
            raise FileExistsError(17, "File exists")

    def refuse_lock(path, *args):
        if str(path).endswith(".lock"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args)
    monkeypatch.setattr(output_file.os, "mkdir", mkdir)
    monkeypatch.setattr(output_file.os, "open", refuse_lock)
    with pytest.raises(ConfigError, match="cannot create its lock file"):
        output_file.OutputLock(target, str(target))
    monkeypatch.undo()
    assert (tmp_path / "a" / "b").is_dir() and not (tmp_path / "a" / "b" / "c").exists()


class Exited(BaseException):
    """The signal handler's os._exit: the call it interrupted never resumes."""


def output_file_lines(call) -> list:
    """(code, line) of each line of tp_engine/frontend/output_file.py that `call()` runs, first runs only, in
    order."""
    import sys
    from tp_engine.frontend import output_file
    lines = []

    def record(frame, event, arg):
        if frame.f_code.co_filename == output_file.__file__ and event == "line":
            lines.append((frame.f_code, frame.f_lineno))
        return record
    sys.settrace(record)
    try:
        call()
    finally:
        sys.settrace(None)
    return list(dict.fromkeys(lines))


def interrupted(call, code, line, handler) -> bool:
    """Run `call()` until it reaches `line` of `code`, then `handler()` there, as a signal's handler runs in
    the main thread, and end the call as its exit would; whether the line was reached."""
    import sys
    fired = []

    def tracer(frame, event, arg):
        if frame.f_code is code and event == "line" and frame.f_lineno == line and not fired:
            fired.append(True)
            sys.settrace(None)
            handler()  # an error here is what failed
            raise Exited
        return tracer
    sys.settrace(tracer)
    try:
        call()
    except Exited:
        pass
    finally:
        sys.settrace(None)
    return bool(fired)


def test_a_signal_inside_the_output_locks_release_still_releases_it(tmp_path):
    """The signal handler releases the output and exits. It can run in the main thread while that thread is
    inside release() (torchrun's SIGTERM after a rank died, as rank 0 ends): at any line of it, the handler's
    release finishes the work without an error, closing the lock's descriptor once."""
    from tp_engine.frontend import output_file
    lock = output_file.OutputLock(tmp_path / "dry" / "a" / "out.jsonl", "out.jsonl")
    lines = output_file_lines(lock.release)
    for n, (code, line) in enumerate(lines):
        target = tmp_path / str(n) / "a" / "out.jsonl"
        lock = output_file.OutputLock(target, str(target))
        fd = lock.fd
        fired = interrupted(lock.release, code, line, lock.release)
        assert fired and not (tmp_path / str(n)).exists(), f"line {line}: the lock file or a folder is left"
        try:
            os.close(fd)  # still open only if the handler came just before the close: its exit closes it
        except OSError:
            pass
    assert len(lines) > 8


def test_a_signal_inside_a_rewrite_of_the_output_leaves_it_whole_and_no_temporary_file(tmp_path):
    """The output is rewritten in input order through a temporary file beside it. A signal in the middle (the
    handler releases the output and exits) leaves no such file, one left by a killed run goes when the next
    run takes the lock, others' files stay, and the output holds either its old lines or its new ones."""
    from tp_engine.frontend import output_file
    target = tmp_path / "out.jsonl"
    old, new = b'{"index": 1}\n{"index": 0}\n', b'{"index": 0}\n{"index": 1}\n'

    def rewrite():
        target.write_bytes(old)
        output_file.rewrite_lines(target, [(13, 12), (0, 12)])
    lines = output_file_lines(rewrite)
    assert target.read_bytes() == new
    (tmp_path / ".out.jsonl.ab12cd34.tmp").write_text("a killed run's")
    (tmp_path / ".out.jsonl.run.json.ab_2cd34.tmp").write_text("a killed run's settings")
    # the last one: a temporary file of another run's output, out.jsonl.x, which went too
    kept = [tmp_path / ".out.jsonl.notes", tmp_path / "other.tmp", tmp_path / ".out.jsonl2.ab12cd34.tmp",
            tmp_path / ".out.jsonl.x.ab12cd34.tmp"]
    for path in kept:
        path.write_text("not the run's")
    for code, line in lines:
        lock = output_file.OutputLock(target, str(target))
        left = [p.name for p in tmp_path.glob(".out.jsonl.*.tmp") if p not in kept]
        assert not left, f"a killed run's temporary files stayed: {left}"
        fired = interrupted(rewrite, code, line, lock.release)
        lock.release()
        assert fired and target.read_bytes() in (old, new), (code.co_name, line)
        assert sorted(tmp_path.iterdir()) == sorted([target, *kept]), (code.co_name, line)
    assert len(lines) > 8


def test_a_result_that_could_not_be_written_is_not_said_to_be_kept(tmp_path, monkeypatch):
    """A result is counted as kept once it is in the file: when the first result's write fails, the message on
    stopping does not say that finished results are in the output, which holds the earlier run's lines
    only."""
    from tp_engine.frontend import results
    out = tmp_path / "out.jsonl"
    out.write_text('{"index": 0, "from": "an earlier run"}\n')
    sink = results.ResultSink(out, str(out), {"model": "m"})

    def refuse(*args):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(results, "write_settings", refuse)
    with pytest.raises(PermissionError):
        sink.add({"index": 0, "sample": 0, "output_token_ids": [1]})
    assert sink.on_stop() == f"no result had finished; {out} was left as it was"
    assert out.read_text() == '{"index": 0, "from": "an earlier run"}\n'
    # the file replaced with the first result, and then no more writes: that result is kept, and said to be
    monkeypatch.undo()
    real_open = Path.open
    monkeypatch.setattr(Path, "open", lambda self, mode="r", *a, **k: refuse() if mode == "ab"
                        else real_open(self, mode, *a, **k))
    with pytest.raises(PermissionError):
        sink.add({"index": 0, "sample": 0, "output_token_ids": [1]})
    assert sink.on_stop() == f"finished results are in {out}; run again with resume: true to continue"
    assert json.loads(out.read_text())["output_token_ids"] == [1]


def test_output_under_a_file_names_the_output(tmp_path):
    from tp_engine.frontend.output_file import check_target
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ConfigError) as err:
        check_target(str(tmp_path / "a_file" / "out.jsonl"), {}, str(DEMO))
    assert str(err.value).startswith(f"output {tmp_path / 'a_file' / 'out.jsonl'}: cannot create its folder")


def test_shard_index_with_a_list_for_weight_map_is_a_checkpoint_error(tmp_path):
    from tp_engine.checkpoint.loader import CheckpointError, checkpoint_files
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": ["model-00001.safetensors"]}')
    with pytest.raises(CheckpointError) as err:
        checkpoint_files(str(tmp_path))
    assert "is not a valid safetensors index ('weight_map' must map tensor names to file names)" \
        in str(err.value)


def test_kv_pool_without_room_for_a_page_is_a_start_up_error():
    from tp_engine.comm import StartupError
    from tp_engine.llm import LLM
    with pytest.raises(StartupError) as err:
        LLM(model=str(DEMO), device="cpu", kv_cache={"page_size": 3_000_000})
    assert "no room for the KV cache: a page of kv_cache.page_size 3000000 tokens takes" in str(err.value)
    with pytest.raises(StartupError) as err:  # 2**50 bytes: more than any address space maps
        LLM(model=str(DEMO), device="cpu", kv_cache={"num_pages": 2**50 // 16384, "page_size": 16})
    assert f"cannot allocate the KV cache: {2**50 // 16384:,} pages (kv_cache.num_pages)" in str(err.value)
    with pytest.raises(StartupError) as err:  # past int64: a TypeError from torch, with a traceback
        LLM(model=str(DEMO), device="cpu", kv_cache={"num_pages": 10**20, "page_size": 16})
    assert f"cannot allocate the KV cache: {10**20:,} pages (kv_cache.num_pages)" in str(err.value)


def test_streamed_text_stops_before_a_stop_string():
    """What the command line streams (a TokenUpdate's text) never shows a stop string, and at the end is cut
    at the earliest one."""
    from tp_engine.runtime.request import RequestOutput
    from tp_engine.sampling.sampler import SamplingParams
    from tp_engine.frontend.token_stream import TextStreams

    def shown(decode, stop, ids, final_text=None):
        texts, req = TextStreams(decode, stop), RequestOutput(0, [1], SamplingParams())
        out = []
        for n, t in enumerate(ids, 1):
            req.output_ids.append(t)
            req.text = final_text if n == len(ids) else None
            out.append(texts.update(req, "stop" if n == len(ids) else None).text)
        return out
    words = {1: "by", 2: " her", 3: " sis", 4: "ter", 5: " and"}
    decode = lambda ids: "".join(words[i] for i in ids)  # noqa: E731
    assert shown(decode, [" sister"], [1, 2, 3, 4], "by her") == ["by", "by her", "by her", "by her"]
    # the whole output (a think block too), cut at the earliest stop string
    think = lambda ids: "<think>\nplan\n</think>\n\nI am Done. More"  # noqa: E731
    assert shown(think, [".", "Done."], [1]) == ["<think>\nplan\n</think>\n\nI am "]
    # only an end that a stop string starts with is held back
    assert shown(decode, [" and then"], [1, 2, 5, 2]) == ["by", "by her", "by her", "by her and her"]


@pytest.mark.slow
def test_streamed_chat_text_stops_before_a_stop_string(tmp_path):
    """With a thinking chat template the finished stream is cut before the stop string too, not decoded anew
    with it."""
    cfg = {"model": str(DEMO), "chat": True, "stream": True,
           "prompts": ["Alice was beginning to get very tired"],
           "sampling": {"max_new_tokens": 12, "stop": ["e"]}}
    proc, lines = run_cli(cfg, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert lines[0]["finish_reason"] == "stop" and lines[0]["reasoning"] == ""
    assert proc.stdout == lines[0]["text"] + "\n"


@pytest.mark.slow
def test_a_stream_piped_into_head_ends_quietly_and_the_run_writes_its_output(tmp_path):
    """`stream: true | head -c 20`: the closed pipe ends the stream on rank 0 without a BrokenPipeError, the
    run goes on to exit 0, and `output` is written."""
    import shlex
    import subprocess
    import sys

    import yaml

    from helpers import GENERATE
    out = tmp_path / "out.jsonl"
    conf = tmp_path / "run.yaml"
    conf.write_text(yaml.safe_dump({"model": str(DEMO), "device": "cpu", "stream": True, "output": str(out),
                                    "prompts": ["Alice was beginning to get very tired"],
                                    "sampling": {"max_new_tokens": 120, "stop": []}}))
    cmd = f"{shlex.quote(sys.executable)} {shlex.quote(str(GENERATE))} --config {shlex.quote(str(conf))}" \
          " | head -c 20"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(proc.stdout) == 20
    line, = [json.loads(t) for t in out.read_text().splitlines()]
    assert line["finish_reason"] == "length" and len(line["output_token_ids"]) == 120


@pytest.mark.slow
def test_a_flat_list_of_numbers_in_prompts_is_three_bad_prompts(tmp_path):
    """`prompts: [5, 6, 7]` is three items, as the docs say, each refused on its own line, not an internal
    error at start-up (the API reads such a list as one prompt of token ids)."""
    proc, lines = run_cli({"model": str(DEMO), "prompts": [5, 6, 7]}, tmp_path)
    assert "encoded holds" not in proc.stderr, proc.stderr[-2000:]
    assert [(line["index"], line["finish_reason"]) for line in lines] == \
        [(0, "error"), (1, "error"), (2, "error")]
    assert all("a prompt must be a string, a list of token ids or an object; got int" in line["error"]
               for line in lines)


def test_a_prompt_yaml_read_as_a_boolean_number_or_date_says_to_quote_it():
    """`- yes`, `- 12:30` and `- 2024-01-01` in a YAML prompt list are True, 750 and a date: the error named
    only the type, which the prompt as written does not show."""
    from tp_engine.frontend.prompts import PromptEncoder, PromptError
    from tp_engine.base.textio import load_yaml

    prompts = load_yaml("prompts: [yes, '12:30', 12:30, 2024-01-01, [3, 4]]")["prompts"]
    got = PromptEncoder(str(DEMO)).encode_all(prompts)
    assert list(got[1]) == PromptEncoder(str(DEMO)).encode("12:30") and list(got[4]) == [3, 4]
    for bad, shown in zip((got[0], got[2], got[3]), ("True", "750", "datetime.date(2024, 1, 1)")):
        assert isinstance(bad, PromptError) and f"({shown}: YAML reads an unquoted" in str(bad), bad
        assert "quote the prompt" in str(bad)
    import numpy as np  # a Python caller's numbers: no word of YAML
    bad, = PromptEncoder(str(DEMO)).encode_all([np.int64(5)])
    assert isinstance(bad, PromptError) and str(bad).endswith("got int64"), bad


def _request(output_ids: list[int]):
    from tp_engine.sampling.sampler import SamplingParams
    from tp_engine.runtime.request import RequestOutput
    return RequestOutput(0, [1], SamplingParams(), output_ids=output_ids)


def _stop_hits(tok, model_dir, ids: list[int], stop: list[str]) -> tuple[list[bool], str | None]:
    """StopStrings.hit after each token of `ids`, as the LLM sets it up, and the request's text once it
    hit."""
    from tp_engine.frontend.prompts import PromptEncoder
    from tp_engine.frontend.stop_strings import StopStrings
    enc = PromptEncoder(str(model_dir))
    stops = StopStrings(stop, enc.decode, enc.special_ids, enc.num_tokens, enc.special_texts)
    req = _request([])
    hits = []
    for t in ids:
        req.output_ids.append(t)
        hits.append(stops.hit(req))
    return hits, req.text


def test_a_stop_string_with_special_tokens_between_its_characters_is_found():
    """The look-back window for stop strings counts the tokens that decode to text: special tokens decode to
    nothing, and a run of them between a stop string's characters does not push its start out of the
    window."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(DEMO))
    special = tok.all_special_ids[0]
    ids = (tok.encode("x a", add_special_tokens=False) + [special] * 13
           + tok.encode("b", add_special_tokens=False))
    hits, text = _stop_hits(tok, DEMO, ids, ["ab"])
    assert hits == [False] * (len(ids) - 1) + [True] and text == "x "


def test_a_stop_string_with_added_special_tokens_between_its_characters_is_found(tmp_path):
    """decode also skips added tokens marked special in tokenizer.json that the tokenizer does not list among
    its special tokens (Qwen3's <|fim_prefix|> and five more): the window does not count them as text, and the
    stop is found."""
    import shutil
    from transformers import AutoTokenizer
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / f, tmp_path / f)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    extra = max([*spec["model"]["vocab"].values(), *(t["id"] for t in spec["added_tokens"])]) + 1
    spec["added_tokens"].append({"id": extra, "content": "<|fim_prefix|>", "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.convert_tokens_to_ids("<|fim_prefix|>") == extra and extra not in tok.all_special_ids
    assert tok.decode([extra], skip_special_tokens=True) == ""
    ids = (tok.encode("x a", add_special_tokens=False) + [extra] * 13
           + tok.encode("b", add_special_tokens=False))
    hits, text = _stop_hits(tok, tmp_path, ids, ["ab"])
    assert hits == [False] * (len(ids) - 1) + [True] and text == "x "


def test_a_stop_string_with_ids_past_the_tokenizer_between_its_characters_is_found():
    """Qwen3's embedding has 151,936 rows for 151,669 tokens, and a random-weight model samples the ids past
    the tokenizer's, which decode to nothing: the window does not count them as text, and the stop is
    found."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(DEMO))
    past = [len(tok) + i for i in range(13)]
    assert tok.decode(past, skip_special_tokens=True) == ""
    ids = tok.encode("x a", add_special_tokens=False) + past + tok.encode("b", add_special_tokens=False)
    hits, text = _stop_hits(tok, DEMO, ids, ["ab"])
    assert hits == [False] * (len(ids) - 1) + [True] and text == "x "


def test_a_stop_string_that_is_a_special_tokens_text_ends_at_that_token(tmp_path):
    """Decoding skips special tokens, so a stop string such as `<|im_end|>` never shows in the text: the
    request ends at that token (output_token_ids hold it) rather than running on to max_new_tokens, the text
    cut before it."""
    import shutil
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer
    from tp_engine.llm import LLM
    from tp_engine.sampling.sampler import SamplingParams
    # the demo model with ids 2 (<|im_end|>, not EOS here) and 1641 (" sister") swapped: it says <|im_end|>
    model = tmp_path / "m"
    shutil.copytree(DEMO, model)
    weights = load_file(model / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]  # tied: the LM head too
    embed[[2, 1641]] = embed[[1641, 2]].clone()
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
    llm = LLM(model=str(model), device="cpu")
    (out,) = llm.generate("Alice was beginning to get very tired", SamplingParams(max_new_tokens=20,
                                                                                  stop=["<|im_end|>"]))
    assert (out["finish_reason"], out["text"]) == ("stop", " of sitting by her")
    assert out["output_token_ids"][-1] == 2
    llm.shutdown()
    tok = AutoTokenizer.from_pretrained(str(DEMO))
    ids = tok.encode("x a", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    hits, text = _stop_hits(tok, DEMO, ids, ["zz", "<|im_end|>"])
    assert hits == [False] * (len(ids) - 1) + [True] and text == "x a"


def test_stop_strings_without_a_tokenizer_are_refused_by_name(tmp_path):
    """Stop strings are found in the decoded text: with a checkpoint without tokenizer files the run is
    refused by name, its output left as it was, not ended by a TypeError from inside the generation loop; the
    API refuses them in generate() and runs on without them."""
    from helpers import make_checkpoint
    from tp_engine.llm import LLM
    from tp_engine.sampling.sampler import SamplingParams
    model = make_checkpoint(tmp_path / "m")
    out = tmp_path / "out.jsonl"
    out.write_text('{"index": 0, "from": "an earlier run"}\n')
    proc, _ = run_cli({"model": str(model), "output": str(out), "prompts": [{"input_ids": [5, 6]}],
                       "sampling": {"stop": ["ab"]}}, tmp_path, read_output=False)
    err = proc.stderr
    assert proc.returncode != 0 and "sampling.stop needs the checkpoint's tokenizer" in err, err[-3000:]
    assert "no tokenizer files" in err and "TypeError" not in err, err[-3000:]
    assert out.read_text() == '{"index": 0, "from": "an earlier run"}\n'
    llm = LLM(model=str(model), device="cpu")
    with pytest.raises(ValueError, match="SamplingParams.stop_token_ids instead"):
        llm.generate([{"input_ids": [5, 6]}], SamplingParams(max_new_tokens=3, stop=["ab"]))
    out = llm.generate([{"input_ids": [5, 6]}], SamplingParams(max_new_tokens=3))[0]
    assert len(out["output_token_ids"]) == 3


def test_stop_strings_decode_a_bounded_window_after_a_long_run_of_special_tokens():
    """When the output ends in a long run of special tokens (ignore_eos with the model repeating EOS), the
    look-back window stays bounded instead of walking back to the first output token: a step decodes a few
    tokens, not the whole output (O(length**2) per request)."""
    from transformers import AutoTokenizer
    from tp_engine.frontend.prompts import PromptEncoder
    from tp_engine.frontend.stop_strings import StopStrings
    tok, enc = AutoTokenizer.from_pretrained(str(DEMO)), PromptEncoder(str(DEMO))
    lengths = []

    def decode(ids):
        lengths.append(len(ids))
        return enc.decode(ids)
    stops = StopStrings(["ab"], decode, enc.special_ids, enc.num_tokens)
    req = _request(tok.encode("x a", add_special_tokens=False))
    special = tok.all_special_ids[0]
    for _ in range(2000):
        req.output_ids.append(special)
        assert not stops.hit(req)
    assert max(lengths) <= stops.need
    req.output_ids += tok.encode("b", add_special_tokens=False)  # found across the 2000 special tokens too
    assert stops.hit(req) and req.text == "x "
