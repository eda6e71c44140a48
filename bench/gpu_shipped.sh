#!/usr/bin/env bash
# bench: shipped on a GPU machine: bench/bench_shipped.py (config.yaml as shipped, paths only, a
# fresh engine dir: READY with its first-start calibration, status at READY, 100 requests, status
# after them, wyoming-bench on the fresh box and on the same box restarted) on the full-size
# random checkpoint. Needs .whl/ (bench/gpu_env.sh: the text layer's wheels, wyoming,
# wyoming-bench and sentence-stream). The record goes to $OUT/shipped-<date>-<machine>.json.
# Usage: bench/gpu_shipped.sh [bench_shipped.py options, e.g. --set model.compile=off]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out/gpu_shipped}
# shellcheck source=bench/gpu_env.sh
. bench/gpu_env.sh
export PYTHONPATH=${PYTHONPATH:-}:$PWD
python3 bench/bench_shipped.py --checkpoint "$CKPT" --out "$OUT/shipped-$(date -u +%F)-${MACHINE:-h200}.json" \
  --requests "${REQUESTS:-100}" --rounds "${ROUNDS:-2}" --work /tmp/shipped --machine "${MACHINE:-h200}" "$@"
