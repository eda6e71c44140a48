"""Fixtures: model (see conftest.py).

* ``tiny_ckpt``   – Path of a random tiny checkpoint (official layout under ``<path>/asset``),
  written once per session (seed 0).
* ``tiny_config`` – a :class:`~appliance.config.Config` pointing at it: backend torch, device cpu,
  float32, 1 thread, max_batch 3, max_seq_len 512, max_prompt_tokens 128.
* ``onnx_dir``    – an engine directory with the FP32 ONNX graphs of ``tiny_ckpt`` (max_batch 3,
  max_seq_len 512, max_prompt_tokens 128, window 64), exported once per session.
* ``golden``      – the arrays of ``tests/golden/upstream_tiny.npz`` (upstream chattts 0.2.5 outputs;
  see ``tests/golden/make_goldens.py``) as a dict.
* ``golden_ckpt`` – Path of the golden's tiny checkpoint rebuilt in the official layout.
* ``golden_model`` – our :class:`~appliance.model.checkpoint.ChatTTSModel` loaded from it (CPU, fp32).
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


@pytest.fixture(scope="session")
def onnx_dir(tiny_ckpt, tmp_path_factory):
    from appliance.build.export import export_all

    root = tmp_path_factory.mktemp("engines")
    export_all(tiny_ckpt, root, precision="fp32", **ONNX_LIMITS, window_tokens=64)
    return root


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
