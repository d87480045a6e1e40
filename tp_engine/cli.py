"""Command line: `torchrun --nproc_per_node=N launch/generate.py --config FILE.yaml [--set key=value ...]`."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import yaml

from tp_engine import config as C
from tp_engine.distributed import StartupError

log = logging.getLogger("tp_engine")

EXAMPLES = """examples:
  torchrun --nproc_per_node=2 launch/generate.py --config configs/demo.yaml
  python launch/generate.py --config run.yaml --set sampling.temperature=0.7 --set sampling.top_p=0.9
  python launch/generate.py --config run.yaml --set 'prompts=["Hello", {input_ids: [1, 2, 3]}]' --print-config

--set takes a dotted key and a YAML value; it may be repeated and wins over the file.

config keys (key = default):
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="generate.py", description="Tensor-parallel Qwen3 generation.",
                                epilog=EXAMPLES + C.describe(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. --set sampling.max_new_tokens=32")
    p.add_argument("--print-config", action="store_true", help="print the merged config as YAML and exit")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p.parse_args(argv)


def read_prompts(cfg: dict) -> list:
    if (cfg["prompts"] is None) == (cfg["prompts_file"] is None):
        raise C.ConfigError("give exactly one of 'prompts' (a list) and 'prompts_file' (a JSONL path)"
                            + ("; both are set" if cfg["prompts"] is not None else "; neither is set"))
    if cfg["prompts"] is not None:
        return cfg["prompts"]
    path = Path(cfg["prompts_file"])
    if not path.is_file():
        raise C.ConfigError(f"config key 'prompts_file': file not found: {path}")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise C.ConfigError(f"{path} line {n}: not valid JSON ({e.msg})") from None
        if not isinstance(item, dict) or not ({"prompt", "input_ids", "messages"} & set(item)):
            raise C.ConfigError(f"{path} line {n}: expected an object with 'prompt', 'input_ids' or 'messages'")
        prompts.append(item)
    return prompts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 and not args.quiet else logging.WARNING,
                        format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    try:
        cfg = C.build_config(args.config, args.overrides)
        prompts = read_prompts(cfg)
    except C.ConfigError as e:
        # Every rank reads the same file and fails the same way; rank 0 says so once.
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        if rank == 0:
            print(yaml.safe_dump(cfg, sort_keys=False), end="")
        return 0
    if args.quiet:
        cfg["progress"] = False
    from tp_engine.llm import LLM  # torch is imported only once the config is known to be good

    try:
        llm = LLM(**cfg)
    except StartupError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    if not llm.rank0:
        llm.generate(prompts)
        llm.shutdown()
        return 0
    t0 = time.perf_counter()
    outputs = llm.generate(prompts)
    seconds = time.perf_counter() - t0
    if cfg["output"]:
        write_jsonl(Path(cfg["output"]), outputs)
    else:
        for out in outputs:
            print(json.dumps(out))
    n_out = sum(len(o["output_token_ids"]) for o in outputs)
    summary = {"requests": len(outputs), "prompt_tokens": sum(len(o["prompt_token_ids"]) for o in outputs),
               "output_tokens": n_out, "errors": sum(o["finish_reason"] == "error" for o in outputs),
               "seconds": round(seconds, 3), "tokens_per_s": round(n_out / max(seconds, 1e-9), 1)}
    print("summary: " + json.dumps(summary), file=sys.stderr)
    llm.shutdown()
    return 0


def write_jsonl(path: Path, outputs: list[dict]) -> None:
    """Write atomically: a reader never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for out in outputs:
            f.write(json.dumps(out) + "\n")
    os.replace(tmp, path)
