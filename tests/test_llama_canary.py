"""llama.cpp's GPU build is tried in a child process before the GPT is offloaded: a GGUF that the
child cannot load is a failed verdict (no exception in the caller), verdicts are kept per GGUF
sha256 and llama-cpp-python version, and a failed verdict makes the runner load the GPT on the
CPU and report ``engine_fallback`` instead of stopping the box. (The machine's build is the CPU
one: its loads ignore the offload count, so the passing child really loads and decodes.)"""

from __future__ import annotations

import json
import shutil

import llama_cpp
import pytest

from appliance.config import config_from_dict
from appliance.engines.llama import canary as llama_canary, lib as llama_lib
from appliance.engines import manifest as mf
from tests.fixtures_model import ONNX_LIMITS as LIMITS


def _gguf_copy(llama_dir, tmp_path):
    d = tmp_path / "llama" / "f32"
    # without the load-check verdicts another test's runner left beside the shared export (a CUDA
    # build checks every offloaded load): this copy is checked anew
    shutil.copytree(llama_dir / "llama" / "f32", d, ignore=shutil.ignore_patterns("load-check-*.json"))
    sha = json.loads((d / mf.MANIFEST).read_text())["files"]["gpt.gguf"]
    return d / "gpt.gguf", sha


def test_a_gguf_that_loads_passes_and_the_verdict_is_kept(llama_dir, tmp_path):
    f, sha = _gguf_copy(llama_dir, tmp_path)
    v = llama_canary.check(f, sha, llama_cpp.__version__)
    assert v.ok and not v.cached, v.reason
    rec = json.loads(llama_canary.marker_path(f, llama_cpp.__version__).read_text())
    assert rec["ok"] is True and rec["gguf_sha256"] == sha
    again = llama_canary.check(f, sha, llama_cpp.__version__)
    assert again.ok and again.cached
    # another export (another sha256) is tried again, not taken from the marker
    assert not llama_canary.check(f, "0" * 64, llama_cpp.__version__).cached


def test_a_gguf_the_child_cannot_load_is_a_failed_verdict(tmp_path):
    f = tmp_path / "gpt.gguf"
    f.write_bytes(b"GGUF" + b"\x00" * 60)       # a header and nothing else
    v = llama_canary.check(f, "ab" * 32, "test")
    assert not v.ok and not v.cached
    assert "could not load" in v.reason and str(f) in v.reason
    assert json.loads(llama_canary.marker_path(f, "test").read_text())["ok"] is False


def test_a_failed_verdict_runs_the_gpt_on_the_cpu_and_health_names_it(tiny_ckpt, llama_dir, tmp_path, monkeypatch):
    from appliance.engines.recover import open_runner_recovering

    f, sha = _gguf_copy(llama_dir, tmp_path)
    why = "llama.cpp's GPU build died with signal 11 loading it offloaded in a test process"
    llama_canary.marker_path(f, llama_cpp.__version__).write_text(
        json.dumps({"gguf_sha256": sha, "ok": False, "reason": why}))
    monkeypatch.setattr(llama_lib, "offloads", lambda device: device != "cpu")   # as a CUDA build answers
    cfg = config_from_dict({"model": {"path": str(tiny_ckpt), "backend": "llama", "threads": 1, **LIMITS,
                                      "engine_dir": str(tmp_path), "llama_precision": "f32"}}, base_dir=str(tiny_ckpt))
    opened = open_runner_recovering(cfg)
    try:
        info = opened.runner.info
        assert info.device == "cpu" and info.backend == "llama.cpp"
        assert why in info.fallback and opened.fallback == info.fallback
        assert opened.runner.device_memory_bytes() == 0
    finally:
        opened.runner.close()


def test_model_device_cpu_never_offloads_and_a_cpu_build_never_does():
    gpu_build = bool(llama_lib.lib().llama_supports_gpu_offload())
    assert llama_lib.offloads("cpu") is False
    assert llama_lib.offloads("auto") is gpu_build and llama_lib.offloads("cuda") is gpu_build


@pytest.mark.cuda
@pytest.mark.skipif(not llama_lib.offloads("auto"), reason="llama-cpp-python here is the CPU build")
def test_the_gpu_build_offloads_the_gpt_and_speaks_as_the_cpu(tiny_ckpt, llama_dir, tmp_path):
    """On a CUDA build (bench/gpu.sh llama builds one): the load check passes in a child, every
    layer goes to the GPU, and three channels draw the CPU's codes (same seeds) from hidden
    states within -40 dB of the CPU's."""
    import numpy as np

    from appliance.core import SamplingParams
    from appliance.engines.llama.runner import LlamaRunner
    from tests.test_engines_llama import _db, _speak

    f, _ = _gguf_copy(llama_dir, tmp_path)

    def cfg(device):
        return config_from_dict({"model": {"path": str(tiny_ckpt), "backend": "llama", "threads": 1, **LIMITS,
                                           "engine_dir": str(tmp_path), "llama_precision": "f32", "device": device,
                                           "llama_kv_cache": "f16"}}, base_dir=str(tiny_ckpt))

    cpu, gpu = LlamaRunner(cfg("cpu"), reason="cpu"), LlamaRunner(cfg("auto"), reason="gpu")
    try:
        assert cpu.info.device == "cpu" and cpu.device_memory_bytes() == 0
        assert gpu.info.device == "cuda:0" and gpu.info.fallback == "", gpu.info.fallback
        assert gpu.device_memory_bytes() >= f.stat().st_size
        assert json.loads(llama_canary.marker_path(f, llama_cpp.__version__).read_text())["ok"] is True
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, 400, n) for n in (30, 17, 44)]
        spk = rng.standard_normal(64).astype(np.float32)
        c_c, h_c = _speak(cpu, prompts, spk, SamplingParams(), 40)
        c_g, h_g = _speak(gpu, prompts, spk, SamplingParams(), 40)
        assert _db(h_g, h_c) < -40
        assert (c_g == c_c).mean() >= 0.9
    finally:
        cpu.close()
        gpu.close()
