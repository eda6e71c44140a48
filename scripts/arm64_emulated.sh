#!/usr/bin/env bash
# arm64_emulated.sh - the Jetson installer and the CPU daemon in an emulated arm64 Debian root.
#
# Usage: scripts/arm64_emulated.sh [options]        (as root: apt, debootstrap, mounts, chroot)
#
# What an Orin's CPU would run, as far as an x86-64 Debian machine can show it (on an arm64 host
# nothing is emulated). Slow (tens of minutes on 2 cores), so not part of the test suite.
#   1. installs qemu-user-static, binfmt-support and debootstrap (apt) where missing, enables
#      binfmt for aarch64, and debootstraps a minimal Debian arm64 root into --root (reused when
#      it is there);
#   2. copies this repository (git archive of HEAD: commit first) into the root and runs
#      scripts/install_jetson.sh there with --prefix /srv/appliance --pip-no-deps: it must complete
#      on a non-Jetson and say which JetPack-only steps it skipped;
#   3. installs the CPU runtime (pyproject.toml's dependencies) into the installed venv from
#      PyPI's aarch64 wheels (--only-binary: no compiler in the root), then runs the installer
#      again (it must be idempotent and keep the config);
#   4. llama-cpp-python for arm64 (--llama): `build` compiles its sdist inside the root under
#      emulation as a box would (the field's path; about 50 min on 2 cores: docs/jetson.md), `cross`
#      (the default) builds the same sdist on the host with Debian's aarch64 cross compiler
#      (armv8.2-a+dotprod+fp16, the Orin's Cortex-A78AE) into a wheel that pip installs in the root,
#      `off` skips it;
#   5. on the host: writes a tiny random checkpoint into the root and exports it (needs torch on
#      the host): the GPT as a q8_0 GGUF beside the FP32 ONNX vocoder for llama.cpp (or, with
#      --llama off, int8 ONNX graphs), so the arm64 side runs no torch;
#   6. in the root (its /proc/cpuinfo describes the emulated Arm cores: qemu 7.2 passes the host's
#      x86 one through, and ONNX Runtime's CPU probe crashes on it at import): `chattts-appliance serve` with the installed config (model.backend auto,
#      which must pick llama.cpp, or onnxruntime with --llama off; audio.output wav), one sentence
#      through `chattts-appliance say`, checks the done event and the WAV file, stops the daemon with SIGTERM;
#   7. runs `chattts-appliance health --json` (one fixed sentence, in-process) emulated and, on the
#      same graphs, natively on the host: their steps/s ratio is the emulation's slowdown;
#   8. writes the log (arm64-emulated-<date>-<HHMM>Z.log in --logs, the start time) and appends a
#      record (bench: arm64_emulated, machine arm64-qemu: python -m bench latest --bench
#      arm64_emulated) to arm64_emulated.jsonl in --results.
#
# Options:
#   --root DIR          the arm64 root (default /work/arm64-root; kept and reused)
#   --fresh             delete the root first and bootstrap it again (nothing mounted in it is
#                       followed: rm --one-file-system)
#   --suite NAME        Debian release to bootstrap (default bookworm)
#   --mirror URL        Debian mirror (default http://deb.debian.org/debian)
#   --host-python PY    host interpreter with torch and this package's dependencies, for the
#                       checkpoint and the export (default: this checkout's .venv/bin/python,
#                       else python3); this checkout is put first on its PYTHONPATH
#   --text TEXT         the sentence to speak
#   --max-new-tokens N  decode steps per sentence (default 300: random weights rarely end one)
#   --results DIR       where the record goes (default: bench/results of this checkout)
#   --logs DIR          where the log goes (default: out/ of this checkout, not tracked)
#   --qemu-cpu MODEL    the emulated CPU (default neoverse-n1: Armv8.2-A with dot product, no SVE,
#                       no i8mm, as the Orin's Cortex-A78AE; qemu-aarch64-static -cpu help lists them)
#   --timeout S         limit of each emulated step, seconds (default 1800)
#   --llama MODE        cross (default), build (in the root, emulated; give it --timeout 14400) or off
#   -h, --help          this text
#
# Exit status: 0 every step worked; 1 a step failed (the log and the record say which);
#              2 bad command line, or not root.

# The steps are functions called through stage() (and cleanup through trap), which shellcheck
# cannot follow:
# shellcheck disable=SC2317
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
ROOT=/work/arm64-root
FRESH=0
SUITE=bookworm
MIRROR=http://deb.debian.org/debian
HOST_PY=""
TEXT="你好，今天天气很好。The time is 9:30, and it is 21 degrees outside."
MAX_NEW=300
RESULTS="$REPO/bench/results"
LOGS="$REPO/out"
LIMIT=1800
QEMU_CPU_MODEL=neoverse-n1
LLAMA_MODE=cross
LLAMA_SPEC=llama-cpp-python==0.3.36

usage() { sed -n '2,/^$/s/^# \{0,1\}//p' "$0"; }
die() { printf 'arm64_emulated.sh: error: %s\n' "$*" >&2; exit 2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --root) [ $# -ge 2 ] || die "--root needs a directory"; ROOT=$2; shift ;;
        --fresh) FRESH=1 ;;
        --suite) [ $# -ge 2 ] || die "--suite needs a name"; SUITE=$2; shift ;;
        --mirror) [ $# -ge 2 ] || die "--mirror needs a URL"; MIRROR=$2; shift ;;
        --host-python) [ $# -ge 2 ] || die "--host-python needs an interpreter"; HOST_PY=$2; shift ;;
        --text) [ $# -ge 2 ] || die "--text needs a sentence"; TEXT=$2; shift ;;
        --max-new-tokens) [ $# -ge 2 ] || die "--max-new-tokens needs a number"; MAX_NEW=$2; shift ;;
        --results) [ $# -ge 2 ] || die "--results needs a directory"; RESULTS=$2; shift ;;
        --logs) [ $# -ge 2 ] || die "--logs needs a directory"; LOGS=$2; shift ;;
        --timeout) [ $# -ge 2 ] || die "--timeout needs seconds"; LIMIT=$2; shift ;;
        --qemu-cpu) [ $# -ge 2 ] || die "--qemu-cpu needs a model"; QEMU_CPU_MODEL=$2; shift ;;
        --llama) [ $# -ge 2 ] || die "--llama needs cross, build or off"; LLAMA_MODE=$2; shift
                 case "$LLAMA_MODE" in cross | build | off) ;; *) die "--llama $LLAMA_MODE: cross, build or off" ;; esac ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; die "unknown option '$1'" ;;
    esac
    shift
done
[ -n "$HOST_PY" ] || { HOST_PY=python3; [ -x "$REPO/.venv/bin/python" ] && HOST_PY="$REPO/.venv/bin/python"; }
ROOT=$(realpath -m "$ROOT")
case "$ROOT" in / | /bin* | /boot* | /dev* | /etc* | /proc* | /sys* | /usr*) die "--root $ROOT: choose a directory of its own" ;; esac
[ "$(id -u)" -eq 0 ] || die "needs root (apt, debootstrap, mount, chroot): sudo $0"

# paths inside the root (as the daemon sees them) and their host paths (under $ROOT)
PREFIX=/srv/appliance
SRC=/src/chattts-appliance
VENV=$PREFIX/opt/chattts-appliance/venv
CLI=$VENV/bin/chattts-appliance
CONFIG=$PREFIX/etc/chattts-appliance/config.yaml
RUN_CFG=$PREFIX/etc/chattts-appliance/arm64-run.yaml
CKPT=$PREFIX/var/lib/chattts-appliance/models/tiny
ENGINES=$PREFIX/var/cache/chattts-appliance/engines
SOCK=$PREFIX/run/appliance.sock
CA=/etc/ssl/certs/host-ca-bundle.crt          # the host's CA bundle, for pip inside the root

mkdir -p "$RESULTS" "$LOGS"
LOG="$LOGS/arm64-emulated-$(date -u +%F-%H%MZ).log"
RECORD="$RESULTS/arm64_emulated.jsonl"
WORK=$(mktemp -d)
STAGES="$WORK/stages.tsv"                     # name, ok|failed, seconds, detail
: >"$STAGES"
exec > >(tee "$LOG") 2>&1

say() { printf '==> %s\n' "$*"; }
note() { printf '    %s\n' "$*"; }
now() { printf '%s' "$EPOCHREALTIME"; }
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

# stage NAME FUNCTION: run FUNCTION, time it, add a row to $STAGES; returns FUNCTION's status.
# DETAIL (set by the function) goes into the row.
DETAIL=""
stage() {
    local name=$1 t0 rc=0 s
    shift
    say "$name"
    DETAIL=""
    t0=$(now)
    "$@" || rc=$?
    s=$(since "$t0")
    printf '%s\t%s\t%s\t%s\n' "$name" "$([ "$rc" -eq 0 ] && echo ok || echo failed)" "$s" "${DETAIL//$'\t'/ }" >>"$STAGES"
    if [ "$rc" -eq 0 ]; then note "ok ($s s)${DETAIL:+: $DETAIL}"; else note "FAILED (exit $rc, $s s)${DETAIL:+: $DETAIL}"; fi
    return "$rc"
}

# in_root CMD...: run CMD inside the root, clean environment, limited to $LIMIT seconds.
in_root() {
    timeout --kill-after=30 "$LIMIT" chroot "$ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        PIP_CERT="$CA" PIP_DEFAULT_TIMEOUT=180 PIP_DISABLE_PIP_VERSION_CHECK=1 QEMU_CPU="$QEMU_CPU_MODEL" "$@"
}

host_py() { PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$HOST_PY" "$@"; }

# ------------------------------------------------------------------------------ steps
# One function per step, each saying at its top what it checks; the driver (main, at the end) runs
# them through stage(). The root's steps are in scripts/arm64/root.sh, the daemon's in
# scripts/arm64/daemon.sh; here llama.cpp's arm64 build (llama_arm64).
# shellcheck source=arm64/root.sh
. "$SCRIPT_DIR/arm64/root.sh"
# shellcheck source=arm64/daemon.sh
. "$SCRIPT_DIR/arm64/daemon.sh"

trap cleanup EXIT

# retag WHEEL: a wheel the host's pip built for aarch64 carries the host's platform tag: rewrite it
# (file name, WHEEL's Tag, RECORD's hash of WHEEL) to linux_aarch64; prints the new file's path.
retag_aarch64() {
    python3 - "$1" <<'EOF'
import base64, hashlib, os, sys, zipfile
src = sys.argv[1]
dst = src.replace("linux_x86_64", "linux_aarch64")
with zipfile.ZipFile(src) as zi:
    items = {i.filename: zi.read(i.filename) for i in zi.infolist()}
wheel = next(n for n in items if n.endswith(".dist-info/WHEEL"))
items[wheel] = items[wheel].replace(b"linux_x86_64", b"linux_aarch64")
digest = base64.urlsafe_b64encode(hashlib.sha256(items[wheel]).digest()).rstrip(b"=").decode()
rec = next(n for n in items if n.endswith(".dist-info/RECORD"))
lines = [f"{wheel},sha256={digest},{len(items[wheel])}" if ln.startswith(wheel + ",") else ln
         for ln in items[rec].decode().splitlines()]
items[rec] = ("\n".join(lines) + "\n").encode()
with zipfile.ZipFile(dst + ".tmp", "w", zipfile.ZIP_DEFLATED) as zo:
    for n, data in items.items():
        zo.writestr(n, data)
os.replace(dst + ".tmp", dst)
if dst != src:
    os.remove(src)
print(dst)
EOF
}

# Checks: llama_cpp imports in the root's venv after the build (--llama cross: the host's aarch64 cross
# compiler; build: the sdist inside the root, emulated; off: nothing) and reports its system info.
llama_arm64() {
    local t0 whl=""
    t0=$(now)
    case "$LLAMA_MODE" in
        off) DETAIL="skipped (--llama off)"; return 0 ;;
        build)
            in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq build-essential cmake >/dev/null || return 1
            note "compilers in the root after $(since "$t0") s; building $LLAMA_SPEC from its sdist under emulation"
            t0=$(now)
            in_root env CMAKE_ARGS="-DGGML_NATIVE=ON" "$VENV/bin/python" -m pip install --no-binary llama-cpp-python \
                "$LLAMA_SPEC" || return 1
            DETAIL="built from its sdist inside the emulated root in $(since "$t0") s" ;;
        cross)
            dpkg -s g++-aarch64-linux-gnu >/dev/null 2>&1 ||
                DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu >/dev/null || return 1
            rm -rf "$WORK/wheel" && mkdir -p "$WORK/wheel"
            CMAKE_ARGS="-DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 -DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc \
-DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ -DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16" \
                host_py -m pip wheel -q --no-deps --no-binary llama-cpp-python --no-cache-dir -w "$WORK/wheel" \
                "$LLAMA_SPEC" || return 1
            whl=$(retag_aarch64 "$(ls "$WORK"/wheel/llama_cpp_python-*.whl)") || return 1
            cp "$whl" "$ROOT/tmp/" || return 1
            in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgomp1 >/dev/null || return 1
            in_root "$VENV/bin/python" -m pip install --only-binary=:all: "/tmp/$(basename "$whl")" || return 1
            DETAIL="cross-compiled on the host (aarch64-linux-gnu-g++, armv8.2-a+dotprod+fp16) in $(since "$t0") s" ;;
    esac
    local ver
    ver=$(in_root "$VENV/bin/python" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__, llama_cpp.llama_print_system_info().decode().strip())') || return 1
    DETAIL="$DETAIL; $ver"
}

SERVE_LOG=/srv/appliance/var/log-serve.txt

DONE_JSON="$WORK/done.json"

HEALTH_EMU="$WORK/health-emulated.json"
HEALTH_NATIVE="$WORK/health-native.json"

# ------------------------------------------------------------------------------ driver

main() {
    local t0 rc=0
    say "arm64 under emulation: root $ROOT ($SUITE), this checkout $REPO, host Python $HOST_PY"
    t0=$(now)
    N_STAGES=13
    stage "host tools: qemu-user-static, binfmt-support, debootstrap; binfmt for aarch64" host_tools &&
        stage "Debian arm64 root" bootstrap &&
        stage "repository into the root (git archive HEAD)" copy_repo &&
        stage "scripts/install_jetson.sh --prefix $PREFIX --pip-no-deps (inside the root)" install_first &&
        stage "CPU runtime from PyPI aarch64 wheels into $VENV" runtime &&
        stage "scripts/install_jetson.sh again (idempotent)" install_again &&
        stage "llama-cpp-python for arm64 (--llama $LLAMA_MODE)" llama_arm64 &&
        stage "run config (the installed one, WAV output)" run_config &&
        stage "tiny random checkpoint + its export (on the host)" checkpoint_export &&
        stage "chattts-appliance serve (emulated arm64)" serve &&
        stage "chattts-appliance say (emulated arm64)" speak &&
        stage "stop the daemon (SIGTERM)" stop_daemon &&
        stage "chattts-appliance health --json: emulated, and natively on the host" health_both || rc=1
    say "total $(since "$t0") s"
    write_record
    exit "$rc"
}

main
