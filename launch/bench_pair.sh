#!/usr/bin/env bash
# The same launch/bench.py command in a baseline checkout and in this one, in turn, so that a change and the
# code before it are measured on one machine in one sitting (the "same-call baseline" of docs/benchmarks.md).
#
#   launch/bench_pair.sh BASELINE_DIR [ROUNDS] -- BENCH_ARGS...
#
# BASELINE_DIR is a checkout of the code before (e.g. `git worktree add /tmp/base COMMIT`, or
# `git archive COMMIT | tar -x -C DIR`). Each round runs the baseline, then this checkout (ROUNDS: 1). Every
# JSON line goes to stdout prefixed with `base ` or `this `; the benches' stderr passes through.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
if [ $# -lt 2 ]; then echo "usage: $0 BASELINE_DIR [ROUNDS] -- BENCH_ARGS..." >&2; exit 2; fi
base="$(cd "$1" && pwd)"; shift
rounds=1
if [ "$1" != "--" ]; then rounds="$1"; shift; fi
if [ "${1:-}" != "--" ]; then echo "$0: expected -- before the bench arguments" >&2; exit 2; fi
shift
if [ ! -f "$base/launch/bench.py" ]; then echo "$0: no launch/bench.py under $base" >&2; exit 2; fi
for ((r = 1; r <= rounds; r++)); do
  for side in base this; do
    if [ "$side" = base ]; then dir="$base"; else dir="$here"; fi
    (cd "$dir" && python3 launch/bench.py "$@") | sed "s/^/$side /"
  done
done
