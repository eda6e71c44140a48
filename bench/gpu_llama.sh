#!/usr/bin/env bash
# On the GPU machine: llama-cpp-python's CUDA variant built from its sdist the way
# scripts/install_jetson.sh builds it (the system's gcc/g++ as the host compiler: CC=/usr/bin/gcc
# CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++), then bench/bench_llama_cuda.py on a full-size random
# checkpoint: does a GGUF load with every layer offloaded, and does the GPU step match the CPU's.
#   LLAMA_SDIST  the sdist (default .dev/llama_cpp_python-*.tar.gz; trimmed of llama.cpp's models,
#                docs and unused backends it packs to ~7 MB)
#   WHL_DIR      wheels the machine lacks (scikit-build-core, gguf, safetensors, ...; default .dev/whl)
#   CUDA_ARCH    CMAKE_CUDA_ARCHITECTURES (default 90)
#   TESTS=0      skips tests/test_llama_canary.py (pytest, on the tiny checkpoint); BENCH=0 the bench
# Writes $OUT/llama-build.log, $OUT/llama-pytest.log, $OUT/llama-cuda.json and $OUT/llama-cuda.log.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
sdists=(.dev/llama_cpp_python-*.tar.gz)
SRC=${LLAMA_SDIST:-${sdists[0]}}
WHL=${WHL_DIR:-.dev/whl}
SITE=/tmp/site
wheels=()
for w in "$WHL"/*.whl; do
  case $w in */numpy-*) python3 -c 'import numpy' 2>/dev/null && continue ;; esac
  wheels+=("$w")
done
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${wheels[@]}" || exit 1
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
echo "== build $(basename "$SRC") with GGML_CUDA (sm ${CUDA_ARCH:-90}), $(nproc) jobs, $(/usr/bin/g++ --version | head -1), $(nvcc --version | tail -1)"
t0=$(date +%s)
CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DLLAVA_BUILD=OFF" \
  python3 -m pip wheel -v --no-build-isolation --no-deps -w /tmp/llw "$SRC" > "$OUT/llama-build.log" 2>&1
rc=$?
echo "build rc=$rc in $(( $(date +%s) - t0 )) s"
[ $rc -eq 0 ] || { tail -30 "$OUT/llama-build.log"; exit 1; }
python3 -m pip install -q --no-index --no-deps --target "$SITE" /tmp/llw/*.whl || exit 1
python3 -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__, "offload", llama_cpp.llama_supports_gpu_offload())'
CKPT=/tmp/ckpt_full
[ -d $CKPT/asset ] || python3 -c \
  "from appliance.build.random_ckpt import write_random_checkpoint as w; w('$CKPT','full',seed=0)" || exit 1
if [ "${TESTS:-1}" -eq 1 ]; then
  echo "== pytest tests/test_llama_canary.py (the runner offloads through the load check and speaks as the CPU)"
  python3 -m pytest -q -p no:cacheprovider tests/test_llama_canary.py > "$OUT/llama-pytest.log" 2>&1
  echo "pytest rc=$?"
  tail -5 "$OUT/llama-pytest.log"
fi
[ "${BENCH:-1}" -eq 1 ] || exit 0
echo "== bench_llama_cuda"
python3 bench/bench_llama_cuda.py --checkpoint $CKPT --gguf-dir /tmp/gguf --types "${TYPES:-q8_0,q4_k_m,f16}" \
  --out "$OUT/llama-cuda.json" --label "${LABEL:-CUDA build with the system g++}" > "$OUT/llama-cuda.log" 2>&1
rc=$?
echo "bench rc=$rc (139 = SIGSEGV)"
grep -v '^llama.cpp: ' "$OUT/llama-cuda.log" | tail -20
exit $rc
