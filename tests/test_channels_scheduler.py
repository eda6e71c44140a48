"""The scheduler in process, with the real pipeline (tiny checkpoint), real WAV output and the
real throttle policy: no per-channel memory admission (slots are sized at start), throttle limits
holding back low priorities, RTF fed back to the throttle."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from appliance.audio.output import AudioOutput
from appliance.config import config_from_dict
from appliance.core import SynthParams
from appliance.messages.protocol import Speak
from appliance.ops.readings import Reading
from appliance.ops.throttle import Level, Throttle
from appliance.service.request import Request as Item
from appliance.service.worker import Worker
from appliance.synth.pipeline import Pipeline


@pytest.fixture(scope="module")
def cfg(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sched")
    return config_from_dict({
        "model": {"path": str(tiny_ckpt), "backend": "torch", "device": "cpu", "threads": 1,
                  "max_batch": 3, "max_seq_len": 512, "max_prompt_tokens": 128},
        "synthesis": {"max_new_tokens": 60},
        "audio": {"output": "wav", "wav_dir": str(tmp / "wav")},
        "service": {"channels": [{"name": "a"}, {"name": "b"}, {"name": "c"}]},
        # the RTF ladder off, as in tests/fixtures_service.service_config: on a loaded host the
        # alert's real RTF (1.2+) held the level at queue_low_priority by compute after the heat cleared
        "throttle": {"min_dwell_s": 0.0, "rtf_reduce": 100.0, "rtf_queue": 100.0},
    }, base_dir=str(tmp))


@pytest.fixture(scope="module")
def pipe(cfg):
    p = Pipeline.from_config(cfg)
    yield p
    p.close()


class Events:
    """A thread-safe sink that records (time, event) per request id."""

    def __init__(self):
        self.lock = threading.Lock()
        self.evs: list = []

    def sink(self, ev):
        with self.lock:
            self.evs.append((time.monotonic(), ev))

    def of(self, rid):
        with self.lock:
            return [e for _, e in self.evs if getattr(e, "id", None) == rid]

    def when(self, rid, kind):
        with self.lock:
            return next(t for t, e in self.evs if getattr(e, "id", None) == rid and e.type == kind)

    def wait_end(self, ids, timeout_s=30.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(any(e.type in ("done", "error") for e in self.of(i)) for i in ids):
                return
            time.sleep(0.02)
        raise AssertionError(f"not all of {ids} ended: {self.evs}")


def _worker(pipe, cfg, **kw) -> Worker:
    audio = AudioOutput(cfg)
    audio.start()
    return Worker(pipe, audio, queue_len={"a": 4, "b": 4, "c": 4}, **kw)


def _item(pipe, ev: Events, rid, channel, priority="normal", seed=1, steps=50):
    sp = Speak(text="你好。", id=rid, channel=channel, priority=priority, seed=seed,
               params=SynthParams(min_new_tokens=steps, max_new_tokens=steps))
    return Item(speak=sp, job=pipe.prepare(sp), channel=channel, sink=ev.sink)


def test_memory_is_not_counted_per_channel_all_slots_run_together(pipe, cfg):
    """Every KV slot is allocated at load (and sized to the budget at start, see
    test_memory_fit.py): admission no longer holds a channel back for memory."""
    w = _worker(pipe, cfg)
    ev = Events()
    for rid, ch in (("m1", "a"), ("m2", "b"), ("m3", "c")):
        w.submit(_item(pipe, ev, rid, ch, steps=40))
    acc = [x for _, x in ev.evs if x.type == "accepted"]
    assert len(acc) == 3 and all(a.waiting is None for a in acc)
    w.start()
    try:
        ev.wait_end({"m1", "m2", "m3"})
    finally:
        w.stop(10)
    for rid in ("m1", "m2", "m3"):
        assert [e.type for e in ev.of(rid)] == ["accepted", "started", "done"]
    starts = sorted(ev.when(r, "started") for r in ("m1", "m2", "m3"))
    assert starts[-1] < min(ev.when(r, "done") for r in ("m1", "m2", "m3"))   # all three synthesized at once


def test_throttle_holds_low_priority_until_it_recovers(pipe, cfg):
    clock = [1000.0]
    th = Throttle(dataclasses.replace(cfg.throttle, trip_c=95.0, temp_hysteresis_c=1.0, min_dwell_s=3.0),
                  memory_budget_mb=1500, channels=3, clock=lambda: clock[0])
    w = _worker(pipe, cfg, throttle=th)
    th.on_change = lambda change: w.poke()

    def tj(c: float) -> Reading:
        return Reading(t=0.0, temps_c={"tj": c})

    assert th.update(tj(95.0)) is Level.ALERTS_ONLY                   # hot: alerts only (92C)
    ev = Events()
    w.submit(_item(pipe, ev, "n1", "a", steps=20))
    w.submit(_item(pipe, ev, "bg", "c", priority="background", steps=20))
    (acc,) = [e for e in ev.of("n1") if e.type == "accepted"]
    assert acc.waiting == "throttle level alerts_only by thermal: temperature 95.0C (>= 92.0C: alerts_only): normal requests wait"
    w.start()
    try:
        w.submit(_item(pipe, ev, "al", "b", priority="alert", steps=20))
        ev.wait_end({"al"})
        time.sleep(0.2)
        st = w.status()
        assert st["a"]["queued"] == 1 and "alerts_only" in st["a"]["waiting"]
        assert [e.type for e in ev.of("n1")] == ["accepted"]
        assert th._rtf is not None                                  # the alert's RTF was observed
        assert th.update(tj(89.0)) is Level.ALERTS_ONLY                 # cooler (queue: 87-91C), for the hold-off ...
        clock[0] += 3.0
        assert th.update(tj(89.0)) is Level.QUEUE_LOW_PRIORITY          # ... then down: normal may run
        ev.wait_end({"n1"})
        time.sleep(0.2)
        assert [e.type for e in ev.of("bg")] == ["accepted"]          # background still waits
        assert "background requests wait" in w.status()["c"]["waiting"]
        th.update(tj(50.0))
        clock[0] += 3.0
        th.update(tj(50.0))
        assert th.level is Level.NORMAL
        ev.wait_end({"bg"})
    finally:
        w.stop(10)
    assert [e.type for e in ev.of("n1")] == ["accepted", "started", "done"]
    assert [e.type for e in ev.of("bg")] == ["accepted", "started", "done"]
