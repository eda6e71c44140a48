"""A Wyoming client frozen by a firewall rule mid-stream is dropped within ``wyoming.write_timeout_s``
and its request cancelled, while another client is still served.

Real parts: a network namespace and a veth pair made by the test (10.x addresses on that pair
only), the daemon's Wyoming server on the host-side veth address, a client in the namespace
speaking Wyoming over a plain socket and reading everything it gets, then ``iptables -j DROP`` on
INPUT and OUTPUT inside the namespace: no data, no ACK, no RST reaches the box from then on. Without
the bounds (write timeout, ``TCP_USER_TIMEOUT``) the box's kernel retransmits for about 15 min
and the request goes on for nobody. Needs root (CAP_NET_ADMIN), ``ip`` (iproute2) and
``iptables``: skipped with the reason otherwise. The namespace and the veth are deleted in a
``finally``.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from tests.fixtures_mqtt import free_port
from tests.fixtures_service import launch_daemon, service_config
from tests.waits import wait_for, wait_log

CLIENT = r"""
import json, socket, sys
host, port, text = sys.argv[1], int(sys.argv[2]), sys.argv[3]
s = socket.create_connection((host, port), 30)
s.sendall(json.dumps({"type": "synthesize", "data": {"text": text}}).encode() + b"\n")
s.settimeout(600)
seen, told = b"", False
while True:
    try:
        b = s.recv(65536)
    except OSError as e:
        print("ended:", e, flush=True)
        break
    if not b:
        print("ended: eof", flush=True)
        break
    if not told:
        seen = (seen + b)[-4096:]
        if b'"audio-chunk"' in seen:
            print("streaming", flush=True)
            told = True
"""


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)


class Netns:
    """A namespace ``name`` holding one end of a veth pair; the host keeps the other end, with
    ``host_ip``/30 on it, the namespace ``ns_ip``/30. Nothing else is touched."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.name, self.host_if, self.ns_if = f"chtts-fw-{tag}", f"cfw{tag}h", f"cfw{tag}n"
        used = _sh("ip", "-o", "addr", "show").stdout
        third = next((n for n in range(tag % 200, 256) if f"10.213.{n}." not in used), None)
        if third is None:
            pytest.skip("no free 10.213.x.0/30 for the test's veth pair")
        self.host_ip, self.ns_ip = f"10.213.{third}.1", f"10.213.{third}.2"
        self.made = False

    def make(self) -> None:
        """Raises: pytest.skip.Exception where namespaces, veth or iptables cannot be used."""
        if shutil.which("ip") is None or shutil.which("iptables") is None:
            pytest.skip("needs ip (iproute2) and iptables")
        r = _sh("ip", "netns", "add", self.name)
        if r.returncode != 0:
            pytest.skip(f"cannot make a network namespace (needs CAP_NET_ADMIN): {r.stderr.strip()}")
        self.made = True
        ns = ("ip", "-n", self.name)
        for cmd in (("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if),
                    ("ip", "link", "set", self.ns_if, "netns", self.name),
                    ("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if),
                    ("ip", "link", "set", self.host_if, "up"),
                    ns + ("addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if),
                    ns + ("link", "set", self.ns_if, "up"), ns + ("link", "set", "lo", "up")):
            r = _sh(*cmd)
            if r.returncode != 0:
                pytest.skip(f"cannot set up the veth pair ({' '.join(cmd)}): {r.stderr.strip()}")
        r = self.iptables("-S")
        if r.returncode != 0:
            pytest.skip(f"iptables does not work in a namespace here: {r.stderr.strip()}")

    def iptables(self, *args: str) -> subprocess.CompletedProcess:
        return _sh("ip", "netns", "exec", self.name, "iptables", "-w", *args)

    def freeze(self) -> None:
        for chain in ("INPUT", "OUTPUT"):
            r = self.iptables("-A", chain, "-j", "DROP")
            assert r.returncode == 0, r.stderr

    def remove(self) -> None:
        if self.made:
            _sh("ip", "netns", "del", self.name)         # takes its veth end, and so the pair, along
        if self.host_if in _sh("ip", "-o", "link", "show").stdout:
            _sh("ip", "link", "del", self.host_if)


def _active(d) -> list:
    return [c["active"] for c in d.request({"type": "status"})[0]["channels"].values() if c["active"] is not None]


def test_a_client_frozen_by_a_firewall_rule_is_dropped_within_the_bound(tiny_ckpt, tmp_path):
    from wyoming.client import AsyncClient
    from wyoming.tts import Synthesize

    net = Netns()
    client = d = None
    try:
        net.make()
        port = free_port()
        cfg = service_config(tiny_ckpt, tmp_path, wyoming={
            "enabled": True, "uris": [f"tcp://{net.host_ip}:{port}"], "write_timeout_s": 2.0, "keepalive_s": 2.0})
        cfg["synthesis"]["max_new_tokens"] = 400
        cfg["service"]["max_text_chars"] = 2000
        d = launch_daemon(tmp_path / "d", cfg)
        wait_log(d.log, f"wyoming: listening on tcp://{net.host_ip}:{port}", 60, alive=d.alive)
        text = "今天天气很好，我们去公园散步吧。" * 60       # 60 sentences: still being made at the freeze
        client = subprocess.Popen(["ip", "netns", "exec", net.name, sys.executable, "-c", CLIENT,
                                   net.host_ip, str(port), text], stdout=subprocess.PIPE, text=True)
        line = client.stdout.readline()                    # an event: its first audio chunk arrived
        assert line.strip() == "streaming", (line, d.log()[-3000:])
        net.freeze()
        t0 = time.monotonic()
        assert _active(d), "the request ended before the rule: make it longer\n" + d.log()[-3000:]
        log = wait_for(lambda: (lambda s: s if ("disconnected: cancelling wy-" in s or
                                                "(wyoming.write_timeout_s): disconnected" in s) else "")(d.log()),
                       120, "the frozen client dropped", show=lambda: d.log()[-3000:])
        took = time.monotonic() - t0
        assert took < 2.0 + 10.0, took                     # the bound, plus a loaded host's slack
        assert "Traceback" not in log
        rid = re.search(r"wyoming#1: speak (wy-\S+)", log).group(1)
        # cancelled: at the drop, or already when the audio held for it passed wyoming.max_buffered_ms
        wait_log(d.log, f"request {rid} ended with cancelled", 30, alive=d.alive)
        assert time.monotonic() - t0 < 2.0 + 10.0
        wait_for(lambda: not _active(d), 30, "no request left running")

        async def served() -> list:                        # another client, on the host
            async with AsyncClient.from_uri(f"tcp://{net.host_ip}:{port}") as c:
                await c.write_event(Synthesize(text="Is the garage door closed?").event())
                got = []
                while True:
                    ev = await asyncio.wait_for(c.read_event(), 120)
                    got.append(ev.type if ev is not None else None)
                    if ev is None or ev.type in ("audio-stop", "error"):
                        return got

        got = asyncio.run(served())
        assert got[-1] == "audio-stop" and "audio-chunk" in got, got
    finally:
        if client is not None:
            client.kill()
            client.wait(10)
        try:
            if d is not None:
                assert d.stop() == 0, d.log()[-3000:]
        finally:
            net.remove()
