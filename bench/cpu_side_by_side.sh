#!/usr/bin/env bash
# The CPU side by side: upstream ChatTTS's GPT loop first (bench/bench_upstream_cpu.py, when
# UPSTREAM_SRC names an unpacked chattts-0.2.5 sdist; its B=1 ms per step goes into every record as
# baseline_ms_per_step), then another tree (OLD, with its own export) and this one in turns, on the
# same full-size random checkpoint and the same look-ahead (LOOKAHEAD, default auto), appended to
# bench/results/cpu-<date>-cpu-2core.json. Each record carries the host's read bandwidth measured
# in its own run (host_read_gbps) and bandwidth_frac.
# Usage: bench/cpu_side_by_side.sh CKPT OLD_TREE OLD_ENGINES NEW_ENGINES [ROUNDS]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
CKPT=$1 OLD=$2 OLD_ENG=$3 NEW_ENG=$4 ROUNDS=${5:-2}
PY=${PY:-.venv/bin/python}
LA=${LOOKAHEAD:-auto}
BASE=()
if [ -n "${UPSTREAM_SRC:-}" ]; then
  UP=$(PYTHONPATH="${UPSTREAM_PATH:-}" $PY bench/bench_upstream_cpu.py --checkpoint "$CKPT" --src "$UPSTREAM_SRC" \
       --batches 1 --steps "${UPSTREAM_STEPS:-30}" --label "upstream, same session" | grep '^{')
  echo "$UP"
  BASE=(--baseline-ms "$(echo "$UP" | $PY -c 'import json,sys; print(json.loads(sys.stdin.readline())["ms_per_step"])')")
fi
for i in $(seq "$ROUNDS"); do
  $PY bench/bench_cpu.py --checkpoint "$CKPT" --engine-dir "$OLD_ENG" --tree "$OLD" --lookahead "$LA" "${BASE[@]}" \
      --ttfb-runs "${TTFB_RUNS:-3}" --label "before ($OLD), look-ahead $LA (round $i)" | grep '^{'
  $PY bench/bench_cpu.py --checkpoint "$CKPT" --engine-dir "$NEW_ENG" --lookahead "$LA" "${BASE[@]}" \
      --ttfb-runs "${TTFB_RUNS:-3}" --label "after, look-ahead $LA (round $i)" | grep '^{'
done
