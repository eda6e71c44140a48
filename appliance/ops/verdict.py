"""The one health verdict: what every part of the box reports as wrong now, assembled in one place.

A part that can go wrong reports it as :class:`~appliance.core.Condition`\\ s (a name for machines,
a reason for people, since when, how bad) through a :data:`~appliance.core.ConditionSource`: a
method of its own (``Monitor.conditions``: throttled and why; ``IntegrityWatch.conditions``:
weights changed on disk), a :class:`~appliance.core.ConditionFlag` it raises and clears (a failed
reload), or :class:`CheckRecord` (what the last field health check found). :class:`Health` is
given every source at construction and is the only place that assembles them: one
:class:`Verdict`, read the same way by the ``health`` request and ``chattts-appliance health``,
``status``, sd_notify ``STATUS=`` and the MQTT health sensor, so they can never disagree.

The verdict is ``healthy`` (no condition), ``degraded`` (the box speaks, worse than it should:
throttled, storage degraded, engine fallback, a failed reload) or ``unhealthy`` (it does not do
its job: no sound device, no writable WAV directory where WAV files are the output, garbled
audio, weights that fail their sha256). Nothing is latched: a condition is there while its
source reports it, so the verdict returns to ``healthy`` when the cause clears.
:meth:`Health.watch` re-reads the sources every second and calls ``on_change`` when the verdict
changes, so ``STATUS=`` and MQTT follow without a request.

Adding a condition: give the part a ``conditions()`` method (or a ``ConditionFlag``) and pass it
to ``Health(sources=...)`` where the daemon is assembled; nothing is registered afterwards.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Optional, Sequence

from ..core import DEGRADED, UNHEALTHY, Condition, ConditionSource
from ..messages.protocol import HealthReply

log = logging.getLogger(__name__)

HEALTHY = "healthy"

#: Seconds between two reads of the sources by :meth:`Health.watch`.
WATCH_PERIOD_S = 1.0


@dataclass(frozen=True)
class Verdict:
    """The box's health at one moment.

    Attributes:
        conditions: what holds now, the unhealthy ones first, then oldest first.
        at: when it was assembled, ``time.monotonic()`` s.
    """

    conditions: tuple
    at: float

    @property
    def word(self) -> str:
        """``healthy``, ``degraded`` or ``unhealthy`` (the worst condition's severity)."""
        if not self.conditions:
            return HEALTHY
        return UNHEALTHY if any(c.severity == UNHEALTHY for c in self.conditions) else DEGRADED

    @property
    def healthy(self) -> bool:
        """True when nothing is wrong."""
        return not self.conditions

    @property
    def reasons(self) -> list:
        """Each condition's reason, in order (one line each)."""
        return [c.reason for c in self.conditions]

    def wire(self) -> list:
        """The conditions as JSON objects: ``name``, ``severity``, ``reason`` and ``for_s`` (how
        long it has held, s)."""
        return [{"name": c.name, "severity": c.severity, "reason": c.reason,
                 "for_s": round(max(0.0, self.at - c.since), 1)} for c in self.conditions]

    def summary(self) -> str:
        """One line for ``STATUS=``: ``healthy``, or e.g. ``degraded: throttled (reduced_channels
        by memory: ...)``."""
        if not self.conditions:
            return HEALTHY
        return f"{self.word}: " + "; ".join(f"{c.name} ({c.reason})" for c in self.conditions)

    def key(self) -> tuple:
        """What a change of the verdict is judged by (ages left out)."""
        return tuple((c.name, c.severity, c.reason) for c in self.conditions)


class Health:
    """Assembles the :class:`Verdict` from the sources given here (module docstring).

    Args:
        sources: every :data:`~appliance.core.ConditionSource` of the box.
        clock: monotonic clock, s (tests).
    """

    def __init__(self, sources: Sequence[ConditionSource], clock: Callable[[], float] = time.monotonic) -> None:
        self.sources = tuple(sources)
        self._clock = clock
        self._failed: set = set()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._last: tuple = ()

    def verdict(self) -> Verdict:
        """Read every source now (thread-safe). A source that raises is itself a ``degraded``
        condition (``health_source``), logged once: health never claims what it could not read."""
        now = self._clock()
        conds: list = []
        for i, src in enumerate(self.sources):
            try:
                conds.extend(src())
            except Exception as e:  # noqa: BLE001 - one broken source must not hide the others
                if i not in self._failed:
                    self._failed.add(i)
                    log.exception("health source %r failed", src)
                conds.append(Condition("health_source", f"a health source failed: {e.__class__.__name__}: {e}",
                                       now, DEGRADED))
            else:
                self._failed.discard(i)
        conds.sort(key=lambda c: (c.severity != UNHEALTHY, c.since))
        return Verdict(tuple(conds), now)

    def fields(self) -> dict:
        """The ``status`` reply's share: ``health`` (the verdict's word) and ``conditions``."""
        v = self.verdict()
        return {"health": v.word, "conditions": v.wire()}

    def reply(self, check: Optional[HealthReply] = None) -> HealthReply:
        """The ``health`` reply: the field check's measurements (``check``; None: not run) with the
        verdict's ``healthy``, ``verdict``, ``reasons`` and ``conditions`` (the check's own
        findings reach the verdict through its :class:`CheckRecord`)."""
        v = self.verdict()
        base = check if check is not None else HealthReply(healthy=v.healthy)
        return replace(base, healthy=v.healthy, verdict=v.word, reasons=v.reasons, conditions=v.wire())

    # -- following it -----------------------------------------------------------------------

    def watch(self, on_change: Callable[[Verdict], None], period_s: float = WATCH_PERIOD_S) -> None:
        """Re-read the sources every ``period_s`` on thread ``health-watch``; log each condition
        that comes or goes and call ``on_change(verdict)`` when the verdict changed."""
        if self._thread is not None:
            return
        self._last = self.verdict().key()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(on_change, period_s), name="health-watch",
                                        daemon=True)
        self._thread.start()

    def _run(self, on_change: Callable[[Verdict], None], period_s: float) -> None:
        levels = {n: sev for n, sev, _ in self._last}
        while not self._stop.wait(period_s):
            v = self.verdict()
            key = v.key()
            if key == self._last:
                continue
            levels = log_changes(levels, self._last, key, v)
            self._last = key
            try:
                on_change(v)
            except Exception:  # noqa: BLE001 - a publisher failure must not stop the watch
                log.exception("health on_change failed")

    def close(self) -> None:
        """Stop watching (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def log_changes(levels: dict, before: tuple, after: tuple, v: Verdict) -> dict:
    """Log what changed between two verdict keys (``(name, severity, reason)`` each), once per
    change that matters: a condition that starts (WARNING), changes its severity (WARNING) or
    clears (INFO), and then the verdict's summary (INFO); a condition whose reason alone moves (a
    temperature reading inside the same level) is logged at DEBUG only. ``levels``: name ->
    severity as last logged; returns it updated."""
    now = {n: (sev, r) for n, sev, r in after}
    was = {n: r for n, _, r in before}
    changed = False
    for n, (sev, r) in now.items():
        if n not in levels:
            log.warning("health: %s: %s [%s]", n, r, sev)
        elif levels[n] != sev:
            log.warning("health: %s now %s (was %s): %s", n, sev, levels[n], r)
        else:
            log.debug("health: %s: %s", n, r)
            continue
        changed = True
    for n in sorted(set(levels) - set(now)):
        log.info("health: %s cleared (was: %s)", n, was.get(n, "?"))
        changed = True
    if changed:
        log.info("health: %s", v.summary())
    return {n: sev for n, (sev, _) in now.items()}


class CheckRecord:
    """What the last field health check (:func:`~appliance.ops.health.run_health_check`) found, as
    a :data:`~appliance.core.ConditionSource`: its conditions hold until a check passes; a
    condition found again keeps its ``since``.

    Args:
        clock: monotonic clock, s (tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._conds: tuple = ()

    def record(self, reply: HealthReply) -> None:
        """Keep ``reply.conditions`` (the check's own findings)."""
        now = self._clock()
        old = {c.name: c.since for c in self._conds}
        self._conds = tuple(Condition(d["name"], d["reason"], old.get(d["name"], now), d.get("severity", DEGRADED))
                            for d in reply.conditions)

    def __call__(self) -> Iterable[Condition]:
        return self._conds


__all__ = ["Health", "Verdict", "CheckRecord", "HEALTHY", "WATCH_PERIOD_S"]
