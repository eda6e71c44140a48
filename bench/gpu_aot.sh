#!/usr/bin/env bash
# GPU session for the ahead-of-time compiled decode step (one device call, < 10 minutes):
#   bench   (default) bench/bench_aot.py on the full random checkpoint, FP16, KV 3 x $MAX_SEQ_LEN (512):
#           ready time cold/warm and ms/step of plain CUDA graphs, the packages built by
#           `chattts-appliance engines compile` (its cold build timed) and torch.compile at start,
#           each in a fresh process through open_runner; the codes of each mode against plain's.
#           A stage that would pass $DEADLINE_S (500 s) is skipped and says so; then run `aot` or
#           `jit` alone in a second call (plain graphs run again as the reference).
#   tests   the CUDA tests of the compiled steps (AOT and torch.compile) and the CPU package test.
#   memory  bench/bench_memory.py, torch CUDA FP16 through Pipeline.from_config: RSS, anonymous,
#           load peak, device memory (NVML) and ready time per stage, plain graphs at the default
#           KV (3 x 2048); then, if a `bench` or `aot` run on this machine left packages in /tmp/eng_*,
#           model.compile auto (the packages) and default (torch.compile, warm cache) at KV 3 x 512.
#   loadcheck  bench/aot_load_check.py: why the packages crash torch's loader here: the toolchain facts, tiny packages
#           (weights baked in / weights as inputs / nothing returned / 256 inputs) built and each loaded and run in a
#           child process that prints native frames on a fault, the libraries each .so needs (ldd); REAL=1 also builds
#           one real decode-step package (~100 s cold); within $LOADCHECK_S (150 s).
# bench and tests need nothing beyond the GPU image (torch, numpy, safetensors, tqdm, PyYAML);
# memory runs the text layer too: carry .whl/ (wetext, kaldifst, opencc, pybase16384, contractions,
# textsearch, anyascii, pyahocorasick, cffi, pycparser; cp312 manylinux wheels).
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
  bench|aot|jit)   # aot / jit: one compiled mode only (plain always runs as the reference)
    stages=aot,jit; [ "$1" != bench ] && stages=$1
    python3 bench/bench_aot.py --checkpoint "$CKPT" --engine-dir "/tmp/eng_$stages" --machine h200 --stages "$stages" \
      --max-seq-len "${MAX_SEQ_LEN:-512}" --deadline-s "${DEADLINE_S:-500}" --out "$OUT/aot-$(date -u +%F)-h200.json" ;;
  tests)
    run tests 500 python3 -m pytest -p no:cacheprovider -q -rA tests/test_gpu_cuda.py tests/test_engines_aot.py \
      -k "aot or compile"
    tail -15 "$OUT/tests.log" ;;
  memory)
    M=(python3 bench/bench_memory.py --checkpoint "$CKPT" --backends torch-cuda --machine h200
       --out "$OUT/memory-$(date -u +%F)-h200.json" --timeout-s 240)
    "${M[@]}" --engine-dir /tmp/eng_mem --compile off --label "default KV"
    for d in /tmp/eng_aot,jit /tmp/eng_aot; do   # left by `bench` or `aot` on this machine
      if ls "$d"/aot/*/manifest.json > /dev/null 2>&1; then
        "${M[@]}" --engine-dir "$d" --compile auto default --max-seq-len "${MAX_SEQ_LEN:-512}" --label "engine dir of bench/bench_aot.py"
        break
      fi
    done ;;
  loadcheck)
    L=${LOADCHECK_S:-150}
    timeout $(( L + 30 )) python3 bench/aot_load_check.py --work /tmp/aot_loadcheck --deadline-s "$L" \
      ${REAL:+--real "$CKPT"} --out "$OUT/aot-loadcheck.json" > "$OUT/aot-loadcheck.log" 2>&1
    echo "loadcheck rc=$?"; sed -n '/^summary:/,$p' "$OUT/aot-loadcheck.log"
    grep -A12 '^facts:' "$OUT/aot-loadcheck.log" | head -14 ;;
  *) echo "usage: bench/gpu_aot.sh [bench|aot|jit|tests|memory|loadcheck]" >&2; exit 2 ;;
esac
