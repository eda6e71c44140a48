"""Fixtures: operations (see conftest.py).

* ``notify_socket`` – a real ``AF_UNIX``/``SOCK_DGRAM`` socket standing in for systemd's
  notify socket. ``NOTIFY_SOCKET`` is exported for the test (monkeypatch), and
  ``notify_socket.env`` gives the variables to pass to a subprocess (the real daemon).
  Every datagram is recorded with its arrival time (``time.monotonic()``).
* ``notify_socket_abstract`` – the same on an abstract address (``@name``), as systemd uses
  for some units.

Typical use with the real daemon::

    def test_daemon_notify(notify_socket):
        env = {**os.environ, **notify_socket.env, "WATCHDOG_USEC": "2000000"}
        proc = subprocess.Popen([...serve...], env=env)
        notify_socket.wait_for("READY", timeout=60)
        pings = notify_socket.wait_count("WATCHDOG", 3, timeout=5)
        ...
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

import pytest


@dataclass
class NotifyMessage:
    """One datagram: ``fields`` maps each ``KEY`` to its value; ``t`` is the monotonic arrival time, s."""

    fields: dict
    raw: str
    t: float


@dataclass
class NotifyCollector:
    """Receives sd_notify datagrams on ``address`` (a path, or ``@name`` for abstract)."""

    address: str
    messages: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        bind = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        self._sock.bind(bind)
        self._sock.settimeout(0.1)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._recv_loop, name="notify-collector", daemon=True)
        self._thread.start()

    @property
    def env(self) -> dict:
        """Environment for a child process: ``{"NOTIFY_SOCKET": address}``."""
        return {"NOTIFY_SOCKET": self.address}

    def _recv_loop(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            raw = data.decode("utf-8", "replace")
            fields = {}
            for line in raw.split("\n"):
                if "=" in line:
                    k, v = line.split("=", 1)
                    fields[k] = v
            with self._cond:
                self.messages.append(NotifyMessage(fields, raw, time.monotonic()))
                self._cond.notify_all()

    def with_key(self, key: str) -> list:
        """Messages that carry ``key`` (e.g. ``"WATCHDOG"``), in arrival order."""
        with self._cond:
            return [m for m in self.messages if key in m.fields]

    def wait_count(self, key: str, n: int, timeout: float = 10.0) -> list:
        """Wait until ``n`` messages carry ``key``; return them.

        Raises:
            AssertionError: fewer arrived within ``timeout`` s (message lists what did arrive).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                got = [m for m in self.messages if key in m.fields]
                if len(got) >= n:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{len(got)}/{n} {key} messages in {timeout} s; "
                                         f"received: {[m.raw for m in self.messages]}")
                self._cond.wait(left)

    def wait_for(self, key: str, timeout: float = 10.0) -> NotifyMessage:
        """Wait for the first message carrying ``key`` and return it."""
        return self.wait_count(key, 1, timeout)[0]

    def keys_in_order(self) -> list:
        """The first key of every message, in arrival order (for sequence assertions)."""
        with self._cond:
            return [next(iter(m.fields), "") for m in self.messages]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()


@pytest.fixture
def notify_socket(monkeypatch):
    """A :class:`NotifyCollector` on a filesystem path; ``NOTIFY_SOCKET`` set for the test."""
    d = tempfile.mkdtemp(prefix="sdn", dir="/tmp")  # short: sun_path holds 108 bytes
    c = NotifyCollector(os.path.join(d, "notify.sock"))
    monkeypatch.setenv("NOTIFY_SOCKET", c.address)
    yield c
    c.close()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def notify_socket_abstract(monkeypatch):
    """A :class:`NotifyCollector` on an abstract address ``@chattts-test-<random>``."""
    c = NotifyCollector(f"@chattts-test-{uuid.uuid4().hex[:12]}")
    monkeypatch.setenv("NOTIFY_SOCKET", c.address)
    yield c
    c.close()
