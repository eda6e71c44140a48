#!/usr/bin/env bash
# The daemon end to end on the GPU machine, as a user hears it: bench/bench_service.py with the
# torch CUDA backend (FP16 GPT), the look-ahead calibrated on the GPU, the compiled step and plain
# CUDA graphs, into the paced ALSA file device. The GPU image has no PortAudio: .alsa/ carries the
# Debian packages (libportaudio2 and what it links: libasound2, libasound2-data, libjack-jackd2-0,
# libdb5.3), unpacked only where the image lacks the library. Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out/gpu_service}
# shellcheck source=bench/gpu_env.sh
. bench/gpu_env.sh
for deb in .alsa/*.deb; do
  lib=$(dpkg-deb -c "$deb" | grep -o '[^/]*\.so\.[0-9]*$' | head -1)
  [ -n "$lib" ] && ldconfig -p | grep -q "$lib" && continue
  dpkg -x "$deb" /
done
ldconfig
python3 -c "import sounddevice as s; print(\"portaudio\", s.get_portaudio_version()[1])"
export PYTHONPATH=${PYTHONPATH:-}:$PWD
ENG=/tmp/eng_gpu
cat > /tmp/cal.yaml <<YAML
model: {path: $CKPT, backend: torch, device: cuda, dtype: float16, compile: "off", engine_dir: $ENG, max_seq_len: 512}
YAML
run calibrate 120 python3 -m appliance calibrate --config /tmp/cal.yaml
tail -3 "$OUT/calibrate.log"
B=(python3 bench/bench_service.py --checkpoint "$CKPT" --engine-dir "$ENG" --backend torch --device cuda --machine h200
   --out "$OUT/service.json" --steps 60 --runs 5 --memory-budget-mb 4096)
run compiled 240 "${B[@]}" --compile default --max-seq-len 512 --lookahead auto exact --keep /tmp/keep-compiled
run plain 100 "${B[@]}" --compile off --lookahead auto exact
grep -h "^|" "$OUT"/compiled.log "$OUT"/plain.log
grep -h "ready\|compil" /tmp/keep-compiled/auto/daemon.log | head -5 > "$OUT/compiled-start.log"
