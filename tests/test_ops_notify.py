"""sd_notify, watchdog (appliance.ops.notify) and logging set-up (appliance.ops.logsetup).

Real datagram sockets (tests/fixtures_ops.py), both transports where systemd-python is installed.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import pytest

from appliance.ops import logsetup, notify
from appliance.ops.logsetup import setup_logging
from appliance.ops.bridge import format_status
from appliance.ops.notify import Notifier, Watchdog

TRANSPORTS = ["stdlib"] + (["libsystemd"] if notify._sd_daemon is not None else [])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_lifecycle_messages_reach_socket(notify_socket, transport):
    n = Notifier(transport)
    assert n.enabled
    assert n.extend_timeout(90, status="loading engines")
    assert n.ready(format_status("ready", busy=0, channels=3, throttle="normal"))
    assert n.status("busy")
    assert n.reloading()
    assert n.stopping()
    msgs = notify_socket.wait_count("STATUS", 5, timeout=5)
    assert notify_socket.keys_in_order() == ["EXTEND_TIMEOUT_USEC", "READY", "STATUS", "RELOADING", "STOPPING"]
    assert msgs[0].fields == {"EXTEND_TIMEOUT_USEC": "90000000", "STATUS": "loading engines"}
    assert msgs[1].fields["READY"] == "1"
    assert msgs[1].fields["STATUS"] == "ready; busy 0/3; throttle normal"
    mono = int(msgs[3].fields["MONOTONIC_USEC"])
    assert abs(mono - notify.monotonic_usec()) < 5_000_000
    assert msgs[4].fields["STOPPING"] == "1"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_abstract_address(notify_socket_abstract, transport):
    assert notify_socket_abstract.address.startswith("@")
    assert Notifier(transport).status("multi\nline")
    m = notify_socket_abstract.wait_for("STATUS", timeout=5)
    assert m.fields["STATUS"] == "multi line"


def test_not_under_systemd_is_noop(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier()
    assert not n.enabled
    assert n.ready() is False


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_unreachable_socket_warns_once_and_returns_false(monkeypatch, caplog, transport):
    monkeypatch.setenv("NOTIFY_SOCKET", "/tmp/does-not-exist-chattts/notify.sock")
    n = Notifier(transport)
    with caplog.at_level(logging.WARNING, logger="appliance.ops.notify"):
        assert n.watchdog() is False
        assert n.watchdog() is False
    assert len([r for r in caplog.records if "sd_notify" in r.message]) == 1


def test_transport_auto_prefers_libsystemd():
    assert Notifier().transport == ("libsystemd" if notify._sd_daemon is not None else "stdlib")
    with pytest.raises(ValueError):
        Notifier("carrier-pigeon")
    with pytest.raises(ValueError):
        Notifier().extend_timeout(0)


def test_format_status_all_fields():
    s = format_status("ready", busy=2, channels=3, last_rtf=0.4234, last_ttfb_ms=310.4,
                      temperature_c=52.06, throttle="reduced_channels")
    assert s == "ready; busy 2/3; rtf 0.42; ttfb 310 ms; 52.1C; throttle reduced_channels"


def test_watchdog_interval_from_environment():
    pid = str(os.getpid())
    assert notify.watchdog_interval_s({}) is None
    assert notify.watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert notify.watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": pid}) == 30.0
    assert notify.watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert notify.watchdog_interval_s({"WATCHDOG_USEC": "soon"}) is None
    assert notify.watchdog_interval_s({"WATCHDOG_USEC": "0"}) is None


def test_watchdog_tick_follows_heartbeat(notify_socket):
    now = [100.0]
    wd = Watchdog(Notifier(), interval_s=10.0, require=("worker", "loop"), clock=lambda: now[0])
    assert wd.enabled and wd.stale_after_s == 10.0
    assert wd.tick()                          # both fresh at construction
    now[0] += 4
    wd.beat("worker")
    assert wd.tick()                          # loop is 4 s old: still fresh
    now[0] += 7
    assert wd.stale() == ["loop"]             # loop 11 s old
    assert not wd.tick()
    wd.beat("loop")
    assert wd.tick()
    Notifier().send("MARK=1")                 # datagrams arrive in order: after the mark, nothing is in flight
    notify_socket.wait_for("MARK", timeout=5)
    assert len(notify_socket.with_key("WATCHDOG")) == 3 == wd.pings


def test_pings_come_from_the_heartbeats_and_stop_when_one_is_stale(notify_socket, caplog):
    """No timer of its own: each beat pings when the last ping is a period old and every required
    heartbeat is fresh; a stale one (the stage it is stuck in named once) withholds the pings; a
    heartbeat back after a pause of the whole process does not blame the others for it."""
    now = [100.0]
    # the stdlib sender: it lets the collector thread run while the socket's queue is full
    # (libsystemd's keeps the GIL, and 11 datagrams in a row from one process fill it)
    wd = Watchdog(Notifier("stdlib"), interval_s=30.0, stale_after_s=5.0, require=("worker", "loop"),
                  clock=lambda: now[0])
    wd.watch_stage("worker", lambda: "a decode step of r1")
    assert wd.period_s == 1.0
    wd.beat("worker")
    assert wd.pings == 0                              # not started (not ready yet): nothing sent
    wd.start()
    assert wd.pings == 1
    for _ in range(8):                                # both beating: one ping per second, not per beat
        now[0] += 0.25
        wd.beat("worker")
        now[0] += 0.25
        wd.beat("loop")
    assert wd.pings == 1 + 4
    with caplog.at_level("ERROR", "appliance.ops.notify"):
        for _ in range(12):                           # the worker is stuck: the loop alone beats
            now[0] += 0.5
            wd.beat("loop")
    assert wd.pings == 1 + 4 + 4                      # pinged while the worker was <= 5 s old
    (line,) = [r.getMessage() for r in caplog.records]
    assert "the worker made no progress for 5.2 s" in line and "stuck in a decode step of r1" in line, line
    wd.beat("worker")
    assert wd.pings == 1 + 4 + 5                      # it moves again: pinged at once
    now[0] += 20.0                                    # SIGSTOP: nobody beat for 20 s
    wd.beat("loop")
    assert wd.stale() == [] and wd.pings == 1 + 4 + 6
    wd.stop()
    now[0] += 2.0
    wd.beat("worker")
    assert wd.pings == 1 + 4 + 6
    Notifier("stdlib").send("MARK=1")
    notify_socket.wait_for("MARK", timeout=5)
    assert len(notify_socket.with_key("WATCHDOG")) == wd.pings


def test_watchdog_period_is_at_most_half_the_interval():
    assert Watchdog(Notifier(), interval_s=1.0).period_s == 0.5
    assert Watchdog(Notifier(), interval_s=30.0).period_s == 1.0


def test_watchdog_disabled_without_env(monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    wd = Watchdog(Notifier())
    assert not wd.enabled
    wd.start()
    wd.beat()
    assert wd.pings == 0
    wd.stop()


@pytest.fixture
def restore_root_logging():
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in saved[0]:
        root.addHandler(h)
    root.setLevel(saved[1])


@pytest.mark.skipif(logsetup._sd_journal is None, reason="systemd-python not installed")
def test_journal_logging_sends_structured_fields(restore_root_logging):
    sent = []

    def sender(MESSAGE, **fields):
        sent.append((MESSAGE, fields))

    mode = setup_logging(environ={"INVOCATION_ID": "abc"}, journal_sender=sender)
    assert mode == "journal"
    logging.getLogger("appliance.test").info(
        "request %s done", "r1", extra={"request_id": "r1", "channel": "main", "ttfb_ms": 312.5, "rtf": 0.41})
    assert logsetup.flush()
    msg, fields = sent[-1]
    assert msg == "request r1 done"
    assert fields["SYSLOG_IDENTIFIER"] == "chattts-appliance"
    assert fields["PRIORITY"] == "6"
    assert fields["LOGGER"] == "appliance.test"
    assert (fields["REQUEST_ID"], fields["CHANNEL"], fields["TTFB_MS"], fields["RTF"]) == ("r1", "main", 312.5, 0.41)
    logging.getLogger("appliance.test").info("plain extra", extra={"request_id": "r9", "rtf": 0.5})
    assert logsetup.flush()
    assert (sent[-1][1]["REQUEST_ID"], sent[-1][1]["RTF"]) == ("r9", 0.5)     # lower-case extras get aliases


def test_stderr_logging_appends_fields(restore_root_logging, capsys):
    assert setup_logging(environ={}) == "stderr"
    logging.getLogger("appliance.test").warning("slow", extra={"request_id": "r2", "rtf": 1.5})
    assert logsetup.flush()
    err = capsys.readouterr().err
    assert "WARNING appliance.test: slow [request_id=r2 rtf=1.5]" in err
    logging.getLogger("appliance.test").info("x", extra={"ttfb_ms": 12})
    assert logsetup.flush()
    assert "INFO appliance.test: x [ttfb_ms=12]" in capsys.readouterr().err


def test_stderr_journal_logging_without_systemd_python(restore_root_logging, capsys, monkeypatch):
    monkeypatch.setattr(logsetup, "_sd_journal", None)
    assert setup_logging(environ={"JOURNAL_STREAM": "8:123"}) == "stderr-journal"
    logging.getLogger("appliance.test").error("boom", extra={"channel": "cabin"})
    assert logsetup.flush()
    assert "<3>appliance.test: boom [channel=cabin]" in capsys.readouterr().err


def test_a_stalled_log_sink_drops_and_counts_records_never_blocks(restore_root_logging, monkeypatch):
    """stderr is a pipe nobody reads (full): logging calls return at once, the records beyond the
    queue are dropped and counted, and the count is logged when the pipe is read again."""
    monkeypatch.setattr(logsetup, "QUEUE_RECORDS", 5)
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        while True:
            os.write(w, b"x" * 65536)            # fill the pipe
    except BlockingIOError:
        pass
    os.set_blocking(w, True)
    stream = os.fdopen(w, "w", buffering=1)
    monkeypatch.setattr(sys, "stderr", stream)
    setup_logging(environ={})
    t0 = time.monotonic()
    for i in range(200):
        logging.getLogger("appliance.test").warning("line %d", i)
    assert time.monotonic() - t0 < 1.0           # never waited on the stalled sink
    got = []
    reader = threading.Thread(target=lambda: got.extend(iter(lambda: os.read(r, 65536), b"")))
    reader.start()                               # the sink returns
    assert logsetup.flush()
    logging.getLogger("appliance.test").warning("after")
    assert logsetup.flush()
    logsetup.stop()                              # closes its descriptor of the pipe
    stream.close()
    reader.join(5)
    assert not reader.is_alive()
    os.close(r)
    lines = b"".join(got).decode().replace("x", "").splitlines()
    notes = [ln for ln in lines if "log records dropped while the log sink stalled" in ln]
    # one note each time the sink came back after drops: a full pipe may still take a short write
    # (the writer's first record) before it stalls for good, so the drops can be told in two notes
    counts = [int(ln.split(" log records dropped")[0].rsplit(" ", 1)[1]) for ln in notes]
    assert counts and all(c > 0 for c in counts), notes
    kept = [ln for ln in lines if "appliance.test: line" in ln]
    assert sum(counts) + len(kept) == 200 and 5 <= len(kept) <= 7   # what the queue held, plus the writer's
    assert lines[-1].endswith("appliance.test: after")


def test_bridge_maps_daemon_hooks_to_notify(notify_socket, monkeypatch):
    from appliance.messages.protocol import StatusReply
    from appliance.ops.bridge import SystemdBridge

    monkeypatch.setenv("WATCHDOG_USEC", "400000")
    b = SystemdBridge(extend_s=0.3)
    assert set(b.hooks()) == {"on_loading", "on_ready", "on_status", "on_heartbeat", "on_loop_beat", "worker_stage",
                              "on_reload", "on_stopping"}
    try:
        b.on_loading("loading the model")
        notify_socket.wait_count("EXTEND_TIMEOUT_USEC", 3, timeout=5)   # the keep-alive re-sends every 0.1 s
        ext = notify_socket.with_key("EXTEND_TIMEOUT_USEC")
        assert len(ext) >= 3 and all(m.fields["EXTEND_TIMEOUT_USEC"] == "300000" for m in ext)
        assert ext[0].fields["STATUS"] == "loading the model"
        b.on_heartbeat()
        b.on_ready()
        n_ext = len(notify_socket.with_key("EXTEND_TIMEOUT_USEC"))
        b.on_status(StatusReply(state="ready", backend="torch-cpu",
                                channels={"main": {"active": "r1", "queued": 2}, "cabin": {"active": None}},
                                last_rtf=0.5, last_ttfb_ms=321.0, throttle="reduced_channels", temperature_c=61.24,
                                health="degraded", conditions=[{"name": "throttled", "severity": "degraded", "for_s": 3.0,
                                                                "reason": "reduced_channels by thermal: temperature 61.2C"}]))
        for _ in range(6):                                # a worker and a loop beating every 0.1 s
            b.on_heartbeat()
            b.on_loop_beat()
            time.sleep(0.1)
        b.on_reload()
        b.reloaded()
        b.on_stopping()
        assert notify_socket.wait_for("STOPPING", timeout=5)
        assert len(notify_socket.with_key("EXTEND_TIMEOUT_USEC")) <= n_ext + 1   # stops once ready
        assert notify_socket.wait_count("WATCHDOG", 2, timeout=5)
        statuses = [m.fields["STATUS"] for m in notify_socket.with_key("STATUS")]
        assert ("ready; busy 1/2; rtf 0.50; ttfb 321 ms; 61.2C; throttle reduced_channels; "
                "degraded: throttled (reduced_channels by thermal: temperature 61.2C)") in statuses
        keys = [k for k in notify_socket.keys_in_order() if k not in ("WATCHDOG", "EXTEND_TIMEOUT_USEC")]
        assert keys == ["READY", "STATUS", "RELOADING", "READY", "STOPPING"]
    finally:
        b.close()
