#!/usr/bin/env bash
# install_jetson.sh - install chattts-appliance as a systemd service on a Jetson (JetPack 6 / 7).
#
# Usage: scripts/install_jetson.sh [options]
#
#   --dry-run          print every action (as '+ command') and change nothing
#   --prefix DIR       install files under DIR instead of / (venv, config, units). With a
#                      prefix other than /, the steps that change the system (apt, service user,
#                      model download, engine build, health check, systemctl) are skipped, and
#                      the script runs on any Linux machine (CI uses this).
#   --repo DIR         source checkout to install from (default: this script's repository)
#   --python PY        interpreter for the venv (default: python3, JetPack's system Python,
#                      which has TensorRT's bindings)
#   --pip-no-deps      pip install --no-deps (no downloads; for CI under --prefix)
#   --precision P      engine precision: fp16 (default) or int8 (weight-only). fp8 is refused:
#                      Orin (sm_87) has no FP8.
#   --onnx-dir DIR     ONNX graphs exported elsewhere: the DIR of `chattts-appliance engines
#                      export --precision fp16 --out DIR` run on any machine with torch (or its
#                      onnx/fp16 subdirectory); copied into the engine cache. Needed when this
#                      box has no torch to export them itself.
#   --export-on-board  also install torch (the [torch] extra) so that this board exports the ONNX
#                      graphs and the GGUF itself; without it no torch is installed: the daemon
#                      never imports torch on the llama.cpp, ONNX Runtime and TensorRT paths, and
#                      the exports come from another machine (--onnx-dir, or engine_dir copied)
#   --skip-model       do not download the checkpoint when it is missing
#   --skip-engines     do not build or check TensorRT engines (nor the ahead-of-time compiled torch step)
#   --skip-health      do not run the health check
#   --no-enable        install the units but do not enable/start them
#   --probe-root DIR   read /etc/nv_tegra_release and /proc/device-tree/model under DIR (tests)
#   -h, --help         this text
#
# Exit status:
#   0  installed (or, with --dry-run, the plan was printed for a supported Jetson)
#   1  a step failed (its command and output are shown)
#   2  bad command line
#   3  not a Jetson: no /etc/nv_tegra_release and no nvidia-l4t-core package (with --dry-run the
#      plan is printed first). Use --prefix DIR to install the non-Jetson parts anywhere.
#   4  unsupported JetPack / L4T or Python (JetPack 5 = L4T R35 ships Python 3.8; we need >= 3.10
#      with JetPack's TensorRT bindings, i.e. JetPack 6 (L4T R36) or 7 (L4T R38/R39))
#
# Every step checks what is already there first, so running the script again is safe: the
# service user, venv, config (never overwritten; the new template goes to config.yaml.dist),
# units (replaced only when they differ), checkpoint and engines (rebuilt only when their
# manifest does not match this board, TensorRT version and checkpoint) are kept.

# shellcheck source-path=SCRIPTDIR
set -euo pipefail

readonly EXIT_FAIL=1 EXIT_USAGE=2 EXIT_NOT_JETSON=3 EXIT_UNSUPPORTED=4

ORIG_ARGS=("$@")
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
PREFIX=/
DRY_RUN=0
PYTHON=python3
PIP_NO_DEPS=0
PRECISION=fp16
SKIP_MODEL=0
SKIP_ENGINES=0
SKIP_HEALTH=0
ENABLE=1
PROBE_ROOT=""
ONNX_DIR=""
EXPORT_ON_BOARD=0
SERVICE_USER=chattts
UNITS=(chattts-appliance.service chattts-appliance.socket chattts-appliance-health.service chattts-appliance-health.timer)

say() { printf '==> %s\n' "$*"; }
note() { printf '    %s\n' "$*"; }
warn() { printf 'install_jetson.sh: warning: %s\n' "$*" >&2; }
die() {
    local code=$1
    shift
    printf 'install_jetson.sh: error: %s\n' "$*" >&2
    exit "$code"
}
usage() { sed -n '2,/^$/s/^# \{0,1\}//p' "$0"; }

# run CMD...: print it, then run it unless --dry-run.
run() {
    printf '+'
    printf ' %q' "$@"
    printf '\n'
    if [ "$DRY_RUN" -eq 0 ]; then
        "$@" || die "$EXIT_FAIL" "command failed ($?): $*"
    fi
}

while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --prefix) [ $# -ge 2 ] || die "$EXIT_USAGE" "--prefix needs a directory"; PREFIX=$2; shift ;;
        --repo) [ $# -ge 2 ] || die "$EXIT_USAGE" "--repo needs a directory"; REPO=$(cd "$2" && pwd); shift ;;
        --python) [ $# -ge 2 ] || die "$EXIT_USAGE" "--python needs an interpreter"; PYTHON=$2; shift ;;
        --pip-no-deps) PIP_NO_DEPS=1 ;;
        --precision) [ $# -ge 2 ] || die "$EXIT_USAGE" "--precision needs fp16 or int8"; PRECISION=$2; shift ;;
        --onnx-dir) [ $# -ge 2 ] || die "$EXIT_USAGE" "--onnx-dir needs a directory"; ONNX_DIR=$(cd "$2" && pwd) || die "$EXIT_USAGE" "--onnx-dir $2 does not exist"; shift ;;
        --export-on-board) EXPORT_ON_BOARD=1 ;;
        --skip-model) SKIP_MODEL=1 ;;
        --skip-engines) SKIP_ENGINES=1 ;;
        --skip-health) SKIP_HEALTH=1 ;;
        --no-enable) ENABLE=0 ;;
        --probe-root) [ $# -ge 2 ] || die "$EXIT_USAGE" "--probe-root needs a directory"; PROBE_ROOT=${2%/}; shift ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; die "$EXIT_USAGE" "unknown option '$1'" ;;
    esac
    shift
done

case "$PRECISION" in
    fp16 | int8) ;;
    fp8) die "$EXIT_USAGE" "--precision fp8: Jetson Orin (sm_87) has no FP8; use fp16 or int8" ;;
    *) die "$EXIT_USAGE" "--precision must be fp16 or int8, got '$PRECISION'" ;;
esac
[ -f "$REPO/pyproject.toml" ] || die "$EXIT_USAGE" "--repo $REPO has no pyproject.toml"

PREFIX=$(realpath -m "$PREFIX")    # absolute: the paths written into config and units
P=${PREFIX%/}                      # "" when installing into /
SYSTEM=0                           # 1: change the system (apt, user, systemctl)
[ -z "$P" ] && SYSTEM=1
APP_DIR="$P/opt/chattts-appliance"
VENV="$APP_DIR/venv"
ETC_DIR="$P/etc/chattts-appliance"
CONFIG="$ETC_DIR/config.yaml"
UNIT_DIR="$P/etc/systemd/system"
STATE_DIR="$P/var/lib/chattts-appliance"
CACHE_DIR="$P/var/cache/chattts-appliance"
MODEL_DIR="$STATE_DIR/models/chattts"
ENGINE_DIR="$CACHE_DIR/engines"
CLI="$VENV/bin/chattts-appliance"

# ------------------------------------------------------------------------------ steps
# One function per step; the driver (main, at the end) runs them in order and each says what it
# checks first. Detection and most steps live beside this script:
#   scripts/jetson/detect.sh   detect_platform
#   scripts/jetson/system.sh   step_apt, step_user, step_dirs, step_units, step_owner, step_enable
#   scripts/jetson/config.sh   step_config, step_model
#   scripts/jetson/engines.sh  step_engines, step_aot, step_calibrate, step_health, step_path
# Here: the Python side (step_venv, step_pip) and the llama.cpp build (step_llama).

IS_JETSON=0
L4T=""
JETPACK=""
BOARD=""
SUPPORTED=0
WHY_UNSUPPORTED=""
APT_PACKAGES=(python3-venv python3-dev python3-pip python3-systemd libportaudio2 alsa-utils mosquitto-clients)
APT_JETSON=(python3-libnvinfer)

# shellcheck source=jetson/detect.sh
. "$SCRIPT_DIR/jetson/detect.sh"
# shellcheck source=jetson/system.sh
. "$SCRIPT_DIR/jetson/system.sh"
# shellcheck source=jetson/config.sh
. "$SCRIPT_DIR/jetson/config.sh"
# shellcheck source=jetson/engines.sh
. "$SCRIPT_DIR/jetson/engines.sh"

# Checks: the interpreter is Python >= 3.10 (else exit 4); the venv exists (kept when it does).
step_venv() {
    say "virtual environment $VENV (--system-site-packages: JetPack's TensorRT and python3-systemd)"
    "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' ||
        die "$EXIT_UNSUPPORTED" "$PYTHON is Python $("$PYTHON" -c 'import platform; print(platform.python_version())'); chattts-appliance needs >= 3.10"
    if [ -x "$VENV/bin/python" ]; then
        note "exists"
    else
        run "$PYTHON" -m venv --system-site-packages "$VENV"
    fi
}

# repo_stamp: identifies the source tree (commit + uncommitted changes), or "" if not a git checkout.
repo_stamp() {
    if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then
        { git -C "$REPO" rev-parse HEAD; git -C "$REPO" status --porcelain; git -C "$REPO" diff HEAD; } 2>/dev/null |
            sha256sum | cut -d' ' -f1
    fi
}

# Checks: the package was installed from this very source tree (commit + changes: .installed-from);
# else pip-installs it (with the [jetson] extra on a Jetson).
step_pip() {
    local spec="$REPO" stamp extras=""
    [ "$IS_JETSON" -eq 1 ] && extras="jetson"
    [ "$EXPORT_ON_BOARD" -eq 1 ] && extras="${extras:+$extras,}torch"   # torch only to export on the board
    spec="$REPO${extras:+[$extras]}"
    say "python package from $spec"
    [ "$IS_JETSON" -eq 1 ] || note "skipped (JetPack only, not a Jetson): the [jetson] extra (cuda-python, jetson-stats)"
    stamp=$(repo_stamp)
    if [ -n "$stamp" ] && [ -x "$CLI" ] && [ "$(cat "$APP_DIR/.installed-from" 2>/dev/null)" = "$stamp" ]; then
        note "already installed from this source tree"
        return
    fi
    local flags=(--disable-pip-version-check)
    [ "$PIP_NO_DEPS" -eq 1 ] && flags+=(--no-deps)
    run "$VENV/bin/python" -m pip install "${flags[@]}" "$spec"
    if [ -n "$stamp" ]; then
        if [ "$DRY_RUN" -eq 0 ]; then printf '%s\n' "$stamp" >"$APP_DIR/.installed-from"; else note "(would record the source stamp)"; fi
    fi
}

# llama.cpp (the [llama] extra: the GPT on llama.cpp) is built from its sdist with the system's
# compiler (scripts/llama_build.sh). On a Jetson with JetPack's nvcc it is the CUDA variant
# (-DGGML_CUDA=on, nvcc's host compiler the system g++): the runner then offloads the GPT unless
# model.device is cpu. Built with another C++ library than the system's (an H200 image's /opt/gcc
# g++) it segfaulted at load; with the system g++ it loads and matches the CPU step
# (bench/HISTORY.md, bench/gpu.sh llama). The runner still tries every offloaded load in a child
# process first and runs the GPT on the CPU if that fails (appliance/engines/llama/canary.py).
# LLAMA_CUDA=0 in the environment builds the CPU variant.
LLAMA_CUDA_LOADS=${LLAMA_CUDA:-1}
# shellcheck source=/dev/null  # scripts/llama_build.sh: llama_has_compiler
. "$SCRIPT_DIR/llama_build.sh"

# Checks: llama_cpp imports in the venv (kept), a C/C++ compiler exists (else a warning: the CPU
# backend stays onnxruntime); builds the CUDA variant on a Jetson with nvcc, else the CPU one.
step_llama() {
    say "llama.cpp for the CPU GPT backend (the [llama] extra, built from its sdist)"
    if [ "$PIP_NO_DEPS" -eq 1 ]; then
        note "skipped (--pip-no-deps: no downloads): the [llama] extra; model.backend auto then uses onnxruntime on a CPU"
        return
    fi
    if "$VENV/bin/python" -c 'import llama_cpp' >/dev/null 2>&1; then
        note "already installed: llama-cpp-python $("$VENV/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)')"
        return
    fi
    if ! llama_has_compiler; then
        warn "llama-cpp-python is built from source and needs a C/C++ compiler: install one (apt-get install build-essential) and run this again; until then the CPU backend is onnxruntime"
        return
    fi
    local args
    args=$(llama_cmake_args)   # scripts/llama_build.sh: LLAMA_CPU=portable (x86-64: every CPU) or native
    if [ "$IS_JETSON" -eq 1 ] && [ -x /usr/local/cuda/bin/nvcc ] && [ "$LLAMA_CUDA_LOADS" -eq 1 ]; then
        # GGML_CUDA_NO_VMM: llama.cpp's virtual-memory pool reserves more address space than an Orin
        # Nano allows (public reports: the offloaded load fails); the plain pool works on every board
        args="$args -DGGML_CUDA=on -DGGML_CUDA_NO_VMM=ON -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc"
        note "CUDA variant (JetPack's nvcc): the GPT on the GPU; 5 min on 16 x86 cores, expect much longer on an Orin"
    elif [ -x /usr/local/cuda/bin/nvcc ]; then
        note "CPU build (LLAMA_CUDA=0, or not a Jetson)"
    fi
    note "building for $(llama_describe): about 5 min on two x86 cores (up to an hour for every x86 CPU), longer on a slow board"
    run env CMAKE_ARGS="$args" CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ \
        "$VENV/bin/python" -m pip install --disable-pip-version-check "${REPO}[llama]"
}


# ------------------------------------------------------------------------------ driver

# system_checks: on / (not under --prefix), refuse an unsupported JetPack (exit 4), a machine that
# is not a Jetson (exit 3, after the plan with --dry-run) and a non-root user (exit 2).
system_checks() {
    if [ "$IS_JETSON" -eq 1 ] && [ "$SUPPORTED" -eq 0 ]; then
        die "$EXIT_UNSUPPORTED" "$WHY_UNSUPPORTED"
    fi
    if [ "$IS_JETSON" -eq 0 ] && [ "$DRY_RUN" -eq 0 ]; then
        die "$EXIT_NOT_JETSON" "this is not a Jetson; use --dry-run to see the plan or --prefix DIR to install the non-Jetson parts"
    fi
    if [ "$DRY_RUN" -eq 0 ] && [ "$(id -u)" -ne 0 ]; then
        die "$EXIT_USAGE" "installing into / needs root: sudo $0 ${ORIG_ARGS[*]}"
    fi
}

main() {
    detect_platform
    if [ "$IS_JETSON" -eq 1 ]; then
        say "Jetson: ${BOARD:-unknown board}, L4T R${L4T:-?} (JetPack ${JETPACK:-?})"
    else
        say "not a Jetson: no $PROBE_ROOT/etc/nv_tegra_release, no nvidia-l4t-core package${BOARD:+ (board: $BOARD)}"
    fi
    [ "$DRY_RUN" -eq 1 ] && say "dry run: nothing is changed"
    if [ "$SYSTEM" -eq 1 ]; then
        system_checks
        step_apt
        step_user
    fi
    step_dirs
    step_venv
    step_pip
    step_llama
    step_config
    step_units
    if [ "$SYSTEM" -eq 1 ]; then
        step_model
        step_engines
        step_aot
        step_calibrate
        step_owner
        step_health
        step_path
        step_enable
    else
        say "prefix $PREFIX: skipped apt, service user, checkpoint, engines, health check and systemctl"
    fi
    if [ "$IS_JETSON" -eq 0 ]; then
        say "JetPack-only steps skipped (not a Jetson): ${APT_JETSON[*]} (TensorRT's Python bindings), the [jetson] extra, the TensorRT engine build; here the daemon's model.backend auto picks onnxruntime (CPU) on graphs from 'chattts-appliance engines export --precision int8'"
    fi
    if [ "$SYSTEM" -eq 1 ] && [ "$IS_JETSON" -eq 0 ]; then
        say "plan printed; this machine is not a Jetson (exit $EXIT_NOT_JETSON)"
        exit "$EXIT_NOT_JETSON"
    fi
    say "done"
}

main
