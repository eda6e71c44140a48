"""systemd integration: sd_notify messages and the watchdog.

Everything here is a no-op outside systemd (no ``$NOTIFY_SOCKET``, no ``$WATCHDOG_USEC``), so
the daemon calls it unconditionally. (Socket activation is
:func:`appliance.transports.socket_server.inherited_socket`.)

**sd_notify transport: libsystemd when importable, else a stdlib sender.** ``systemd-python``
(``systemd.daemon.notify`` -> ``sd_pid_notify_with_fds(3)``) is the reference implementation of
the protocol: it follows whatever address forms the running systemd supports (path, abstract
``@name``, and ``vsock:`` on systemd >= 253) and is what ``python3-systemd`` gives on a Jetson.
It is a C extension that pip only builds with ``libsystemd-dev`` + ``pkg-config``, so a dev
box or CI may lack it; then :func:`_send_stdlib` sends the same datagram itself (protocol in
``sd_notify(3)``: one ``AF_UNIX``/``SOCK_DGRAM`` datagram of newline-separated ``KEY=VALUE``
assignments to ``$NOTIFY_SOCKET``; a leading ``@`` means the Linux abstract namespace). The
transport is picked once at import (:data:`TRANSPORT`); :class:`Notifier` composes every
message and is the only caller of either sender, so the message logic exists once.

Public API used by the daemon (see each docstring):

* :class:`Notifier` – ``ready()``, ``status()``, ``watchdog()``, ``reloading()``, ``stopping()``,
  ``extend_timeout()``, ``send()``.
* :class:`Watchdog` – sends ``WATCHDOG=1`` from the heartbeats of the worker and the event loop
  (:meth:`Watchdog.beat`), about every second while both make progress.

The daemon's hooks as sd_notify calls, and the ``STATUS=`` text, are in :mod:`appliance.ops.bridge`.

Logging (journald under systemd, stderr otherwise) is set up in :mod:`appliance.ops.logsetup`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable, Iterable, Optional

log = logging.getLogger(__name__)

try:  # pragma: no cover - depends on the machine
    from systemd import daemon as _sd_daemon
except ImportError:  # pragma: no cover
    _sd_daemon = None

#: ``"libsystemd"`` (systemd-python) or ``"stdlib"``: how :class:`Notifier` sends.
TRANSPORT = "libsystemd" if _sd_daemon is not None else "stdlib"


def _send_stdlib(message: str) -> bool:
    """Send one sd_notify datagram to ``$NOTIFY_SOCKET`` with the socket module.

    Returns False when ``$NOTIFY_SOCKET`` is unset (not under systemd), True when sent.

    Raises:
        OSError: the socket cannot be reached (ENOENT, ECONNREFUSED, ...) or the address form
            is not supported here (``vsock:``, needs libsystemd).
    """
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr[0] == "@":
        addr = "\0" + addr[1:]
    elif addr[0] != "/":
        raise OSError(f"NOTIFY_SOCKET={addr!r}: only path and @abstract addresses are supported "
                      f"without systemd-python (install python3-systemd)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.connect(addr)
        s.sendall(message.encode("utf-8"))
    return True


def _send_libsystemd(message: str) -> bool:
    """Send through ``sd_pid_notify_with_fds`` (systemd-python); same contract as
    :func:`_send_stdlib`."""
    return bool(_sd_daemon.notify(message))


def monotonic_usec() -> int:
    """``CLOCK_MONOTONIC`` in microseconds (what ``MONOTONIC_USEC=`` carries)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    """Sends sd_notify(3) messages to ``$NOTIFY_SOCKET`` (read at each send, as libsystemd does).

    Every method returns True when a datagram was sent, False when not under systemd or when
    sending failed (a failure is logged as a warning once; notify must never stop the daemon).

    Args:
        transport: ``"auto"`` (:data:`TRANSPORT`), ``"libsystemd"`` or ``"stdlib"`` (tests).

    Raises:
        ValueError: ``transport="libsystemd"`` without systemd-python, or an unknown name.
    """

    def __init__(self, transport: str = "auto") -> None:
        if transport == "auto":
            transport = TRANSPORT
        if transport == "libsystemd" and _sd_daemon is None:
            raise ValueError("transport 'libsystemd' needs systemd-python (pip install "
                             "systemd-python, or apt install python3-systemd)")
        if transport not in ("libsystemd", "stdlib"):
            raise ValueError(f"unknown notify transport {transport!r} (auto, libsystemd, stdlib)")
        self.transport = transport
        self._sender: Callable[[str], bool] = _send_libsystemd if transport == "libsystemd" else _send_stdlib
        self._warned = False
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """True when ``$NOTIFY_SOCKET`` is set (the service runs under systemd ``Type=notify``)."""
        return bool(os.environ.get("NOTIFY_SOCKET"))

    def send(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` assignments in one datagram (newlines inside values are replaced
        by spaces, since the protocol is line-based)."""
        if not self.enabled:
            return False
        msg = "\n".join(a.replace("\n", " ") for a in assignments)
        try:
            with self._lock:
                return self._sender(msg)
        except OSError as e:
            if not self._warned:
                log.warning("sd_notify to %s failed: %s (further failures are not logged)",
                            os.environ.get("NOTIFY_SOCKET"), e)
                self._warned = True
            return False

    def ready(self, status: Optional[str] = None) -> bool:
        """``READY=1`` (after warm-up, and again at the end of a reload), with ``STATUS=``."""
        return self.send("READY=1", *([f"STATUS={status}"] if status is not None else []))

    def status(self, text: str) -> bool:
        """``STATUS=<text>`` (see :func:`appliance.ops.bridge.format_status`)."""
        return self.send(f"STATUS={text}")

    def watchdog(self) -> bool:
        """``WATCHDOG=1`` (use :class:`Watchdog` instead of calling this directly)."""
        return self.send("WATCHDOG=1")

    def reloading(self, status: str = "reloading configuration") -> bool:
        """``RELOADING=1`` + ``MONOTONIC_USEC=`` (systemd >= 253 requires it, older ignores
        it); send :meth:`ready` when the reload is done."""
        return self.send("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec()}", f"STATUS={status}")

    def stopping(self, status: str = "stopping") -> bool:
        """``STOPPING=1`` (at SIGTERM, before the drain)."""
        return self.send("STOPPING=1", f"STATUS={status}")

    def extend_timeout(self, seconds: float, status: Optional[str] = None) -> bool:
        """``EXTEND_TIMEOUT_USEC=<seconds * 1e6>``: asks systemd for ``seconds`` more from now
        before the start (or stop) timeout fires; send it again before it runs out while
        engines load or build."""
        if seconds <= 0:
            raise ValueError(f"extend_timeout: seconds must be > 0, got {seconds}")
        extra = [f"STATUS={status}"] if status is not None else []
        return self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}", *extra)


def watchdog_interval_s(environ: Optional[dict] = None) -> Optional[float]:
    """The watchdog timeout systemd set for this process, seconds, or None.

    Follows ``sd_watchdog_enabled(3)``: ``$WATCHDOG_USEC`` must be a positive integer and
    ``$WATCHDOG_PID``, when set, must be this process's pid.
    """
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC")
    if not usec:
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r (not an integer)", usec)
        return None
    pid = env.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    return value / 1e6 if value > 0 else None


PING_S = 1.0
"""Seconds between two ``WATCHDOG=1`` while everything makes progress (at most half the interval)."""
PAUSE_S = 5.0
"""No heartbeat at all for longer than this: the whole process was paused (SIGSTOP, a paused VM, a
swap storm), and no heartbeat is blamed for that time."""


class Watchdog:
    """Sends ``WATCHDOG=1`` from the heartbeats themselves, about every :data:`PING_S` (at most
    half the watchdog interval), while every required heartbeat is fresh: a ping follows progress,
    it never comes from a timer of its own.

    The worker thread beats at least every 0.25 s while it works or waits for work (every decode
    step, every idle wait), the event loop every 0.5 s (``("worker", "loop")``); each :meth:`beat`
    sends a ping when the last one is :attr:`period_s` old and no required heartbeat is older than
    ``stale_after_s`` (``safety.stall_s``). So any stall of the whole process shorter than
    ``WatchdogSec`` minus one period never restarts the box (the first beat after it pings), and
    a worker stuck past ``stale_after_s`` while the loop runs stops the pings with one ERROR line
    naming the stage it is stuck in (:meth:`watch_stage`); systemd then restarts the service
    ``WatchdogSec`` later. A time of more than :data:`PAUSE_S` in which no heartbeat came at all
    (the whole process was paused) counts against none of them.

    Args:
        notifier: where pings go.
        interval_s: watchdog timeout, s; default from :func:`watchdog_interval_s` (None:
            disabled, nothing is sent).
        stale_after_s: heartbeat age beyond which pings stop, s; default ``interval_s``.
        require: heartbeat names that must all be fresh (e.g. ``("worker", "loop")``).
        clock: monotonic clock in seconds (tests).
    """

    def __init__(self, notifier: Notifier, interval_s: Optional[float] = None,
                 stale_after_s: Optional[float] = None, require: Iterable[str] = ("worker",),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.notifier = notifier
        self.interval_s = watchdog_interval_s() if interval_s is None else interval_s
        self.stale_after_s = stale_after_s if stale_after_s is not None else (self.interval_s or 0.0)
        self.period_s = min(PING_S, (self.interval_s or 2 * PING_S) / 2)
        self.require = tuple(require)
        self._clock = clock
        now = clock()
        self._beats = {name: now for name in self.require}
        self._stages: dict[str, Callable[[], str]] = {}
        self._lock = threading.Lock()
        self._running = False
        self._last_ping = float("-inf")
        self._stale_logged = False
        self.pings = 0

    @property
    def enabled(self) -> bool:
        """True when systemd asked for a watchdog (``WatchdogSec=`` set on the unit)."""
        return bool(self.interval_s)

    def watch_stage(self, name: str, stage: Callable[[], str]) -> None:
        """``stage()`` says what heartbeat ``name``'s thread is doing (named when it is stuck)."""
        self._stages[name] = stage

    def beat(self, name: str = "worker") -> None:
        """Record that thread ``name`` made progress (cheap; from the thread itself); pings when
        due (class docstring)."""
        now = self._clock()
        with self._lock:
            quiet = now - max(self._beats.values(), default=now)
            if quiet > PAUSE_S:          # nobody beat: the whole process stood still, nobody is to blame for it
                for n, t in self._beats.items():
                    self._beats[n] = min(now, t + quiet)
            self._beats[name] = now
            due = self._running and now - self._last_ping >= self.period_s
        if due:
            self.tick()

    def stale(self) -> list[str]:
        """Names of required heartbeats older than ``stale_after_s`` (empty: all fresh)."""
        now = self._clock()
        return [n for n in self.require if now - self._beats.get(n, float("-inf")) > self.stale_after_s]

    def tick(self) -> bool:
        """One watchdog decision: ping if every required heartbeat is fresh. Returns True
        when ``WATCHDOG=1`` was sent."""
        with self._lock:
            stale = self.stale()
            if stale:
                if not self._stale_logged:
                    now = self._clock()
                    log.error("watchdog: %s; withholding WATCHDOG=1 so systemd restarts the service",
                              "; ".join(f"the {n} made no progress for {now - self._beats[n]:.1f} s (over "
                                        f"{self.stale_after_s:g} s, safety.stall_s)" + self._stage(n) for n in stale))
                    self._stale_logged = True
                return False
            if self._stale_logged:
                log.warning("watchdog: heartbeats fresh again; pinging resumes")
                self._stale_logged = False
            self._last_ping = self._clock()
        sent = self.notifier.watchdog()
        if sent:
            self.pings += 1
        return sent

    def _stage(self, name: str) -> str:
        fn = self._stages.get(name)
        if fn is None:
            return ""
        try:
            return f": stuck in {fn()}"
        except Exception:  # noqa: BLE001 - a log line must not fail
            return ""

    def start(self) -> None:
        """Begin pinging from the heartbeats (one ping now); no-op when disabled."""
        if not self.enabled or self._running:
            return
        with self._lock:
            self._running = True
        log.info("watchdog: interval %.1f s, WATCHDOG=1 about every %.1f s while %s make progress "
                 "(stuck after %.1f s)", self.interval_s, self.period_s, "/".join(self.require), self.stale_after_s)
        self.tick()

    def stop(self) -> None:
        """Stop pinging."""
        with self._lock:
            self._running = False
