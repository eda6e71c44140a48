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
#   8. writes the log (arm64-emulated-<date>-arm64-qemu-<HHMM>Z.log, the start time) and appends a
#      JSON record (bench: arm64_emulated, machine arm64-qemu) to
#      arm64-emulated-<date>-arm64-qemu.json in --results.
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
#   --results DIR       where the log and the record go (default: bench/results of this checkout)
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

DATE=$(date -u +%F)
mkdir -p "$RESULTS"
LOG="$RESULTS/arm64-emulated-$DATE-arm64-qemu-$(date -u +%H%MZ).log"
RECORD="$RESULTS/arm64-emulated-$DATE-arm64-qemu.json"
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

host_tools() {
    local missing=() p
    for p in qemu-user-static binfmt-support debootstrap; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        apt-get update -qq || return 1
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" || return 1
    fi
    DETAIL="qemu $(dpkg-query -W -f='${Version}' qemu-user-static), debootstrap $(dpkg-query -W -f='${Version}' debootstrap)"
    [ "$(uname -m)" = aarch64 ] && { DETAIL="$DETAIL; arm64 host: nothing emulated"; return 0; }
    local bf=/proc/sys/fs/binfmt_misc
    [ -e "$bf/register" ] || mount -t binfmt_misc binfmt_misc "$bf" || return 1
    if ! grep -qx enabled "$bf/qemu-aarch64" 2>/dev/null; then
        update-binfmts --enable qemu-aarch64 || return 1
    fi
    grep -qx enabled "$bf/qemu-aarch64" || { echo "binfmt for aarch64 is not enabled" >&2; return 1; }
}

bootstrap() {
    local marker="$ROOT/.arm64-root-ready" out="$WORK/debootstrap.txt"
    if [ "$FRESH" -eq 1 ] && [ -d "$ROOT" ]; then
        if grep -q " $ROOT/" /proc/mounts; then echo "something is mounted under $ROOT: not deleting it" >&2; return 1; fi
        rm -rf --one-file-system "$ROOT" || return 1
        note "deleted $ROOT (--fresh)"
    fi
    if [ -f "$marker" ]; then
        DETAIL="reused $ROOT ($(cat "$marker"))"
    else
        mkdir -p "$ROOT"
        note "debootstrap (its output: the last lines here, all of it only on failure)"
        if ! debootstrap --arch=arm64 --variant=minbase \
            --include=python3,python3-venv,python3-pip,python3-yaml,ca-certificates,libportaudio2 \
            "$SUITE" "$ROOT" "$MIRROR" >"$out" 2>&1; then
            cat "$out"
            return 1
        fi
        tail -n 3 "$out" | sed 's/^/    | /'
        note "$(grep -c '^I: Unpacking' "$out") packages"
        printf 'Debian %s arm64 minbase, bootstrapped %s\n' "$SUITE" "$(date -u +%FT%TZ)" >"$marker"
        DETAIL="bootstrapped Debian $SUITE arm64 into $ROOT"
    fi
    mount_root || return 1
    cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
    cp /etc/ssl/certs/ca-certificates.crt "$ROOT$CA"
    local arch py
    arch=$(in_root uname -m) || return 1
    py=$(in_root python3 -c 'import platform; print(platform.python_version())') || return 1
    [ "$arch" = aarch64 ] || { echo "the root runs $arch, not aarch64" >&2; return 1; }
    DETAIL="$DETAIL; uname -m: $arch, Python $py, emulated CPU $QEMU_CPU_MODEL"
}

MOUNTED=()
mount_root() {
    local d
    for d in proc sys dev; do
        mountpoint -q "$ROOT/$d" && continue
        case "$d" in
            proc) mount -t proc proc "$ROOT/proc" || return 1 ;;
            sys) mount -t sysfs sysfs "$ROOT/sys" || return 1 ;;
            dev) mount --rbind /dev "$ROOT/dev" && mount --make-rslave "$ROOT/dev" || return 1 ;;
        esac
        MOUNTED+=("$ROOT/$d")
    done
    [ "$(uname -m)" = aarch64 ] && return 0
    # qemu 7.2 (Debian 12) shows the guest the host's x86 /proc/cpuinfo (qemu 8 emulates an Arm
    # one); ONNX Runtime's CPU probe (cpuinfo) segfaults on it when onnxruntime is imported. Give
    # the root the Arm one of the emulated cores: one entry per host core, the MIDR of --qemu-cpu.
    cpuinfo_of "$QEMU_CPU_MODEL" >"$ROOT/etc/arm64-cpuinfo" || return 1
    mount --bind "$ROOT/etc/arm64-cpuinfo" "$ROOT/proc/cpuinfo" || return 1
    MOUNTED+=("$ROOT/proc/cpuinfo")
}

# cpuinfo_of MODEL: an aarch64 /proc/cpuinfo for qemu's CPU MODEL (MIDR: N1 r4p1 0x414fd0c1, A76 r4p1
# 0x414fd0b1, A72 r0p3 0x410fd083; features: what their HWCAPs say).
cpuinfo_of() {
    local midr feats i
    feats="fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"
    case "$1" in
        neoverse-n1) midr="0x41 0x4 0xd0c 1" ;;
        cortex-a76) midr="0x41 0x4 0xd0b 1" ;;
        cortex-a72) midr="0x41 0x0 0xd08 3"; feats="fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid" ;;
        *) echo "--qemu-cpu $1: no /proc/cpuinfo entry known for it (neoverse-n1, cortex-a76, cortex-a72)" >&2; return 1 ;;
    esac
    read -r -a midr <<<"$midr"
    for ((i = 0; i < $(nproc); i++)); do
        printf 'processor\t: %d\nBogoMIPS\t: 50.00\nFeatures\t: %s\nCPU implementer\t: %s\nCPU architecture: 8\nCPU variant\t: %s\nCPU part\t: %s\nCPU revision\t: %s\n\n' \
            "$i" "$feats" "${midr[0]}" "${midr[1]}" "${midr[2]}" "${midr[3]}"
    done
}

DAEMON_PID=""
cleanup() {
    local i
    if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then kill -KILL "$DAEMON_PID" 2>/dev/null || true; fi
    for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do umount -R "${MOUNTED[i]}" 2>/dev/null || umount -lR "${MOUNTED[i]}" || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT

copy_repo() {
    rm -rf "$ROOT$SRC"
    mkdir -p "$ROOT$SRC"
    git -C "$REPO" archive --format=tar HEAD | tar -x -C "$ROOT$SRC" || return 1
    DETAIL="$(git -C "$REPO" rev-parse --short HEAD)"
    [ -z "$(git -C "$REPO" status --porcelain --untracked-files=no -- . ':!bench/results')" ] ||
        DETAIL="$DETAIL (uncommitted changes are NOT copied)"
}

INSTALL_OUT=""
installer() {
    local out="$WORK/install-$1.txt" rc=0
    shift
    in_root bash "$SRC/scripts/install_jetson.sh" --prefix "$PREFIX" --repo "$SRC" --python /usr/bin/python3 "$@" \
        2>&1 | tee "$out" || rc=$?
    INSTALL_OUT=$out
    [ "$rc" -eq 0 ] || return "$rc"
    grep -q "JetPack-only steps skipped (not a Jetson)" "$out" ||
        { echo "the installer did not say which JetPack-only steps it skipped" >&2; return 1; }
    DETAIL="exit 0; $(grep -c '^+ ' "$out") commands run; says: $(grep -o 'JetPack-only steps skipped[^;]*' "$out")"
}

install_first() { installer first --pip-no-deps; }

install_again() {
    installer again --pip-no-deps || return 1
    grep -q "keeping the existing config" "$INSTALL_OUT" || { echo "the re-run did not keep the config" >&2; return 1; }
    [ "$(grep -c 'unchanged: chattts-appliance' "$INSTALL_OUT")" -eq 4 ] || { echo "the re-run rewrote units" >&2; return 1; }
    DETAIL="$DETAIL; config kept, 4 units unchanged"
}

runtime() {
    local deps=() d failed=() out
    mapfile -t deps < <(python3 -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' "$REPO/pyproject.toml")
    if ! in_root "$VENV/bin/python" -m pip install --only-binary=:all: "${deps[@]}"; then
        note "all at once failed; one at a time to see which:"
        for d in "${deps[@]}"; do
            in_root "$VENV/bin/python" -m pip install --only-binary=:all: "$d" >/dev/null 2>&1 || failed+=("$d")
        done
        DETAIL="no aarch64 wheel or failed: ${failed[*]:-none (a retry worked)}"
        [ ${#failed[@]} -eq 0 ] || return 1
    fi
    in_root "$VENV/bin/python" -m pip check || return 1
    out=$(in_root "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md, platform
names = ["numpy", "onnxruntime", "tokenizers", "safetensors", "wetext", "kaldifst", "opencc", "soxr", "sounddevice", "pybase16384", "wyoming", "paho-mqtt"]
vers = ", ".join(f"{n} {md.version(n)}" for n in names)
print(f"{platform.machine()} Python {platform.python_version()}: {vers}")
EOF
) || return 1
    DETAIL="$out"
    if in_root "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then DETAIL="$DETAIL; torch present"; else DETAIL="$DETAIL; no torch"; fi
}

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

run_config() {
    # the installed config with WAV output and a socket inside the prefix; the model and engine
    # paths point at the tiny checkpoint. A twin with host paths drives the export on the host.
    host_py - "$ROOT" "$CONFIG" "$RUN_CFG" "$CKPT" "$ENGINES" "$SOCK" <<'EOF' || return 1
import sys, yaml
root, config, run_cfg, ckpt, engines, sock = sys.argv[1:]
cfg = yaml.safe_load(open(root + config))
cfg["model"].update(path=ckpt, engine_dir=engines)
cfg["audio"]["output"] = "wav"
cfg["service"]["socket"] = sock
head = "# scripts/arm64_emulated.sh: the installed config.yaml with a tiny checkpoint, WAV output, socket in the prefix\n"
open(root + run_cfg, "w").write(head + yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
cfg["model"].update(path=root + ckpt, engine_dir=root + engines)
open(root + run_cfg + ".host", "w").write(head + yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
EOF
    mkdir -p "$ROOT$(dirname "$SOCK")"
    DETAIL="$RUN_CFG: model.backend $(grep -A20 '^model:' "$ROOT$RUN_CFG" | grep -m1 ' backend:' | awk '{print $2}'), audio.output wav"
}

checkpoint_export() {
    if [ ! -f "$ROOT$CKPT/asset/gpt/config.json" ]; then
        host_py -m appliance model random --size tiny "$ROOT$CKPT" || return 1
    fi
    # fresh graphs every run: the export format follows the copied tree
    rm -rf "$ROOT$ENGINES/onnx" "$ROOT$ENGINES/llama"
    local p=q8_0 kind=llama
    [ "$LLAMA_MODE" = off ] && p=int8 kind=onnx
    host_py -m appliance engines export --config "$ROOT$RUN_CFG.host" --precision "$p" || return 1
    DETAIL="tiny random checkpoint, $kind/$p $(du -sh "$ROOT$ENGINES/$kind/$p" | cut -f1) (exported on the host by $HOST_PY)"
}

SERVE_LOG=/srv/appliance/var/log-serve.txt
READY_S=""
serve() {
    local t0 log="$ROOT$SERVE_LOG" i
    rm -f "$ROOT$SOCK"
    t0=$(now)
    timeout --kill-after=30 "$LIMIT" chroot "$ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 PATH=/usr/bin:/bin \
        QEMU_CPU="$QEMU_CPU_MODEL" "$CLI" serve --config "$RUN_CFG" >"$log" 2>&1 &
    DAEMON_PID=$!
    for ((i = 0; i < LIMIT; i++)); do
        grep -q "ready: channels" "$log" && break
        kill -0 "$DAEMON_PID" 2>/dev/null || { tail -30 "$log"; echo "the daemon exited" >&2; return 1; }
        sleep 1
    done
    grep -q "ready: channels" "$log" || { tail -30 "$log"; echo "the daemon was not ready in $LIMIT s" >&2; return 1; }
    READY_S=$(since "$t0")
    grep -E "inference backend|audio output|pipeline loaded|warm-up took|ready:" "$log" | sed 's/^/    /'
    local want=llama.cpp
    [ "$LLAMA_MODE" = off ] && want=onnxruntime
    grep -q "inference backend: $want" "$log" || { echo "the daemon did not pick $want" >&2; return 1; }
    DETAIL="ready after $READY_S s; $(grep -o 'inference backend: .*' "$log" | head -1)"
}

DONE_JSON="$WORK/done.json"
speak() {
    local events="$WORK/events.jsonl"
    in_root "$CLI" say --config "$RUN_CFG" --json --timeout "$LIMIT" --max-new-tokens "$MAX_NEW" "$TEXT" >"$events" || { cat "$events"; return 1; }
    python3 - "$events" "$ROOT" "$DONE_JSON" >"$WORK/speak.txt" <<'EOF' || { cat "$WORK/speak.txt"; return 1; }
import json, sys, wave
events, root, out = sys.argv[1:]
done = [e for e in map(json.loads, open(events)) if e.get("type") == "done"]
if not done:
    sys.exit("no done event: " + open(events).read()[-2000:])
d = done[-1]
path = root + str(d.get("output", ""))
with wave.open(path) as w:
    d["wav_frames"], d["wav_rate"], d["wav_path"] = w.getnframes(), w.getframerate(), path[len(root):]
if d["wav_frames"] <= 0:
    sys.exit(f"{path} holds no audio")
json.dump(d, open(out, "w"))
print(f"WAV {d['wav_path']}: {d['wav_frames'] / d['wav_rate']:.2f} s at {d['wav_rate']} Hz; ttfb {d.get('ttfb_ms')} ms, "
      f"rtf {d.get('rtf')}, {d.get('steps')} steps at {d.get('steps_per_s')}/s")
EOF
    DETAIL=$(tail -n 1 "$WORK/speak.txt")
}

PEAK_RSS=""
stop_daemon() {
    local i
    # $DAEMON_PID is timeout(1); its child is the emulated daemon (chroot and env exec into it)
    local child
    child=$(cat "/proc/$DAEMON_PID/task/$DAEMON_PID/children" 2>/dev/null || true)
    PEAK_RSS=$(awk '/^VmHWM/ { printf "%.0f", $2 / 1024 }' "/proc/${child%% *}/status" 2>/dev/null || true)
    kill -TERM "$DAEMON_PID" || return 1
    for ((i = 0; i < 300; i++)); do kill -0 "$DAEMON_PID" 2>/dev/null || break; sleep 1; done
    if kill -0 "$DAEMON_PID" 2>/dev/null; then echo "the daemon did not stop within 300 s of SIGTERM" >&2; return 1; fi
    wait "$DAEMON_PID" 2>/dev/null || true
    DAEMON_PID=""
    grep -q "stopped" "$ROOT$SERVE_LOG" || { echo "no 'stopped' line in the daemon's log" >&2; return 1; }
    DETAIL="SIGTERM: stopped after ${i} s; peak RSS of the emulated process ${PEAK_RSS:-?} MiB"
}

HEALTH_EMU="$WORK/health-emulated.json"
HEALTH_NATIVE="$WORK/health-native.json"
# health_json OUT CMD...: run CMD (a `health --json`), keep its health line in OUT. Exit 1 means
# unhealthy (emulated, RTF > 1 is expected) and still carries the numbers; anything else fails.
health_json() {
    local out=$1 rc=0
    shift
    "$@" >"$WORK/h.txt" 2>/dev/null || rc=$?
    grep '"type": *"health"' "$WORK/h.txt" | tail -n 1 >"$out" || true
    if [ "$rc" -gt 1 ] || [ ! -s "$out" ]; then
        cat "$WORK/h.txt"
        echo "health failed (exit $rc): $*" >&2
        return 1
    fi
}

health_both() {
    health_json "$HEALTH_EMU" in_root "$CLI" health --config "$RUN_CFG" --json || return 1
    health_json "$HEALTH_NATIVE" host_py -m appliance health --config "$ROOT$RUN_CFG.host" --json || return 1
    DETAIL=$(python3 - "$HEALTH_EMU" "$HEALTH_NATIVE" <<'EOF'
import json, sys
e, n = (json.load(open(f)) for f in sys.argv[1:])
print(f"emulated {e['steps_per_s']} steps/s, RTF {e['rtf']}, TTFB {e['ttfb_ms']} ms; natively on the host "
      f"{n['steps_per_s']} steps/s, RTF {n['rtf']}, TTFB {n['ttfb_ms']} ms: emulation {n['steps_per_s'] / e['steps_per_s']:.1f}x slower")
EOF
)
}

write_record() {
    python3 - "$STAGES" "$DONE_JSON" "$RECORD" "$DATE" "$READY_S" "$PEAK_RSS" "$(git -C "$REPO" rev-parse --short HEAD)" \
        "$SUITE" "$N_STAGES" "$QEMU_CPU_MODEL" "$(dpkg-query -W -f='${Version}' qemu-user-static 2>/dev/null)" "$(date -u +%FT%TZ)" \
        "$HEALTH_EMU" "$HEALTH_NATIVE" "$LOG" "$LLAMA_MODE" <<'EOF'
import json, os, sys
stages_f, done_f, record_f, date, ready_s, peak, commit, suite, n_stages, qemu_cpu, qemu, time_utc, health_emu, health_native, log_f, llama = sys.argv[1:]
stages = [dict(zip(("name", "result", "seconds", "detail"), l.rstrip("\n").split("\t"))) for l in open(stages_f) if l.strip()]
for s in stages:
    s["seconds"] = float(s["seconds"])
d = json.load(open(done_f)) if os.path.exists(done_f) else {}
health = {k: json.load(open(f)) if os.path.exists(f) else None for k, f in (("emulated", health_emu), ("native", health_native))}
for h in health.values():
    if h:
        h.pop("limits", None), h.pop("type", None)
slowdown = (round(health["native"]["steps_per_s"] / health["emulated"]["steps_per_s"], 2)
            if health["native"] and health["emulated"] else None)
ok = len(stages) == int(n_stages) and all(s["result"] == "ok" for s in stages)
sps = d.get("steps_per_s")
rec = {
    "bench": "arm64_emulated", "date": date, "machine": "arm64-qemu", "backend": "onnxruntime" if llama == "off" else "llama.cpp",
    "precision": "int8" if llama == "off" else "q8_0", "llama_build": llama,
    "checkpoint": "tiny", "batch": 1, "ms_per_step": round(1000 / sps, 2) if sps else None, "steps_per_s": sps,
    "rtf": d.get("rtf"), "ttfb_ms": d.get("ttfb_ms"), "peak_mem_mib": int(peak) if peak else None,
    "baseline_ms_per_step": None, "commit": commit, "all_ok": ok, "ready_s": float(ready_s) if ready_s else None,
    "audio_s": d.get("audio_s"), "steps": d.get("steps"), "output": d.get("wav_path"),
    "spoken": d.get("spoken"), "unspeakable": d.get("unspeakable"), "qemu_cpu": qemu_cpu, "qemu": qemu,
    "time_utc": time_utc, "health_emulated": health["emulated"], "health_native_x86": health["native"],
    "emulation_slowdown": slowdown, "log": os.path.basename(log_f), "stages": stages,
    "notes": (f"Debian {suite} arm64 root under qemu-user on the 2-core x86-64 host: scripts/install_jetson.sh --prefix, "
              "the CPU runtime from PyPI aarch64 wheels, the daemon on a tiny random checkpoint (int8 ONNX graphs exported "
              "on the host), one sentence to a WAV file. Emulated: the times and RSS (qemu's included) say nothing about "
              "an Orin's speed."),
}
records = json.load(open(record_f)) if os.path.exists(record_f) else []
json.dump(records + [rec], open(record_f, "w"), indent=1, ensure_ascii=False)
open(record_f, "a").write("\n")
print(f"record: {record_f} (all_ok={ok})")
EOF
    if [ -f "$ROOT$SERVE_LOG" ]; then
        say "the daemon's log"
        sed 's/^/    | /' "$ROOT$SERVE_LOG"
    fi
}

# ------------------------------------------------------------------------------ main

say "arm64 under emulation: root $ROOT ($SUITE), this checkout $REPO, host Python $HOST_PY"
T0=$(now)
RC=0
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
    stage "chattts-appliance health --json: emulated, and natively on the host" health_both || RC=1
say "total $(since "$T0") s"
write_record
exit "$RC"
