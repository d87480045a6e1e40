"""Shared test helpers: tiny random checkpoints written with transformers, the HF reference, the
CLI runner."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
GENERATE = ROOT / "launch" / "generate.py"
TP_GENERATE = [sys.executable, "-m", "tp_engine.launcher"]  # the tp-generate console script; run it from ROOT


def make_checkpoint(path: Path, *, vocab: int = 512, hidden: int = 64, inter: int = 128, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, head_dim: int = 32, tie: bool = False,
                    max_pos: int = 512, shard: bool = False, v4_style: bool = False,
                    eos: int | list | None = None, seed: int = 0, attention_bias: bool = False) -> Path:
    """A random Qwen3 checkpoint saved by transformers itself (its names, shapes and file layout)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=max_pos, tie_word_embeddings=tie, eos_token_id=eos,
                      attention_bias=attention_bias, rope_theta=10000.0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the default init give peaked, tie-free logits
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(path, max_shard_size="100KB" if shard else "5GB")
    if v4_style:  # the config.json layout transformers 4.x writes
        c = json.loads((path / "config.json").read_text())
        rope = c.pop("rope_parameters", {}) or {}
        c["rope_theta"] = rope.get("rope_theta", 10000.0)
        c["rope_scaling"] = None
        c["torch_dtype"] = c.pop("dtype", "float32")
        c.pop("layer_types", None)
        c["transformers_version"] = "4.51.3"
        (path / "config.json").write_text(json.dumps(c, indent=2))
    return path


def make_moe_checkpoint(path: Path, *, vocab: int = 509, hidden: int = 64, inter: int = 96,
                        moe_inter: int = 32, layers: int = 3, heads: int = 4, kv_heads: int = 1,
                        head_dim: int = 16, experts: int = 8, top_k: int = 2, norm_topk_prob: bool = True,
                        sparse_step: int = 1, mlp_only_layers: tuple[int, ...] = (), tie: bool = False,
                        shard: bool = True, seed: int = 0, std: float = 0.08,
                        dtype: torch.dtype = torch.float32) -> Path:
    """A random Qwen3-MoE checkpoint saved by transformers (per-expert tensor names; sharded with an index, as
    published checkpoints are)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                         moe_intermediate_size=moe_inter, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim, num_experts=experts,
                         num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob,
                         decoder_sparse_step=sparse_step, mlp_only_layers=list(mlp_only_layers),
                         tie_word_embeddings=tie, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, eos_token_id=None)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # peaked logits and routing: ties are rare
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    model.to(dtype).save_pretrained(path, max_shard_size="100KB" if shard else "5GB")
    return path


def hf_generate(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from transformers' own Qwen3 (fp32), one prompt at a time, EOS included."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    outs = []
    for ids in prompts:
        with torch.no_grad():
            x = torch.tensor([ids])  # an explicit mask: otherwise generate treats token 0 as padding
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=0)
        outs.append(out[0, len(ids):].tolist())
    return outs


def shell_lines(markdown: str) -> list[str]:
    """The command lines of a Markdown text's fenced blocks without a language (the README's shell commands),
    with backslash continuations joined."""
    lines, fence = [], None  # fence: the language of the open block, "" for none
    for line in markdown.replace("\\\n", " ").splitlines():
        if line.lstrip().startswith("```"):
            fence = line.lstrip()[3:].strip() if fence is None else None
        elif fence == "" and line.strip():
            lines.append(line.strip())
    return lines


def assert_rate_ratio(ratio: float, num: dict, den: dict) -> None:
    """`ratio` is num's output tokens per second over den's, and each run's output_tok_s its output_tokens
    over its seconds, as far as the rounding of launch/bench.py's figures allows (seconds to 1 ms, tokens/s to
    0.1, the ratio to 3 or 4 digits)."""
    def rate(run: dict, slack: float) -> float:  # tokens/s with the rounded seconds moved by `slack`
        assert run["seconds"] > 5e-4, run  # took some time: the bounds are finite
        return run["output_tokens"] / (run["seconds"] + slack)
    for run in (num, den):
        assert rate(run, 5e-4) - 0.05 <= run["output_tok_s"] <= rate(run, -5e-4) + 0.05, run
    low = (rate(num, 5e-4) - 0.05) / (rate(den, -5e-4) + 0.05) - 5e-4
    high = (rate(num, -5e-4) + 0.05) / (rate(den, 5e-4) - 0.05) + 5e-4
    assert low <= ratio <= high, (ratio, low, high, num, den)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


API_JOB = """
import json, sys
sys.path.insert(0, {root!r})
from tp_engine import LLM, SamplingParams
results = {{}}
for name, path in {models!r}.items():
    llm = LLM(model=path, device="cpu")
    outs = llm.generate([{{"input_ids": p}} for p in {prompts!r}], SamplingParams(**{sampling!r}))
    llm.shutdown()
    results[name] = outs  # None on the ranks other than 0
if results[next(iter(results))] is not None:
    with open({out!r}, "w") as f:
        json.dump(results, f)
"""


def api_job(models: dict[str, Path], prompts: list[list[int]], sampling: dict, tp: int,
            tmp_path: Path) -> dict:
    """{name: rank 0's outputs} of each checkpoint in `models`, through the Python API in one torchrun job of
    `tp` ranks (a job per checkpoint would spend most of its time starting processes)."""
    script = tmp_path / "job.py"
    script.write_text(API_JOB.format(root=str(ROOT), models={k: str(v) for k, v in models.items()},
                                     prompts=prompts, sampling=sampling, out=str(tmp_path / "results.json")))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp}",
                           "--standalone", str(script)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "results.json").read_text())


def api_outputs(models: dict[str, Path], prompts: list[list[int]], sampling: dict, tp: int,
                tmp_path: Path) -> dict:
    """As `api_job`; at TP 1 in this process (no job to start)."""
    if tp > 1:
        return api_job(models, prompts, sampling, tp, tmp_path)
    from tp_engine import LLM, SamplingParams
    results = {}
    for name, path in models.items():
        llm = LLM(model=str(path), device="cpu")
        results[name] = llm.generate([{"input_ids": p} for p in prompts], SamplingParams(**sampling))
        llm.shutdown()
    return results


def run_cli(cfg: dict, tmp_path: Path, nproc: int = 0, args: tuple = (), timeout: float = 180,
            name: str = "run", read_output: bool = True) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run launch/generate.py with `cfg` written to YAML; returns the process and output lines. nproc 0: one
    rank in one plain process (no launcher to start: the tests that test no launcher behaviour); nproc N:
    under torchrun with N ranks."""
    cfg = dict(cfg)
    cfg.setdefault("output", str(tmp_path / f"{name}.jsonl"))
    cfg.setdefault("device", "cpu")
    conf = tmp_path / f"{name}.yaml"
    conf.write_text(yaml.safe_dump(cfg))
    launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"] if nproc else []
    cmd = [sys.executable, *launcher, str(GENERATE), "--config", str(conf), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    out = Path(cfg["output"])
    read = read_output and out.is_file()
    lines = [json.loads(line) for line in out.read_text().splitlines()] if read else []
    return proc, lines


def start_job(cfg, tmp_path, nproc=2, script=GENERATE, name="job", stderr=subprocess.PIPE, tp_generate=False):
    """Start the CLI under torchrun (or tp-generate, which takes no script) in the background, detached with
    setsid like a job started from a shell."""
    conf = tmp_path / f"{name}.yaml"
    conf.write_text(yaml.safe_dump(cfg))
    if tp_generate:
        cmd = [*TP_GENERATE, f"--nproc_per_node={nproc}"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
               str(script)]
    cmd += ["--config", str(conf)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                            start_new_session=True)


def wait_for_lines(out, n, proc, limit=120):
    t0 = time.time()
    while time.time() - t0 < limit:
        if out.is_file() and len(out.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError("no results appeared")


def worker_pids(launcher_pid):
    """torchrun's workers, by RANK."""
    pids = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (d / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher_pid:
            for kv in env:
                if kv.startswith(b"RANK="):
                    pids[int(kv[5:])] = int(d.name)
    return pids
