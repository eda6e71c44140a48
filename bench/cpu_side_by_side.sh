#!/usr/bin/env bash
# The CPU side by side: another tree (OLD, with its own export) and this one (exact and calibrated
# look-ahead) in turns, on the same full-size random checkpoint, appended to
# bench/results/cpu-<date>-cpu-2core.json; then upstream ChatTTS's GPT loop in the same session when
# UPSTREAM_SRC names an unpacked chattts-0.2.5 sdist (bench/bench_upstream_cpu.py).
# Usage: bench/cpu_side_by_side.sh CKPT OLD_TREE OLD_ENGINES NEW_ENGINES [ROUNDS]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
CKPT=$1 OLD=$2 OLD_ENG=$3 NEW_ENG=$4 ROUNDS=${5:-2}
PY=${PY:-.venv/bin/python}
for i in $(seq "$ROUNDS"); do
  $PY bench/bench_cpu.py --checkpoint "$CKPT" --engine-dir "$OLD_ENG" --tree "$OLD" --lookahead exact --label "before, exact look-ahead (round $i)" | grep '^{'
  $PY bench/bench_cpu.py --checkpoint "$CKPT" --engine-dir "$OLD_ENG" --tree "$OLD" --lookahead auto --label "before, calibrated look-ahead (round $i)" | grep '^{'
  $PY bench/bench_cpu.py --checkpoint "$CKPT" --engine-dir "$NEW_ENG" --lookahead exact --label "after, exact look-ahead (round $i)" | grep '^{'
  $PY bench/bench_cpu.py --checkpoint "$CKPT" --engine-dir "$NEW_ENG" --lookahead auto --label "after, calibrated look-ahead (round $i)" | grep '^{'
done
if [ -n "${UPSTREAM_SRC:-}" ]; then
  $PY bench/bench_upstream_cpu.py --checkpoint "$CKPT" --src "$UPSTREAM_SRC" --label "upstream, same session" | grep '^{'
fi
