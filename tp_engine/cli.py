"""The command line each rank runs (launch/generate.py, python -m tp_engine); launcher.py starts the ranks."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import sys
import time
from typing import TYPE_CHECKING

import yaml

from tp_engine.base import config as C
from tp_engine.frontend.output_file import OutputLock, check_target
from tp_engine.frontend.progress import Progress, Streamer
from tp_engine.frontend.prompt_sampling import line_counts, own_settings
from tp_engine.frontend.openai_batch_output import prepare_batch
from tp_engine.frontend.prompts import PromptEncoder, PromptError, read_prompts
from tp_engine.frontend.results import ResultSink, run_settings
from tp_engine.frontend.resume import open_results
from tp_engine.frontend.summary import Summary

if TYPE_CHECKING:  # torch itself is imported only once the config is known to be good
    import torch

log = logging.getLogger("tp_engine")
FOLLOWER_GRACE_S = 5.0
EXIT_PROMPT_ERRORS = 3  # with fail_on_prompt_error; 0 done, 1 a rank failed, 2 start-up error, 128+N signal N

EXAMPLES = """examples:
  torchrun --nproc_per_node=2 launch/generate.py --config configs/demo.yaml
  python launch/generate.py --config run.yaml --set sampling.temperature=0.7 --set sampling.top_p=0.9
  python launch/generate.py --config run.yaml --set 'prompts=["Hello", {input_ids: [1, 2, 3]}]' --print-config

--set takes a dotted key and a YAML value; it may be repeated and wins over the file.

config keys (key = default):
"""


def describe_keys() -> str:
    """Every config key with its default, for `--help`."""
    lines = []
    for dotted, key in C.SCHEMA.items():
        choices = f" [{'|'.join(key.choices)}]" if key.choices else ""
        lines.append(f"  {dotted} = {json.dumps(key.default)}{choices}\n      {key.help}")
    return "\n".join(lines)


def make_parser(prog: str = "generate.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Tensor-parallel Qwen3 generation.",
                                epilog=EXAMPLES + describe_keys(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. --set sampling.max_new_tokens=32")
    p.add_argument("--print-config", action="store_true", help="print the merged config as YAML and exit")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 and not args.quiet else logging.WARNING,
                        format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    try:
        cfg = C.build_config(args.config, args.overrides)
        prompts = read_prompts(cfg)
    except C.ConfigError as e:
        # Every rank reads the same file and fails the same way; rank 0 says so once.
        return fail(rank, str(e), 2)
    if args.print_config:
        if rank == 0:
            print(yaml.safe_dump(cfg, sort_keys=False), end="")
        return 0
    if rank != 0:
        prompts = []  # read to fail as rank 0 does; only rank 0 holds a job's prompts
    install_signal_handlers(rank)
    try:
        return run(cfg, prompts, rank, config_path=args.config, quiet=args.quiet)
    except Exception as e:  # noqa: BLE001 - any failure ends this rank now; torchrun then stops the rest
        from tp_engine.comm import PeerLost, StartupError, failure_report, gloo_reason  # torch is loaded
        if isinstance(e, StartupError):
            fail(rank, str(e), 2)
            os._exit(2)  # the process group is up: leave without gloo's teardown (see finish)
        _STOPPING.acquire(blocking=False)  # a signal now (torchrun's, as the others stop) must not hide why
        message = failure_report() or f"{type(e).__name__}: {e}"  # a stuck push all-reduce stops its kernel
        lost = ("Connection reset by peer", "closed by peer")
        if isinstance(e, PeerLost):  # which rank, and how, is in the message
            message = str(e)
        elif isinstance(e, RuntimeError) and any(s in str(e) for s in lost):
            # its traceback would only show where this rank was waiting
            message = f"lost contact with another rank ({gloo_reason(e)}): it probably died; the launcher " \
                "names it"
        elif isinstance(e, RuntimeError) and "Timed out waiting" in str(e) and "timeout_s" not in str(e):
            # gloo's own words; a message of the engine's that names timeout_s already says what waited
            message = f"another rank did not join a collective within timeout_s ({cfg['timeout_s']} s; " \
                f"{gloo_reason(e)}): it is stuck or stopped"
        else:
            import traceback
            traceback.print_exc()
        if rank == 0 and _SINK is not None:  # what finished is kept: say where, as a signal would
            message += f"; {_SINK.on_stop()}"
        release_output()
        fail(rank, f"rank {rank}: {message}", 1, always=True)
        os._exit(1)  # skip destructors that could wait on a collective the other ranks never join


class Preflight:
    """Rank 0's start-up work that needs no weights: the output file (checks, lock, resume) and the prompts'
    ids. The engine runs it before any rank loads a weight, and every rank stops if it fails."""

    def __init__(self, cfg: dict, prompts: list, config_path: str | None) -> None:
        self.cfg, self.prompts, self.config_path = cfg, prompts, config_path
        self.lock: OutputLock | None = None
        self.encoded: list = []
        self.own: dict[int, dict] = {}  # the prompts' own `sampling`, by index
        self.requests = self.most_samples = 0  # (prompt, sample) lines; the largest sampling.n
        self.sink: ResultSink | None = None

    def __call__(self, device: torch.device) -> None:
        cfg, target, shown = self.cfg, None, self.cfg["output"]
        encoder = PromptEncoder.from_config(cfg)
        encoder.check_stop_strings(cfg["sampling"]["stop"])
        if shown:
            others = {"config file": self.config_path, "prompts_file": cfg["prompts_file"]}
            target = check_target(shown, others, cfg["model"])
            self.lock = OutputLock(target, shown)
        self.encoded = encoder.encode_all(self.prompts)
        prepare_batch(self.prompts, self.encoded, PromptError)  # the lines of a Batch API file it cannot run
        self.own = own_settings(self.prompts, self.encoded)
        self.requests, self.most_samples = line_counts(len(self.prompts), cfg["sampling"]["n"], self.own)
        # it needs torch: imported only once the config is good
        from tp_engine.checkpoint.model_config import ModelConfig
        mc = ModelConfig.from_dir(cfg["model"])
        dtype = cfg["dtype"] if cfg["dtype"] != "auto" else mc.auto_dtype(device.type)
        tp = cfg["tensor_parallel_size"] or int(os.environ.get("WORLD_SIZE", "1"))  # each replica's
        settings = run_settings(cfg, dtype, tp, mc.max_position_embeddings, mc.quant is not None)
        # with resume, the lines it keeps; the output lines of OpenAI Batch API requests for such a file
        self.sink = open_results(cfg, target, shown, self.prompts, self.encoded, settings, self.own, encoder)


_SINK: ResultSink | None = None  # rank 0's results, for the signal handler
_PREFLIGHT: Preflight | None = None  # rank 0's output lock, for a run that ends early
_LATE: list[int] = []  # a signal that came while rank 0 printed the results: it exits once they are out
_STOPPING = threading.Lock()  # held by whatever ends this rank early: a signal's handler, or a failure


def release_output() -> None:
    """Remove the output's lock file and the empty folders this run made: at the end, at a refusal, at a
    signal or a failure (the lock itself goes with the process, but its file would stay)."""
    if _PREFLIGHT is not None and _PREFLIGHT.lock is not None:
        _PREFLIGHT.lock.release()


def run(cfg: dict, prompts: list, rank: int, config_path: str | None = None, quiet: bool = False) -> int:
    from tp_engine.llm import LLM  # torch is imported only once the config is known to be good

    global _SINK, _PREFLIGHT
    preflight = _PREFLIGHT = Preflight(cfg, prompts, config_path)
    try:
        llm = LLM(**cfg, preflight=preflight if rank == 0 else None)
    except BaseException:  # refused at start-up: nothing was written, and the lock goes too
        release_output()
        raise
    if not llm.rank0:
        llm.generate(prompts)
        return finish(llm, 0)
    sink = _SINK = preflight.sink
    show_progress = cfg["progress"] and not quiet and not cfg["stream"]
    progress = Progress(preflight.requests - len(sink.skip), show_progress)
    streamer = None
    if cfg["stream"]:
        if preflight.requests != 1:
            log.warning("stream: true prints text for a single prompt and sample only; "
                        "%d prompts, %d requests given", len(prompts), preflight.requests)
        else:
            streamer = Streamer()

    def on_token(update) -> None:
        progress.token()
        if streamer is not None:  # the whole output (a think block too), held back before a stop string
            streamer.update(update.text, final=update.finish_reason is not None)

    summary = Summary(preflight.most_samples)

    def on_finish(out: dict) -> None:
        sink.add(out)
        progress.finished()
        summary.add(out)

    t0 = time.perf_counter()
    # no output is kept here: the sink has each one (a job of any length runs in bounded memory)
    llm.generate(prompts, on_finish=on_finish, skip=sink.skip, on_token=on_token,
                 encoded=preflight.encoded, return_outputs=False)
    seconds = time.perf_counter() - t0
    sink.close()
    if _LATE:
        print(f"\nstopped by {signal.Signals(_LATE[0]).name} after the results were printed", file=sys.stderr)
        sys.stderr.flush()
        os._exit(128 + _LATE[0])
    release_output()
    print(summary.line(seconds, llm.engine.num_preempted, len(sink.skip), llm.engine.spec_summary()),
          file=sys.stderr)
    if not summary.errors:
        return finish(llm, 0)
    # Every prompt has its line: a few bad prompts in a large batch leave the job successful (a scheduler
    # would run all of it again for them), unless fail_on_prompt_error asks for status 3.
    ended = summary.errors_line(cfg["output"], cfg["output"] is None and sys.stdout.isatty())
    if cfg["fail_on_prompt_error"]:
        return finish(llm, fail(0, ended, EXIT_PROMPT_ERRORS))
    print(f"warning: {ended}; exit status 0 (fail_on_prompt_error: true makes it 3)", file=sys.stderr)
    return finish(llm, 0)


def finish(llm, code: int) -> int:
    """Meet the other ranks once more, then leave without tearing the process group down: gloo's teardown
    can abort a rank whose peer (the store host) exited first, which would fail a run that succeeded."""
    if llm.tp.size == 1:
        return code
    from tp_engine import comm as tpd
    tpd.barrier(llm.tp)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def fail(rank: int, message: str, code: int, always: bool = False) -> int:
    """Print `message` once (rank 0, or any rank when `always`), and leave it for torchrun's summary.

    The other ranks usually fail the same way at the same moment. They wait a little before exiting, so
    that torchrun, which stops the job when the first rank exits, does not kill rank 0 before it has
    printed. If they are still alive after that (rank 0 did not fail), they say why themselves."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torchrun shows this as the root cause instead of a pointer to its docs
        # whole or absent: torchrun reads it the moment another rank's exit stops the job, and an empty
        # file fails its JSON parser, which then speaks instead of the ranks
        partial = f"{error_file}.{os.getpid()}.partial"
        with open(partial, "w") as f:
            extra = {"py_callstack": message, "timestamp": str(int(time.time()))}
            json.dump({"message": {"message": message, "extraInfo": extra}}, f)
        os.replace(partial, error_file)
    if rank == 0 or always:
        print(f"error: {message}", file=sys.stderr)
    else:
        time.sleep(FOLLOWER_GRACE_S)
        print(f"error: rank {rank}: {message}", file=sys.stderr)
    sys.stderr.flush()
    return code


def install_signal_handlers(rank: int) -> None:
    """SIGINT/SIGTERM end the job at once: rank 0 has already flushed every finished result to disk, or,
    without an output file, prints them to stdout before it exits."""
    # close() is printing the results to stdout, or has printed them all
    printing = lambda: rank == 0 and _SINK is not None and _SINK.printing and not _SINK.printed  # noqa: E731
    printed = lambda: rank == 0 and _SINK is not None and _SINK.printed  # noqa: E731

    def stop(signum, frame):
        if frame is not None and printing():
            # let close() finish printing (a line cut short would be lost): run() exits after it. torchrun
            # follows a Ctrl-C with SIGTERM: that one waits too.
            _LATE[:] = _LATE or [signum]
            return
        if not _STOPPING.acquire(blocking=False):
            return  # already stopping (a second Ctrl-C, the other thread below, or a failure)
        if printed():  # after run() looked for a late signal
            name = signal.Signals(signum).name
            print(f"\nstopped by {name} after the results were printed", file=sys.stderr)
        elif rank == 0:
            where = _SINK.on_stop() if _SINK is not None else "no result had finished"
            print(f"\nstopped by {signal.Signals(signum).name}: {where}", file=sys.stderr)
        release_output()
        sys.stderr.flush()
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    # `stop` runs only once the main thread is back in Python. A rank blocked in a collective (a peer
    # stuck, or gone without its sockets closing) would not get there before timeout_s, and torchrun
    # kills it only 30 s after asking. The interpreter's C-level handler also writes the signal's number
    # to this pipe at once; the thread below then ends the rank itself.
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            signum = os.read(read_end, 1)[0]
            if signum in (signal.SIGINT, signal.SIGTERM):
                time.sleep(1.0)  # the main thread's handler normally exits first
                if (_LATE and not printed()) or printing():  # the main thread prints the
                    continue  # results, and its handler (it runs once a write returns) then exits after them
                stop(signum, None)

    threading.Thread(target=watch, name="signal-watch", daemon=True).start()
