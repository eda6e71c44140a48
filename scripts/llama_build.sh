# shellcheck shell=bash
# Sourced by scripts/test.sh, scripts/quickstart.sh and scripts/install_jetson.sh: build and install
# llama-cpp-python (the [llama] extra: the GPT on llama.cpp) from its sdist.
#
#   llama_install PY SPEC   pip-installs SPEC (e.g. ".[llama]" or "-e .[torch,llama]") with PY;
#                           CMAKE_ARGS defaults to -DGGML_NATIVE=ON (kernels for this CPU).
#                           Returns 3 with one message when no C/C++ compiler is present.
#
# llama-cpp-python has no binary wheel: pip builds it with CMake (fetched from PyPI when the
# system has none) and the system's C/C++ compiler, ~5 min on two cores; pip's wheel cache keeps
# the result, so later installs of the same version take seconds.

llama_has_compiler() {
  command -v "${CXX:-c++}" >/dev/null 2>&1 && command -v "${CC:-cc}" >/dev/null 2>&1
}

llama_install() {
  local py=$1
  shift
  if ! "$py" -c "import llama_cpp" >/dev/null 2>&1 && ! llama_has_compiler; then
    echo "llama-cpp-python (the CPU GPT backend) is built from source and needs a C/C++ compiler:" \
      "install one (Debian/Ubuntu: apt-get install build-essential) and run this again" >&2
    return 3
  fi
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" "$py" -m pip install -q "$@"
}
