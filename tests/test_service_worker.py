"""The request queue of the worker (its thread not started, so the order stays observable):
priority order, per-channel limits, duplicate ids, cancel of queued requests, stop."""

from __future__ import annotations

import pytest

from appliance.errors import BusyError, RequestError
from appliance.service.protocol import Speak
from appliance.service.worker import Item, Worker


def _worker(limit: int = 8) -> Worker:
    return Worker(pipeline=None, audio=None, queue_len={"main": limit, "hall": limit})


def _item(events: list, rid: str, priority: str = "normal", channel: str = "main") -> Item:
    return Item(speak=Speak(text="x", id=rid, priority=priority), job=None, channel=channel,
                sink=lambda ev, payload=None: events.append(ev))


def test_queue_orders_by_priority_fifo_within_one():
    w, evs = _worker(), []
    order = [("b1", "background"), ("n1", "normal"), ("a1", "alert"), ("n2", "normal"), ("a2", "alert")]
    positions = {rid: w.submit(_item(evs, rid, p)) for rid, p in order}
    assert positions == {"b1": 0, "n1": 0, "a1": 0, "n2": 2, "a2": 1}
    assert [e.queue_position for e in evs] == [0, 0, 0, 2, 1] and all(e.type == "accepted" for e in evs)
    assert [it.id for it in w._queue] == ["a1", "a2", "n1", "n2", "b1"]
    assert w.status()["main"] == {"queued": 5, "active": None}


def test_limits_and_duplicate_ids():
    w, evs = _worker(limit=2), []
    w.submit(_item(evs, "r1"))
    w.submit(_item(evs, "r2"))
    with pytest.raises(BusyError, match="queue_len"):
        w.submit(_item(evs, "r3"))
    w.submit(_item(evs, "h1", channel="hall"))          # other channels have their own limit
    with pytest.raises(RequestError, match="already queued"):
        w.submit(_item(evs, "h1", channel="hall"))
    assert len(evs) == 3                                 # refused requests were never 'accepted'


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
