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


@pytest.mark.parametrize("backend", ["llama", "onnxruntime"])
def test_serve_never_imports_torch(backend, tiny_ckpt, llama_dir, onnx_dir, tmp_path, start_daemon):
    eng = llama_dir if backend == "llama" else onnx_dir
    cfg = service_config(tiny_ckpt, tmp_path, model={"backend": backend, "engine_dir": str(eng), **ONNX_LIMITS})
    d = start_daemon(cfg)
    events = d.request({"type": "speak", "text": "hello there", "seed": 3, "id": "tf-1"})
    assert events[-1]["type"] == "done", events[-1]
    st = d.request({"type": "status"})[-1]
    assert st["type"] == "status" and st["backend"] in ("llama.cpp", "onnxruntime")
    assert st["torch_loaded"] is False, d.log()[-3000:]
    assert st["memory_kind"] == "cpu" and st["memory_all_in_mib"] == pytest.approx(st["memory_mib"], abs=50)
    assert "libtorch" not in _maps(d.proc.pid), "the daemon mapped libtorch"
    assert set(st["networks"]) == {"gpt", "decoder", "vocos"}, st["networks"]
