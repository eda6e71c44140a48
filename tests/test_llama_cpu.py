"""One image on every CPU of its architecture (appliance.engines.llama.cpu, .lib,
scripts/llama_build.sh): the build record checked against /proc/cpuinfo before llama.cpp's
library loads, a start refused with one line and exit 2 (or ``auto`` taking ONNX Runtime) on a
CPU the build does not fit, and the installed portable build run on emulated older CPUs
(qemu-user: Haswell, AVX2 without AVX-512; Westmere, no AVX at all)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.engines.llama import cpu
from tests.fixtures_model import ONNX_LIMITS
from tests.fixtures_service import ROOT, launch_daemon, service_config
from tests.waits import wait_for

WESTMERE = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 " \
           "ss syscall nx lm constant_tsc pni pclmulqdq ssse3 cx16 sse4_1 sse4_2 popcnt aes hypervisor lahf_lm"
NATIVE = {"version": "0.3.36", "cmake_args": "-DGGML_NATIVE=ON", "arch": "x86_64", "variants": False,
          "requires": ["sse4_2", "avx", "f16c", "fma", "avx2", "bmi2", "avx512f", "avx512bw", "avx512vl"]}
PORTABLE = dict(NATIVE, cmake_args="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON",
                variants=True, requires=[])


def _cpuinfo(tmp_path: Path, flags: str) -> str:
    f = tmp_path / "cpuinfo"
    f.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    return str(f)


def test_the_record_against_the_cpu(tmp_path):
    old = _cpuinfo(tmp_path, WESTMERE)
    why = cpu.problem(NATIVE, old, machine="x86_64")
    assert why.startswith("the installed llama.cpp was built for another CPU: it needs avx f16c fma avx2 bmi2 "
                          "avx512f avx512bw avx512vl, which this CPU lacks"), why
    assert cpu.problem(PORTABLE, old, machine="x86_64") is None            # the variants fit every x86-64
    assert cpu.problem(NATIVE, _cpuinfo(tmp_path, WESTMERE + " avx f16c fma avx2 bmi2 avx512f avx512bw avx512vl"),
                       machine="x86_64") is None
    assert "built for x86_64, this machine is aarch64" in cpu.problem(PORTABLE, old, machine="aarch64")
    assert cpu.problem(None, old) is None                                   # no record: not checked
    assert cpu.describe(PORTABLE).startswith("every x86_64 CPU")


def _shadow(tmp_path: Path, needs: list[str]) -> Path:
    """A directory ahead on the path with a ``llama_cpp`` package whose record needs ``needs``
    (importing it, which would load the native library, fails the daemon loudly) and a ``torch``
    that fails to import (a box without torch: nothing to fall back to but exported graphs)."""
    d = tmp_path / "shadow"
    (d / "llama_cpp" / "lib").mkdir(parents=True)
    (d / "llama_cpp" / "__init__.py").write_text("raise SystemExit('llama_cpp imported despite the CPU check')\n")
    (d / "llama_cpp" / "lib" / cpu.RECORD).write_text(json.dumps(dict(NATIVE, requires=needs)))
    (d / "torch").mkdir()
    (d / "torch" / "__init__.py").write_text("raise ImportError('no torch on this box')\n")
    return d


def _missing_feature() -> str:
    have = cpu.cpu_features()
    return next((f for f in ("amx_tile", "amx_int8", "avx512_bf16", "avx_vnni", "avx512f") if f not in have),
                "a_future_feature")


def test_a_start_on_a_cpu_the_build_does_not_fit(tiny_ckpt, llama_dir, onnx_dir, tmp_path):
    engines = tmp_path / "engines"
    shutil.copytree(llama_dir / "llama", engines / "llama")
    need = _missing_feature()
    env = {"PYTHONPATH": os.pathsep.join([str(_shadow(tmp_path, ["sse2", need])), str(ROOT)])}
    why = (f"the installed llama.cpp was built for another CPU: it needs {need}, which this CPU lacks; build it "
           f"here for every CPU (LLAMA_CPU=portable scripts/quickstart.sh, scripts/llama_build.sh) or use "
           f"model.backend: onnxruntime")
    # device auto (the memory plan asks whether llama.cpp offloads: answered without loading it)
    model = {"engine_dir": str(engines), "device": "auto", **ONNX_LIMITS}

    # only the llama.cpp export and no torch: nothing runs; not rebuilt (the files are fine)
    cfg = service_config(tiny_ckpt, tmp_path, model=dict(model, backend="llama"))
    d = launch_daemon(tmp_path / "llama", cfg, env=env, wait=False)
    wait_for(lambda: d.proc.poll() is not None, 120, "the refused start's exit", show=lambda: d.log()[-3000:])
    assert d.proc.returncode == 2, d.log()[-3000:]                          # RestartPreventExitStatus=2
    (line,) = [ln for ln in d.log().splitlines() if ln.startswith("chattts-appliance serve: error: ")]
    assert line.startswith(f"chattts-appliance serve: error: no inference backend can run: llama: {why}; "), line
    assert f"not rebuilding the llama engine: {why}" in d.log() and "imported despite" not in d.log()

    # with the ONNX graphs beside it: auto takes them (and an explicit llama falls back to them,
    # health engine_fallback naming the same reason: appliance.engines.recover)
    shutil.copytree(onnx_dir / "onnx", engines / "onnx")
    cfg = service_config(tiny_ckpt, tmp_path, model=dict(model, backend="auto"))
    d = launch_daemon(tmp_path / "auto", cfg, env=env)
    try:
        (st,) = d.request({"type": "status"})
        assert st["backend"].startswith("onnxruntime"), st["backend"]
        assert d.request({"type": "speak", "text": "你好。", "id": "x"})[-1]["type"] == "done"
        assert f"model.backend auto: not llama.cpp: {why}" in d.log()
    finally:
        assert d.stop() == 0, d.log()[-3000:]


STEP = r"""
import sys, numpy as np
from appliance.config import config_from_dict
from appliance.core import SamplingParams
from appliance.engines.llama import lib
from appliance.engines.llama.runner import LlamaRunner
tiny, engines = sys.argv[1:3]
r = LlamaRunner(config_from_dict({"model": {"path": tiny, "backend": "llama", "threads": 1, "engine_dir": engines,
                                            "max_batch": 1, "max_seq_len": 64, "max_prompt_tokens": 16}},
                                 base_dir=tiny), reason="qemu")
r.prefill(0, np.array([1, 2, 3]), None)
r.start(0, SamplingParams(), 1)
codes = r.step(np.arange(1), 1)[0]
h = r.hidden(0, 0, 2)
assert np.isfinite(h).all(), h
print("STEP OK", codes.tolist(), lib.cpu_library())
"""


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("qemu-x86_64") is None,
                    reason="needs an x86-64 host with qemu-user (scripts/test.sh installs it)")
@pytest.mark.parametrize("model, variant", [("Haswell", "haswell"), ("Westmere", "sse42")])
def test_the_installed_build_runs_on_an_emulated_older_cpu(tiny_ckpt, llama_dir, tmp_path, model, variant):
    rec = cpu.read_record()
    if rec is None:
        pytest.skip("llama.cpp was installed without scripts/llama_build.sh: what it was built for is unknown")
    if not rec.get("variants"):
        # qemu-user passes the host's /proc/cpuinfo through, so the check cannot see the emulated
        # CPU: a native build would die of SIGILL here (the refusal is tested above)
        pytest.skip(f"this llama.cpp is a native build ({cpu.describe(rec)}), not the portable one")
    p = subprocess.run(["qemu-x86_64", "-cpu", model, sys.executable, "-c", STEP, str(tiny_ckpt), str(llama_dir)],
                       cwd=ROOT, capture_output=True, text=True, timeout=1200,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "STEP OK" in p.stdout and f"libggml-cpu-{variant}.so" in p.stdout, p.stdout + p.stderr[-2000:]


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("qemu-x86_64") is None,
                    reason="needs an x86-64 host with qemu-user (scripts/test.sh installs it)")
def test_the_daemon_starts_and_speaks_on_an_emulated_haswell(tiny_ckpt, llama_dir, tmp_path):
    rec = cpu.read_record()
    if rec is None or not rec.get("variants"):
        pytest.skip(f"not the portable llama.cpp build: {cpu.describe(rec)}")
    cfg = service_config(tiny_ckpt, tmp_path, model={"backend": "llama", "engine_dir": str(llama_dir), **ONNX_LIMITS})
    # PYTHONUTF8=1: no re-exec into UTF-8 mode (appliance.cli.utf8), which would leave the emulator
    d = launch_daemon(tmp_path / "d", cfg, argv_prefix=["qemu-x86_64", "-cpu", "Haswell"], timeout_s=600,
                      env={"PYTHONUTF8": "1"})
    try:
        assert "CPU library libggml-cpu-haswell.so" in d.log(), d.log()[-3000:]
        assert d.request({"type": "speak", "text": "你好。", "id": "h"}, timeout_s=300)[-1]["type"] == "done"
    finally:
        assert d.stop() == 0, d.log()[-3000:]

