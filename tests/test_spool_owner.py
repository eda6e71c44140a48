"""One owner of the spool, with real daemons on one ``service.spool_dir``: a second daemon with
another socket waits for the spool's lock, then exits 75 naming the owner's pid and the lock, and
never opens the journal; a daemon started while the first drains after SIGTERM waits until it has
exited and speaks only what it left. Each request is spoken exactly once (the daemons' logs of
what they started; the ALSA file device keeps the first request sounding while the second waits).
A world-writable spool is made private at start."""

from __future__ import annotations

import os
import signal
import stat

from tests.fixtures_service import launch_daemon, service_config
from tests.waits import wait_log

SLOW = 0.1
"""The card's clock while a request must still sound when the next step of the test happens."""


def _cfg(tiny_ckpt, tmp, spool, sock: str, **service):
    return service_config(tiny_ckpt, tmp, audio={"output": "device"},
                          service={"spool_dir": str(spool), "socket": str(tmp / "run" / sock),
                                   "channels": [{"name": "main", "on_disconnect": "finish"}], **service})


def _speak(rid: str, n: int = 60) -> dict:
    return {"type": "speak", "text": "你好。", "id": rid, "seed": 7, "params": {"min_new_tokens": n, "max_new_tokens": n}}


def _started(logs, rid: str) -> int:
    return sum(log().count(f"started {rid} on ") for log in logs)


def test_a_second_daemon_on_the_same_spool_waits_then_exits_naming_the_owner(tiny_ckpt, tmp_path, alsa_file):
    spool = tmp_path / "spool"
    spool.mkdir()
    os.chmod(spool, 0o777)                                   # a neighbour could plant files there
    d1 = launch_daemon(tmp_path / "d1", _cfg(tiny_ckpt, tmp_path, spool, "one.sock"), alsa=alsa_file)
    try:
        assert "service.spool_dir: directory" in d1.log() and "mode 0777" in d1.log()
        assert stat.S_IMODE(spool.stat().st_mode) == 0o755
        alsa_file.set_speed(SLOW)                            # r1 still sounds while the second daemon tries
        c = d1.connect()
        c.send(_speak("r1"))
        c.events(("started",))
        d2 = launch_daemon(tmp_path / "d2", _cfg(tiny_ckpt, tmp_path, spool, "two.sock", spool_lock_wait_s=1.0),
                           alsa=alsa_file, wait=False)
        assert d2.proc.wait(120) == 75, d2.log()[-3000:]
        log2 = d2.log()
        assert f"another daemon (pid {d1.proc.pid}) owns the spool" in log2 and str(spool / "spool.lock") in log2, log2
        assert "request journal" not in log2 and "replaying" not in log2, log2[-3000:]
        assert not (tmp_path / "run" / "two.sock").exists()
        (st,) = d1.request({"type": "status"})                # the owner still answers
        assert st["channels"]["main"]["active"] == "r1" or "r1" in st["channels"]["main"].get("playing", []), st
        alsa_file.set_speed(1.0)
        assert c.events(("done", "error"))[-1]["type"] == "done"
        c.close()
    finally:
        alsa_file.set_speed(1.0)
        assert d1.stop() == 0, d1.log()[-3000:]
    assert _started([d1.log, d2.log], "r1") == 1


def test_a_daemon_started_while_the_first_drains_speaks_only_what_it_left(tiny_ckpt, tmp_path, alsa_file):
    spool = tmp_path / "spool"
    cfg = _cfg(tiny_ckpt, tmp_path, spool, "appliance.sock", spool_lock_wait_s=120.0)
    d1 = launch_daemon(tmp_path / "d1", cfg, alsa=alsa_file)
    d2 = None
    try:
        alsa_file.set_speed(SLOW)                            # r1 sounds through the whole hand-over
        c = d1.connect()
        c.send(_speak("r1"))
        c.send(_speak("r2"))
        c.events_until_ids({"r1", "r2"}, kinds=("accepted",))
        wait_log(d1.log, "started r1 on", 60)
        d1.proc.send_signal(signal.SIGTERM)                   # drain: r1 finishes; r2, if not started, is spooled
        wait_log(d1.log, "stopping (finishing the running request)", 30)
        d2 = launch_daemon(tmp_path / "d2", cfg, alsa=alsa_file, wait=False)
        wait_log(d2.log, "is owned by another daemon", 120, alive=d2.alive)   # waits: never opens the journal
        assert "replaying" not in d2.log()
        alsa_file.set_speed(1.0)
        assert d1.proc.wait(120) == 0, d1.log()[-3000:]
        c.close()
        wait_log(d2.log, "ready:", 120, alive=d2.alive)
        assert f"the spool {spool} is ours now" in d2.log()
        if "started r2 on" not in d1.log():                  # spooled at the stop: the new owner speaks it
            wait_log(d2.log, "replayed request r2: done", 120, alive=d2.alive)
    finally:
        alsa_file.set_speed(1.0)
        if d1.proc.poll() is None:
            d1.stop()
        if d2 is not None:
            assert d2.stop() == 0, d2.log()[-3000:]
    assert _started([d1.log, d2.log], "r1") == 1, "r1 was spoken by both daemons"
    assert "replayed request r1" not in d2.log()
    assert _started([d1.log, d2.log], "r2") == 1, "r2 was spoken twice or never"
