"""Integrity at load and at output: checkpoint sha256 sums (cached by size + mtime), the PCM
guard (NaN/Inf never reach a sink: engine_error naming the stage), and the health check's audio
checks (non-finite, silent). Real checkpoints written by ``model random``, real pipelines."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from appliance.core import SynthesisRequest, SynthParams
from appliance.errors import CheckpointError, EngineError
from appliance.model import integrity
from appliance.synth.guard import check_pcm, finite


def _random_ckpt(root: Path) -> Path:
    from appliance.build.random_ckpt import write_random_checkpoint

    write_random_checkpoint(root, "tiny", seed=0)
    return root


def corrupt_behind_header(f: Path, value: int = 0xFF, n: int = 200_000) -> None:
    """Overwrite ``n`` bytes of a safetensors file's data (the JSON header stays intact, the size
    too): 0xFF bytes are NaN float32s."""
    b = bytearray(f.read_bytes())
    start = 8 + struct.unpack("<Q", b[:8])[0] + 4096
    end = min(len(b), start + n)
    b[start:end] = bytes([value]) * (end - start)
    f.write_bytes(bytes(b))


def _config(root: Path, tmp: Path, **safety):
    from appliance.config import config_from_dict

    return config_from_dict({"model": {"path": str(root), "backend": "torch", "device": "cpu", "threads": 1,
                                       "max_batch": 1, "max_seq_len": 256, "max_prompt_tokens": 64},
                             "safety": {"cache_dir": str(tmp / "cache"), **safety}}, base_dir=str(tmp))


def test_random_checkpoint_carries_its_sums_and_the_cache_makes_boot_cheap(tmp_path):
    root = _random_ckpt(tmp_path / "ck")
    sums = json.loads((root / integrity.SUMS_FILE).read_text())
    assert set(sums) == {f"asset/{r}" for r in integrity.VERIFIED_FILES}
    cache = tmp_path / "cache" / integrity.CACHE_FILE
    r1 = integrity.verify_checkpoint(root, cache)
    assert r1.hashed == r1.files == len(integrity.VERIFIED_FILES) and r1.source.endswith(integrity.SUMS_FILE)
    r2 = integrity.verify_checkpoint(root / "asset", cache)        # the asset dir itself works too
    assert r2.hashed == 0                                           # size + mtime + inode unchanged: no re-hash
    f = root / "asset" / "Embed.safetensors"
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))   # touched: hashed again
    assert integrity.verify_checkpoint(root, cache).hashed == 1


def test_bytes_corrupted_behind_an_intact_header_are_refused_naming_the_file(tmp_path):
    root = _random_ckpt(tmp_path / "ck")
    cache = tmp_path / "cache" / integrity.CACHE_FILE
    integrity.verify_checkpoint(root, cache)                       # good sums cached first
    gpt = root / "asset" / "gpt" / "model.safetensors"
    size = gpt.stat().st_size
    corrupt_behind_header(gpt)
    assert gpt.stat().st_size == size
    with pytest.raises(CheckpointError) as e:
        integrity.verify_checkpoint(root, cache)
    msg = str(e.value)
    assert str(gpt) in msg and "sha256" in msg and "model random" in msg and "verify_checkpoint: false" in msg
    for other in ("Embed.safetensors", "Vocos.safetensors"):
        assert other not in msg                                    # only the bad file is named
    # the pipeline refuses to load it: nothing heavy is built
    from appliance.synth.pipeline import Pipeline

    with pytest.raises(CheckpointError, match="model.safetensors"):
        Pipeline.from_config(_config(root, tmp_path))


def test_a_checkpoint_without_own_sums_is_checked_against_upstreams_map(tmp_path):
    root = _random_ckpt(tmp_path / "ck")
    (root / integrity.SUMS_FILE).unlink()
    with pytest.raises(CheckpointError) as e:
        integrity.verify_checkpoint(root)
    msg = str(e.value)
    assert "upstream's published sums" in msg and f"model sums {root}" in msg
    assert msg.count("sha256 ") == len(integrity.VERIFIED_FILES)   # random weights are not upstream's
    from appliance.cli.main import main

    assert main(["model", "sums", str(root)]) == 0                  # record our own: accepted from now on
    assert integrity.verify_checkpoint(root).hashed == len(integrity.VERIFIED_FILES)
    (root / "asset" / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json: missing"):
        integrity.verify_checkpoint(root)


def test_guard_passes_finite_audio_and_names_the_stage_of_nan(tmp_path):
    assert finite(np.zeros(0, np.float32)) and finite(np.ones(4, np.float32))
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones(100, np.float32)
        x[37] = bad
        assert not finite(x)
        with pytest.raises(EngineError, match="1 of 100 samples") as e:
            check_pcm(x, "r1")
        assert e.value.code == "engine_error" and "vocoder output" in str(e.value)


@pytest.fixture(scope="module")
def nan_pipeline(tmp_path_factory):
    """The issue's reproduction: NaN bytes behind an intact header of gpt/model.safetensors,
    integrity check off (bypassed) -> the weights load."""
    from appliance.synth.pipeline import Pipeline

    tmp = tmp_path_factory.mktemp("nan")
    root = _random_ckpt(tmp / "ck")
    corrupt_behind_header(root / "asset" / "gpt" / "model.safetensors")
    p = Pipeline.from_config(_config(root, tmp, verify_checkpoint=False))
    yield p
    p.close()


def test_nan_weights_end_with_engine_error_naming_the_gpt_never_pcm(nan_pipeline):
    got = []
    job = nan_pipeline.prepare(SynthesisRequest(id="nan", text="你好。", seed=1, params=SynthParams(max_new_tokens=100)))
    with pytest.raises(EngineError) as e:
        for chunk in nan_pipeline.run(job):
            got.append(chunk)
    assert got == []                                                # not one chunk reached the caller
    assert "the GPT" in str(e.value) and "NaN/Inf" in str(e.value)
    assert job.stats is None                                        # never 'done'


def test_health_check_fails_on_nan_and_on_silence(nan_pipeline, tmp_path):
    from appliance.ops.health import run_health_check
    from appliance.synth.pipeline import Pipeline

    cfg = nan_pipeline.cfg
    cfg = dataclasses.replace(cfg, health=dataclasses.replace(cfg.health, max_rtf=1e6, max_ttfb_ms=1e9))
    r = run_health_check(nan_pipeline, cfg)
    assert not r.healthy and r.reasons[0].startswith("engine_error") and "NaN/Inf" in r.reasons[0]

    # weights that compute zeros: Vocos' magnitude bias at -1e4 -> exp() == 0 -> exact silence
    from safetensors.numpy import load_file, save_file

    root = _random_ckpt(tmp_path / "silent")
    voc = root / "asset" / "Vocos.safetensors"
    t = load_file(str(voc))
    n_freq = t["head.out.bias"].shape[0] // 2
    t["head.out.bias"][:n_freq] = -1e4
    save_file(t, str(voc), metadata={"format": "pt"})
    integrity.write_sums(root)                                      # a deliberate change: new sums
    p = Pipeline.from_config(_config(root, tmp_path))
    try:
        r = run_health_check(p, dataclasses.replace(cfg, model=p.cfg.model))
    finally:
        p.close()
    assert not r.healthy and any(x.startswith("audio: silent") for x in r.reasons), r.reasons

    p = Pipeline.from_config(_config(_random_ckpt(tmp_path / "good"), tmp_path))
    try:
        r = run_health_check(p, dataclasses.replace(cfg, model=p.cfg.model))
    finally:
        p.close()
    assert not any(x.startswith("audio") for x in r.reasons), r.reasons   # healthy audio passes
