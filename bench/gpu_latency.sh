#!/usr/bin/env bash
# One GPU session for the latency work: CUDA tests, the decode step's kernels before/after a change
# (.old/ = a checkout of an earlier tree since the one-generation-path redesign, optional), the
# plain-graph step side by side,
# then the default CUDA path (model.compile: auto) started cold (empty compile cache) and warm,
# with the look-ahead calibrated on the GPU. Everything lands under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out/gpu_latency}
# shellcheck source=bench/gpu_env.sh
. bench/gpu_env.sh
PYTHONPATH=${PYTHONPATH:-}:$PWD run tests 170 python3 -m pytest -p no:cacheprovider -q -rA tests/test_gpu_cuda.py tests/test_same_seed.py
tail -2 "$OUT/tests.log"
if [ -d .old/appliance ]; then
  APPLIANCE_TREE=$PWD/.old run kernels-old 60 python3 bench/step_kernels.py $CKPT
  APPLIANCE_TREE=$PWD/.old run plain-old 90 python3 bench/bench_gpu.py --out "$OUT/plain-old" --ckpt $CKPT --variants plain --sections ours --label "earlier tree (.old)"
fi
run kernels-new 60 python3 bench/step_kernels.py $CKPT
run plain-new 150 python3 bench/bench_gpu.py --out "$OUT/plain-new" --ckpt $CKPT --variants plain --sections ours --calibrate --engine-dir /tmp/eng_plain
run auto-cold 260 python3 bench/bench_gpu.py --out "$OUT/auto-cold" --ckpt $CKPT --variants auto --sections ours --load-only --engine-dir /tmp/eng_auto
run auto-warm 200 python3 bench/bench_gpu.py --out "$OUT/auto-warm" --ckpt $CKPT --variants auto --sections ours --calibrate --engine-dir /tmp/eng_auto
