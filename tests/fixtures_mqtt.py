"""Fixtures: mqtt (see conftest.py). A real ``mosquitto`` broker and a real paho client.

* :func:`start_broker` / :class:`Broker` – ``/usr/sbin/mosquitto`` on a free 127.0.0.1 port
  with a minimal config (anonymous, persistence off unless asked; optional TLS from
  :func:`make_tls_files` and users); :meth:`Broker.restart` stops it and starts it again on
  the same port (for reconnect tests).
* fixture ``mqtt_broker`` – one broker for the whole test session.
* fixture ``mqtt_broker_factory`` – brokers of one test (stopped at teardown), e.g. to restart.
* :class:`Listener` – a paho client subscribed to ``<base>/#`` that records every message and
  can wait for one: ``wait(pred)``, ``events(id)``, ``publish(leaf, payload)``.
* :func:`mqtt_section` – the ``mqtt`` config section pointing a test daemon at a broker.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now. Under ``pytest -n N`` worker
    ``gwK`` only gets ports with ``port % N == K``: two workers never pick the same port between
    this call and the moment its user binds it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    k = int(worker[2:]) % n if worker.startswith("gw") and worker[2:].isdigit() and n > 1 else 0
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if n <= 1:
            return port
        # Linux hands out even ports to bind(0): move to this worker's residue and check it is free
        port += (k - port) % n
        if port > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


@dataclass
class Broker:
    """A mosquitto process listening on ``127.0.0.1:port``."""

    port: int
    conf: Path
    log_path: Path
    proc: Optional[subprocess.Popen] = None

    def start(self, timeout_s: float = 10.0) -> "Broker":
        """Start mosquitto and wait until the port accepts connections.

        Raises:
            RuntimeError: it exited or did not listen within ``timeout_s``.
        """
        logf = open(self.log_path, "ab")
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.conf)], stdout=logf, stderr=subprocess.STDOUT)
        logf.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited with {self.proc.returncode}:\n{self.log()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"mosquitto not listening on {self.port} after {timeout_s} s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop it (SIGTERM: clean, saves persistence; SIGKILL: crash) and wait until it is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self, down_s: float = 0.0, sig: int = signal.SIGTERM) -> None:
        """Stop, stay down ``down_s`` seconds, start again on the same port."""
        self.stop(sig)
        time.sleep(down_s)
        self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass(frozen=True)
class TlsFiles:
    """A throw-away CA and a server certificate for 127.0.0.1 (PEM files)."""

    ca: Path
    cert: Path
    key: Path


def make_tls_files(tmp: Path) -> TlsFiles:
    """Create a CA and a server cert/key (EC P-256, SAN ``IP:127.0.0.1``) with ``openssl``."""
    tmp.mkdir(parents=True, exist_ok=True)

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp, check=True, capture_output=True)

    ssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
        "-subj", "/CN=test-ca", "-keyout", "ca.key", "-out", "ca.pem")
    ssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", "server.key", "-out", "server.csr")
    (tmp / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    ssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "2", "-extfile", "san.ext", "-out", "server.pem")
    return TlsFiles(ca=tmp / "ca.pem", cert=tmp / "server.pem", key=tmp / "server.key")


def start_broker(tmp: Path, port: Optional[int] = None, persistence: bool = False,
                 tls: Optional[TlsFiles] = None, users: Optional[dict] = None) -> Broker:
    """Write a minimal ``mosquitto.conf`` in ``tmp`` and start a broker on it.

    Args:
        persistence: keep sessions and queued QoS 1 messages across a clean restart (in ``tmp``).
        tls: serve TLS only, with these files.
        users: ``{name: password}``; anonymous clients are then refused.
    """
    tmp.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    lines = [f"listener {port} 127.0.0.1"]
    if tls is not None:
        lines += [f"cafile {tls.ca}", f"certfile {tls.cert}", f"keyfile {tls.key}"]
    if users:
        pw = tmp / "passwd"
        pw.write_text("")
        for name, password in users.items():
            subprocess.run(["mosquitto_passwd", "-b", str(pw), name, password], check=True, capture_output=True)
        lines += ["allow_anonymous false", f"password_file {pw}"]
    else:
        lines += ["allow_anonymous true"]
    if persistence:
        lines += ["persistence true", f"persistence_location {tmp}/", "autosave_interval 1"]
    else:
        lines += ["persistence false"]
    if os.geteuid() == 0:
        lines.append("user root")     # else mosquitto drops to 'mosquitto', who cannot write tmp
    conf = tmp / "mosquitto.conf"
    conf.write_text("\n".join(lines) + "\n")
    return Broker(port=port, conf=conf, log_path=tmp / "mosquitto.log").start()


@pytest.fixture(scope="session")
def mqtt_broker(tmp_path_factory):
    """One mosquitto for the test session (do not stop or restart it in a test)."""
    b = start_broker(tmp_path_factory.mktemp("mosquitto"))
    yield b
    b.stop()


@pytest.fixture
def mqtt_broker_factory(tmp_path):
    """``start(name="broker", **kw) -> Broker``; every broker is stopped at teardown."""
    started: list[Broker] = []

    def start(name: str = "broker", **kw) -> Broker:
        b = start_broker(tmp_path / name, **kw)
        started.append(b)
        return b

    yield start
    for b in started:
        b.stop()


def mqtt_section(broker: Broker, device_id: Optional[str] = None, **kw: Any) -> dict:
    """The ``mqtt`` config section for a test daemon on ``broker`` (a fresh device id each call)."""
    sec = {"enabled": True, "host": "127.0.0.1", "port": broker.port, "topic_prefix": "test",
           "device_id": device_id or f"box-{uuid.uuid4().hex[:8]}", "reconnect_min_s": 1, "reconnect_max_s": 2,
           "status_interval_s": 5.0}
    sec.update(kw)
    return sec


@dataclass
class Msg:
    """One received message: topic leaf (after the base), payload bytes, retain flag, arrival time."""

    leaf: str
    payload: bytes
    retain: bool
    at: float = field(default_factory=time.monotonic)

    def json(self) -> Any:
        return json.loads(self.payload)


class Listener:
    """A paho client (VERSION2 callbacks) subscribed to ``<base>/#`` at QoS 1.

    Args:
        broker: where to connect. base: ``<prefix>/<device_id>``.
        client_id / clean_session: set a fixed id and ``clean_session=False`` to keep the
            subscription across a broker restart (with broker persistence).
    """

    def __init__(self, broker: Broker, base: str, client_id: Optional[str] = None, clean_session: bool = True,
                 ca: Optional[Path] = None, username: Optional[str] = None, password: Optional[str] = None) -> None:
        import paho.mqtt.client as paho

        self.base = base
        self.msgs: list[Msg] = []
        self.cv = threading.Condition()
        self.subscribed = threading.Event()
        self.c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id or f"t-{uuid.uuid4().hex[:10]}",
                             clean_session=clean_session)
        self.c.reconnect_delay_set(1, 1)
        if ca is not None:
            self.c.tls_set(ca_certs=str(ca))
        if username is not None:
            self.c.username_pw_set(username, password)
        self.c.on_connect = lambda c, u, f, rc, p: c.subscribe(f"{base}/#", qos=1)
        self.c.on_subscribe = lambda c, u, mid, rcs, p: self.subscribed.set()
        self.c.on_message = self._on_message
        self.c.connect("127.0.0.1", broker.port, keepalive=10)
        self.c.loop_start()
        assert self.subscribed.wait(10), "test client did not subscribe"

    def _on_message(self, c, u, msg) -> None:
        leaf = msg.topic[len(self.base) + 1:]
        with self.cv:
            self.msgs.append(Msg(leaf, bytes(msg.payload), bool(msg.retain)))
            self.cv.notify_all()

    def publish(self, leaf: str, payload: Any, qos: int = 1) -> None:
        """Publish to ``<base>/<leaf>``; a dict is sent as JSON, a str as UTF-8, bytes as they are."""
        if isinstance(payload, dict):
            payload = json.dumps(payload, ensure_ascii=False).encode()
        elif isinstance(payload, str):
            payload = payload.encode()
        self.c.publish(f"{self.base}/{leaf}", payload, qos=qos).wait_for_publish(10)

    def wait(self, pred: Callable[[Msg], bool], timeout_s: float = 60.0, what: str = "message") -> Msg:
        """The first recorded message (old or new) for which ``pred`` holds.

        Raises:
            AssertionError: none within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while True:
                for m in self.msgs:
                    if pred(m):
                        return m
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {what} after {timeout_s} s; got: "
                                         f"{[(m.leaf, m.payload[:120]) for m in self.msgs][-20:]}")
                self.cv.wait(min(left, 0.5))

    def events(self, rid: Optional[str] = None) -> list[dict]:
        """Decoded ``event`` messages so far (those with id ``rid`` if given)."""
        with self.cv:
            evs = [m.json() for m in self.msgs if m.leaf == "event"]
        return [e for e in evs if rid is None or e.get("id") == rid]

    def wait_event(self, rid: Optional[str], types: tuple = ("done", "error"), timeout_s: float = 60.0,
                   after: float = 0.0) -> dict:
        """The first ``event`` with id ``rid`` whose type is in ``types`` (received at or after
        ``after``, a ``time.monotonic()`` value)."""
        def pred(m: Msg) -> bool:
            if m.leaf != "event" or m.at < after:
                return False
            e = m.json()
            return e.get("id") == rid and e.get("type") in types
        return self.wait(pred, timeout_s, f"event {types} for id {rid!r}").json()

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


@pytest.fixture
def mqtt_listener():
    """Factory ``mqtt_listener(broker, base, **kw) -> Listener``; all closed at teardown."""
    made: list[Listener] = []

    def make(broker: Broker, base: str, **kw) -> Listener:
        lst = Listener(broker, base, **kw)
        made.append(lst)
        return lst

    yield make
    for lst in made:
        lst.close()
