#!/usr/bin/env bash
# Command 2 of README.md: install what the tests need and run them.
#
# System packages (when root): PortAudio + ALSA tools (real sounddevice output into an ALSA
# `file` PCM), mosquitto (a real MQTT broker per test session), shellcheck, systemd
# (systemd-analyze verify), libsystemd-dev + pkg-config (systemd-python), build-essential (a C/C++
# compiler: llama-cpp-python builds from its sdist, scripts/llama_build.sh), qemu-user (the portable
# llama.cpp build run on an emulated older CPU, tests/test_llama_cpu.py), iproute2 + iptables (a
# Wyoming client in a network namespace frozen by a DROP rule, tests/test_wyoming_firewall.py).
# Python: .venv with torch (CPU) and the [torch,dev,tensorrt-rtx,systemd,llama] extras.
# Extra arguments go to pytest (e.g. scripts/test.sh -k protocol).
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PKGS="libportaudio2 alsa-utils libfaketime mosquitto shellcheck systemd libsystemd-dev pkg-config openssl build-essential qemu-user iproute2 iptables"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=""
  for p in $APT_PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
  if [ -n "$missing" ]; then
    echo "==> apt-get install$missing"
    apt-get update -qq
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
  fi
fi
# mosquitto's package starts a system broker on 1883 on some machines; tests start their own.

[ -x .venv/bin/python ] || python3 -m venv .venv
PY=.venv/bin/python
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
# shellcheck source=/dev/null  # scripts/llama_build.sh: llama_install
. scripts/llama_build.sh
llama_install "$PY" -e ".[torch,dev,tensorrt-rtx,systemd,llama]"  # llama-cpp-python: built once (up to an hour), then cached

# Three workers (pytest-xdist), each test file whole on one worker (its module-scoped daemons and
# brokers stay shared), the longest files first (tests/conftest.py); TEST_WORKERS=0: one process.
# Three on a 2-core machine: much of the suite waits on real-time playback (the paced ALSA file
# device) and on daemons starting, and a third worker fills that time (5 min 16 s against 5 min
# 57 s with two, same tree, same machine).
exec "$PY" -m pytest -q -ra -n "${TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder "$@"
