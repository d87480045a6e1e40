"""The shipped demo model: readable text, its tokenizer, chat templates, stop strings and streaming."""
import json
import os
import shlex
import subprocess
import sys

import pytest
import yaml

from helpers import ROOT, TP_GENERATE, api_outputs, hf_generate, run_cli, shell_lines

DEMO = ROOT / "configs" / "models" / "demo"
DRAFT = ROOT / "configs" / "models" / "demo-draft"  # the demo's draft model for speculative decoding
CORPUS = (ROOT / "launch" / "data" / "corpus.txt").read_text()
PHRASES = ["Alice was beginning to get very tired", "'Curiouser and curiouser!' cried Alice"]


def words(text):
    return " ".join(text.split())


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_demo_continues_phrases_from_its_training_text(tmp_path, tp):
    cfg = {"model": str(DEMO), "prompts": PHRASES, "sampling": {"max_new_tokens": 24}}
    proc, lines = run_cli(cfg, tmp_path, nproc=tp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for phrase, line in zip(PHRASES, lines):
        assert len(line["text"].split()) >= 8
        assert words(phrase + line["text"]) in words(CORPUS), line["text"]  # the book, word for word


@pytest.mark.slow
def test_demo_config_runs_as_the_readme_says():
    """The README's demo commands, run as written from the checkout's root: tp-generate prints what its
    lower-level form, torchrun with launch/generate.py, prints: one JSON line per prompt, piped."""
    conf = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    commands = [shlex.split(line) for line in shell_lines((ROOT / "README.md").read_text())
                if "configs/demo.yaml" in line]
    speculating = [c for c in commands if "speculative.method=draft" in c]  # the draft model's run
    commands = [c for c in commands if c not in speculating]
    assert sorted(c[0] for c in commands) == ["torchrun", "tp-generate"], commands
    assert [c[0] for c in speculating] == ["tp-generate"], speculating
    # the installed tp-generate as this interpreter runs it; torchrun on a port of its own
    launchers = {"tp-generate": TP_GENERATE,
                 "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone"]}
    stdout = {}
    for command in commands:
        name = command[0]
        proc = subprocess.run([*launchers[name], *command[1:]], capture_output=True, text=True,
                              timeout=120, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        stdout[name] = proc.stdout
    lines = [json.loads(x) for x in stdout["tp-generate"].splitlines()]
    assert len(lines) == len(conf["prompts"])
    assert words(conf["prompts"][0] + lines[0]["text"]) in words(CORPUS)
    assert stdout["tp-generate"] == stdout["torchrun"]
    # with the draft model: the same lines, and the drafts accepted (it agrees with the model on 99%); how
    # many it drafts at a time follows the step times the adaptive policy measures, so that is not checked
    proc = subprocess.run([*launchers["tp-generate"], *speculating[0][1:]], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == stdout["tp-generate"]
    summary = json.loads(proc.stderr.split("summary: ")[1].splitlines()[0])
    assert summary["acceptance_rate"] > 0.9 and summary["accept_length"] > 1, summary


@pytest.mark.slow
def test_chat_template_with_options(tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DEMO, local_files_only=True)
    cfg = {"model": str(DEMO), "chat": True, "chat_template_kwargs": {"enable_thinking": False},
           "prompts": ["Who are you?", {"messages": [{"role": "user", "content": "Hi"}]}],
           "sampling": {"max_new_tokens": 4}}
    proc, lines = run_cli(cfg, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = tok.apply_chat_template([{"role": "user", "content": "Who are you?"}], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=False)
    assert "<think>" in want and "<|im_start|>assistant" in want
    assert lines[0]["prompt_token_ids"] == tok.encode(want, add_special_tokens=False)
    assert tok.decode(lines[1]["prompt_token_ids"]).startswith("<|im_start|>user\nHi<|im_end|>")


@pytest.mark.slow
def test_stop_strings_end_a_request(tmp_path):
    cfg = {"model": str(DEMO), "prompts": [PHRASES[0]],
           "sampling": {"max_new_tokens": 40, "stop": [" sister"]}}
    proc, lines = run_cli(cfg, tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert lines[0]["finish_reason"] == "stop"
    assert lines[0]["text"] == " of sitting by her"  # cut before the stop string
    n = len(lines[0]["output_token_ids"])  # the stop string completes on the last allowed token: still "stop"
    proc, lines = run_cli({**cfg, "sampling": {"max_new_tokens": n, "stop": [" sister"]}},
                          tmp_path, name="edge")
    assert (lines[0]["finish_reason"], lines[0]["text"]) == ("stop", " of sitting by her")


@pytest.mark.slow
def test_stream_prints_text_as_it_is_generated(tmp_path):
    cfg = {"model": str(DEMO), "prompts": [PHRASES[0]], "stream": True, "sampling": {"max_new_tokens": 20}}
    proc, lines = run_cli(cfg, tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert lines[0]["text"] in proc.stdout


def test_streamer_writes_deltas_of_whole_characters():
    """The command line's stream writes each TokenUpdate's new text, which waits for a character's last
    byte."""
    import io
    from tp_engine.frontend.progress import Streamer
    from tp_engine.sampling.sampler import SamplingParams
    from tp_engine.runtime.request import RequestOutput
    from tp_engine.frontend.token_stream import TextStreams
    table = {1: "Hel", 2: "lo", 3: "\ufffd", 4: "é"}  # 3 then 4: a character split across two tokens
    texts = TextStreams(lambda ids: "".join(table[i] for i in ids).replace("\ufffdé", "é"), [])
    out = io.StringIO()
    writes = []
    out.write = lambda s: writes.append(s)
    streamer, req = Streamer(out), RequestOutput(0, [1], SamplingParams())
    for t in [1, 2, 3, 4]:
        req.output_ids.append(t)
        update = texts.update(req, "length" if t == 4 else None)
        streamer.update(update.text, final=update.finish_reason is not None)
    assert writes == ["Hel", "lo", "é", "\n"]


def test_draft_shares_the_demo_tokenizer_and_special_ids():
    """The draft model is a Qwen3 with the demo's tokenizer files, vocabulary size and bos/eos/pad ids
    (drafted ids must mean the same tokens to both) and about a fifth of its parameters."""
    from transformers import AutoTokenizer
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (DRAFT / name).read_bytes() == (DEMO / name).read_bytes(), name
    tok = AutoTokenizer.from_pretrained(DRAFT, local_files_only=True)
    assert tok.eos_token == "<|im_end|>" and len(tok) == 2048
    draft, demo = ({f: json.loads((d / f).read_text()) for f in ("config.json", "generation_config.json")}
                   for d in (DRAFT, DEMO))
    assert draft["config.json"]["model_type"] == "qwen3"
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings"):
        assert draft["config.json"][key] == demo["config.json"][key], key
    for gen in (draft, demo):
        gen["generation_config.json"].pop("transformers_version")
    assert draft["generation_config.json"] == demo["generation_config.json"]
    sizes = [(d / "model.safetensors").stat().st_size for d in (DRAFT, DEMO)]
    assert sizes[0] < sizes[1] / 3, sizes  # float32 weights: bytes count parameters


def test_draft_predicts_the_demo_models_next_tokens():
    """On four corpus passages of 120 tokens (the demo model's training windows are 128) the draft's greedy
    next token is the demo model's at 99.8% of the positions (479 of 480 where measured); the bound
    leaves room for other CPUs' arithmetic."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DEMO, local_files_only=True)
    starts = [CORPUS.index(s) for s in ("Alice was beginning", "Down, down, down", "'Curiouser and curiouser",
                                        "They were indeed a queer-looking party")]
    ids = torch.tensor([tok(CORPUS[s:s + 600], add_special_tokens=False)["input_ids"][:120] for s in starts])
    assert ids.shape == (4, 120)
    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in (DRAFT, DEMO)]
    with torch.no_grad():
        guesses = [model(input_ids=ids).logits.argmax(-1) for model in models]
    agree = (guesses[0] == guesses[1]).float().mean().item()
    assert agree >= 0.95, agree


def test_the_engine_runs_the_draft_as_transformers_does(tmp_path):
    """The draft is a checkpoint the engine loads: its greedy tokens on a phrase are transformers'."""
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(DEMO, local_files_only=True)(PHRASES[0])["input_ids"]
    lines = api_outputs({"draft": DRAFT}, [ids], {"max_new_tokens": 16}, 1, tmp_path)["draft"]
    assert lines[0]["output_token_ids"] == hf_generate(DRAFT, [ids], 16)[0]
    assert lines[0]["text"]
