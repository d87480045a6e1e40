"""`tp-generate`: starts a job's ranks as torchrun does, from this process (torch's launch API), each running
the generate command line (`python -m tp_engine`); a failed job ends in its ranks' own words, not torchrun's.

    tp-generate --nproc_per_node=2 --config configs/demo.yaml --set sampling.temperature=0

The options torchrun knows go to the launcher, the others to the command line. torchrun ends a failed job in
its own traceback and a summary of every rank; here the rank that failed has said why (an `error:` line, or a
crash's traceback), the launcher adds nothing unless a rank died without a word, and the job's exit status is
that rank's (see tp_engine/cli.py)."""
from __future__ import annotations

import argparse
import logging
import signal
import sys

from tp_engine import cli
from tp_engine.frontend.lifeline import stop_early

USAGE = "tp-generate [launcher options] --config FILE [--set KEY=VALUE ...] [--print-config] [--quiet]"
DESCRIPTION = """\
Tensor-parallel Qwen3 generation: starts the ranks, as torchrun does, and runs the command line on each.
Options that torchrun knows go to the launcher (in full, either spelling); the others go to every rank.
Without --nproc_per_node (or with 1) on one node, the one rank runs in this process.

A failed job ends with the failing rank's line `error: ...` (a crash: its traceback) and exits with that
rank's status (2: a configuration or start-up error, 1: a rank failed, 128+N: signal N; all of them in
docs/configuration.md, "Exit status")."""
EXAMPLES = """examples:
  tp-generate --nproc_per_node=2 --config configs/demo.yaml
  tp-generate --config run.yaml --set sampling.temperature=0.7 --set sampling.top_p=0.9
  tp-generate --nnodes=2 --nproc_per_node=8 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 \\
      --config run.yaml

The lower-level form: torchrun --nproc_per_node=2 launch/generate.py --config configs/demo.yaml

config keys (key = default):
"""
NOT_FOR_US = ("help", "module", "no_python", "run_path")  # torchrun's, but tp-generate chooses what ranks run


def make_parser() -> tuple[argparse.ArgumentParser, set[argparse.Action]]:
    """The command line's options and torchrun's in one parser (one --help, one usage error before any rank
    starts), and the launcher's actions among them."""
    from torch.distributed.run import get_args_parser

    p = cli.make_parser("tp-generate")
    p.usage, p.description, p.epilog = USAGE, DESCRIPTION, EXAMPLES + cli.describe_keys()
    p.allow_abbrev = False  # an option is the launcher's or the ranks' by its full name
    p._optionals.title = "options (every rank's)"
    group = p.add_argument_group("launcher options (torchrun's; `torchrun --help` says more)")
    launcher = set()
    for action in get_args_parser()._actions:
        if action.option_strings and action.dest not in NOT_FOR_US:
            group._add_action(action)
            launcher.add(action)
    return p, launcher


def split(argv: list[str], p: argparse.ArgumentParser, launcher: set[argparse.Action]) -> tuple[list, list]:
    """argv's launcher options, each with its value, and the rest (the ranks' arguments), in their order."""
    ours, ranks, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0] if token.startswith("--") else token[:2]  # -r3 is -r with 3
        action = p._option_string_actions.get(name)
        n = 2 if action is not None and action.nargs is None and token == name else 1  # the value comes next
        (ours if action in launcher else ranks).extend(argv[i:i + n])
        i += n
    return ours, ranks


def job_status(failures: dict) -> int:
    """The exit status of the rank that failed first (the detection order; 128+N for one killed by signal N).

    A rank killed by anything but the launcher's SIGTERM, which stops the others once one has failed, counts
    first: the others failed for its loss. A rank that exited has said why; for a killed one, say it here."""
    killed = [(r, f) for r, f in failures.items() if f.exitcode < 0 and f.exitcode != -signal.SIGTERM]
    rank, first = (killed or list(failures.items()))[0]
    if first.exitcode >= 0:
        return first.exitcode
    print(f"error: rank {rank} (pid {first.pid}) was killed by {first.signal_name()}", file=sys.stderr)
    return 128 - first.exitcode


def main(argv: list[str] | None = None) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):  # until torch's launch takes them: one line, no traceback
        signal.signal(sig, stop_early)
    argv = sys.argv[1:] if argv is None else argv
    p, launcher = make_parser()
    args = p.parse_args(argv)
    ours, ranks = split(argv, p, launcher)
    import torch.distributed.run as torchrun
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    try:
        one = torchrun.determine_local_world_size(args.nproc_per_node) == 1 and \
            torchrun.parse_min_max_nnodes(args.nnodes) == (1, 1)
    except ValueError as e:
        print(f"error: launcher: {e}", file=sys.stderr)
        return 2
    if one:
        return cli.main(ranks)  # one rank: run it here
    logging.disable(logging.CRITICAL)  # torchrun's log lines: the ranks say what went wrong themselves
    try:
        torchrun.run(torchrun.get_args_parser().parse_args([*ours, "--module", "tp_engine", *ranks]))
    except ChildFailedError as e:
        return job_status(e.failures)
    except SignalException as e:  # passed on to the ranks, which said where the finished results are
        return 128 + e.sigval
    except (ValueError, AssertionError, RendezvousError, DistError) as e:  # a bad option value, a port in use
        print(f"error: launcher: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
