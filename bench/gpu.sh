#!/usr/bin/env bash
# GPU benchmark runs as one line: prepare the GPU machine once, then run the named suites.
#
#   bench/gpu.sh --fetch        here, with network: fill .gpu/ (git-ignored, ~20 MB: wheels the GPU
#                               image lacks, PortAudio's Debian packages, llama-cpp-python's sdist
#                               trimmed of models/docs/.git, this tree's commit); carry .gpu to the GPU
#   bench/gpu.sh SUITE...       on the GPU machine (no network): prepare, then each suite in turn
#
# Suites (records: $OUT/<bench>.jsonl; one log: $OUT/gpu.log; merge them here with
# `python -m bench merge DIR`):
#   shipped     python -m bench shipped: torch CUDA and llama.cpp CUDA + ONNX Runtime, in turns
#   latency     python -m bench gpu: plain and compiled CUDA graphs, calibrated look-ahead
#   memory      python -m bench memory: torch-cuda stages, compile off and auto
#   llama       python -m bench llama (q8_0, q4_k_m, f16 offloaded vs CPU) and tests/test_llama_canary.py
#   cuda-tests  pytest -m cuda (the CUDA tests on the full random checkpoint)
#   service     python -m bench service on torch CUDA into the paced ALSA file device
# Environment: OUT (default out/gpu), CKPT (default /tmp/ckpt_full), CUDA_ARCH (default 90),
# REQUESTS (shipped, 100), ROUNDS (wyoming-bench rounds, 2), SUITE_S (time limit per suite, 540).
# Steps already done on a warm machine (wheels, checkpoint, llama.cpp build) are skipped.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
GPU=.gpu
OUT=${OUT:-out/gpu}
CKPT=${CKPT:-/tmp/ckpt_full}
SITE=$PWD/out/gpu-site   # installed wheels and the llama.cpp build: kept on a warm machine
LLW=$PWD/out/gpu-llw
export GPU OUT CKPT SITE LLW
WHEELS=(tokenizers pybase16384 wetext kaldifst opencc markdown-it-py mdurl linkify-it-py uc-micro-py sounddevice
  soxr paho-mqtt wyoming wyoming-bench sentence-stream regex safetensors gguf nvidia-ml-py scikit-build-core pathspec onnxscript onnx-ir
  ml-dtypes emoji diskcache)
DEBS=(libportaudio2 libasound2 libasound2-data libjack-jackd2-0 libdb5.3)

# Checks: pip and apt-get reach their indexes; the sdist is llama-cpp-python's pinned version.
fetch() {
  local tmp v
  v=$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml | cut -d= -f3)
  rm -rf "$GPU" && mkdir -p "$GPU/whl" "$GPU/deb" && tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$GPU/whl" "${WHEELS[@]}" || return 1
  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$v" -d "$tmp" || return 1
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp" || return 1
  local d=("$tmp"/llama_cpp_python-*/)
  rm -rf "${d[0]}.git" "${d[0]}vendor/llama.cpp/"{models,docs,media,benches,tests,app,pocs,examples,tools/ui}
  tar czf "$GPU/llama_cpp_python-$v.tar.gz" -C "$tmp" "$(basename "${d[0]}")" || return 1
  (cd "$GPU/deb" && apt-get download "${DEBS[@]}") || echo "no PortAudio packages (apt-get download failed)"
  git rev-parse --short HEAD > "$GPU/commit"
  rm -rf "$tmp"
  du -sh "$GPU"
}

# Checks: every carried wheel the image lacks installs into $SITE; the package imports.
prepare_python() {
  local w name
  mkdir -p "$SITE"
  export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 BENCH_OUT=$OUT
  [ -n "${BENCH_COMMIT:-}" ] || { [ -f "$GPU/commit" ] && BENCH_COMMIT=$(cat "$GPU/commit") && export BENCH_COMMIT; }
  for w in "$GPU"/whl/*.whl; do
    [ -e "$w" ] || continue
    name=$(basename "$w" | cut -d- -f1)
    python3 -m pip show -q "$name" >/dev/null 2>&1 && continue
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$w" || return 1
  done
  python3 -c "import appliance, numpy, torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
}

# Checks: libportaudio loads (sounddevice reports its version); packages unpacked only where missing.
prepare_portaudio() {
  local deb lib
  for deb in "$GPU"/deb/*.deb; do
    [ -e "$deb" ] || continue
    lib=$(dpkg-deb -c "$deb" | grep -o '[^/]*\.so\.[0-9]*$' | head -1)
    [ -n "$lib" ] && ldconfig -p | grep -q "$lib" && continue
    dpkg -x "$deb" /
  done
  ldconfig
  python3 -c "import sounddevice as s; print('portaudio', s.get_portaudio_version()[1])" || true
}

# Checks: the full-size random checkpoint exists (written once, seed 0).
prepare_checkpoint() {
  [ -d "$CKPT/asset" ] && return 0
  python3 -m appliance model random --size full "$CKPT" > /dev/null || return 1
}

# Checks: llama-cpp-python's CUDA build (the system gcc/g++ as host compiler) offloads; built once.
build_llama() {
  local sdist=("$GPU"/llama_cpp_python-*.tar.gz) t0
  python3 -c 'import llama_cpp, sys; sys.exit(not llama_cpp.llama_supports_gpu_offload())' 2>/dev/null && return 0
  if ! ls "$LLW"/*.whl >/dev/null 2>&1; then
    t0=$(date +%s)
    echo "== llama.cpp CUDA build (sm ${CUDA_ARCH:-90}, $(nproc) jobs)"
    CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
      CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DLLAVA_BUILD=OFF" \
      python3 -m pip wheel -q --no-build-isolation --no-deps -w "$LLW" "${sdist[0]}" > /tmp/llama-build.log 2>&1 \
      || { tail -30 /tmp/llama-build.log; return 1; }
    echo "built in $(( $(date +%s) - t0 )) s"
  fi
  python3 -m pip install -q --no-index --no-deps --target "$SITE" "$LLW"/*.whl || return 1
  python3 -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__, "offload", llama_cpp.llama_supports_gpu_offload())'
}

suite_shipped() {
  build_llama || return 1
  python3 -m bench shipped --checkpoint "$CKPT" --candidates torch,llama --requests "${REQUESTS:-100}" \
    --rounds "${ROUNDS:-2}" --work /tmp/shipped
}

suite_latency() {
  python3 -m bench gpu --ckpt "$CKPT" --variants plain,compiled --calibrate --engine-dir /tmp/eng_latency \
    --compiled-max-seq 512 --work /tmp/bench_gpu
}

suite_memory() {
  python3 -m bench memory --checkpoint "$CKPT" --engine-dir /tmp/eng_memory --backends torch-cuda --compile off auto
}

suite_llama() {
  build_llama || return 1
  python3 -m pytest -q -p no:cacheprovider tests/test_llama_canary.py | tail -3
  python3 -m bench llama --checkpoint "$CKPT" --gguf-dir /tmp/gguf --types "${TYPES:-q8_0,q4_k_m,f16}"
}

suite_cuda_tests() {
  APPLIANCE_FULL_CKPT=$CKPT python3 -m pytest -q -p no:cacheprovider -rfE -m cuda tests | tail -15
}

suite_service() {
  prepare_portaudio
  local c
  for c in default off; do   # the compiled step (KV 512: fewer compilations), then plain CUDA graphs
    python3 -m bench service --checkpoint "$CKPT" --engine-dir /tmp/eng_service --backend torch --device cuda \
      --compile "$c" --max-seq-len 512 --lookahead auto --steps 60 --runs 5 --memory-budget-mb 4096
  done
}

main() {
  [ "${1:-}" = "--fetch" ] && { fetch; return; }
  [ $# -gt 0 ] || { sed -n '2,20p' "$0"; return 2; }
  local s r rc=0
  for s in "$@"; do
    declare -F "suite_${s//-/_}" >/dev/null || { echo "unknown suite: $s" >&2; return 2; }
  done
  mkdir -p "$OUT"
  prepare_python >> "$OUT/gpu.log" 2>&1 || { tail -20 "$OUT/gpu.log"; return 1; }
  prepare_checkpoint >> "$OUT/gpu.log" 2>&1 || { tail -20 "$OUT/gpu.log"; return 1; }
  for s in "$@"; do
    echo "== $s $(date -u +%H:%M:%S)" | tee -a "$OUT/gpu.log"
    timeout "${SUITE_S:-540}" bash -c "$(declare -f); suite_${s//-/_}" >> "$OUT/gpu.log" 2>&1
    r=$?
    echo "$s: rc=$r" | tee -a "$OUT/gpu.log"
    [ "$r" -eq 0 ] || rc=1
  done
  grep -h '^{"bench"' "$OUT"/*.jsonl 2>/dev/null | cut -c1-300
  return $rc
}

main "$@"
