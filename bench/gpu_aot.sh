#!/usr/bin/env bash
# GPU session for the ahead-of-time compiled decode step (one device call, < 10 minutes):
#   bench   (default) bench/bench_aot.py on the full random checkpoint, FP16, KV 3 x $MAX_SEQ_LEN:
#           ready time cold/warm and ms/step of plain CUDA graphs, the packages built by
#           `chattts-appliance engines compile` (its cold build timed) and torch.compile at start,
#           each in a fresh process through open_runner; the codes of each mode against plain's.
#   tests   the CUDA tests of the compiled steps (AOT and torch.compile) and the CPU package test.
# Needs nothing beyond the GPU image (torch, numpy, safetensors, tqdm, PyYAML): no .whl/.
# Results under $OUT: aot-<date>-h200.json (records), .raw.json, .log (every child's output).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out/gpu_aot}
# shellcheck source=bench/gpu_env.sh
. bench/gpu_env.sh
export PYTHONPATH=${PYTHONPATH:-}:$PWD
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case ${1:-bench} in
  bench)
    python3 bench/bench_aot.py --checkpoint "$CKPT" --engine-dir /tmp/eng_aot --machine h200 \
      --max-seq-len "${MAX_SEQ_LEN:-512}" --deadline-s "${DEADLINE_S:-480}" --out "$OUT/aot-$(date -u +%F)-h200.json" ;;
  tests)
    run tests 500 python3 -m pytest -p no:cacheprovider -q -rA tests/test_gpu_cuda.py tests/test_engines_aot.py \
      -k "aot or compile"
    tail -15 "$OUT/tests.log" ;;
  *) echo "usage: bench/gpu_aot.sh [bench|tests]" >&2; exit 2 ;;
esac
