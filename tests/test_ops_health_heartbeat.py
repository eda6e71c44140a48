"""A long health check on the worker thread keeps the watchdog fed: heartbeats come from every
decode step of the engine, not only from the scheduler loop (a health check longer than
WatchdogSec used to stop the pings and get the service killed)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.fixtures_service import service_config

ROOT = Path(__file__).resolve().parent.parent


def test_watchdog_pings_continue_during_a_long_health_check(tiny_ckpt, tmp_path, notify_socket):
    cfg = service_config(tiny_ckpt, tmp_path, model={"max_seq_len": 2048},
                         synthesis={"max_new_tokens": 1800, "min_new_tokens": 1800},
                         health={"at_start": False, "max_rtf": 100.0, "max_ttfb_ms": 1e6})
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LISTEN_", "WATCHDOG_"))}
    # WatchdogSec=2 s (the unit ships 30 s): pings every 1 s, and the gap that would get the service
    # killed is 2 s; 1 s left 0.5 s of scheduling slack, which a loaded 2-core host used up (1.23 s)
    env.update(notify_socket.env, WATCHDOG_USEC="2000000", PYTHONUNBUFFERED="1")
    with open(tmp_path / "daemon.log", "wb") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--config", str(cfg_path)],
                                cwd=str(ROOT), env=env, stdout=logf, stderr=subprocess.STDOUT)
    try:
        notify_socket.wait_for("READY", timeout=120)
        t0 = time.monotonic()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(120)
            s.connect(cfg["service"]["socket"])
            s.sendall(b'{"type": "health"}\n')
            buf = b""
            while b"\n" not in buf:
                chunk = s.recv(65536)
                assert chunk
                buf += chunk
        t1 = time.monotonic()
        reply = json.loads(buf.split(b"\n")[0])
        assert reply["type"] == "health", reply
        assert t1 - t0 > 2.5, f"health check too short ({t1 - t0:.1f} s) to test the watchdog"
        pings = [m.t for m in notify_socket.messages if "WATCHDOG" in m.fields]
        during = [t0] + [t for t in pings if t0 <= t <= t1] + [t1]
        gaps = [b - a for a, b in zip(during, during[1:])]
        assert max(gaps) < 2.0, f"watchdog gap {max(gaps):.2f} s during the health check: {gaps}"
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
