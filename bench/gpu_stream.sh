#!/usr/bin/env bash
# GPU session for the stateful vocoder and the sound device's buffer: CUDA tests (the CUDA runner's
# stateful passes against the host runner's), the look-ahead calibrated on the GPU, then the daemon
# end to end (bench/bench_service.py, torch CUDA FP16 GPT) with audio.latency_ms 20 instead of 100.
# Usage: [LATENCY_MS=20] bench/gpu_stream.sh tests|plain|compiled (each calibrates first where this
# machine has no calibration yet). Results under $OUT. Needs .whl/ and .alsa/ as bench/gpu_service.sh.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out/gpu_stream}
# shellcheck source=bench/gpu_env.sh
. bench/gpu_env.sh
for deb in .alsa/*.deb; do
  lib=$(dpkg-deb -c "$deb" | grep -o '[^/]*\.so\.[0-9]*$' | head -1)
  [ -n "$lib" ] && ldconfig -p | grep -q "$lib" && continue
  dpkg -x "$deb" /
done
ldconfig
export PYTHONPATH=${PYTHONPATH:-}:$PWD
ENG=/tmp/eng_gpu
B=(python3 bench/bench_service.py --checkpoint "$CKPT" --engine-dir "$ENG" --backend torch --device cuda --machine h200
   --out "$OUT/service.json" --steps 60 --runs 5 --memory-budget-mb 4096 --latency-ms "${LATENCY_MS:-20}")
calibrate() {   # the look-ahead on this GPU, once per machine (a fresh machine has none)
  [ -f $ENG/calibration.json ] && return
  cat > /tmp/cal.yaml <<YAML
model: {path: $CKPT, backend: torch, device: cuda, dtype: float16, compile: "off", engine_dir: $ENG, max_seq_len: 512}
YAML
  run calibrate 150 python3 -m appliance calibrate --config /tmp/cal.yaml
  tail -4 "$OUT/calibrate.log"
}
case ${1:-tests} in
  tests)
    run tests 200 python3 -m pytest -p no:cacheprovider -q -rA tests/test_gpu_cuda.py tests/test_gpu_loop.py \
      tests/test_model_cuda.py tests/test_same_seed.py
    tail -2 "$OUT/tests.log"
    calibrate ;;
  plain) calibrate; run plain 150 "${B[@]}" --compile off --lookahead auto exact
    grep -h "^|" "$OUT"/plain.log ;;
  compiled) calibrate; run "compiled-${LATENCY_MS:-20}ms" 400 "${B[@]}" --compile default --max-seq-len 512 --lookahead auto exact
    grep -h "^|" "$OUT"/compiled-*.log ;;
esac
