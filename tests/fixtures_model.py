"""Fixtures: model (see conftest.py).

* ``tiny_ckpt``   – Path of a random tiny checkpoint (official layout under ``<path>/asset``),
  written once per session (seed 0).
* ``tiny_config`` – a :class:`~appliance.config.Config` pointing at it: backend torch, device cpu,
  float32, 1 thread, max_batch 3, max_seq_len 512, max_prompt_tokens 128.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    from appliance.model.random_ckpt import write_random_checkpoint

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
