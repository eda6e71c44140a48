"""Self-throttling: a level with hysteresis, driven by telemetry and measured RTF.

Levels (:class:`Level`, a ``str`` enum whose value goes into ``STATUS=`` and MQTT status):

==================== =====================================================================
``normal``            every channel, every priority
``reduced_channels``  at most ``throttle.reduced_channels`` channels synthesize at once
``queue_low_priority`` as above, chunks ``throttle.chunk_scale`` x larger, ``background``
                      requests wait in their queue (accepted, not started)
``alerts_only``       one channel, only ``alert`` requests start; the rest wait
==================== =====================================================================

A request held by the throttle waits at most ``service.max_hold_s`` (then it ends ``throttled``,
:mod:`appliance.service.scheduler`); when memory is what holds the level, a request of a priority
that cannot start is refused at once with ``insufficient_memory`` instead of waiting
(:attr:`Limits.resources`).

Signals, each a :class:`Ladder` of three thresholds (one per level above normal) with its own
hysteresis band, so a value hovering at a threshold never flaps:

* temperature (``Reading.hot_c``: ``tj``, else the hottest die sensor) against
  ``trip - reduce/queue/alerts_margin_c``, where ``trip`` is the board's lowest *passive* trip
  point (``/sys/class/thermal/*/trip_point_*``; ``active`` fan trips are ignored), else
  ``throttle.trip_c`` / ``fallback_trip_c``;
* the appliance's memory use against ``service.memory_budget_mb`` (fractions);
* free memory as the box sees it (:attr:`Reading.free_mib <appliance.ops.readings.Reading.free_mib>`:
  the least of ``MemAvailable``, tegrastats' RAM and a cgroup's headroom; on a Jetson the GPU's
  allocations share it and cannot be swapped) against the larger of ``throttle.min_available_mb``
  and ``min_available_frac`` of the memory total (queue_low_priority; half of it: alerts_only);
* input power (``VDD_IN`` or the sum of rails) against ``throttle.power_limit_mw``;
* measured RTF (observations older than ``max(60 s, 4 x min_dwell_s)`` are forgotten).

The level is the worst signal's level. It rises at once; it falls once every signal has been
below the current level for ``throttle.min_dwell_s`` (a few seconds: the hysteresis bands already
keep a value at a threshold from flapping), straight to the level the signals ask for. Every
change is logged with its reason and passed to ``on_change``; nothing is latched, so every level
is left again when the cause goes away. Every window is on the monotonic clock.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from ..config import ThrottleConfig
from ..core import Condition
from .readings import Reading, Trip

log = logging.getLogger(__name__)


class Level(str, enum.Enum):
    """Throttle level; ``.value`` is the string shown in STATUS and MQTT."""

    NORMAL = "normal"
    REDUCED_CHANNELS = "reduced_channels"
    QUEUE_LOW_PRIORITY = "queue_low_priority"
    ALERTS_ONLY = "alerts_only"

    @property
    def rank(self) -> int:
        """0 (normal) .. 3 (alerts_only)."""
        return _ORDER.index(self)

    def __str__(self) -> str:
        return self.value


_ORDER = [Level.NORMAL, Level.REDUCED_CHANNELS, Level.QUEUE_LOW_PRIORITY, Level.ALERTS_ONLY]


@dataclass(frozen=True)
class Limits:
    """What the scheduler may do at a level.

    Attributes:
        level: the level these limits belong to.
        max_channels: channels that may synthesize at the same time.
        chunk_scale: multiply ``stream.chunk_tokens`` by this.
        run_priorities: priorities that may start now; others stay queued (not refused).
        cause: what holds the level, e.g. ``by memory: available memory 300.0MiB (<= 389.0MiB:
            alerts_only)``; empty at ``normal``.
        resources: the resources behind it (``thermal``, ``memory``, ``power``, ``compute``).
    """

    level: Level
    max_channels: int
    chunk_scale: int
    run_priorities: frozenset
    cause: str = ""
    resources: frozenset = frozenset()


@dataclass(frozen=True)
class Change:
    """One level change: ``t`` (monotonic s), ``old``, ``new``, ``reason`` (text)."""

    t: float
    old: Level
    new: Level
    reason: str


class Ladder:
    """One signal's level (0..3) from three thresholds with a hysteresis band.

    Up: the level becomes the highest ``k`` whose threshold the value reaches. Down: level
    ``k`` is left only when the value is ``hysteresis`` past threshold ``k`` (below it, or
    above it when ``lower_is_worse``). A None value (sensor absent) releases the signal.

    Args:
        name: signal name for reasons, e.g. ``temperature``.
        thresholds: three values for levels 1..3 (None = this signal never reaches that level);
            increasing (decreasing when ``lower_is_worse``).
        hysteresis: band width, same unit as the value.
        unit: printed after values (``C``, ``MiB``...).
        lower_is_worse: e.g. available memory.
        resource: what runs short, as health names it: ``thermal``, ``memory``, ``power`` or
            ``compute`` (default: ``name``).
    """

    def __init__(self, name: str, thresholds: Iterable[Optional[float]], hysteresis: float, unit: str = "",
                 lower_is_worse: bool = False, resource: Optional[str] = None) -> None:
        self.name = name
        self.resource = resource or name
        self.thresholds = list(thresholds)
        assert len(self.thresholds) == 3, "one threshold per level above normal"
        self.hysteresis = hysteresis
        self.unit = unit
        self.sign = -1.0 if lower_is_worse else 1.0
        self.level = 0
        self.value: Optional[float] = None

    def _reached(self, x: float, k: int) -> bool:
        t = self.thresholds[k - 1]
        return t is not None and self.sign * x >= self.sign * t

    def _left(self, x: float, k: int) -> bool:
        t = self.thresholds[k - 1]
        return t is None or self.sign * x < self.sign * t - self.hysteresis

    def update(self, value: Optional[float]) -> int:
        """Feed a value; return the signal's level 0..3."""
        self.value = value
        if value is None:
            self.level = 0
            return 0
        up = max([k for k in (1, 2, 3) if self._reached(value, k)], default=0)
        if up >= self.level:
            self.level = up
        else:
            while self.level > up and self._left(value, self.level):
                self.level -= 1
        return self.level

    def describe(self) -> str:
        """e.g. ``temperature 88.0C (>= 84.0C: reduced_channels)``; inside the hysteresis band
        (back past the threshold, not yet far enough to leave the level) e.g. ``temperature 82.5C
        (reduced_channels until below 79.0C)``, never a reading that contradicts its threshold."""
        if self.value is None:
            return f"{self.name} unknown"
        op = "<=" if self.sign < 0 else ">="
        if self.level:
            t = self.thresholds[self.level - 1]
            if not self._reached(self.value, self.level):
                edge = t - self.sign * self.hysteresis
                return (f"{self.name} {self.value:.1f}{self.unit} ({_ORDER[self.level].value} until "
                        f"{'above' if self.sign < 0 else 'below'} {edge:.1f}{self.unit})")
            return f"{self.name} {self.value:.1f}{self.unit} ({op} {t:.1f}{self.unit}: {_ORDER[self.level].value})"
        return f"{self.name} {self.value:.1f}{self.unit}"


def board_trip_c(trips: Iterable[Trip]) -> Optional[tuple]:
    """The temperature where the board starts throttling itself, from its trip points.

    Returns ``(temp_c, description)``: the lowest ``passive`` trip of any zone (fan ``active``
    trips are ignored; PMIC zones skipped); without one, 10 C below the lowest ``hot`` or
    ``critical`` trip; None when the board reports none.
    """
    trips = [t for t in trips if "pmic" not in t.zone]
    passive = [t for t in trips if t.kind == "passive"]
    if passive:
        t = min(passive, key=lambda x: x.temp_c)
        return t.temp_c, f"{t.zone} passive trip {t.temp_c:.1f}C"
    crit = [t for t in trips if t.kind in ("hot", "critical")]
    if crit:
        t = min(crit, key=lambda x: x.temp_c)
        return t.temp_c - 10.0, f"{t.zone} {t.kind} trip {t.temp_c:.1f}C - 10C"
    return None


class Throttle:
    """The throttle policy (thread-safe). See the module docstring.

    Args:
        cfg: ``config.throttle``.
        trips: the board's trip points (``Telemetry.trips()``).
        memory_budget_mb: ``service.memory_budget_mb``, MiB.
        channels: configured channel count (``len(service.channels)``).
        on_change: called as ``on_change(change)`` after each level change (publish STATUS/MQTT).
        clock: monotonic clock, s (tests).
    """

    def __init__(self, cfg: ThrottleConfig, trips: Iterable[Trip] = (), memory_budget_mb: float = 1500.0,
                 channels: int = 1, on_change: Optional[Callable[[Change], None]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.channels = channels
        self.on_change = on_change
        self._clock = clock
        self._lock = threading.Lock()
        if cfg.trip_c is not None:
            trip, where = cfg.trip_c, f"throttle.trip_c {cfg.trip_c:.1f}C"
        else:
            found = board_trip_c(trips)
            trip, where = found if found else (cfg.fallback_trip_c, f"throttle.fallback_trip_c {cfg.fallback_trip_c:.1f}C (no trip points)")
        self.trip_c = trip
        self.trip_source = where
        temps = [trip - cfg.reduce_margin_c, trip - cfg.queue_margin_c, trip - cfg.alerts_margin_c]
        budget = float(memory_budget_mb)
        avail = cfg.min_available_mb         # the floor; readings with a total raise it (min_available_frac)
        power = cfg.power_limit_mw
        self.ladders = {
            "temperature": Ladder("temperature", temps, cfg.temp_hysteresis_c, "C", resource="thermal"),
            "memory": Ladder("memory", [cfg.mem_reduce_frac * budget, cfg.mem_queue_frac * budget,
                                        cfg.mem_alerts_frac * budget], cfg.mem_hysteresis_frac * budget, "MiB"),
            "available": Ladder("available memory", [None, avail, avail / 2], max(16.0, avail / 4), "MiB",
                                lower_is_worse=True, resource="memory"),
            "power": Ladder("power", [power, power * 1.1 if power else None, None], cfg.power_hysteresis_mw, "mW"),
            "rtf": Ladder("rtf", [cfg.rtf_reduce, cfg.rtf_queue, None], cfg.rtf_hysteresis, resource="compute"),
        }
        self.level = Level.NORMAL
        self.reason = "start"
        self.history: list = []
        self._since = clock()
        self._throttled_since: Optional[float] = None   # when it left normal (monotonic s)
        self._lower_since: Optional[float] = None       # since when every signal asks for less (monotonic s)
        self._rtf: Optional[tuple] = None
        self._limits = self._make_limits()
        log.info("throttle: temperature levels %.1f/%.1f/%.1fC from %s; memory budget %.0f MiB; power limit %s",
                 *temps, where, budget, f"{power:.0f} mW" if power else "off")

    # -- inputs -----------------------------------------------------------------------------

    def observe_rtf(self, rtf: float) -> None:
        """Record a measured RTF (call at every finished request); used by the next :meth:`update`."""
        self._rtf = (float(rtf), self._clock())

    def update(self, reading: Optional[Reading] = None, *, app_mem_mib: Optional[float] = None,
               rtf: Optional[float] = None) -> Level:
        """Re-evaluate the level from a telemetry reading, the appliance's own memory use (MiB,
        counted against the budget) and/or an RTF measurement. Returns the (new) level.
        ``on_change`` is called after the lock is released (it may read :meth:`conditions`)."""
        change = None
        with self._lock:
            if rtf is not None:
                self.observe_rtf(rtf)
            now = self._clock()
            rtf_value = None
            if self._rtf is not None and now - self._rtf[1] <= max(60.0, 4 * self.cfg.min_dwell_s):
                rtf_value = self._rtf[0]
            lad = self.ladders
            lad["temperature"].update(reading.hot_c if reading is not None else None)
            self._free_floor(reading)
            lad["available"].update(reading.free_mib if reading is not None else None)
            lad["power"].update(reading.power_mw if reading is not None and self.cfg.power_limit_mw else None)
            lad["memory"].update(app_mem_mib)
            lad["rtf"].update(rtf_value)
            if not self.cfg.enabled:
                return self.level
            target = max(x.level for x in lad.values())
            cur = self.level.rank
            if target >= cur:
                self._lower_since = None
                if target > cur:
                    change = self._set(_ORDER[target], now, "; ".join(x.describe() for x in lad.values() if x.level == target))
            elif self._lower_since is None:
                self._lower_since = now
            if target < cur and now - self._lower_since >= self.cfg.min_dwell_s:
                worst = [x.describe() for x in lad.values() if x.level == target and target > 0]
                why = "; ".join(worst) if worst else ", ".join(x.describe() for x in lad.values() if x.value is not None)
                change = self._set(_ORDER[target], now, f"recovered: below {self.level.value} for "
                                                        f"{now - self._lower_since:.1f} s: {why}")
                self._lower_since = None
            level = self.level
            self._limits = self._make_limits()
        if change is not None and self.on_change is not None:
            try:
                self.on_change(change)
            except Exception:  # noqa: BLE001 - a publisher failure must not stop throttling
                log.exception("throttle on_change callback failed")
        return level

    def _free_floor(self, reading: Optional[Reading]) -> None:
        """The free-memory thresholds from ``reading``'s memory total (``min_available_frac``),
        never below ``min_available_mb``."""
        total = reading.total_mib if reading is not None else None
        floor = max(self.cfg.min_available_mb, self.cfg.min_available_frac * total if total else 0.0)
        self.ladders["available"].thresholds = [None, floor, floor / 2]
        self.ladders["available"].hysteresis = max(16.0, floor / 4)

    def _set(self, new: Level, now: float, reason: str) -> Change:
        old = self.level
        self.level, self.reason, self._since = new, reason, now
        if new is Level.NORMAL:
            self._throttled_since = None
        elif old is Level.NORMAL:
            self._throttled_since = now
        change = Change(now, old, new, reason)
        self.history.append(change)
        (log.warning if new.rank > old.rank else log.info)("throttle %s -> %s: %s", old.value, new.value, reason)
        return change

    # -- outputs ----------------------------------------------------------------------------

    def conditions(self) -> tuple:
        """Health's view (a :data:`~appliance.core.ConditionSource`): ``throttled`` while the level
        is above normal, its reason naming the level, the resource that runs short (``thermal``,
        ``memory``, ``power``, ``compute``) and the reading against its threshold, e.g.
        ``queue_low_priority by thermal: temperature 86.0C (>= 82.0C: queue_low_priority)``; once
        every signal is back, ``... recovering: ...`` until the level comes down."""
        with self._lock:
            lim, since = self._limits, self._throttled_since
        if lim.level is Level.NORMAL or since is None:
            return ()
        return (Condition("throttled", f"{lim.level.value} {lim.cause}", since),)

    def _cause(self) -> tuple:
        """``(text, resources)``: what holds the current level (lock held)."""
        hot = [x for x in self.ladders.values() if x.level > 0]
        if not hot:
            return f"recovering: every signal is back ({self.reason})", frozenset()
        top = max(x.level for x in hot)
        causes = [x for x in hot if x.level == top]
        res = tuple(dict.fromkeys(x.resource for x in causes))
        return f"by {'/'.join(res)}: " + "; ".join(x.describe() for x in causes), frozenset(res)

    def limits(self) -> Limits:
        """The scheduler's limits at the current level (see the module docstring); the same
        object until the next :meth:`update` (no allocation per call)."""
        return self._limits

    def _make_limits(self) -> Limits:
        """Limits of the current level with its cause (lock held)."""
        lvl, cfg, n = self.level, self.cfg, self.channels
        if lvl is Level.NORMAL:
            return Limits(lvl, n, 1, frozenset({"alert", "normal", "background"}))
        cause, res = self._cause()
        if lvl is Level.REDUCED_CHANNELS:
            return Limits(lvl, min(n, cfg.reduced_channels), 1, frozenset({"alert", "normal", "background"}), cause, res)
        if lvl is Level.QUEUE_LOW_PRIORITY:
            return Limits(lvl, min(n, cfg.reduced_channels), cfg.chunk_scale, frozenset({"alert", "normal"}), cause, res)
        return Limits(lvl, 1, cfg.chunk_scale, frozenset({"alert"}), cause, res)
