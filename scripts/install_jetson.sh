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

# ------------------------------------------------------------------------------ detection

IS_JETSON=0
L4T=""
JETPACK=""
BOARD=""
SUPPORTED=0
WHY_UNSUPPORTED=""

# jetpack_of L4T_VERSION -> JetPack release (map from jetson-stats' NVIDIA_JETPACK table).
jetpack_of() {
    case "$1" in
        35.1*) echo 5.0.2 ;; 35.2*) echo 5.1 ;; 35.3*) echo 5.1.1 ;; 35.4*) echo 5.1.2 ;;
        35.5*) echo 5.1.3 ;; 35.6.0*) echo 5.1.4 ;; 35.6*) echo 5.1.5 ;;
        36.2*) echo 6.0DP ;; 36.3*) echo 6.0 ;; 36.4.0* | 36.4.2*) echo 6.1 ;; 36.4.3*) echo 6.2 ;;
        36.4*) echo 6.2.1 ;; 36.5*) echo 6.2.2 ;; 38.*) echo 7.0 ;; 39.*) echo 7.2 ;;
        *) echo unknown ;;
    esac
}

detect_platform() {
    local rel="$PROBE_ROOT/etc/nv_tegra_release" model="$PROBE_ROOT/proc/device-tree/model" line major rev pkg
    if [ -r "$rel" ]; then
        line=$(head -n 1 "$rel")
        major=$(printf '%s\n' "$line" | sed -n 's/^# R\([0-9][0-9]*\) (release).*/\1/p')
        rev=$(printf '%s\n' "$line" | sed -n 's/.*REVISION: *\([0-9.][0-9.]*\).*/\1/p')
        [ -n "$major" ] && [ -n "$rev" ] && L4T="$major.$rev"
        IS_JETSON=1
    elif [ -z "$PROBE_ROOT" ] && command -v dpkg-query >/dev/null 2>&1 &&
        pkg=$(dpkg-query -W -f='${Version}' nvidia-l4t-core 2>/dev/null) && [ -n "$pkg" ]; then
        L4T=${pkg%%-*}
        IS_JETSON=1
    fi
    if [ -r "$model" ]; then
        BOARD=$(tr -d '\0' <"$model")
    fi
    [ "$IS_JETSON" -eq 1 ] || return 0
    JETPACK=$(jetpack_of "$L4T")
    case "$L4T" in
        36.* | 38.* | 39.*) SUPPORTED=1 ;;
        35.*) WHY_UNSUPPORTED="JetPack $JETPACK (L4T R$L4T) ships Python 3.8 and TensorRT 8.5 for it; chattts-appliance needs Python >= 3.10 with JetPack's TensorRT bindings. Upgrade to JetPack 6.x (L4T R36)." ;;
        "") WHY_UNSUPPORTED="cannot read the L4T release from $rel (or the nvidia-l4t-core package)" ;;
        *) WHY_UNSUPPORTED="L4T R$L4T (JetPack $JETPACK) is not supported; use JetPack 6.x (L4T R36) or 7.x (L4T R38/R39)" ;;
    esac
}

# ------------------------------------------------------------------------------ steps

APT_PACKAGES=(python3-venv python3-dev python3-pip python3-systemd libportaudio2 alsa-utils mosquitto-clients)
APT_JETSON=(python3-libnvinfer)

step_apt() {
    say "apt packages"
    local pkgs=("${APT_PACKAGES[@]}") missing=() p
    if [ "$IS_JETSON" -eq 1 ]; then
        pkgs+=("${APT_JETSON[@]}")
    else
        note "skipped (JetPack only, not a Jetson): ${APT_JETSON[*]}"
    fi
    for p in "${pkgs[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        note "already installed: ${pkgs[*]}"
        return
    fi
    run apt-get update
    run env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
}

step_user() {
    say "service user '$SERVICE_USER' (groups audio, video)"
    local groups=audio,video g
    if getent group jtop >/dev/null 2>&1; then groups="$groups,jtop"; fi
    if id -u "$SERVICE_USER" >/dev/null 2>&1; then
        note "user exists"
    else
        run useradd --system --user-group --home-dir /var/lib/chattts-appliance --no-create-home \
            --shell /usr/sbin/nologin "$SERVICE_USER"
    fi
    for g in ${groups//,/ }; do
        if id -nG "$SERVICE_USER" 2>/dev/null | tr ' ' '\n' | grep -qx "$g"; then
            note "already in group $g"
        else
            run usermod -a -G "$g" "$SERVICE_USER"
        fi
    done
}

step_dirs() {
    say "directories"
    local d
    for d in "$APP_DIR" "$ETC_DIR" "$UNIT_DIR" "$STATE_DIR" "$STATE_DIR/spool" "$STATE_DIR/out" "$CACHE_DIR" "$ENGINE_DIR"; do
        if [ -d "$d" ]; then note "exists: $d"; else run mkdir -p "$d"; fi
    done
}

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
# (bench/RESULTS.md, bench/gpu_llama.sh). The runner still tries every offloaded load in a child
# process first and runs the GPT on the CPU if that fails (appliance/engines/llama/canary.py).
# LLAMA_CUDA=0 in the environment builds the CPU variant.
LLAMA_CUDA_LOADS=${LLAMA_CUDA:-1}
# shellcheck source=/dev/null  # scripts/llama_build.sh: llama_has_compiler
. "$SCRIPT_DIR/llama_build.sh"

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

# set_key FILE SECTION KEY VALUE: replace '  KEY: ...' inside top-level 'SECTION:' (comments kept).
set_key() {
    local file=$1 section=$2 key=$3 value=$4 tmp
    tmp=$(mktemp)
    awk -v s="$section" -v k="$key" -v v="$value" '
        /^[A-Za-z_]+:/ { cur = $1; sub(":.*", "", cur) }
        cur == s && $0 ~ "^  " k ":" && !done { sub(":[^#]*", ": " v "   "); done = 1 }
        { print }
        END { if (!done) exit 3 }' "$file" >"$tmp" || { rm -f "$tmp"; die "$EXIT_FAIL" "config template has no $section.$key"; }
    mv "$tmp" "$file"
}

step_config() {
    say "config $CONFIG"
    local dist="$CONFIG.dist"
    if [ "$DRY_RUN" -eq 1 ]; then
        printf '+ write %s from %s (model.path=%s, model.engine_dir=%s, service.spool_dir, audio.wav_dir under %s, safety.cache_dir)\n' \
            "$dist" "$REPO/config.yaml" "$MODEL_DIR" "$ENGINE_DIR" "$STATE_DIR"
        if [ -f "$CONFIG" ]; then note "keeping the existing $CONFIG"; else printf '+ cp %q %q\n' "$dist" "$CONFIG"; fi
        return
    fi
    cp "$REPO/config.yaml" "$dist"
    set_key "$dist" model path "$MODEL_DIR"
    set_key "$dist" model engine_dir "$ENGINE_DIR"
    set_key "$dist" service spool_dir "$STATE_DIR/spool"
    set_key "$dist" audio wav_dir "$STATE_DIR/out"
    set_key "$dist" safety cache_dir "$CACHE_DIR"
    sed -i "1i # Written by scripts/install_jetson.sh from $REPO/config.yaml; edit freely (kept on re-install)." "$dist"
    if [ -f "$CONFIG" ]; then
        note "keeping the existing config; the current template is $dist"
    else
        run cp "$dist" "$CONFIG"
    fi
    if [ -x "$VENV/bin/python" ]; then
        "$VENV/bin/python" -c 'import sys; from appliance.config import load_config; load_config(sys.argv[1])' "$CONFIG" ||
            die "$EXIT_FAIL" "$CONFIG does not validate (see the message above)"
        note "config validates"
    fi
}

step_units() {
    say "systemd units in $UNIT_DIR"
    local u src tmp changed=0
    for u in "${UNITS[@]}"; do
        src="$REPO/systemd/$u"
        [ -f "$src" ] || die "$EXIT_FAIL" "missing unit $src"
        tmp=$(mktemp)
        sed -e "s#/opt/chattts-appliance#$APP_DIR#g" -e "s#/etc/chattts-appliance#$ETC_DIR#g" "$src" >"$tmp"
        if [ -f "$UNIT_DIR/$u" ] && cmp -s "$tmp" "$UNIT_DIR/$u"; then
            note "unchanged: $u"
        elif [ "$DRY_RUN" -eq 1 ]; then
            printf '+ install -m 0644 %q %q   # paths under %s\n' "$src" "$UNIT_DIR/$u" "${P:-/}"
            changed=1
        else
            run install -m 0644 "$tmp" "$UNIT_DIR/$u"
            changed=1
        fi
        rm -f "$tmp"
    done
    if [ "$SYSTEM" -eq 1 ] && [ "$changed" -eq 1 ]; then run systemctl daemon-reload; fi
}

step_model() {
    say "checkpoint $MODEL_DIR"
    if [ -f "$MODEL_DIR/asset/gpt/config.json" ]; then
        note "present"
    elif [ "$SKIP_MODEL" -eq 1 ]; then
        warn "no checkpoint at $MODEL_DIR (--skip-model): put the 2Noise/ChatTTS asset/ there before starting"
    else
        note "weights: 2Noise/ChatTTS, licence CC BY-NC 4.0 (non-commercial use only)"
        run "$CLI" model fetch "$MODEL_DIR"
    fi
}

# engines_match: exit 0 when <engine_dir>/trt/<precision>/manifest.json matches this board, its
# TensorRT version, the checkpoint and the configured limits (appliance.engines.manifest.check).
engines_match() {
    "$VENV/bin/python" - "$CONFIG" "$PRECISION" <<'EOF'
import sys
from appliance.config import load_config
from appliance.errors import ApplianceError
from appliance.engines import manifest as mf
try:
    import tensorrt
except ImportError:
    sys.exit("TensorRT Python bindings are not importable (apt: python3-libnvinfer)")
cfg = load_config(sys.argv[1])
precision = sys.argv[2]
d = cfg.resolve(cfg.model.engine_dir) / "trt" / precision
try:
    m = mf.read(d)
    dev = mf.device_facts()
    ck = mf.checkpoint_identity(cfg.resolve(cfg.model.path), m.get("checkpoint"))
    mf.check(m, {"kind": "tensorrt", "precision": precision, "runtime": {"version": tensorrt.__version__},
                 "device": {"board": dev["board"], "l4t": dev["l4t"]}, "checkpoint_sha256": ck["sha256"],
                 "limits": {"max_batch": cfg.model.max_batch, "max_seq_len": cfg.model.max_seq_len}},
             "rebuild")
except ApplianceError as e:
    sys.exit(str(e))
print(f"engines in {d} match this board and checkpoint")
EOF
}

step_engines() {
    say "TensorRT engines ($PRECISION) in $ENGINE_DIR"
    if [ "$SKIP_ENGINES" -eq 1 ]; then
        note "skipped (--skip-engines)"
        return
    fi
    if [ "$DRY_RUN" -eq 0 ] && engines_match; then
        note "reusing the cached engines"
        return
    fi
    [ "$DRY_RUN" -eq 1 ] && note "(the engines are rebuilt only if their manifest does not match)"
    local onnx="$ENGINE_DIR/onnx/fp16"
    if [ -n "$ONNX_DIR" ]; then
        local src="$ONNX_DIR"
        [ -d "$ONNX_DIR/onnx/fp16" ] && src="$ONNX_DIR/onnx/fp16"
        [ -f "$src/manifest.json" ] || die "$EXIT_USAGE" "--onnx-dir: no manifest.json in $src (export with --precision fp16)"
        run mkdir -p "$onnx"
        run cp -a "$src/." "$onnx/"
    elif [ -f "$onnx/manifest.json" ]; then
        note "ONNX graphs present in $onnx"
    elif [ "$DRY_RUN" -eq 1 ] || "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
        # the export needs a torch its graphs are tested with (2.10+; JetPack 6's NVIDIA wheels are 2.3-2.5):
        # say so and what to do before a long export fails (appliance/build/cli.py torch_problem)
        local why=""
        [ "$DRY_RUN" -eq 1 ] || why=$("$VENV/bin/python" -c 'from appliance.build.cli import torch_problem as p; print(p() or "")')
        [ -z "$why" ] || die "$EXIT_FAIL" "$why"
        run "$CLI" engines export --config "$CONFIG" --precision fp16
    else
        die "$EXIT_FAIL" "no ONNX graphs in $onnx and no torch in $VENV to export them: run 'chattts-appliance engines export --precision fp16 --out DIR' on a machine with torch and pass --onnx-dir DIR"
    fi
    # engines build then measures the vocoder look-ahead these plans and this checkpoint need
    # (chattts-appliance calibrate) and records it beside them: the daemon's first audio depends on it
    run "$CLI" engines build --config "$CONFIG" --precision "$PRECISION"
}

# step_aot: the torch CUDA path's decode step compiled ahead of time (chattts-appliance engines
# compile: AOTInductor packages in <engine_dir>/aot, loaded at start by model.compile: auto). It
# needs a PyTorch with Triton to build; JetPack's has none, so on a stock Jetson this is skipped
# and the torch fallback captures plain CUDA graphs (the TensorRT plans above are the fast path).
# Exit 1 from it means the packages were built but fail their load check in a child process (torch
# 2.11's loader crashed on them on an H200): recorded beside them, the daemon runs plain CUDA graphs,
# so the install goes on with a warning; any other failure stops it.
step_aot() {
    say "ahead-of-time compiled torch step in $ENGINE_DIR/aot"
    if [ "$SKIP_ENGINES" -eq 1 ]; then
        note "skipped (--skip-engines)"
        return
    fi
    if [ "$DRY_RUN" -eq 1 ]; then
        note "(only where PyTorch has CUDA and Triton: not JetPack's)"
    elif ! "$VENV/bin/python" -c 'import sys, torch; from appliance.engines.torch.step_modes import has_triton; sys.exit(0 if torch.cuda.is_available() and has_triton() else 1)' >/dev/null 2>&1; then
        note "skipped: no PyTorch with CUDA and Triton in $VENV; the torch fallback runs plain CUDA graphs"
        return
    fi
    printf '+ %q engines compile --config %q\n' "$CLI" "$CONFIG"
    [ "$DRY_RUN" -eq 1 ] && return
    local rc=0
    "$CLI" engines compile --config "$CONFIG" || rc=$?
    case "$rc" in
        0) ;;
        1) warn "the compiled step's packages cannot be loaded by this PyTorch (see above): the daemon runs plain CUDA graphs" ;;
        *) die "$EXIT_FAIL" "command failed ($rc): $CLI engines compile --config $CONFIG" ;;
    esac
}

# step_calibrate: the vocoder look-ahead of the backend the daemon will open, where none is
# recorded for it (engines build calibrated the TensorRT plans; this covers the torch CUDA path and
# a CPU box's ONNX graphs exported elsewhere). The daemon would otherwise measure it at its first
# start, before it serves (stream.calibrate_at_start).
step_calibrate() {
    say "look-ahead calibration of the engines the daemon opens"
    if [ "$SKIP_ENGINES" -eq 1 ]; then
        note "skipped (--skip-engines): the daemon calibrates at its first start"
        return
    fi
    run "$CLI" calibrate --config "$CONFIG" --if-missing
}

step_owner() {
    say "ownership of $STATE_DIR and $CACHE_DIR"
    run chown -R "$SERVICE_USER:$SERVICE_USER" "$STATE_DIR" "$CACHE_DIR"
}

step_health() {
    say "health check"
    if [ "$SKIP_HEALTH" -eq 1 ]; then
        note "skipped (--skip-health)"
        return
    fi
    printf '+ runuser -u %s -- %q health --config %q\n' "$SERVICE_USER" "$CLI" "$CONFIG"
    [ "$DRY_RUN" -eq 1 ] && return
    local rc=0
    runuser -u "$SERVICE_USER" -- "$CLI" health --config "$CONFIG" || rc=$?
    case "$rc" in
        0) note "healthy" ;;
        1) warn "the health check reports UNHEALTHY (see the table above); the service is installed anyway, tune health.* in $CONFIG" ;;
        *) die "$EXIT_FAIL" "the health check could not run (exit $rc); fix the error above and run this script again" ;;
    esac
}

# step_path: which backend the box will run each network on, and its expected all-in footprint
# (the daemon's own estimate before the load: docs/jetson-memory.md gives the figures per path)
step_path() {
    say "the path this box will run"
    if [ "$DRY_RUN" -eq 1 ]; then
        note "(would print the backend model.backend auto picks here and its expected memory)"
        return
    fi
    "$VENV/bin/python" - "$CONFIG" <<'PY' || warn "could not tell the path yet (export the engines first): docs/jetson-memory.md"
import sys
from appliance.config import load_config
from appliance.daemon.memory import plan_before_load
from appliance.engines.select import choose_backend
from appliance.engines.sizes import plan_sizes
from appliance.ops.footprint import memory_kind
cfg = load_config(sys.argv[1])
backend, why = choose_backend(cfg)
print(f"    backend {backend}: {why}")
try:
    s = plan_sizes(cfg)
    fit = plan_before_load(cfg, s, memory_kind(s.device), 100.0)
    print(f"    expected: about {fit.footprint_mib:.0f} MiB all-in at {fit.max_batch} x {fit.max_seq_len} positions ({fit.action}); {fit.text}")
except Exception as e:   # sizes unknown until the engines exist
    print(f"    expected footprint unknown until the engines are exported ({e}); docs/jetson-memory.md")
PY
}

step_enable() {
    say "enable the service"
    if [ "$ENABLE" -eq 0 ]; then
        note "skipped (--no-enable)"
        return
    fi
    run systemctl enable --now chattts-appliance.service chattts-appliance-health.timer
}

# ------------------------------------------------------------------------------ main

detect_platform
if [ "$IS_JETSON" -eq 1 ]; then
    say "Jetson: ${BOARD:-unknown board}, L4T R${L4T:-?} (JetPack ${JETPACK:-?})"
else
    say "not a Jetson: no $PROBE_ROOT/etc/nv_tegra_release, no nvidia-l4t-core package${BOARD:+ (board: $BOARD)}"
fi
[ "$DRY_RUN" -eq 1 ] && say "dry run: nothing is changed"

if [ "$SYSTEM" -eq 1 ]; then
    if [ "$IS_JETSON" -eq 1 ] && [ "$SUPPORTED" -eq 0 ]; then
        die "$EXIT_UNSUPPORTED" "$WHY_UNSUPPORTED"
    fi
    if [ "$IS_JETSON" -eq 0 ] && [ "$DRY_RUN" -eq 0 ]; then
        die "$EXIT_NOT_JETSON" "this is not a Jetson; use --dry-run to see the plan or --prefix DIR to install the non-Jetson parts"
    fi
    if [ "$DRY_RUN" -eq 0 ] && [ "$(id -u)" -ne 0 ]; then
        die "$EXIT_USAGE" "installing into / needs root: sudo $0 ${ORIG_ARGS[*]}"
    fi
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
