"""Upgrades in place under a speaking daemon (model.backend llama): the export's files (the GGUF,
the embedding tables, the vocoder's ONNX graphs and their data) overwritten and then truncated
while an utterance is being made change nothing the daemon computes and cannot kill it: the
utterance finishes with finite audio, later requests too, health names the changed file
(``integrity``), and a restart onto the rewritten files is clean (appliance.engines.llama.lib,
appliance.engines.onnx.vocoder.open_session, docs/guarantees.md)."""

from __future__ import annotations

import os
import shutil

import numpy as np

from tests.fixtures_model import ONNX_LIMITS
from tests.fixtures_service import launch_daemon, service_config
from tests.waits import wait_for


def _speak(d, rid: str, steps: int) -> tuple[list[dict], np.ndarray, object]:
    """A speak request with its audio returned; (events, PCM float32, the connection) with the
    connection left open after the first audio event (the caller reads on with ``_finish``)."""
    c = d.connect(120)
    c.send({"type": "speak", "id": rid, "text": "你好，今天天气很好。", "seed": 5, "return_audio": True,
            "params": {"max_new_tokens": steps, "min_new_tokens": steps}})
    evs = c.events(until=("audio", "done", "error"))
    assert evs[-1]["type"] == "audio", evs
    return evs, c


def _finish(c, evs: list[dict]) -> tuple[list[dict], np.ndarray]:
    evs = evs + c.events(until=("done", "error"))
    c.close()
    pcm = np.concatenate([np.frombuffer(e["_payload"], np.float32) for e in evs if e["type"] == "audio"])
    return evs, pcm


def _status(d) -> dict:
    (st,) = d.request({"type": "status"}, timeout_s=30)
    return st


def test_an_export_overwritten_and_truncated_under_a_speaking_daemon(tiny_ckpt, llama_dir, tmp_path):
    engines = tmp_path / "engines"
    shutil.copytree(llama_dir, engines)
    (export,) = [p for p in (engines / "llama").iterdir() if (p / "manifest.json").is_file()]
    saved = {f.name: f.read_bytes() for f in export.iterdir() if f.name != "manifest.json"}
    cfg = service_config(tiny_ckpt, tmp_path, model={"backend": "llama", "engine_dir": str(engines),
                                                     "rebuild_engines": False, **ONNX_LIMITS},
                         safety={"reverify_mib_per_s": 64.0})
    d = launch_daemon(tmp_path / "d", cfg)
    try:
        evs, c = _speak(d, "during", 400)               # speaking: its first audio is out
        for name, data in saved.items():                 # an upgrade written in place, then cut short
            with open(export / name, "r+b") as f:
                f.write(np.random.default_rng(0).integers(0, 256, len(data), np.uint8).tobytes())
                f.flush()
                os.fsync(f.fileno())
                f.truncate(len(data) // 3)
        evs, pcm = _finish(c, evs)
        assert evs[-1]["type"] == "done" and evs[-1]["id"] == "during", evs[-1]
        assert pcm.size > 0 and np.isfinite(pcm).all() and np.abs(pcm).max() > 0
        assert d.alive()

        st = wait_for(lambda: (s := _status(d))["health"] == "unhealthy" and s, 60, "health naming the change")
        (cond,) = [x for x in st["conditions"] if x["name"] == "integrity"]
        assert "changed on disk since the load" in cond["reason"], cond

        evs2, c2 = _speak(d, "after", 100)               # keeps speaking with what it loaded
        evs2, pcm2 = _finish(c2, evs2)
        assert evs2[-1]["type"] == "done" and np.isfinite(pcm2).all(), evs2[-1]
    finally:
        rc = d.stop()
    assert rc == 0, d.log()[-3000:]
    assert "SIGBUS" not in d.log() and "Fatal Python error" not in d.log()

    for name, data in saved.items():                     # the upgrade completes: the files as they were
        (export / name).write_bytes(data)
    d = launch_daemon(tmp_path / "d2", cfg)               # a restart onto them is clean
    try:
        evs, c = _speak(d, "restarted", 50)
        evs, pcm = _finish(c, evs)
        assert evs[-1]["type"] == "done" and np.isfinite(pcm).all()
        assert _status(d)["health"] != "unhealthy"
    finally:
        assert d.stop() == 0, d.log()[-3000:]
