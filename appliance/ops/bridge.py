"""The daemon's lifecycle hooks as sd_notify(3) messages (:class:`SystemdBridge`) and the one-line
``STATUS=`` text (:func:`format_status`) that ``systemctl status`` shows: state, load, timings,
temperature, throttle level, memory and the health verdict with its conditions. The messages go
out through :class:`~appliance.ops.notify.Notifier`; the watchdog is
:class:`~appliance.ops.notify.Watchdog`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Iterable, Optional

from ..messages.protocol import StatusReply
from .notify import Notifier, Watchdog

log = logging.getLogger(__name__)


def format_status(state: str, *, busy: Optional[int] = None, channels: Optional[int] = None,
                  last_rtf: Optional[float] = None, last_ttfb_ms: Optional[float] = None,
                  temperature_c: Optional[float] = None, throttle: Optional[str] = None,
                  memory_mib: Optional[float] = None, memory_budget_mib: Optional[float] = None,
                  health: Optional[str] = None, conditions: Iterable[dict] = ()) -> str:
    """One-line ``STATUS=`` text, e.g. ``ready; busy 1/3; rtf 0.42; ttfb 310 ms; 52.1C; throttle normal;
    mem 812/1500 MiB; healthy`` (or ``...; degraded: throttled (reduced_channels by memory: ...)``).

    Args:
        state: daemon state word (``loading``, ``warming up``, ``ready``, ``reloading``, ``draining``).
        busy / channels: channels synthesizing now / channels configured.
        last_rtf: real-time factor of the last finished request (s compute per s audio).
        last_ttfb_ms: time to first PCM of the last request, ms.
        temperature_c: the temperature the throttle uses (tj or GPU), degrees C.
        throttle: throttle level name (:class:`appliance.ops.throttle.Level` value).
        memory_mib / memory_budget_mib: RSS + device memory now / ``service.memory_budget_mb``, MiB.
        health / conditions: the one verdict (``healthy``, ``degraded``, ``unhealthy``) and its
            conditions' wire form (``name``, ``reason``; :mod:`appliance.ops.verdict`).
    """
    parts = [state]
    if busy is not None and channels is not None:
        parts.append(f"busy {busy}/{channels}")
    if last_rtf is not None:
        parts.append(f"rtf {last_rtf:.2f}")
    if last_ttfb_ms is not None:
        parts.append(f"ttfb {last_ttfb_ms:.0f} ms")
    if temperature_c is not None:
        parts.append(f"{temperature_c:.1f}C")
    if throttle is not None:
        parts.append(f"throttle {throttle}")
    if memory_mib is not None:
        parts.append(f"mem {memory_mib:.0f}" + (f"/{memory_budget_mib:.0f}" if memory_budget_mib else "") + " MiB")
    conds = [f"{c['name']} ({c['reason']})" for c in conditions]
    if health is not None:
        parts.append(f"{health}: " + "; ".join(conds) if conds else health)
    return "; ".join(parts)


class SystemdBridge:
    """The daemon's hooks (:class:`appliance.daemon.daemon.Hooks`) turned into sd_notify messages.

    Wiring (in ``hooks.build_hooks``)::

        bridge = SystemdBridge()
        return Hooks(**bridge.hooks())

    * ``on_loading(text)``: ``EXTEND_TIMEOUT_USEC`` + ``STATUS=text``; a keep-alive thread
      re-sends the extension every ``extend_s / 3`` until ready, so one slow stage (an engine
      build) does not hit ``TimeoutStartSec``; after ``max_start_s`` it stops extending and
      systemd's timeout applies (a hung start-up is still caught).
    * ``on_ready()``: ``READY=1`` + ``STATUS=``; starts the :class:`Watchdog` (pings follow the
      heartbeats of the worker and the event loop from then on).
    * ``on_status(reply)``: ``STATUS=`` from a :class:`~appliance.messages.protocol.StatusReply`
      (:func:`format_status`: busy channels, last RTF/TTFB, temperature, throttle level, the
      health verdict with its conditions).
    * ``on_heartbeat()``: :meth:`Watchdog.beat` ``("worker")`` (from the worker thread);
      ``on_loop_beat()``: ``("loop")`` (from the event loop); ``worker_stage(fn)``: what the
      worker does now, named when it is stuck.
    * ``on_reload()``: ``RELOADING=1`` + ``MONOTONIC_USEC``; call :meth:`reloaded` when the new
      config is in force (``READY=1``), or systemd waits for the reload until its timeout.
    * ``on_stopping()``: ``STOPPING=1`` (the watchdog keeps pinging while the worker drains).

    Args:
        notifier: default ``Notifier()``.
        watchdog: default ``Watchdog(notifier, stale_after_s=stall_s, require=("worker", "loop"))``
            (interval from ``$WATCHDOG_USEC``).
        stall_s: ``safety.stall_s``: a heartbeat older than this stops the pings.
        extend_s: each start-up extension, s.
        max_start_s: stop extending after this long, s.
    """

    def __init__(self, notifier: Optional[Notifier] = None, watchdog: Optional[Watchdog] = None,
                 extend_s: float = 90.0, max_start_s: float = 1800.0, stall_s: Optional[float] = None) -> None:
        self.notifier = notifier or Notifier()
        self.watchdog = watchdog or Watchdog(self.notifier, stale_after_s=stall_s, require=("worker", "loop"))
        self.extend_s = extend_s
        self.max_start_s = max_start_s
        self._starting = threading.Event()
        self._ready = threading.Event()
        self._extender: Optional[threading.Thread] = None
        self._t0 = time.monotonic()

    def hooks(self) -> dict:
        """Keyword arguments for ``Hooks(...)``."""
        return {"on_loading": self.on_loading, "on_ready": self.on_ready, "on_status": self.on_status,
                "on_heartbeat": self.on_heartbeat, "on_loop_beat": self.on_loop_beat,
                "worker_stage": self.worker_stage, "on_reload": self.on_reload, "on_stopping": self.on_stopping}

    def on_loading(self, text: str) -> None:
        self.notifier.extend_timeout(self.extend_s, status=text)
        if self._extender is None and self.notifier.enabled:
            self._extender = threading.Thread(target=self._keep_extending, name="sd-extend", daemon=True)
            self._extender.start()

    def _keep_extending(self) -> None:
        while not self._ready.wait(self.extend_s / 3):
            if time.monotonic() - self._t0 > self.max_start_s:
                log.error("start-up still not finished after %.0f s; no more EXTEND_TIMEOUT_USEC", self.max_start_s)
                return
            self.notifier.extend_timeout(self.extend_s)

    def on_ready(self) -> None:
        self._ready.set()
        self.notifier.ready(format_status("ready"))
        self.watchdog.start()

    def on_status(self, reply: StatusReply) -> None:
        chans = reply.channels
        busy = sum(1 for c in chans.values() if c.get("active"))
        self.notifier.status(format_status(
            reply.state, busy=busy, channels=len(chans) or None, last_rtf=reply.last_rtf,
            last_ttfb_ms=reply.last_ttfb_ms, temperature_c=reply.temperature_c, throttle=reply.throttle,
            memory_mib=reply.memory_mib, memory_budget_mib=reply.memory_budget_mib,
            health=reply.health, conditions=reply.conditions))

    def on_heartbeat(self) -> None:
        self.watchdog.beat("worker")

    def on_loop_beat(self) -> None:
        self.watchdog.beat("loop")

    def worker_stage(self, stage) -> None:
        self.watchdog.watch_stage("worker", stage)

    def on_reload(self) -> None:
        self.notifier.reloading()

    def reloaded(self, status: str = "ready (configuration reloaded)") -> None:
        """``READY=1`` after a reload (see :meth:`on_reload`)."""
        self.notifier.ready(status)

    def on_stopping(self) -> None:
        self._ready.set()
        self.notifier.stopping("stopping: draining accepted requests")

    def close(self) -> None:
        """Stop the watchdog and extender threads (at exit)."""
        self._ready.set()
        self.watchdog.stop()
        if self._extender is not None:
            self._extender.join(timeout=2)
