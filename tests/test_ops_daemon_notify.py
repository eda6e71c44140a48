"""The real daemon (tiny checkpoint, WAV output) under a stand-in systemd: NOTIFY_SOCKET is a
test datagram socket, WATCHDOG_USEC is set. Asserts the start-up sequence, READY, the watchdog
cadence, STATUS after a request, RELOADING then READY on SIGHUP, STOPPING and a clean exit on
SIGTERM (``hooks.build_hooks`` wires :class:`~appliance.ops.bridge.SystemdBridge`)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.fixtures_service import service_config

ROOT = Path(__file__).resolve().parent.parent

def _speak(path: Path, text: str, timeout: float = 60.0) -> list:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(json.dumps({"type": "speak", "text": text, "seed": 3}).encode() + b"\n")
        events, buf = [], b""
        while True:
            chunk = s.recv(65536)
            assert chunk, f"connection closed after {events}"
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                ev = json.loads(line)
                events.append(ev)
                if ev["type"] in ("done", "error"):
                    return events


def test_daemon_under_notify_socket(tiny_ckpt, tmp_path, notify_socket):
    cfg = service_config(tiny_ckpt, tmp_path, health={"at_start": True})    # the start systemd sees
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LISTEN_", "WATCHDOG_"))}
    env.update(notify_socket.env, WATCHDOG_USEC="1000000", PYTHONUNBUFFERED="1")
    log = tmp_path / "daemon.log"
    with open(log, "wb") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "appliance", "-v", "serve", "--config", str(cfg_path)],
                                cwd=str(ROOT), env=env, stdout=logf, stderr=subprocess.STDOUT)
    try:
        ready = notify_socket.wait_for("READY", timeout=120)
        first = notify_socket.messages[0]
        assert "EXTEND_TIMEOUT_USEC" in first.fields and first.fields["STATUS"] == "loading the model"
        assert int(first.fields["EXTEND_TIMEOUT_USEC"]) >= 10_000_000
        assert ready.fields["STATUS"] == "ready"

        pings = notify_socket.wait_count("WATCHDOG", 4, timeout=10)
        gaps = [b.t - a.t for a, b in zip(pings, pings[1:])]
        assert all(0.25 < g < 1.2 for g in gaps), gaps        # WATCHDOG_USEC/2 = 0.5 s, with slack

        events = _speak(Path(cfg["service"]["socket"]), "你好，今天天气很好。")
        assert events[-1]["type"] == "done", events
        deadline = time.monotonic() + 10
        while not any("rtf" in m.fields.get("STATUS", "") for m in notify_socket.messages):
            assert time.monotonic() < deadline, [m.raw for m in notify_socket.messages]
            time.sleep(0.05)

        proc.send_signal(signal.SIGHUP)
        reload = notify_socket.wait_for("RELOADING", timeout=10)
        assert reload.fields["MONOTONIC_USEC"].isdigit()
        again = notify_socket.wait_count("READY", 2, timeout=10)[1]
        assert again.t >= reload.t and again.fields["STATUS"].startswith("ready")

        proc.send_signal(signal.SIGTERM)
        stop = notify_socket.wait_for("STOPPING", timeout=10)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
        order = [k for k in notify_socket.keys_in_order() if k not in ("WATCHDOG", "EXTEND_TIMEOUT_USEC")]
        assert order[0] == "READY" and order.index("RELOADING") < len(order) - 1 - order[::-1].index("READY") < order.index("STOPPING")
        assert stop.t > ready.t
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
