#!/usr/bin/env bash
# The vocoder side by side: another tree (OLD, with its own export) and this one in turns
# (bench/bench_vocoder.py: Decoder + Vocos ms per second of audio, three chunk plans), on the same
# full-size random checkpoint and the same look-ahead (LOOKAHEAD, default 14: both trees' calibrated
# value at full size, 2026-12-02), appended to bench/results/vocoder-<date>-cpu-2core.json. Each
# record carries the host's read bandwidth measured in its own run (host_read_gbps); compare the
# ratios of adjacent runs on a shared host.
# Usage: bench/vocoder_side_by_side.sh CKPT OLD_TREE OLD_ENGINES NEW_ENGINES [ROUNDS]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
CKPT=$1 OLD=$2 OLD_ENG=$3 NEW_ENG=$4 ROUNDS=${5:-2}
PY=${PY:-.venv/bin/python}
LA=${LOOKAHEAD:-14}
for i in $(seq "$ROUNDS"); do
  $PY bench/bench_vocoder.py --checkpoint "$CKPT" --engine-dir "$OLD_ENG" --tree "$OLD" --lookahead "$LA" \
      --label "before ($OLD), look-ahead $LA (round $i)" | grep '^{'
  $PY bench/bench_vocoder.py --checkpoint "$CKPT" --engine-dir "$NEW_ENG" --lookahead "$LA" \
      --label "after, look-ahead $LA (round $i)" | grep '^{'
done
