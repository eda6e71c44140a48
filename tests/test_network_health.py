"""Every network service in health, and bounded: a real mosquitto that hands the box's client id
to another client (health names MQTT, the back-off grows), an expired broker certificate (health
says why), a missing CA bundle (the box starts, MQTT waits for it and connects once it is there);
a Wyoming request under ``alerts_only`` answered within ``wyoming.start_timeout_s`` by the real
``wyoming`` client, and a Wyoming client that stops reading dropped at ``wyoming.write_timeout_s``."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.fixtures_mqtt import TlsFiles, free_port, make_tls_files, mqtt_section
from tests.fixtures_service import launch_daemon, service_config
from tests.test_ops_verdict import board
from tests.waits import wait_for, wait_log


def _conditions(d) -> dict:
    return {c["name"]: c["reason"] for c in d.request({"type": "status"})[-1]["conditions"]}


def _mqtt_cfg(tiny_ckpt, tmp_path, broker_port: int, **mqtt) -> dict:
    sec = mqtt_section(type("B", (), {"port": broker_port})(), **mqtt)
    return service_config(tiny_ckpt, tmp_path, mqtt=sec)


def test_a_client_id_takeover_is_in_health_with_a_growing_back_off(tiny_ckpt, tmp_path, mqtt_broker_factory):
    import paho.mqtt.client as paho

    broker = mqtt_broker_factory()
    cid = f"box-{free_port()}"
    cfg = _mqtt_cfg(tiny_ckpt, tmp_path, broker.port, client_id=cid, reconnect_min_s=1, reconnect_max_s=8)
    d = launch_daemon(tmp_path / "d", cfg)
    stop = threading.Event()

    def kicker() -> None:          # another client with the box's id, connecting every 0.5 s
        while not stop.is_set():
            c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=cid)
            try:
                c.connect("127.0.0.1", broker.port, keepalive=30)
                c.loop(0.2)
                c.disconnect()
            except OSError:
                pass
            stop.wait(0.5)

    try:
        wait_log(d.log, "mqtt: connected", 30)
        t = threading.Thread(target=kicker, daemon=True)
        t0 = time.monotonic()
        t.start()
        wait_log(d.log, "next try in 4 s", 60, alive=d.alive)
        conds = _conditions(d)
        assert "mqtt" in conds and f"client id '{cid}'" in conds["mqtt"], conds
        wait_log(d.log, "next try in 8 s", 60, alive=d.alive)
        spent = time.monotonic() - t0
        # without the back-off the box would take its id back about once a second
        assert d.log().count("mqtt: connected") <= 2 + spent / 2, (spent, d.log().count("mqtt: connected"))
        stop.set()
        t.join(5)
        wait_for(lambda: "mqtt" not in _conditions(d), 60, "the mqtt condition cleared once the id is free")
    finally:
        stop.set()
        assert d.stop() == 0, d.log()[-3000:]


def _expired_tls(tmp: Path) -> TlsFiles:
    """A CA and a server certificate that expired 8 days ago (signed under libfaketime)."""
    lib = next(iter(sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))), None)
    if lib is None or shutil.which("openssl") is None:
        pytest.skip("needs openssl and libfaketime")
    tls = make_tls_files(tmp)
    env = dict(os.environ, LD_PRELOAD=lib, FAKETIME="-10d")
    subprocess.run(["openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                    "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "server.pem"],
                   cwd=tmp, env=env, check=True, capture_output=True)
    return tls


def test_an_expired_broker_certificate_is_named_in_health(tiny_ckpt, tmp_path, mqtt_broker_factory):
    tls = _expired_tls(tmp_path / "tls")
    out = subprocess.run(["openssl", "x509", "-in", str(tls.cert), "-noout", "-checkend", "0"], capture_output=True)
    assert out.returncode == 1                                   # it has expired
    broker = mqtt_broker_factory(tls=tls)
    cfg = _mqtt_cfg(tiny_ckpt, tmp_path, broker.port, tls=True, ca_file=str(tls.ca))
    d = launch_daemon(tmp_path / "d", cfg)
    try:
        reason = wait_for(lambda: _conditions(d).get("mqtt"), 30, "the mqtt condition")
        assert "certificate has expired" in reason, reason
        assert "certificate has expired" in d.log() and "Traceback" not in d.log()
        assert d.request({"type": "status"})[-1]["state"] == "ready"       # the box serves
    finally:
        assert d.stop() == 0, d.log()[-3000:]


def test_a_missing_ca_file_degrades_mqtt_until_it_is_there(tiny_ckpt, tmp_path, mqtt_broker_factory):
    tls = make_tls_files(tmp_path / "tls")
    broker = mqtt_broker_factory(tls=tls)
    ca = tmp_path / "later" / "ca.pem"
    cfg = _mqtt_cfg(tiny_ckpt, tmp_path, broker.port, tls=True, ca_file=str(ca))
    d = launch_daemon(tmp_path / "d", cfg)
    try:
        conds = wait_for(lambda: _conditions(d), 30, "a condition")
        assert "mqtt" in conds and f"{ca} does not exist" in conds["mqtt"], conds
        ca.parent.mkdir()
        shutil.copy(tls.ca, ca)
        wait_log(d.log, "mqtt: connected", 30, alive=d.alive)
        wait_for(lambda: "mqtt" not in _conditions(d), 30, "the mqtt condition cleared")
    finally:
        assert d.stop() == 0, d.log()[-3000:]


# ----------------------------------------------------------------------------------- Wyoming


def _wy(tiny_ckpt, tmp_path, **kw) -> tuple[dict, str]:
    port = free_port()
    root = board(tmp_path / "board", temp_c=93.0) if kw.pop("hot", False) else None
    wy = {"enabled": True, "uris": [f"tcp://127.0.0.1:{port}"], **kw}
    extra = {"telemetry": {"source": "sysfs", "interval_s": 0.2, "root": str(root)},
             "throttle": {"min_dwell_s": 1.0}} if root is not None else {}
    cfg = service_config(tiny_ckpt, tmp_path, wyoming=wy, **extra)
    if root is not None:
        cfg["throttle"].update({"rtf_reduce": 100.0, "rtf_queue": 100.0})
    return cfg, f"tcp://127.0.0.1:{port}"


def test_a_wyoming_request_under_alerts_only_hears_back_within_the_bound(tiny_ckpt, tmp_path):
    from wyoming.client import AsyncClient
    from wyoming.tts import Synthesize

    cfg, uri = _wy(tiny_ckpt, tmp_path, hot=True, start_timeout_s=2.0)
    d = launch_daemon(tmp_path / "d", cfg)

    async def ask() -> tuple[float, list]:
        async with AsyncClient.from_uri(uri) as c:
            t0 = time.monotonic()
            await c.write_event(Synthesize(text="Is the garage door closed?").event())
            got = []
            while True:
                ev = await asyncio.wait_for(c.read_event(), 60)
                if ev is None:
                    return time.monotonic() - t0, got
                got.append(ev)
                if ev.type == "error":
                    return time.monotonic() - t0, got

    try:
        wait_for(lambda: d.request({"type": "status"})[0]["throttle"] == "alerts_only", 20, "alerts_only")
        try:
            took, evs = asyncio.run(ask())
        except asyncio.TimeoutError:
            raise AssertionError("no answer: " + "\n".join(x for x in d.log().splitlines()[-60:]))
        err = evs[-1]
        assert err.type == "error" and err.data["code"] == "throttled", [e.type for e in evs]
        assert "alerts_only by thermal" in err.data["text"] and "wyoming.start_timeout_s" in err.data["text"]
        assert took < 2.0 + 5.0, took                                # the bound, plus a loaded host's slack
        assert "audio-chunk" not in [e.type for e in evs]
        wait_for(lambda: all(c["queued"] == 0 for c in d.request({"type": "status"})[0]["channels"].values()),
                 20, "the request cancelled, not left queued")
    finally:
        assert d.stop() == 0, d.log()[-3000:]


def test_a_wyoming_client_that_stops_reading_is_dropped_and_its_request_cancelled(tiny_ckpt, tmp_path):
    cfg, uri = _wy(tiny_ckpt, tmp_path, write_timeout_s=2.0)
    cfg["synthesis"]["max_new_tokens"] = 400
    d = launch_daemon(tmp_path / "d", cfg)
    port = int(uri.rsplit(":", 1)[1])
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)      # a frozen client: nothing read
    try:
        wait_for(lambda: _connects(port), 30, "the wyoming port")
        s.connect(("127.0.0.1", port))
        text = "今天天气很好，我们去公园散步吧。" * 8
        s.sendall(json.dumps({"type": "synthesize", "data": {"text": text}}).encode() + b"\n")
        log = wait_log(d.log, "took no data for 2 s (wyoming.write_timeout_s): disconnected", 120, alive=d.alive)
        assert "Traceback" not in log
        # its request: cancelled if it was still being made (the tiny model may have finished it)
        wait_for(lambda: all(c["active"] is None for c in d.request({"type": "status"})[0]["channels"].values()),
                 30, "its request ended")
        s.settimeout(30)
        try:                                                     # the box's end is closed: EOF or a reset
            while s.recv(65536):
                pass
        except ConnectionResetError:
            pass
    finally:
        s.close()
        assert d.stop() == 0, d.log()[-3000:]


def _connects(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 1):
            return True
    except OSError:
        return False


def test_two_boxes_with_one_mdns_name_are_both_discoverable(tiny_ckpt, tmp_path):
    pytest.importorskip("zeroconf")
    from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

    async def resolve(name: str, timeout_ms: int = 5000):
        zc = AsyncZeroconf()
        try:
            info = AsyncServiceInfo("_wyoming._tcp.local.", f"{name}._wyoming._tcp.local.")
            return info if await info.async_request(zc.zeroconf, timeout_ms) else None
        finally:
            await zc.async_close()

    async def probe() -> bool:     # does mDNS work on this machine at all?
        zc = AsyncZeroconf()
        info = AsyncServiceInfo("_wyoming._tcp.local.", f"probe-{os.getpid()}._wyoming._tcp.local.", port=1,
                                addresses=[socket.inet_aton("127.0.0.1")])
        try:
            await zc.async_register_service(info)
            return await resolve(f"probe-{os.getpid()}", 2000) is not None
        finally:
            await zc.async_close()

    if not asyncio.run(probe()):
        pytest.skip("mDNS multicast does not work on this machine")
    name = f"chattts-twin-{free_port()}"
    boxes = []
    try:
        for k in (1, 2):
            cfg, uri = _wy(tiny_ckpt, tmp_path / f"b{k}", zeroconf=True, zeroconf_name=name)
            boxes.append((launch_daemon(tmp_path / f"b{k}" / "d", cfg), int(uri.rsplit(":", 1)[1])))
            wait_log(boxes[-1][0].log, "wyoming: advertised as", 60, alive=boxes[-1][0].alive)
        (d1, p1), (d2, p2) = boxes
        first, second = asyncio.run(resolve(name)), asyncio.run(resolve(f"{name}-2"))
        assert first is not None and first.port == p1, d1.log()[-2000:]
        assert second is not None and second.port == p2, d2.log()[-2000:]
        conds = _conditions(d2)
        assert "mdns" in conds and f"advertised as {name}-2" in conds["mdns"], conds
        assert "mdns" not in _conditions(d1)
    finally:
        for d, _ in boxes:
            assert d.stop() == 0, d.log()[-3000:]


def test_an_unknown_ca_is_named_and_a_replaced_ca_file_is_read_on_sighup(tiny_ckpt, tmp_path, mqtt_broker_factory):
    import signal

    tls, other = make_tls_files(tmp_path / "tls"), make_tls_files(tmp_path / "other")
    broker = mqtt_broker_factory(tls=tls)
    ca = tmp_path / "ca.pem"
    shutil.copy(other.ca, ca)                                    # not the broker's CA
    cfg = _mqtt_cfg(tiny_ckpt, tmp_path, broker.port, tls=True, ca_file=str(ca))
    d = launch_daemon(tmp_path / "d", cfg)
    try:
        reason = wait_for(lambda: _conditions(d).get("mqtt"), 30, "the mqtt condition")
        assert "CA this box does not trust" in reason and "mqtt.ca_file" in reason, reason
        shutil.copy(tls.ca, ca)                                  # the right one, then SIGHUP
        d.proc.send_signal(signal.SIGHUP)
        wait_log(d.log, "mqtt: connected", 30, alive=d.alive)
        wait_for(lambda: "mqtt" not in _conditions(d), 30, "the mqtt condition cleared")
    finally:
        assert d.stop() == 0, d.log()[-3000:]


def test_keep_alive_sets_tcp_keepalive_and_a_bound_on_unacknowledged_data():
    from appliance.transports.wyoming_sink import keep_alive

    async def check() -> dict:
        got: dict = {}

        async def on_client(reader, writer):
            keep_alive(writer, "t", idle_s=15.0, unacked_s=10.0)
            s = writer.get_extra_info("socket")
            got.update(keepalive=s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                       idle=s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                       intvl=s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                       cnt=s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                       user_timeout=s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT))
            writer.close()

        srv = await asyncio.start_server(on_client, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        r, w = await asyncio.open_connection("127.0.0.1", port)
        await r.read()
        w.close()
        srv.close()
        return got

    assert asyncio.run(check()) == {"keepalive": 1, "idle": 15, "intvl": 5, "cnt": 3, "user_timeout": 10000}
