#!/usr/bin/env bash
# GPU session for issue 19's host memory (one device call, about 7 minutes in all, checkpoint included):
#   1. bench/gpu_heap_probe.py on the full random checkpoint (torch CUDA FP16, plain CUDA graphs, KV 3 x 2048):
#      glibc's view of the heap stage by stage in fresh processes: default, plain torch (bare), cuDNN off, MALLOC_MMAP_THRESHOLD_,
#      CUDA_MODULE_LOADING=EAGER, MALLOC_ARENA_MAX=2, MALLOC_TRIM_THRESHOLD_=0 (deadline $HEAP_DEADLINE_S, 240 s);
#   2. with the time left (until $TOTAL_S, 400 s, from the start), bench/gpu_aot.sh loadcheck: why the ahead-of-time
#      packages crash torch's loader (tiny packages loaded in child processes with native frames).
# Results under $OUT: heap-probe-<date>-h200.json (every stage record), heap-probe.log, aot-loadcheck.json/.log.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out/gpu_heap}
start=$(date +%s)
# shellcheck source=bench/gpu_env.sh
. bench/gpu_env.sh
export PYTHONPATH=${PYTHONPATH:-}:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "checkpoint ready after $(( $(date +%s) - start )) s"
python3 bench/gpu_heap_probe.py "$CKPT" --deadline-s "${HEAP_DEADLINE_S:-240}" ${HEAP_VARIANTS:+--variants "$HEAP_VARIANTS"} \
  --json "$OUT/heap-probe-$(date -u +%F)-h200.json" > "$OUT/heap-probe.log" 2>&1
echo "heap probe: rc=$? after $(( $(date +%s) - start )) s"
sed -n '/^milestones/,$p' "$OUT/heap-probe.log"
grep -A6 '^== default\|^== bare ' "$OUT/heap-probe.log"
left=$(( ${TOTAL_S:-400} - ($(date +%s) - start) ))
if [ "$left" -gt 60 ]; then
  LOADCHECK_S=$left bash bench/gpu_aot.sh loadcheck
else
  echo "no time left for bench/gpu_aot.sh loadcheck ($left s)"
fi
