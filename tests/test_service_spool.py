"""Accepted requests are not lost across a stop: queued ones stay in the journal (their clients
get ``spooled``) and are spoken after restart."""

from appliance.service.journal import Journal
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
