"""``WATCHDOG=1`` follows progress, seen by a real ``NOTIFY_SOCKET`` listener: about every second
while the worker and the event loop run (no gap over 2 s, idle or speaking); a worker blocked in
one decode step past ``safety.stall_s`` stops the pings with one line naming that stage, and they
resume once it moves; a whole process stopped (SIGSTOP) for two thirds of ``WatchdogSec`` is
pinged again as soon as it continues, so the gap stays below ``WatchdogSec`` (the unit's 20 s in
30 s scaled to 4 s in 6 s: the same mechanism, a cheaper test). The worker is blocked by the test
runner wrapper (tests/slow_runner.py: one decode step of a slow sentence takes 6 s)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests import slow_runner
from tests.fixtures_service import Conn, service_config
from tests.waits import wait_for, wait_log

ROOT = Path(__file__).resolve().parent.parent


def _start(tmp_path, cfg: dict, notify_socket, watchdog_usec: int, prefix: list) -> tuple[subprocess.Popen, Path]:
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LISTEN_", "WATCHDOG_"))}
    env.update(notify_socket.env, WATCHDOG_USEC=str(watchdog_usec), PYTHONUNBUFFERED="1")
    log = tmp_path / "daemon.log"
    with open(log, "wb") as logf:
        proc = subprocess.Popen(prefix + [sys.executable, "-m", "appliance", "serve", "--config", str(cfg_path)],
                                cwd=str(ROOT), env=env, stdout=logf, stderr=subprocess.STDOUT)
    return proc, log


def _pings(notify_socket, t0: float, t1: float) -> list[float]:
    return [t0] + [m.t for m in notify_socket.with_key("WATCHDOG") if t0 <= m.t <= t1] + [t1]


def _gaps(ts: list[float]) -> list[float]:
    return [b - a for a, b in zip(ts, ts[1:])]


def test_pings_follow_the_worker_and_stop_while_it_is_stuck(tiny_ckpt, tmp_path, notify_socket):
    cfg = service_config(tiny_ckpt, tmp_path, safety={"stall_s": 2.0})
    # the 3rd decode step of every sentence takes 6 s
    proc, log = _start(tmp_path, cfg, notify_socket, 30_000_000, slow_runner.argv(0.0, 3, 6000.0, 0))
    read = lambda: log.read_text(errors="replace")      # noqa: E731
    try:
        notify_socket.wait_for("READY", timeout=120)
        t0 = time.monotonic()
        n = len(notify_socket.with_key("WATCHDOG"))
        notify_socket.wait_count("WATCHDOG", n + 3, timeout=10)     # idle: the worker waits for work
        gaps = _gaps(_pings(notify_socket, t0, time.monotonic()))
        assert max(gaps) < 2.0, gaps
        c = Conn(Path(cfg["service"]["socket"]), 60)
        c.send({"type": "speak", "text": "你好。", "id": "stuck", "seed": 1})
        t2 = time.monotonic()
        wait_log(read, "withholding WATCHDOG=1", 30)
        wait_log(read, "pinging resumes", 30)                   # the 6 s step returned
        n = len(notify_socket.with_key("WATCHDOG"))
        notify_socket.wait_count("WATCHDOG", n + 2, timeout=10)
        gaps = _gaps(_pings(notify_socket, t2, time.monotonic()))
        assert max(gaps) > 3.0, gaps                                 # withheld while stuck past 2 s
        text = read()
        assert text.count("withholding WATCHDOG=1") == 1, text[-3000:]
        line = next(x for x in text.splitlines() if "withholding WATCHDOG=1" in x)
        assert "the worker made no progress for" in line and "stuck in a decode step of stuck" in line, line
        c.close()
    finally:
        proc.terminate()
        assert proc.wait(60) == 0, log.read_text()[-3000:]


def test_pings_every_second_while_speaking_and_a_stopped_process_is_pinged_before_watchdog_sec(
        tiny_ckpt, tmp_path, notify_socket):
    cfg = service_config(tiny_ckpt, tmp_path, synthesis={"max_new_tokens": 300})
    proc, log = _start(tmp_path, cfg, notify_socket, 6_000_000, [])
    try:
        notify_socket.wait_for("READY", timeout=120)
        t0 = time.monotonic()
        c = Conn(Path(cfg["service"]["socket"]), 120)
        c.send({"type": "speak", "text": "你好，今天天气很好。我们一起去公园散步吧。", "id": "normal", "seed": 3,
                "params": {"min_new_tokens": 300, "max_new_tokens": 300}})
        assert c.events(("done", "error"))[-1]["type"] == "done"
        c.close()
        n = len(notify_socket.with_key("WATCHDOG"))
        # and idle again: five more pings, so the window holds enough of them even where the tiny
        # model speaks the sentence in about a second (a quiet box)
        notify_socket.wait_count("WATCHDOG", n + 5, timeout=15)
        t1 = time.monotonic()
        gaps = _gaps(_pings(notify_socket, t0, t1))
        assert len(gaps) >= 5 and max(gaps) < 2.0 and min(gaps[1:-1]) > 0.5, gaps   # about every second
        proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        time.sleep(4.0)                                  # the stall itself (2/3 of WatchdogSec), not a wait
        proc.send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        wait_for(lambda: [m for m in notify_socket.with_key("WATCHDOG") if m.t > resumed], 10, "a ping after SIGCONT")
        gaps = _gaps(_pings(notify_socket, stopped - 2.0, time.monotonic()))
        assert max(gaps) < 6.0, gaps                     # never as long as WatchdogSec
        first = min(m.t for m in notify_socket.with_key("WATCHDOG") if m.t > resumed)
        assert first - resumed < 1.5, first - resumed    # the first heartbeat after it pings
        assert "withholding" not in log.read_text()
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        assert proc.wait(60) == 0, log.read_text()[-3000:]
