"""Accepted requests are not lost across a stop: queued ones stay in the journal (their clients
get ``spooled``) and are spoken after restart."""

import logging

from appliance.messages.protocol import parse_request
from appliance.service.journal import Journal
from appliance.service.recovery import tell_stopped
from appliance.service.request import Request
from tests.fixtures_service import launch_daemon, service_config
from tests.waits import wait_log


def test_queued_requests_are_spooled_at_stop_and_spoken_after_restart(tiny_ckpt, tmp_path):
    cfg = service_config(tiny_ckpt, tmp_path, synthesis={"max_new_tokens": 200, "min_new_tokens": 200},
                         service={"channels": [{"name": "main", "queue_len": 8}]})
    spool = tmp_path / "d" / "spool"
    d = launch_daemon(tmp_path / "d", cfg)
    c = d.connect()
    try:
        for i in range(3):
            c.send({"type": "speak", "text": "你好", "id": f"s{i}", "seed": i})
        # wait until all three are accepted and the first runs, then stop: s1 and s2 are queued
        evs, _ = c.events_until_ids({"s0", "s1", "s2"}, kinds=("accepted",))
        if not any(e["type"] == "started" for e in evs):
            c.events(("started",))
        assert d.stop() == 0
        _, ends = c.events_until_ids({"s0", "s1", "s2"}, kinds=("done", "error"))
    finally:
        c.close()
    assert ends["s0"]["type"] == "done"                 # the running one was drained
    assert ends["s1"]["code"] == ends["s2"]["code"] == "spooled", ends
    assert [e.id for e in Journal(spool).open().pending] == ["s1", "s2"]   # s0 played: not kept
    assert "2 queued request(s) left at stop: 2 kept in the journal (spoken after the next start)" in d.log()

    # restart on the same config: the spool is replayed and emptied
    d2 = launch_daemon(tmp_path / "d", cfg)
    try:
        wav = tmp_path / "wav"
        wait_log(d2.log, "replaying 2 journaled request(s)", 120)
        for rid in ("s1", "s2"):
            wait_log(d2.log, f"replayed request {rid}: done", 120)
            assert (wav / f"{rid}.wav").exists()
        assert "replayed request s0" not in d2.log()
    finally:
        assert d2.stop() == 0
    assert Journal(spool).open().pending == []


def test_the_stop_log_counts_kept_and_dropped_apart(caplog):
    """Wyoming's requests (play: false) are never journaled: the stop log must not count them
    as kept (it said "3 ... kept in the journal" when 2 were)."""
    got = []

    def item(rid: str, journal, **kw) -> Request:
        return Request(speak=parse_request({"text": "hi", "id": rid, **kw}), job=None, channel="main",
                    sink=lambda e: got.append(e), journal=journal)

    items = [item("a", 1), item("b", 2), item("wy-1", None, play=False, return_audio=True)]
    with caplog.at_level(logging.INFO, logger="appliance.service.recovery"):
        tell_stopped(items, journal_on=True)
        assert ("3 queued request(s) left at stop: 2 kept in the journal (spoken after the next start), 1 dropped "
                "(play: false, e.g. Wyoming's: their audio goes only to a client that is gone, so they are never "
                "journaled)") in caplog.text
        assert [e.code for e in got] == ["spooled", "spooled", "cancelled"]
        caplog.clear()
        tell_stopped([item("c", None), item("d", None)], journal_on=False)
        assert "2 queued request(s) left at stop: 2 dropped (journal.enabled: false)" in caplog.text
        assert "kept" not in caplog.text
