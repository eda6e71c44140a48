"""``serve`` on the llama.cpp and ONNX Runtime paths never imports torch: the daemon, started in a
child process on the tiny checkpoint's exports, reports ``torch_loaded: false`` in ``status`` and
maps no ``libtorch`` (``/proc/PID/maps``), after a request has been spoken."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures_model import ONNX_LIMITS
from tests.fixtures_service import service_config


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def _llama_cuda() -> bool:
    """llama.cpp's CUDA build and an NVIDIA GPU are here (the GPU machine)."""
    import shutil

    from appliance.engines.select import llama_gpu_build

    return bool(shutil.which("nvidia-smi")) and llama_gpu_build()


@pytest.mark.parametrize("backend", ["llama", "onnxruntime", pytest.param("auto", marks=pytest.mark.skipif(
    not _llama_cuda(), reason="needs llama.cpp's CUDA build and an NVIDIA GPU"))])
def test_serve_never_imports_torch(backend, tiny_ckpt, llama_dir, tmp_path, start_daemon, request):
    """``auto`` runs where llama.cpp's CUDA build and a GPU are present: it must pick llama.cpp with
    the GPT offloaded, count device memory with its context, and still never import torch."""
    eng = request.getfixturevalue("onnx_dir") if backend == "onnxruntime" else llama_dir
    model = {"backend": backend, "engine_dir": str(eng), **ONNX_LIMITS}
    if backend == "auto":
        model.update(device="auto", dtype="auto")
    d = start_daemon(service_config(tiny_ckpt, tmp_path, model=model))
    events = d.request({"type": "speak", "text": "hello there", "seed": 3, "id": "tf-1"})
    assert events[-1]["type"] == "done", events[-1]
    st = d.request({"type": "status"})[-1]
    assert st["type"] == "status" and st["backend"] in ("llama.cpp", "onnxruntime")
    assert st["torch_loaded"] is False, d.log()[-3000:]
    assert "libtorch" not in _maps(d.proc.pid), "the daemon mapped libtorch"
    assert set(st["networks"]) == {"gpt", "decoder", "vocos"}, st["networks"]
    if backend == "auto":
        assert st["backend"] == "llama.cpp" and "CUDA" in st["networks"]["gpt"], st
        assert "CUDA build" in st["backend_reason"] and st["memory_kind"] == "discrete", st
        assert st["memory_all_in_mib"] > st["memory_mib"] > 0, st            # host RSS + device with the context
        assert "network gpt: llama.cpp" in d.log()
    else:
        assert st["memory_kind"] == "cpu" and st["memory_all_in_mib"] == pytest.approx(st["memory_mib"], abs=50)
