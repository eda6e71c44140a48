# shellcheck shell=bash
# Sourced by scripts/arm64_emulated.sh (its variables and helpers: say, note, stage, in_root, host_py).
# The emulated arm64 root: host tools, the Debian root and its mounts, the repository and the
# installer in it, the CPU runtime.
# shellcheck disable=SC2154,SC2034  # read and set for scripts/arm64_emulated.sh

# Checks: qemu-user-static, binfmt-support and debootstrap are installed (apt installs the missing);
# binfmt_misc runs aarch64 binaries (enabled when it is not). On an arm64 host nothing is emulated.
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

# Checks: the root's ready marker (else debootstrap, --fresh deletes it first); inside it uname -m is
# aarch64 and python3 runs.
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
# Checks: nothing: binds /proc, /sys, /dev and an Arm /proc/cpuinfo into the root (undone by cleanup).
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
# Checks: nothing: kills a daemon left running, unmounts what mount_root mounted, removes the work dir.
cleanup() {
    local i
    if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then kill -KILL "$DAEMON_PID" 2>/dev/null || true; fi
    for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do umount -R "${MOUNTED[i]}" 2>/dev/null || umount -lR "${MOUNTED[i]}" || true; done
    rm -rf "$WORK"
}

# Checks: the tree's tracked files equal HEAD (else says it copies HEAD without the changes).
copy_repo() {
    rm -rf "$ROOT$SRC"
    mkdir -p "$ROOT$SRC"
    git -C "$REPO" archive --format=tar HEAD | tar -x -C "$ROOT$SRC" || return 1
    DETAIL="$(git -C "$REPO" rev-parse --short HEAD)"
    [ -z "$(git -C "$REPO" status --porcelain --untracked-files=no -- . ':!bench/results')" ] ||
        DETAIL="$DETAIL (uncommitted changes are NOT copied)"
}

INSTALL_OUT=""
# Checks: scripts/install_jetson.sh exits 0 inside the root and says which JetPack-only steps it skipped.
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

# Checks: the second run keeps the config and leaves the four units unchanged (idempotent).
install_again() {
    installer again --pip-no-deps || return 1
    grep -q "keeping the existing config" "$INSTALL_OUT" || { echo "the re-run did not keep the config" >&2; return 1; }
    [ "$(grep -c 'unchanged: chattts-appliance' "$INSTALL_OUT")" -eq 4 ] || { echo "the re-run rewrote units" >&2; return 1; }
    DETAIL="$DETAIL; config kept, 4 units unchanged"
}

# Checks: pyproject's dependencies install from aarch64 wheels only, pip check passes, and they import.
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
