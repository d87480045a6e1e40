"""The structured workload of launch/bench.py: output constraints (JSON schemas through xgrammar) against the
same requests unconstrained, on random weights, in one LLM.

Every step of a constrained request fills and applies its grammar's mask, whichever token the model would
pick. The schemas hold open-ended strings, numbers and arrays, which random weights seldom close, so that a
constrained run goes on for about --new-tokens tokens; both runs use ignore_eos=False and report their output
tokens (and how many constrained outputs are complete or cut short), so a reader sees how long each went.

  latency     batch 1, --prompt-len random tokens, --new-tokens new, greedy: an 8-field schema (nested
              object, array, enum, all required) against no constraint; tok/s over each whole run, after a
              warm-up run of each; target: ratio >= 0.97
  throughput  --num-requests requests, each with one of 8 distinct schemas, at --temperature: output tok/s
              against the same requests unconstrained, after a warm-up; target: ratio >= 0.90
  compile     a 20-field schema through the engine's own cache (Grammars.compile with constraint_of's key, as
              a request's matcher gets it): ms at first use, and the median of later lookups; target:
              cached <= 1 ms

The engine compiles constraints with the checkpoint's tokenizer. The shapes in configs/models have none: the
workload then makes, once, a model directory of links to the model's files beside a byte-level BPE tokenizer
of the model's vocabulary, trained on the Python sources installed here (or --tokenizer DIR's files, e.g.
Qwen3's own).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from bench_compiles import KernelCompiles
from tp_engine import LLM, SamplingParams
from tp_engine.sampling.constraints import constraint_of

TARGETS = {"latency": 0.97, "throughput": 0.90, "compile_cached_ms": 1.0}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json")
CACHED_LOOKUPS = 21
CORPUS_CHARS = 256 << 20  # of Python sources the tokenizer is trained on, at most (a minute's training)


def record_schema(variant: int = 0) -> dict:
    """8 fields, all required: integer, string, enum, boolean, number, a nested object, an array of strings
    and a free-text string (the engine's key sorts them by name). `variant` names the enum's values and the
    array's field: each variant is a grammar of its own."""
    v = variant or ""
    text = {"type": "string"}
    props = {"id": {"type": "integer"}, "name": text,
             "role": {"enum": [f"{r}{v}" for r in ("admin", "editor", "viewer")]},
             "active": {"type": "boolean"}, "score": {"type": "number"},
             "address": {"type": "object", "properties": {"city": text, "zip": text},
                         "required": ["city", "zip"], "additionalProperties": False},
             f"tags{v}": {"type": "array", "items": text}, "notes": text}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def wide_schema(n: int = 20) -> dict:
    """n fields, all required, of each kind in turn: string, integer, enum, boolean, number, array,
    object."""
    kinds = [{"type": "string"}, {"type": "integer"}, {"enum": ["low", "mid", "high"]}, {"type": "boolean"},
             {"type": "number"}, {"type": "array", "items": {"type": "integer"}},
             {"type": "object", "properties": {"k": {"type": "string"}, "v": {"type": "number"}},
              "required": ["k", "v"]}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


# ---- a model directory with a tokenizer ----

def model_with_tokenizer(model: str, tokenizer: str | None) -> tuple[str, dict]:
    """A directory the engine loads `model` from with a tokenizer, and what that tokenizer is: `model` itself
    when it has one and no `tokenizer` is given; else a directory of links to `model`'s files beside the
    files of `tokenizer` or a trained one, made once (every rank of a job asks for the same one: the first
    to finish it moves it into place) under the temporary directory."""
    src = Path(model)
    if tokenizer is None and any((src / f).is_file() for f in TOKENIZER_FILES):
        return model, {"source": "the model's", "tokens": tokenizer_size(src)}
    given = tokenizer and Path(tokenizer).resolve()
    key = f"{(src / 'config.json').read_text()}|{src.resolve()}|{given}|{sys.version}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / "tp_engine-bench-structured" / f"{src.name}-{digest}"
    if not out.is_dir():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent))
        for f in src.iterdir():
            if f.name not in TOKENIZER_FILES:
                (tmp / f.name).symlink_to(f.resolve())
        if tokenizer is not None:
            for f in TOKENIZER_FILES:
                if (Path(tokenizer) / f).is_file():
                    shutil.copy(Path(tokenizer) / f, tmp / f)
        else:
            train_tokenizer(tmp, json.loads((src / "config.json").read_text()))
        try:
            os.rename(tmp, out)
        except OSError:  # another rank was first
            shutil.rmtree(tmp)
    source = tokenizer or f"byte-level BPE trained on Python {sys.version.split()[0]}'s sources and packages"
    return str(out), {"source": source, "tokens": tokenizer_size(out)}


def train_tokenizer(out: Path, cfg: dict) -> None:
    """A byte-level BPE tokenizer within the model's vocabulary, trained on the Python sources of the
    standard library and the installed packages (200 MB of them make all 151,643 of Qwen3's tokens). The
    model's EOS and BOS ids are not tokens of it: those in the upper half (Qwen3's) by ending the tokens below
    them (the engine and xgrammar take them by id), the others as special tokens from id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    special = {i for k in ("eos_token_id", "bos_token_id")
               for i in (cfg.get(k) if isinstance(cfg.get(k), list) else [cfg.get(k)]) if i is not None}
    low = [i for i in special if i < cfg["vocab_size"] // 2]
    names = [f"<|special_{i}|>" for i in range(max(low, default=-1) + 1)]  # ids 0, 1, ... up to the last low
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}
    files = sorted({p.resolve() for root in roots for p in Path(root).rglob("*.py")})
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min([cfg["vocab_size"], *(special - set(low))]),
                                  special_tokens=names,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts(files, CORPUS_CHARS), trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def texts(files: list[Path], limit: int):
    """The files' texts, in order, until they add up to `limit` characters."""
    for p in files:
        text = p.read_text(errors="replace")
        limit -= len(text)
        if limit < 0:
            return
        yield text


def tokenizer_size(model_dir: Path) -> int | None:
    """Tokens of the directory's tokenizer.json (its model's and the added ones), None without one."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    t = json.loads(path.read_text())
    added = {a["id"] for a in t.get("added_tokens", [])} - set(t["model"]["vocab"].values())
    return len(t["model"]["vocab"]) + len(added)


# ---- the runs ----

def timed(llm: LLM, prompts: list, params) -> dict | None:
    """One measured generate call from a cold prefix cache: output tokens, seconds, tok/s over the whole
    call, how many outputs are whole matches of their constraint and how many are cut short, the requests
    preempted, the Triton kernels compiled inside the call, and with constraints the host's milliseconds a
    masked step by part (Grammars.host_s) (rank 0; the others None)."""
    if llm.engine.pool is not None:
        llm.engine.pool.clear()  # the other run had the same prompts
    grammars = llm.engine.grammars
    host, steps = (dict(grammars.host_s), grammars.masked_steps) if grammars else ({}, 0)
    t0 = time.perf_counter()
    with KernelCompiles() as compiles:
        outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    if outs is None:
        return None
    masked = grammars.masked_steps - steps if grammars else 0
    mask_ms = {k: round((v - host[k]) / masked * 1e3, 3) for k, v in grammars.host_s.items()} \
        if masked else {}
    bad = [o["error"] for o in outs if o["finish_reason"] == "error"]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(outs)} requests failed, the first with: {bad[0]}")
    tokens = sum(len(o["output_token_ids"]) for o in outs)
    return {"requests": len(outs), "output_tokens": tokens, "seconds": round(seconds, 3),
            "tok_s": round(tokens / seconds, 1), "preempted": llm.engine.num_preempted,
            "kernel_compiles": compiles.report(),
            **{k: sum(o.get("constraint") == k for o in outs) for k in ("complete", "incomplete")},
            **({"masked_steps": masked, "mask_host_ms_per_step": mask_ms} if masked else {})}


def compare(llm: LLM, prompts: list, warm: list, constrained: list, plain: list) -> dict | None:
    """A warm-up call of each on `warm` prompts, then `prompts` measured with each; their ratio of tok/s."""
    for params in (constrained, plain):
        llm.generate(warm, params[:len(warm)])
    c, u = timed(llm, prompts, constrained), timed(llm, prompts, plain)
    if c is None:
        return None
    return {"constrained": c, "unconstrained": u, "ratio": round(c["tok_s"] / u["tok_s"], 4)}


def compile_times(llm: LLM) -> dict:
    """The 20-field schema through Grammars.compile under constraint_of's key, as a request's matcher gets
    it: the first use compiles (the tokenizer's share, made by the runs before, is not in it), later ones
    find it cached."""
    grammars, params = llm.engine.grammars, SamplingParams(json_schema=wide_schema())
    t0 = time.perf_counter()
    grammars.compile(*constraint_of(params))
    first = time.perf_counter() - t0
    cached = []
    for _ in range(CACHED_LOOKUPS):
        t0 = time.perf_counter()
        grammars.compile(*constraint_of(params))
        cached.append(time.perf_counter() - t0)
    return {"fields": len(params.json_schema["properties"]), "first_ms": round(first * 1e3, 3),
            "cached_ms": round(statistics.median(cached) * 1e3, 4), "cached_lookups": CACHED_LOOKUPS}


def constrain(params: SamplingParams, schema: dict) -> SamplingParams:
    return dataclasses.replace(params, json_schema=schema)


def run_structured(llm: LLM, args) -> dict | None:
    """Every rank: the three measurements on `llm`; rank 0 returns the figures and the targets' verdicts."""
    vocab, rng = llm.engine.model_cfg.vocab_size, random.Random(args.seed)

    def prompts(n: int) -> list[dict]:
        return [{"input_ids": [rng.randrange(vocab) for _ in range(args.prompt_len)]} for _ in range(n)]

    one = SamplingParams(max_new_tokens=args.new_tokens, seed=args.seed)
    latency = compare(llm, prompts(1), prompts(1), [constrain(one, record_schema())], [one])
    n = args.num_requests
    many = [SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, seed=args.seed + k) for k in range(n)]
    schemas = [record_schema(v) for v in range(8)]
    throughput = compare(llm, prompts(n), prompts(min(n, 64)),
                         [constrain(p, schemas[k % 8]) for k, p in enumerate(many)], many)
    compile_ = compile_times(llm)
    if latency is None:
        return None
    throughput["schemas"] = len(schemas)
    got = {"latency": latency["ratio"], "throughput": throughput["ratio"],
           "compile_cached_ms": compile_["cached_ms"]}
    return {"latency": latency, "throughput": throughput, "compile": compile_,
            "targets": {k: {"value": v, "target": TARGETS[k],
                            "pass": v <= TARGETS[k] if k == "compile_cached_ms" else v >= TARGETS[k]}
                        for k, v in got.items()}}


def bench_structured(args, options: dict, res: dict) -> None:
    """launch/bench.py's `structured`: one LLM built from the bench's options (on a model directory with a
    tokenizer), then run_structured; PASS or FAIL per target on stderr."""
    model, tokenizer = model_with_tokenizer(options["model"], args.tokenizer)
    llm = LLM(overrides=args.overrides, **{**options, "model": model})
    try:
        out = run_structured(llm, args)
    finally:
        llm.shutdown()
    if out is None:
        return
    res["structured"] = {"tokenizer": tokenizer, "prompt_tokens": args.prompt_len,
                         "new_tokens": args.new_tokens, **out}
    for name, target in out["targets"].items():
        figures = {k: v for k, v in target.items() if k != "pass"}
        print(f"structured {name}: {'PASS' if target['pass'] else 'FAIL'} {figures}", file=sys.stderr)
