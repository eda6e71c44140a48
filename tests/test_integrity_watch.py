"""Weights are watched while the box runs: the background re-verification names a file whose bytes
changed after the load, and the health check fails on it and on degenerate audio (a buzz, or the
same audio whatever the seed) that a flipped weight speaks while every request ends ``done``."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import replace

import numpy as np
import pytest

from appliance.core import PcmChunk
from appliance.ops.health import run_health_check
from appliance.ops.integrity_watch import IntegrityWatch
from tests.fixtures_service import launch_daemon, service_config
from tests.waits import wait_log


@pytest.fixture(scope="module")
def pipeline(tiny_config):
    from appliance.synth.pipeline import Pipeline

    p = Pipeline.from_config(tiny_config)
    p.warmup()
    yield p
    p.close()


def _flip_bit(path, offset: int, bit: int = 6) -> None:
    """Flip one bit in place, keeping size and mtime (bit rot, not an edit)."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_watch_names_the_file_that_changed(tmp_path):
    files = []
    for i in range(3):
        p = tmp_path / f"w{i}.bin"
        p.write_bytes(os.urandom(3 << 20))
        files.append((p, hashlib.sha256(p.read_bytes()).hexdigest()))
    w = IntegrityWatch(files, mib_per_s=1.0)
    for _ in range(12):                                            # one clean round (9 MiB in 1 MiB steps)
        assert w.step(1 << 20) is None
        if w.rounds == 1:
            break
    assert w.rounds == 1
    _flip_bit(files[1][0], 2 << 20)
    found = None
    for _ in range(12):
        found = w.step(1 << 20)
        if found:
            break
    assert found and "w1.bin" in found and files[1][1] in found
    assert w.step(1 << 20) == found                        # it stays unhealthy until a restart
    assert IntegrityWatch(files, mib_per_s=0).mib_per_s == 0   # 0 = off: start() starts nothing


class _Buzz:
    """A pipeline whose weights are broken: every seed speaks the same 200 Hz buzz."""

    def __init__(self, p):
        self.p, self.info = p, p.info

    def prepare(self, speak):
        return self.p.prepare(speak)

    def device_memory_bytes(self):
        return 0

    def run(self, job, cancel, **kw):
        return _Buzzing(self.p.run(job, cancel, **kw))


class _Buzzing:
    """The real run (its timings and report), heard as 2 s of the same buzz whatever the seed."""

    def __init__(self, run):
        self._run = run

    @property
    def report(self):
        return self._run.report

    def __iter__(self):
        first = True
        for chunk in self._run:
            if first:
                t = np.arange(48000, dtype=np.float32) / 24000.0
                yield PcmChunk(samples=(0.3 * np.sign(np.sin(2 * np.pi * 200.0 * t))).astype(np.float32),
                               rate=chunk.rate)
                first = False


def _lenient(cfg):
    return dataclasses.replace(cfg, health=replace(cfg.health, max_rtf=100.0, max_ttfb_ms=60_000.0,
                                                   max_memory_mib=1e6))


def test_health_fails_on_a_buzz_that_ignores_the_seed(pipeline, tiny_config):
    ok = run_health_check(pipeline, _lenient(tiny_config))
    assert ok.healthy, ok.reasons                                  # the real model passes
    bad = run_health_check(_Buzz(pipeline), _lenient(tiny_config))
    assert not bad.healthy
    assert any("periodic" in r for r in bad.reasons) and any("seed" in r for r in bad.reasons), bad.reasons


def test_health_reports_a_file_that_changed_on_disk(pipeline, tiny_config):
    r = run_health_check(pipeline, _lenient(tiny_config), weights_failure="Embed.safetensors: sha256 abc, expected def")
    assert not r.healthy and r.reasons == ["weights: Embed.safetensors: sha256 abc, expected def"]


def test_daemon_finds_bit_rot_after_the_load(tiny_ckpt, tmp_path):
    """A bit flipped in a checkpoint file while the daemon runs (size and mtime unchanged) is found by
    the background re-verification and named by the next health check."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    cfg = service_config(ck, tmp_path, safety={"reverify_mib_per_s": 64.0})
    d = launch_daemon(tmp_path / "d", cfg)
    try:
        (h,) = d.request({"type": "health"}, until=("health",))
        assert h["healthy"] or not any(r.startswith("weights:") for r in h["reasons"]), h
        target = ck / "asset" / "Decoder.safetensors"
        _flip_bit(target, target.stat().st_size // 2)
        wait_log(d.log, "weights changed on disk", 60, alive=d.alive)
        (h,) = d.request({"type": "health"}, until=("health",))
        assert not h["healthy"] and any(r.startswith("weights:") and "Decoder.safetensors" in r for r in h["reasons"]), h
    finally:
        assert d.stop() == 0
