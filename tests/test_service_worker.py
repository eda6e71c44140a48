"""The request queue of the worker (its thread not started, so the order stays observable):
priority order, per-channel limits, duplicate ids, cancel of queued requests, stop; and the
daemon's thread-safe entry for inputs on other threads (MQTT later), run in process."""

from __future__ import annotations

import time

import pytest

from appliance.errors import BusyError, RequestError
from appliance.messages.protocol import Cancel, Speak
from appliance.service.request import Request as Item
from appliance.service.worker import Worker


def _worker(limit: int = 8) -> Worker:
    return Worker(pipeline=None, audio=None, queue_len={"main": limit, "hall": limit})


def _item(events: list, rid: str, priority: str = "normal", channel: str = "main") -> Item:
    return Item(speak=Speak(text="x", id=rid, priority=priority), job=None, channel=channel,
                sink=lambda ev: events.append(ev))


def test_queue_orders_by_priority_fifo_within_one():
    w, evs = _worker(), []
    order = [("b1", "background"), ("n1", "normal"), ("a1", "alert"), ("n2", "normal"), ("a2", "alert")]
    positions = {rid: w.submit(_item(evs, rid, p)) for rid, p in order}
    assert positions == {"b1": 0, "n1": 0, "a1": 0, "n2": 2, "a2": 1}
    assert [e.queue_position for e in evs] == [0, 0, 0, 2, 1] and all(e.type == "accepted" for e in evs)
    assert [it.id for it in w.sched.queue] == ["a1", "a2", "n1", "n2", "b1"]
    st = w.status()["main"]
    assert st["queued"] == 5 and st["active"] is None and st["playing"] == []


def test_limits_and_duplicate_ids():
    w, evs = _worker(limit=2), []
    w.submit(_item(evs, "r1"))
    w.submit(_item(evs, "r2"))
    with pytest.raises(BusyError) as e:
        w.submit(_item(evs, "r3"))
    assert "2 requests queued, the limit set by service.channels[0].queue_len (the entry with name: main)" \
        in str(e.value)
    w.submit(_item(evs, "h1", channel="hall"))          # other channels have their own limit
    w.submit(_item(evs, "h2", channel="hall"))
    with pytest.raises(BusyError, match=r"service\.channels\[1\]\.queue_len \(the entry with name: hall\)"):
        w.submit(_item(evs, "h3", channel="hall"))
    with pytest.raises(RequestError, match="already queued"):
        w.submit(_item(evs, "h1", channel="hall"))
    assert len(evs) == 4                                 # refused requests were never 'accepted'


def test_cancel_queued_by_id_and_channel_then_stop():
    w, evs = _worker(), []
    for rid, ch in [("m1", "main"), ("m2", "main"), ("h1", "hall"), ("h2", "hall")]:
        w.submit(_item(evs, rid, channel=ch))
    assert [it.id for it in w.cancel(request_id="m2")] == ["m2"]
    assert sorted(it.id for it in w.cancel(channel="hall")) == ["h1", "h2"]
    assert w.cancel(request_id="m2") == []               # already gone
    errors = [e for e in evs if e.type == "error"]
    assert sorted(e.id for e in errors) == ["h1", "h2", "m2"] and {e.code for e in errors} == {"cancelled"}
    left = w.stop()
    assert [it.id for it in left] == ["m1"] and not w.busy
    with pytest.raises(BusyError, match="stopping"):
        w.submit(_item(evs, "late"))


def test_daemon_in_process_threadsafe_entry_for_other_inputs(tiny_ckpt, tmp_path):
    """The entry the MQTT input uses: Dispatcher.handle_request_threadsafe from a foreign thread,
    with a parsed request and its own sink; the daemon runs in this (main) thread and is stopped
    through request_stop."""
    import threading

    from appliance.config import config_from_dict
    from appliance.daemon.daemon import Daemon, Hooks
    from tests.fixtures_service import service_config

    cfg = config_from_dict(service_config(tiny_ckpt, tmp_path, health={"at_start": False}), str(tmp_path))
    ready, events, errors = threading.Event(), [], []
    d = Daemon(cfg, hooks=Hooks(on_ready=ready.set))
    assert d.dispatch is None            # built complete with the loaded parts, never before

    def mqtt_like():
        try:
            assert ready.wait(60)
            fut = d.dispatch.handle_request_threadsafe(Speak(text="from another thread", id="mq-1", seed=1),
                                                       lambda ev: events.append(ev))
            fut.result(30)
            d.dispatch.handle_request_threadsafe(Cancel(id="nothing-runs"),
                                                 lambda ev: errors.append(ev)).result(30)
            deadline = time.monotonic() + 30
            while not any(e.type in ("done", "error") for e in events) and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            d.dispatch.loop.call_soon_threadsafe(d.request_stop)

    t = threading.Thread(target=mqtt_like)
    t.start()
    assert d.run() == 0
    t.join()
    assert [e.type for e in events] == ["accepted", "started", "done"], events
    assert events[-1].output == str(tmp_path / "wav" / "mq-1.wav")
    assert [(e.type, e.code) for e in errors] == [("error", "bad_request")]
    with pytest.raises(BusyError):       # after the stop: refused, never queued
        d.dispatch.handle_request_threadsafe(Speak(text="too late"), lambda ev: None)
