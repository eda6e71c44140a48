#!/usr/bin/env bash
# A short GPU session after the last step changes: CUDA tests, the step's kernels before/after,
# the plain-graph step side by side with an earlier tree (.old/: a checkout since the
# one-generation-path redesign, see bench/bench_gpu.py), then the compiled
# step (KV 512: fewer compilations) with the look-ahead calibrated on the GPU. Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out/gpu_final}
# shellcheck source=bench/gpu_env.sh
. bench/gpu_env.sh
PYTHONPATH=/tmp/site:$PWD run tests 120 python3 -m pytest -p no:cacheprovider -q -rA tests/test_gpu_cuda.py tests/test_same_seed.py
tail -2 "$OUT/tests.log"
APPLIANCE_TREE=$PWD/.old run kernels-old 45 python3 bench/step_kernels.py $CKPT
run kernels-new 45 python3 bench/step_kernels.py $CKPT
APPLIANCE_TREE=$PWD/.old run plain-old 60 python3 bench/bench_gpu.py --out "$OUT/plain-old" --ckpt $CKPT --variants plain --sections ours --label "earlier tree (.old)"
run plain-new 90 python3 bench/bench_gpu.py --out "$OUT/plain-new" --ckpt $CKPT --variants plain --sections ours --calibrate --engine-dir /tmp/eng_plain
run compiled-new 150 python3 bench/bench_gpu.py --out "$OUT/compiled-new" --ckpt $CKPT --variants compiled --compiled-max-seq 512 --sections ours --calibrate --engine-dir /tmp/eng_compiled
