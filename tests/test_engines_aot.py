"""The ahead-of-time compiled decode step (AOTInductor) on the CPU with the tiny checkpoint.

One package (batch 1 of 2 KV slots: the step writes views of the state) is built by the real
command (``chattts-appliance engines compile``, inductor's C++ backend here; skipped cleanly where
that cannot compile), then a FRESH process loads it through
``model.compile``'s path (``CudaRunner(compile="aot")``: no tracing, no compiling) and must draw
the same codes and hidden states as the eager step for the same seed. Then what keys and guards
it: a changed config, a damaged package and a package set for another checkpoint all fall back
to the plain step with the reason, and a manifest records every file's sha256. Last the load
canary: a child process loads the set before any process does in-process; a loader that dies by
SIGSEGV there (a stand-in for torch 2.11's loader on the H200) leaves the runner on plain graphs
with the reason and a marker that later starts obey without trying again, and ``engines compile``
exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
# the packages are compiled (engines compile, a child inheriting CXX) and loaded by the system C++ compiler's runtime
pytestmark = pytest.mark.usefixtures("system_cxx")

REPO = Path(__file__).resolve().parents[1]
LIMITS = {"max_batch": 2, "max_seq_len": 64, "max_prompt_tokens": 32}

# runs in a fresh process: codes and hidden states of the eager step and of the loaded package
PROBE = """
import json, sys, time, numpy as np
from appliance.config import config_from_dict
from appliance.core import SamplingParams
from appliance.engines.torch.cuda_runner import CudaRunner
cfg = config_from_dict(json.loads(sys.argv[1]))
out = {}
for name, kw in (("eager", {}), ("aot", {"compile": "aot", "aot_dir": sys.argv[2]})):
    t0 = time.perf_counter()
    r = CudaRunner(cfg, **kw)
    ready = time.perf_counter() - t0
    r.prefill(0, np.arange(5, 14), None)
    first = r.start(0, SamplingParams(min_new_tokens=40, max_new_tokens=40, temperature=0.7), 2**40 + 9)
    codes = [first[None]] + [r.step(np.array([0]), 8)[:, 0].copy() for _ in range(5)]
    out[name] = {"codes": np.concatenate(codes).tolist(), "hidden": r.hidden(0, 0, 40).tolist(),
                 "compiled": r.compiled, "source": r.step_source, "ready_s": ready}
print(json.dumps(out))
"""


def _cfg_dict(ckpt: Path, eng: Path, **model) -> dict:
    return {"model": {"path": str(ckpt), "backend": "torch", "device": "cpu", "dtype": "float32", "threads": 1,
                      "engine_dir": str(eng), **LIMITS, **model}}


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def built(tiny_ckpt, tmp_path_factory):
    """``engines compile`` for the tiny checkpoint on the CPU -> (config dict, aot dir, package dir)."""
    from appliance.engines.torch.aot_step import SUBDIR

    eng = tmp_path_factory.mktemp("aot_engines")
    cfg_path = eng / "config.json.yaml"
    cfg = _cfg_dict(tiny_ckpt, eng)
    cfg_path.write_text(json.dumps(cfg))  # JSON is YAML
    r = subprocess.run([sys.executable, "-m", "appliance", "engines", "compile", "--config", str(cfg_path),
                        "--device", "cpu", "--batches", "1"], capture_output=True, text=True, timeout=600, env=_env(), cwd=str(eng))
    if r.returncode != 0 and ("CppCompileError" in r.stderr or "InvalidCxxCompiler" in r.stderr):
        pytest.skip(f"inductor cannot compile C++ here: {r.stderr[-400:]}")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "compiled 1 packages" in r.stdout, r.stdout
    assert "load check: 1 packages loaded and run once on zero inputs in a test process" in r.stdout, r.stdout
    dirs = [p.parent for p in (eng / SUBDIR).glob("*/manifest.json")]
    assert len(dirs) == 1
    return cfg, eng / SUBDIR, dirs[0]


def test_package_in_a_fresh_process_gives_the_eager_codes(built):
    cfg, aot, pkg = built
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cfg), str(aot)], capture_output=True, text=True,
                       timeout=300, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    eager, got = out["eager"], out["aot"]
    assert got["compiled"] == "aot" and str(pkg) in got["source"], got["source"]
    assert "load check in a test process recorded" in got["source"]   # engines compile ran it
    assert not list(pkg.glob(".loading-*"))   # the in-process load's mark is gone after it
    assert "plain step for b2_L64 (not built)" in got["source"]   # only batch 1 was built: rows 0..0 of 2
    assert eager["compiled"] is None
    codes = np.array(got["codes"])
    assert codes.shape == (41, 4) and len(np.unique(codes[:, 0])) > 5, "real draws expected"
    np.testing.assert_array_equal(codes, np.array(eager["codes"]))
    np.testing.assert_allclose(np.array(got["hidden"]), np.array(eager["hidden"]), rtol=1e-4, atol=1e-5)


def test_manifest_records_identity_and_file_digests(built, tiny_ckpt):
    from appliance.engines import manifest as mf

    _, _, pkg = built
    m = mf.read(pkg)
    assert m["kind"] == "aot-inductor" and m["key"] == pkg.name
    ident = m["identity"]
    assert ident["checkpoint_sha256"] == mf.checkpoint_sha256(tiny_ckpt)
    assert ident["kv"] == {"max_batch": 2, "max_seq_len": 64, "dtype": "torch.float32"}
    assert ident["torch"] == torch.__version__ and ident["device"]["type"] == "cpu" and ident["precision"] == "fp32"
    (name, g), = m["graphs"].items()
    assert name == "step_b1_L64.pt2" and (g["batch"], g["span"]) == (1, 64)
    assert g["sha256"] == mf.file_sha256(pkg / name) and g["bytes"] == (pkg / name).stat().st_size
    assert any(n.startswith("kv.k.") for n, _, _ in m["inputs"]) and ["runner.t", [1], "torch.int64"] in m["inputs"]


def _config(d: dict):
    from appliance.config import config_from_dict

    return config_from_dict(d)


def test_other_config_falls_back_to_plain_graphs_with_the_reason(built):
    from appliance.engines.torch.cuda_runner import CudaRunner

    cfg, aot, _ = built
    c = _config(cfg)
    c = dataclasses.replace(c, model=dataclasses.replace(c.model, max_seq_len=48))
    r = CudaRunner(c, compile="aot", aot_dir=str(aot))
    assert r.compiled is None and r._aot is None
    assert "plain CUDA graphs" in r.step_source and "kv.max_seq_len is 64, here 48" in r.step_source
    assert "chattts-appliance engines compile" in r.step_source
    r = CudaRunner(_config(cfg), compile="aot", aot_dir=str(aot.parent / "nowhere"))
    assert r.compiled is None and "no ahead-of-time compiled step in" in r.step_source


def test_damaged_package_is_refused(built, tmp_path):
    from appliance.engines.torch.cuda_runner import CudaRunner

    cfg, aot, pkg = built
    copy = tmp_path / "aot" / pkg.name
    shutil.copytree(pkg, copy)
    f = copy / "step_b1_L64.pt2"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10   # one flipped bit, size unchanged
    f.write_bytes(bytes(data))
    r = CudaRunner(_config(cfg), compile="aot", aot_dir=str(tmp_path / "aot"))
    assert r.compiled is None
    assert "does not match the sha256 its manifest records" in r.step_source and str(f) in r.step_source


def test_identity_names_what_differs(built, tmp_path):
    from appliance.engines.torch import aot_step
    from appliance.engines.torch.cuda_runner import CudaRunner

    cfg, aot, pkg = built
    r = CudaRunner(_config(cfg))
    m = json.loads((pkg / "manifest.json").read_text())
    mine = aot_step.identity(r, m["identity"]["checkpoint_sha256"], "default")
    assert aot_step.key_of(mine) == pkg.name   # the key is the identity's hash
    other = tmp_path / "aot" / "x"
    other.mkdir(parents=True)
    m["identity"] = {**m["identity"], "checkpoint_sha256": "0" * 64, "torch": "2.0.0"}
    (other / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(Exception, match=r"checkpoint_sha256 is 000000000000\.\.\., here .*torch is '2\.0\.0', here"):
        aot_step.find(r, tmp_path / "aot", cfg["model"]["path"])


# ---------------------------------------------------------------------------- the load canary
SEGV_LOADER = """
import os, signal
from pathlib import Path

def load(path, device_index):
    with open(Path(__file__).with_name("calls.txt"), "a") as f:
        f.write(f"{path}\\n")
    os.kill(os.getpid(), signal.SIGSEGV)
"""


def _unchecked_copy(pkg: Path, tmp_path: Path) -> Path:
    """A copy of the package set without its load-check marker -> the copy's directory."""
    copy = tmp_path / "aot" / pkg.name
    shutil.copytree(pkg, copy)
    for m in copy.glob("load-check-*"):
        m.unlink()
    return copy


def _segv_loader(tmp_path: Path, monkeypatch) -> Path:
    """Point the canary's child at a loader that kills itself with SIGSEGV -> its call log."""
    from appliance.engines.torch import aot_canary

    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "segv_loader.py").write_text(SEGV_LOADER)
    monkeypatch.syspath_prepend(str(mods))   # the child starts with the parent's sys.path
    monkeypatch.setattr(aot_canary, "LOADER", "segv_loader:load")
    return mods / "calls.txt"


def test_engines_compile_recorded_a_passed_load_check(built):
    from appliance.engines.torch import aot_canary
    from appliance.engines import manifest as mf

    _, _, pkg = built
    mark = json.loads(aot_canary.marker_path(pkg).read_text())
    assert mark["ok"] is True and mark["torch"] == torch.__version__
    assert mark["packages"] == {n: g["sha256"] for n, g in mf.read(pkg)["graphs"].items()}


def test_a_loader_that_segfaults_in_the_canary_leaves_plain_graphs_and_a_marker(built, tmp_path, monkeypatch):
    from appliance.engines.torch import aot_canary
    from appliance.engines.torch.cuda_runner import CudaRunner

    cfg, _, pkg = built
    copy = _unchecked_copy(pkg, tmp_path)
    calls = _segv_loader(tmp_path, monkeypatch)
    in_process = []
    monkeypatch.setattr(aot_canary, "load_package", lambda *a: in_process.append(a))

    r = CudaRunner(_config(cfg), compile="aot", aot_dir=str(tmp_path / "aot"))
    assert r.compiled is None and r._aot is None
    src = r.step_source
    assert src.startswith("plain CUDA graphs: ") and f"crash torch {torch.__version__}'s loader" in src, src
    assert "(signal 11, SIGSEGV, loading step_b1_L64.pt2 in a test process, at " in src and "segv_loader.py:" in src
    if hasattr(torch._C, "_set_print_stack_traces_on_fatal_signal"):
        assert "; native: " in src and "fatalSignalHandler" not in src, src   # c10's report, its own frames left out
    mark = aot_canary.marker_path(copy)
    assert str(mark) in src and "delete that file to try again" in src
    data = json.loads(mark.read_text())
    assert data["ok"] is False and data["torch"] == torch.__version__ and "SIGSEGV" in data["reason"]
    assert calls.read_text().splitlines() == [str(copy / "step_b1_L64.pt2")]
    assert in_process == []   # never loaded in the daemon's own process

    again = CudaRunner(_config(cfg), compile="aot", aot_dir=str(tmp_path / "aot"))
    assert again.compiled is None and "SIGSEGV" in again.step_source and "(recorded " in again.step_source
    assert len(calls.read_text().splitlines()) == 1 and in_process == []   # the marker kept it from trying


C10_REPORT = """SIGSEGV(11), PID: 24219, Thread 24219:
 frame #0: c10::FatalSignalHandler::stacktraceSignalHandler(bool) + 0x8f (0x7f673d51fc4f in /x/torch/lib/libc10.so)
frame #1: c10::FatalSignalHandler::fatalSignalHandler(int, siginfo_t*) + 0x2da (0x7f673d52027a in /x/torch/lib/libc10.so)
frame #2: <unknown function> + 0x3c050 (0x7f673e05a050 in /lib/x86_64-linux-gnu/libc.so.6)
frame #3: torch::inductor::AOTIModelContainerRunner::AOTIModelContainerRunner(std::string const&) + 0x1a (0x7f1 in /x/torch/lib/libtorch_cpu.so)
frame #4: <unknown function> + 0x8608 (0x7f673db6c608 in /tmp/pkg/data/aotinductor/model/cxyz.wrapper.so)
frame #5: ffi_call + 0xcd (0x7f673db2bb0d in /lib/x86_64-linux-gnu/libffi.so.8)
frame #6: _start + 0x21 (0x557bcb552081 in /usr/bin/python3)

SIGSEGV(11), PID: 24219, Thread 24262:
 frame #0: c10::FatalSignalHandler::stacktraceSignalHandler(bool) + 0x8f (0x7f673d51fc4f in /x/torch/lib/libc10.so)
frame #1: pthread_cond_wait + 0x1e8 (0x7f673e0a65d8 in /lib/x86_64-linux-gnu/libc.so.6)

Fatal Python error: Segmentation fault
"""


def test_native_frames_of_the_faulting_thread_from_c10s_report():
    from appliance.engines.torch.aot_canary import _native_frames

    got = _native_frames(C10_REPORT)
    assert got == ("torch::inductor::AOTIModelContainerRunner::AOTIModelContainerRunner(std::string const&) + 0x1a "
                   "(libtorch_cpu.so) <- + 0x8608 (cxyz.wrapper.so) <- ffi_call + 0xcd (libffi.so.8)"), got
    assert _native_frames("Fatal Python error: Segmentation fault\n") == ""


def test_a_start_that_died_loading_in_process_is_remembered(built, tmp_path):
    from appliance.engines.torch import aot_canary
    from appliance.engines.torch.cuda_runner import CudaRunner

    cfg, _, pkg = built
    copy = tmp_path / "aot" / pkg.name
    shutil.copytree(pkg, copy)   # with the passed check engines compile recorded
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (copy / f".loading-{gone.pid}").write_text(torch.__version__ + "\n")   # as a start killed mid-load leaves it

    r = CudaRunner(_config(cfg), compile="aot", aot_dir=str(tmp_path / "aot"))
    assert r.compiled is None
    assert f"a start (pid {gone.pid}) died while loading the ahead-of-time packages" in r.step_source
    assert json.loads(aot_canary.marker_path(copy).read_text())["ok"] is False
    assert not list(copy.glob(".loading-*"))


def test_engines_compile_exits_1_when_its_packages_crash_the_loader(built, tmp_path, monkeypatch, capsys):
    from appliance.build import aot
    from appliance.engines.torch import aot_canary

    cfg, aot_dir, pkg = built
    copy = tmp_path / "aot" / pkg.name
    shutil.copytree(pkg, copy)   # a passed check recorded: compile checks again regardless
    _segv_loader(tmp_path, monkeypatch)
    monkeypatch.setattr(aot, "compile_packages", lambda *a, **kw: copy)
    args = argparse.Namespace(config=str(aot_dir.parent / "config.json.yaml"), device="cpu", mode="default",
                              batches="1", buckets=None, out=None)
    assert aot.cli_main(args) == 1
    err = capsys.readouterr().err
    assert "load check failed" in err and f"signal {int(signal.SIGSEGV)}, SIGSEGV" in err, err
    assert "the daemon runs plain CUDA graphs" in err
    assert json.loads(aot_canary.marker_path(copy).read_text())["ok"] is False


def test_a_loader_that_raises_in_the_canary_is_a_failure_with_its_message(built, tmp_path, monkeypatch):
    from appliance.engines.torch import aot_canary
    from appliance.engines import manifest as mf

    _, _, pkg = built
    copy = _unchecked_copy(pkg, tmp_path)
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "raising_loader.py").write_text("def load(path, device_index):\n"
                                            "    raise RuntimeError('Error in dlopen: no such symbol')\n")
    monkeypatch.syspath_prepend(str(mods))
    v = aot_canary.check(copy, mf.read(copy), -1, loader="raising_loader:load")
    assert not v.ok and not v.recorded and v.marker == aot_canary.marker_path(copy)
    assert "fail with torch" in v.reason and "RuntimeError: Error in dlopen: no such symbol" in v.reason, v.reason
    assert "loading step_b1_L64.pt2 in a test process" in v.reason
    again = aot_canary.check(copy, mf.read(copy), -1)   # the default loader would pass: the marker decides
    assert not again.ok and again.recorded
