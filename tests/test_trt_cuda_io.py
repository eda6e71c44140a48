"""The TensorRT runner's memory without TensorRT and without torch: device buffers, pinned
staging, the KV scatter and sampling over copied logits (``tests/trt_plumbing.py``), run in a
child process on the host-memory CUDA fake everywhere and on the real CUDA runtime where
cuda-python and a GPU are present; a failing CUDA call raises naming it and frees what was
allocated."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.errors import ConfigError, EngineError

ROOT = Path(__file__).resolve().parents[1]


def _cuda_here() -> bool:
    has = any(importlib.util.find_spec(m.split(".")[0]) and _spec(m) for m in ("cuda.bindings.runtime", "cuda.cudart"))
    return bool(has and shutil.which("nvidia-smi"))


def _spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.parametrize("kind", ["fake", pytest.param("cuda", marks=pytest.mark.skipif(
    not _cuda_here(), reason="needs cuda-python and an NVIDIA GPU"))])
def test_buffers_copies_and_sampling_run_without_torch(kind):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "tests.trt_plumbing", kind], cwd=str(ROOT), env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok put/get, KV scatter") and "torch not imported" in r.stdout, r.stdout


def test_a_failing_cuda_call_raises_naming_it_and_frees_what_was_made():
    from appliance.engines.tensorrt.cuda import Cuda
    from appliance.engines.tensorrt.io import TrtIO
    from tests import fake_cudart
    from tests.trt_plumbing import plan

    cu = Cuda(runtime=fake_cudart)
    before = fake_cudart.live()
    fake_cudart.fail.add("cudaMallocHost")
    try:
        with pytest.raises(EngineError, match="CUDA cudaMallocHost failed: cudaErrorMemoryAllocation: out of memory"):
            TrtIO(cu, plan())
    finally:
        fake_cudart.fail.clear()
    assert fake_cudart.live() == before


def test_kv_dtype_mismatch_is_refused_before_use():
    from appliance.engines.tensorrt.cuda import Cuda
    from appliance.engines.tensorrt.io import TrtIO
    from appliance.errors import EngineMismatchError
    from tests import fake_cudart
    from tests.trt_plumbing import plan

    p = plan()
    p["gpt"]["k_new"]["dtype"] = "float32"
    before = fake_cudart.live()
    with pytest.raises(EngineMismatchError, match="rebuild the plans"):
        TrtIO(Cuda(runtime=fake_cudart), p)
    assert fake_cudart.live() == before


def test_without_cuda_python_the_error_says_what_to_install(monkeypatch):
    from appliance.engines.tensorrt import cuda

    monkeypatch.setattr(cuda, "MODULES", ("no_such_cuda_module",))
    with pytest.raises(ConfigError, match="pip install 'cuda-python"):
        cuda.Cuda()
