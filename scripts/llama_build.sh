# shellcheck shell=bash
# Sourced by scripts/test.sh, scripts/quickstart.sh and scripts/install_jetson.sh: build and install
# llama-cpp-python (the [llama] extra: the GPT on llama.cpp) from its sdist.
#
#   llama_install PY SPEC   builds llama-cpp-python's wheel (once per version and build flags),
#                           installs it with PY, records what the build needs of the CPU, then
#                           pip-installs SPEC (e.g. ".[llama]" or "-e .[torch,llama]").
#                           Returns 3 with one message when no C/C++ compiler is present.
#   llama_cmake_args        the CMake flags for this machine (LLAMA_CPU=portable|native).
#   llama_describe          one line: what the flags build for.
#
# Builds for other CPUs (docs/guarantees.md): on x86-64 the default (LLAMA_CPU=portable) builds
# llama.cpp's CPU backend once per x86 feature level (GGML_CPU_ALL_VARIANTS: x64, SSE4.2, AVX,
# AVX2, AVX-512, ..., each a libggml-cpu-<level>.so loaded at run time, GGML_BACKEND_DL) and
# the runtime loads the best one the CPU has (appliance/engines/llama/lib.py): an image built on
# one x86-64 CPU runs on every other. LLAMA_CPU=native (and every build on another architecture,
# e.g. a Jetson) builds for this CPU only (-march=native); the record then lists this CPU's
# features and a CPU without one of them is refused before the library loads (ONNX Runtime is
# used instead, or the daemon stops with exit 2). CMAKE_ARGS, when set, replaces the flags.
#
# The record, llama_build.json (version, flags, architecture, the CPU features needed), is kept
# beside the wheel and copied next to the installed library (llama_cpp/lib/llama_build.json).
# Wheels are cached per version + flags under pip's cache directory (pip's own wheel cache keys
# on the sdist alone, so a native and a portable wheel would replace each other there): a later
# install of the same version and flags takes seconds, on CI too.

# The x86 / Arm features a -march=native build may use (names as /proc/cpuinfo's flags).
LLAMA_X86_FEATURES="sse4_2 avx f16c fma avx2 bmi2 avx_vnni avx512f avx512cd avx512bw avx512dq avx512vl avx512vbmi avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16"
LLAMA_ARM_FEATURES="asimd fphp asimdhp asimddp i8mm bf16 sve sve2 sme"

llama_has_compiler() {
  command -v "${CXX:-c++}" >/dev/null 2>&1 && command -v "${CC:-cc}" >/dev/null 2>&1
}

llama_cmake_args() {
  if [ -n "${CMAKE_ARGS:-}" ]; then
    echo "$CMAKE_ARGS"
  elif [ "${LLAMA_CPU:-portable}" = portable ] && [ "$(uname -m)" = x86_64 ]; then
    echo "-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON"
  else
    echo "-DGGML_NATIVE=ON"
  fi
}

# llama_requires ARGS: the CPU features a build with ARGS needs, space-separated ("" = none).
llama_requires() {
  case " $1 " in
    *" -DGGML_CPU_ALL_VARIANTS=ON "*) return ;;
    *" -DGGML_NATIVE=OFF "*) return ;;
  esac
  local want f have
  if [ "$(uname -m)" = x86_64 ]; then want=$LLAMA_X86_FEATURES; else want=$LLAMA_ARM_FEATURES; fi
  have=" $(grep -m1 -E '^(flags|Features)' /proc/cpuinfo | cut -d: -f2) "
  for f in $want; do
    case "$have" in *" $f "*) printf '%s ' "$f" ;; esac
  done
}

llama_describe() {
  local args req
  args=$(llama_cmake_args)
  req=$(llama_requires "$args")
  case " $args " in
    *" -DGGML_CPU_ALL_VARIANTS=ON "*) echo "every $(uname -m) CPU (one CPU library per feature level, the best chosen at start)" ;;
    *) if [ -n "$req" ]; then echo "CPUs with this one's features ($(uname -m): ${req% }) only"
       else echo "every $(uname -m) CPU"; fi ;;
  esac
}

# llama_version: the llama-cpp-python version pyproject.toml pins.
llama_version() {
  sed -n 's/.*"llama-cpp-python==\([^"]*\)".*/\1/p' pyproject.toml | head -1
}

# llama_wheel PY: the directory holding llama-cpp-python's wheel for these flags and its record,
# built first when absent. Returns 1 when the build fails.
llama_wheel() {
  local py=$1 ver args req key dir tmp
  ver=$(llama_version)
  args=$(llama_cmake_args)
  req=$(llama_requires "$args")
  key=$(printf '%s|%s|%s' "$ver" "$args" "$(uname -m)" | sha256sum | cut -c1-16)
  dir="$("$py" -m pip cache dir 2>/dev/null || echo "${XDG_CACHE_HOME:-$HOME/.cache}/pip")/chattts-appliance-llama/$ver-$key"
  if ! ls "$dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "==> building llama-cpp-python $ver for $(llama_describe) (CMAKE_ARGS=$args): up to an hour on two cores (every x86 CPU), once" >&2
    tmp=$(mktemp -d)
    if ! "$py" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$ver" -d "$tmp/src" >&2 ||
      ! CMAKE_ARGS="$args" "$py" -m pip wheel -q --no-deps --no-cache-dir "$tmp"/src/llama_cpp_python-*.tar.gz -w "$tmp/whl" >&2; then
      rm -rf "$tmp"
      return 1
    fi
    # shellcheck disable=SC2086  # $req: a list
    "$py" - "$ver" "$args" "$(uname -m)" $req >"$tmp/whl/llama_build.json" <<'PYEOF'
import json, sys
print(json.dumps({"version": sys.argv[1], "cmake_args": sys.argv[2], "arch": sys.argv[3],
                  "variants": "-DGGML_CPU_ALL_VARIANTS=ON" in sys.argv[2].split(),
                  "requires": sys.argv[4:]}, indent=1))
PYEOF
    mkdir -p "$(dirname "$dir")" && rm -rf "$dir" && mv "$tmp/whl" "$dir" && rm -rf "$tmp"
  fi
  echo "$dir"
}

llama_install() {
  local py=$1 dir lib
  shift
  if ! "$py" -c "import llama_cpp" >/dev/null 2>&1 && ! llama_has_compiler; then
    echo "llama-cpp-python (the CPU GPT backend) is built from source and needs a C/C++ compiler:" \
      "install one (Debian/Ubuntu: apt-get install build-essential) and run this again" >&2
    return 3
  fi
  dir=$(llama_wheel "$py") || return 1
  lib=$("$py" -c 'import importlib.util as u, os; s = u.find_spec("llama_cpp"); print(os.path.join(os.path.dirname(s.origin), "lib") if s else "")')
  if [ -z "$lib" ] || ! cmp -s "$dir/llama_build.json" "$lib/llama_build.json"; then
    "$py" -m pip install -q --force-reinstall --no-deps "$dir"/llama_cpp_python-*.whl || return 1
    lib=$("$py" -c 'import importlib.util as u, os; print(os.path.join(os.path.dirname(u.find_spec("llama_cpp").origin), "lib"))')
    cp "$dir/llama_build.json" "$lib/llama_build.json"
  fi
  echo "==> llama.cpp built for $(llama_describe)" >&2
  "$py" -m pip install -q "$@"
}
