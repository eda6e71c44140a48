"""The request socket against its neighbours: connection caps, an idle timeout, a budget for
malformed lines, a log that summarises a flood, running out of file descriptors, the socket's
group and directory. Real daemon, real UNIX sockets, real client processes."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time

from tests.fixtures_service import ROOT, launch_daemon, service_config
from tests.waits import wait_for, wait_log

LEVELED = re.compile(r"^\S+ \S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ", re.M)


def _raw(path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))          # blocking: waits while the listen backlog is full
    s.settimeout(30)
    return s


def _lines_until_eof(s: socket.socket) -> list[dict]:
    buf = b""
    while True:
        data = s.recv(65536)
        if not data:
            return [json.loads(x) for x in buf.split(b"\n") if x.strip()]
        buf += data


def _read_until(s: socket.socket, kind: str) -> list[dict]:
    """Events on ``s`` up to the first of type ``kind``."""
    buf, out = b"", []
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            out.append(json.loads(line))
            if out[-1].get("type") == kind:
                return out
        data = s.recv(65536)
        assert data, f"EOF before {kind}: {out[-3:]}"
        buf += data


def _say(sock_path, text: str, env=None) -> dict:
    """``chattts-appliance say --json`` in its own process (another client pid); its done event."""
    r = subprocess.run([sys.executable, "-m", "appliance", "say", "--socket", str(sock_path), "--json", text],
                       cwd=str(ROOT), capture_output=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return [json.loads(x) for x in r.stdout.splitlines() if x.strip()][-1]


def test_idle_connections_and_a_flood_of_malformed_lines_leave_a_client_served(tiny_ckpt, tmp_path):
    cfg = service_config(tiny_ckpt, tmp_path, service={
        "max_connections": 64, "max_connections_per_client": 16, "max_bad_lines_per_min": 30,
        "bad_input_log_s": 3, "socket_mode": 0o660})
    d = launch_daemon(tmp_path / "d", cfg)
    held: list[socket.socket] = []
    try:
        base = _say(d.socket, "你好。")                      # the usual first-audio time, before any load
        assert base["type"] == "done"
        t0_log = len(d.log())
        held = [_raw(d.socket) for _ in range(200)]        # one process: 16 stay, 184 are refused
        refused = []
        for s in held[16:]:
            evs = _lines_until_eof(s)
            refused.append(evs)
        assert all(len(e) == 1 and e[0]["type"] == "error" and e[0]["code"] == "busy" for e in refused), refused[:2]
        assert "max_connections_per_client 16" in refused[0][0]["message"]
        kept = held[:16]
        flood = b"this is not a request\n" * 2000
        answers: dict[int, list] = {}

        def flood_one(i: int, s: socket.socket) -> None:
            s.sendall(flood)
            s.sendall(b'{"type": "status"}\n')            # a valid line is still served
            answers[i] = _read_until(s, "status")

        threads = [threading.Thread(target=flood_one, args=(i, s)) for i, s in enumerate(kept)]
        for t in threads:
            t.start()
        done = _say(d.socket, "你好。")                      # meanwhile, another client speaks
        for t in threads:
            t.join(120)
        assert done["type"] == "done" and done["audio_s"] > 0
        assert done["ttfb_ms"] < max(10 * base["ttfb_ms"], 5000), (base["ttfb_ms"], done["ttfb_ms"])
        for i, evs in answers.items():
            codes = [e.get("code") for e in evs if e["type"] == "error"]
            assert 30 <= codes.count("bad_request") <= 32, (i, len(codes))    # the budget (+ what refilled)
            assert codes.count("rate_limited") == 1, codes[-3:]
            assert len(codes) < 40, len(codes)                                  # 2000 lines sent, the rest dropped
        log = wait_log(d.log, "malformed lines", 30)
        flood_log = log[t0_log:]
        assert "Traceback" not in flood_log
        leveled = [m.group(1) for m in LEVELED.finditer(flood_log)]
        info_up = [lv for lv in leveled if lv != "DEBUG"]
        print(f"ttfb before {base['ttfb_ms']:.0f} ms, during the flood {done['ttfb_ms']:.0f} ms; log lines at "
              f"INFO+ {len(info_up)} of {len(leveled)}")
        # 32,000 malformed lines and 184 refused connections: at most one summary line per
        # client (16) plus one for the refusals per 3 s interval, and the two requests' own lines
        assert len(info_up) <= 60, "\n".join(x for x in flood_log.splitlines() if " DEBUG " not in x)[-4000:]
        assert re.search(r"client #\d+ \(pid \d+.*\): \d+ malformed lines", flood_log), flood_log[-3000:]
        assert re.search(r"socket: 184 connections refused", flood_log), flood_log[-3000:]
    finally:
        for s in held:
            s.close()
        assert d.stop() == 0, d.log()[-3000:]


def test_an_idle_connection_is_closed_and_a_busy_one_kept(tiny_ckpt, tmp_path):
    cfg = service_config(tiny_ckpt, tmp_path, service={"idle_timeout_s": 1.0})
    d = launch_daemon(tmp_path / "d", cfg)
    try:
        idle = _raw(d.socket)
        t0 = time.monotonic()
        assert idle.recv(100) == b""                              # closed by the daemon, no reply
        assert 0.9 <= time.monotonic() - t0 < 20
        busy = _raw(d.socket)
        busy.sendall(json.dumps({"text": "今天天气很好，我们去公园散步吧。" * 3, "id": "long"}).encode() + b"\n")
        evs = _read_until(busy, "done")                            # longer than 1 s: in flight, kept
        assert evs[-1]["id"] == "long"
    finally:
        assert d.stop() == 0, d.log()[-3000:]


def test_field_errors_echo_the_id_and_the_socket_has_its_group(tiny_ckpt, tmp_path):
    group = 4242 if os.geteuid() == 0 else os.getgid()
    cfg = service_config(tiny_ckpt, tmp_path, service={"socket_group": str(group)})
    (tmp_path / "run").mkdir()
    os.chmod(tmp_path / "run", 0o777)
    d = launch_daemon(tmp_path / "d", cfg)
    try:
        st, dst = os.stat(d.socket), os.stat(d.socket.parent)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, group)
        assert (stat.S_IMODE(dst.st_mode), dst.st_gid) == (0o750, group)
        ev = d.request({"id": "abc", "text": "hi", "priority": "urgent"})[-1]
        assert (ev["type"], ev["code"], ev["id"]) == ("error", "bad_request", "abc")
        ev = d.request(b'{"id": "x\\u0001y", "text": 5}')[-1]         # an invalid id is not echoed
        assert (ev["code"], ev["id"]) == ("bad_request", None)
    finally:
        assert d.stop() == 0, d.log()[-3000:]


def _events(s: socket.socket, kind: str) -> list[dict]:
    """Events on ``s`` up to the first of type ``kind`` or EOF."""
    buf, out = b"", []
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            out.append(json.loads(line))
            if out[-1].get("type") == kind:
                return out
        data = s.recv(65536)
        if not data:
            return out
        buf += data


def test_out_of_file_descriptors_refuses_new_clients_and_serves_the_others(tiny_ckpt, tmp_path):
    cfg = service_config(tiny_ckpt, tmp_path, service={"max_connections": 4000, "max_connections_per_client": 4000,
                                                       "bad_input_log_s": 2})
    d = launch_daemon(tmp_path / "d", cfg, argv_prefix=["prlimit", "--nofile=200:200", "--"])
    held: list[socket.socket] = []
    try:
        first = _raw(d.socket)
        refusal = None
        for _ in range(400):                                   # until the daemon runs out
            s = _raw(d.socket)
            held.append(s)
            s.sendall(b'{"type": "status"}\n')
            last = (_events(s, "status") or [{}])[-1]
            if last.get("type") != "status":
                refusal = last
                break
        assert refusal is not None and refusal.get("code") == "busy", (len(held), refusal)
        assert "out of file descriptors" in refusal["message"]
        first.sendall(b'{"type": "status"}\n')                 # a client already in is served
        assert _events(first, "status")[-1]["state"] == "ready"
        log = wait_log(d.log, "connections refused: out of file descriptors", 30)
        assert "Traceback" not in log and "socket.accept() out of system resource" not in log
        for s in held:
            s.close()
        held.clear()
        ev = wait_for(lambda: _try_status(d.socket), 30, "a new client served once descriptors are free")
        assert ev["type"] == "status"
    finally:
        for s in held:
            s.close()
        assert d.stop() == 0, d.log()[-3000:]


def _try_status(path):
    try:
        s = _raw(path)
        s.sendall(b'{"type": "status"}\n')
        return (_events(s, "status") or [{}])[-1].get("type") == "status" and {"type": "status"}
    except OSError:
        return None
