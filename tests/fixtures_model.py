"""Fixtures: model (see conftest.py).

* ``tiny_ckpt``   – Path of a random tiny checkpoint (official layout under ``<path>/asset``),
  written once per session (seed 0).
* ``tiny_config`` – a :class:`~appliance.config.Config` pointing at it: backend torch, device cpu,
  float32, 1 thread, max_batch 3, max_seq_len 512, max_prompt_tokens 128.
* ``onnx_dir``    – an engine directory with the FP32 ONNX graphs of ``tiny_ckpt`` (max_batch 3,
  max_seq_len 512, max_prompt_tokens 128, window 64), exported once per test run: under
  ``pytest -n N`` the workers share one export (keyed by the checkpoint's sha256 and the limits,
  made by the first worker that needs it while the others wait on a file lock). Read-only: a
  test that changes engine files works on a copy.
* ``llama_dir``   – an engine directory with the F32 GGUF export of ``tiny_ckpt`` for llama.cpp
  (``llama/f32/``, the same limits), exported once per test run like ``onnx_dir``. Read-only.
* ``golden``      – the arrays of ``tests/golden/upstream_tiny.npz`` (upstream chattts 0.2.5 outputs;
  see ``tests/golden/make_goldens.py``) as a dict.
* ``golden_ckpt`` – Path of the golden's tiny checkpoint rebuilt in the official layout.
* ``golden_model`` – our :class:`~appliance.model.checkpoint.ChatTTSModel` loaded from it (CPU, fp32).
* ``system_cxx``  – module scope: ``CXX`` and inductor's ``cpp.cxx`` set to the system C++ compiler
  (``/usr/bin/g++``, where it exists) for the tests that compile with inductor and load what it
  built (the AOT packages, ``torch.compile`` on the CPU); child processes inherit ``CXX``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

GOLDEN = Path(__file__).parent / "golden" / "upstream_tiny.npz"


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    from appliance.build.random_ckpt import write_random_checkpoint

    root = tmp_path_factory.mktemp("tiny_ckpt")
    write_random_checkpoint(root, "tiny", seed=0)
    return root


@pytest.fixture(scope="session")
def tiny_config(tiny_ckpt):
    from appliance.config import config_from_dict

    return config_from_dict(
        {"model": {"path": str(tiny_ckpt), "backend": "torch", "device": "cpu", "dtype": "float32",
                   "threads": 1, "max_batch": 3, "max_seq_len": 512, "max_prompt_tokens": 128}},
        base_dir=str(tiny_ckpt),
    )


ONNX_LIMITS = {"max_batch": 3, "max_seq_len": 512, "max_prompt_tokens": 128}


def shared_dir(tmp_path_factory, name: str, make) -> Path:
    """``make(path)`` run once per test run for ``name``: in the pytest temp directory of this
    run, which ``pytest -n N`` workers have in common (each worker's own base temp is one level
    below it); the others wait on a file lock and reuse the result. Without xdist it is simply
    made in this session's base temp."""
    import os

    from filelock import FileLock

    common = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        common = common.parent
    path, done = common / name, common / f"{name}.done"
    with FileLock(str(common / f"{name}.lock")):
        if not done.exists():
            make(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def onnx_dir(tiny_ckpt, tmp_path_factory):
    from appliance.build.export import export_all
    from appliance.engines.manifest import checkpoint_sha256

    key = checkpoint_sha256(tiny_ckpt)[:16] + "-" + "-".join(f"{v}" for v in ONNX_LIMITS.values())
    return shared_dir(tmp_path_factory, f"engines-{key}",
                      lambda root: export_all(tiny_ckpt, root, precision="fp32", **ONNX_LIMITS, window_tokens=64))


@pytest.fixture(scope="session")
def llama_dir(tiny_ckpt, tmp_path_factory):
    from appliance.build.gguf_export import export_llama
    from appliance.engines.manifest import checkpoint_sha256

    key = checkpoint_sha256(tiny_ckpt)[:16] + "-" + "-".join(f"{v}" for v in ONNX_LIMITS.values())
    return shared_dir(tmp_path_factory, f"llama-{key}",
                      lambda root: export_llama(tiny_ckpt, root, qtype="f32", **ONNX_LIMITS, window_tokens=64))


@pytest.fixture(scope="session")
def golden():
    with np.load(GOLDEN) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="session")
def golden_ckpt(golden, tmp_path_factory) -> Path:
    """Rebuild the tiny checkpoint (float32 safetensors + json/tokenizer files) from the npz."""
    from safetensors.numpy import save_file

    from appliance.model import layout

    root = tmp_path_factory.mktemp("golden_ckpt")
    asset = root / "asset"
    meta = json.loads(golden["meta_json"].tobytes().decode("utf-8"))
    files: dict[str, dict[str, np.ndarray]] = {}
    for k, v in golden.items():
        if k.startswith("w|"):
            _, name, key = k.split("|", 2)
            files.setdefault(name, {})[key] = v.astype(np.float32)
        elif k.startswith("f|"):
            p = asset / k[2:]
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(v.tobytes())
    files[layout.GPT_FILE]["embed_tokens.weight"] = np.zeros(meta["embed_tokens_shape"], np.float32)
    for name, tensors in files.items():
        (asset / name).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(asset / name))
    from appliance.model.integrity import write_sums

    write_sums(root)  # its own sums (not upstream's): every load verifies them
    return root


@pytest.fixture(scope="session")
def golden_model(golden_ckpt):
    """Our ChatTTSModel loaded (float32, CPU) from ``golden_ckpt``."""
    from appliance.model.checkpoint import load_model

    return load_model(golden_ckpt)


SYSTEM_CXX = "/usr/bin/g++"


@pytest.fixture(scope="module")
def system_cxx():
    """Inductor compiles C++ with ``$CXX`` (else ``g++`` on the PATH), and this process or a child
    then loads what it built: it must be the system compiler, whose C++ runtime is the one the
    process has. The H200 image sets ``CXX`` to another GCC (/opt/gcc), whose AOT packages crash
    at load (bench/HISTORY.md, 2026-12-02), so the tests set it themselves. Yields the compiler
    used (None where there is no /usr/bin/g++: left as it is; those tests skip when nothing
    compiles)."""
    import os

    if not os.path.exists(SYSTEM_CXX):
        yield None
        return
    import torch._inductor.config as ic

    old = os.environ.get("CXX")
    os.environ["CXX"] = SYSTEM_CXX
    try:
        with ic.patch({"cpp.cxx": (None, SYSTEM_CXX)}):
            yield SYSTEM_CXX
    finally:
        if old is None:
            os.environ.pop("CXX", None)
        else:
            os.environ["CXX"] = old
