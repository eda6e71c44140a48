"""The health check against the reference ``calibrate`` records: the health sentence rendered when
the box was known good (codes digest + band log-spectrum, tolerance from calibrate's bar). Real
parts: a copy of the random tiny checkpoint, the real calibrate, real pipelines, a weight changed
in memory and a bit flipped on disk after the calibration (size and mtime unchanged)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct

import numpy as np
import pytest
import torch

from appliance.config import config_from_dict
from appliance.model.tensorfile import TensorFile
from appliance.ops.health import run_health_check
from appliance.synth import reference as rf
from appliance.synth.pipeline import Pipeline

SMALL = dict(candidates=(6, 10, 12), sentences=(("zh", "你好。"),), voices=(("seed:2", 1),), tokens=(40, 50))


def _cfg(ckpt, engine_dir, **safety):
    return config_from_dict({
        "model": {"path": str(ckpt), "backend": "torch", "device": "cpu", "threads": 1, "max_batch": 3,
                  "max_seq_len": 512, "max_prompt_tokens": 128, "engine_dir": str(engine_dir)},
        "synthesis": {"max_new_tokens": 120}, "safety": safety,
        "health": {"max_rtf": 100.0, "max_ttfb_ms": 60_000.0, "max_memory_mib": 1e6}}, base_dir=str(ckpt))


@pytest.fixture(scope="module")
def calibrated(tiny_ckpt, tmp_path_factory):
    """(config, calibration): a copy of the tiny checkpoint calibrated into its own engine dir."""
    import appliance.build.calibrate as c

    tmp = tmp_path_factory.mktemp("ref")
    ckpt = tmp / "ck"
    shutil.copytree(tiny_ckpt, ckpt)                       # copy2: sizes and mtimes kept
    cfg = _cfg(ckpt, tmp / "eng")
    orig = c.calibrate
    c.calibrate = lambda pipe, thr: orig(pipe, thr, **SMALL)
    try:
        cal, _ = c.run(cfg)
    finally:
        c.calibrate = orig
    return cfg, cal


@pytest.fixture(scope="module")
def pipeline(calibrated):
    p = Pipeline.from_config(calibrated[0])
    yield p
    p.close()


def test_calibrate_records_a_small_reference_and_health_passes_against_it(calibrated, pipeline):
    cfg, cal = calibrated
    entry = json.loads((cfg.resolve(cfg.model.engine_dir) / "calibration.json").read_text())["entries"][0]
    ref = entry["reference"]
    assert ref == cal.reference and ref["sentence"] == cfg.health.sentence and ref["seed"] == rf.HEALTH_SEED
    assert len(ref["codes_sha256"]) == 64 and ref["steps"] == 120          # the torch CPU backend repeats its codes
    assert len(json.dumps(ref)) < 4096                                       # a few KB
    m = ref["measured"]
    assert m["bar_db"] == max(cal.threshold_db, cal.floor_db + 3.0) and ref["range_db"] == -m["bar_db"]
    assert ref["tolerance_db"] == max(m["repeat_db"], m["bar_noise_db"]) > 0
    assert ref["lookahead_tokens"] == cal.lookahead_tokens < cal.exact_lookahead

    beats = []                 # the worker's liveness beat: every engine step, and between the stages after synthesis
    r = run_health_check(pipeline, cfg, beat=lambda: beats.append(1))
    assert r.healthy, r.reasons
    assert r.reference.startswith(f"matches the reference recorded by calibrate on {cal.date[:10]} (codes identical")
    assert len(beats) > 3 + 2 * 5              # two renders of 120 steps, in growing chunks of at most 48 steps


def test_a_weight_changed_in_memory_fails_naming_the_reference(calibrated, pipeline):
    cfg, cal = calibrated
    w = pipeline.runner.model.decoder.decoder.conv_in[0].weight
    keep = w.detach().clone()
    try:
        with torch.no_grad():
            w.view(-1)[5] *= 256.0                                           # an exponent bit: x 2^8
        r = run_health_check(pipeline, cfg)
    finally:
        with torch.no_grad():
            w.copy_(keep)
    assert not r.healthy
    far = [x for x in r.reasons if x.startswith("audio: far from the reference")]
    assert len(far) == 1, r.reasons
    assert f"recorded by calibrate on {cal.date[:10]}: log-spectral distance" in far[0]
    assert f"(allowed {cal.reference['tolerance_db']:.2f})" in far[0] and "restart the daemon" in far[0]
    d = float(far[0].split("log-spectral distance ")[1].split(" dB")[0])
    assert d > 10 * cal.reference["tolerance_db"]
    assert r.reference.startswith("differs from the reference")
    assert run_health_check(pipeline, cfg).healthy                           # restored: passes again


def _grow_weight(path, offset: int) -> tuple[float, float]:
    """Flip exponent bit 3 of the little-endian float32 at ``offset`` (x 2^8 when it is clear) in
    place, keeping size, inode and mtime (bit rot, not an edit); returns (before, after)."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        raw = f.read(4)
        flipped = struct.pack("<I", struct.unpack("<I", raw)[0] ^ (1 << 26))
        f.seek(offset)
        f.write(flipped)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    st2 = os.stat(path)
    assert (st2.st_ino, st2.st_size, st2.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    return struct.unpack("<f", raw)[0], struct.unpack("<f", flipped)[0]


def test_a_bit_flipped_on_disk_after_calibration_fails_naming_the_reference(calibrated, tmp_path):
    """The load's own sha256 check would refuse the file (tests/test_integrity.py); here it is off,
    so what finds the flip is the health check's comparison with the reference."""
    cfg, cal = calibrated
    ckpt = tmp_path / "ck"
    shutil.copytree(cfg.resolve(cfg.model.path), ckpt)
    f = ckpt / "asset" / "gpt" / "model.safetensors"
    tf = TensorFile(f)
    e = next(e for e in tf.entries if e.name == "layers.1.mlp.down_proj.weight")
    before, after = _grow_weight(f, tf.data_start + e.begin + 4 * 5)
    assert after == 256 * before                                           # one weight, finite: no NaN to catch
    bad = _cfg(ckpt, cfg.resolve(cfg.model.engine_dir), verify_checkpoint=False)
    p = Pipeline.from_config(bad)
    try:
        r = run_health_check(p, bad)
    finally:
        p.close()
    assert not r.healthy
    far = [x for x in r.reasons if x.startswith("audio: far from the reference")]
    assert len(far) == 1 and "the decode drew other codes for the same seed" in far[0], r.reasons
    assert cal.reference["codes_sha256"][:12] in far[0] and "restart the daemon" in far[0]


def test_a_stale_reference_is_ignored_and_said_so(calibrated, pipeline, tmp_path):
    cfg, cal = calibrated
    data = json.loads((cfg.resolve(cfg.model.engine_dir) / "calibration.json").read_text())
    data["entries"][0]["engine_id"] = "torch 0.0 fp32"                         # engines rebuilt since
    (tmp_path / "calibration.json").write_text(json.dumps(data))
    stale = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, engine_dir=str(tmp_path)))
    r = run_health_check(pipeline, stale)
    assert r.healthy, r.reasons
    assert "other engines" in r.reference and "'torch 0.0 fp32'" in r.reference and "ignored" in r.reference
    none = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, engine_dir=str(tmp_path / "none")))
    r = run_health_check(pipeline, none)
    assert r.healthy and r.reference.startswith("no reference: not calibrated for torch-cpu/fp32")
    other = dataclasses.replace(stale, health=dataclasses.replace(cfg.health, sentence="你好。"))
    data["entries"][0]["engine_id"] = pipeline.info.engine_id
    (tmp_path / "calibration.json").write_text(json.dumps(data))
    r = run_health_check(pipeline, other)
    assert r.healthy and "another health sentence" in r.reference


def test_fingerprint_and_distance():
    rng = np.random.default_rng(1)
    x = (0.3 * rng.standard_normal(48000)).astype(np.float32)
    f = rf.fingerprint(x)
    assert f.shape == (1 + (48000 - rf.N_FFT) // rf.HOP, len(rf.BAND_EDGES_HZ) - 1)
    assert np.array_equal(rf._decode(rf._encode(f), len(f)), f)              # stored exactly (0.01 dB)
    assert rf.band_lsd(f, f, 60.0) == 0.0
    assert rf.band_lsd(f, rf.fingerprint(0.5 * x), 60.0) == pytest.approx(20 * np.log10(2), abs=0.02)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_cuda_reference_holds_across_processes(tiny_ckpt, tmp_path, dtype):
    """On the GPU (CUDA graphs, FP16 or FP32): ``calibrate`` in one process, ``health`` in two later
    ones (each its own load, capture and chunk timings) match the reference: identical codes and a
    distance within the tolerance. A false alarm here would be one on every box."""
    import subprocess
    import sys

    import yaml

    conf = tmp_path / "config.yaml"
    conf.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_ckpt), "backend": "torch", "device": "cuda", "dtype": dtype, "compile": "off",
                  "max_batch": 3, "max_seq_len": 512, "max_prompt_tokens": 128, "engine_dir": str(tmp_path / "eng")},
        "synthesis": {"max_new_tokens": 240},
        "health": {"max_rtf": 100.0, "max_ttfb_ms": 60_000.0, "max_memory_mib": 1e6}}, allow_unicode=True))

    def cli(*argv):
        return subprocess.run([sys.executable, "-m", "appliance", *argv, "--config", str(conf)], capture_output=True,
                              text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))})

    cal = cli("calibrate", "--json")
    assert cal.returncode == 0, cal.stderr[-2000:]
    ref = json.loads(cal.stdout)["reference"]
    assert ref["codes_sha256"], ref["measured"]                 # two renders in one process drew the same codes
    for _ in range(2):
        h = cli("health", "--json")
        reply = json.loads(h.stdout)
        assert h.returncode == 0 and reply["healthy"], (reply, h.stderr[-2000:])
        assert reply["reference"].startswith("matches the reference recorded by calibrate"), reply["reference"]


def test_an_unreadable_reference_is_a_note(calibrated, pipeline, tmp_path):
    cfg, _ = calibrated
    data = json.loads((cfg.resolve(cfg.model.engine_dir) / "calibration.json").read_text())
    data["entries"][0]["reference"]["spectrum"] = "not base64!"
    (tmp_path / "calibration.json").write_text(json.dumps(data))
    r = run_health_check(pipeline, dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, engine_dir=str(tmp_path))))
    assert r.healthy and "unreadable" in r.reference and "calibrate" in r.reference
