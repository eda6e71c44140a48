"""What the daemon starts for self-throttling: telemetry sampled on its own thread, each reading fed
to the :class:`~appliance.ops.throttle.Throttle` policy (:class:`Monitor`), and
:func:`open_monitor`, which starts one or says why it cannot.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from ..errors import ApplianceError
from .readings import Reading
from .telemetry import appliance_memory_mib, open_telemetry
from .throttle import Change, Limits, Throttle

log = logging.getLogger(__name__)


class Monitor:
    """What the daemon starts: telemetry sampled on its own thread, each reading fed to a
    :class:`Throttle` together with the appliance's memory use as the budget counts it
    (:attr:`budget_mib`; unset: :func:`~appliance.ops.telemetry.appliance_memory_mib`).

    Daemon use::

        mon = Monitor(cfg, on_change=lambda ch: publish_status(),
                      budget_mib=lambda: current_mib(pipeline))   # appliance.service.memory
        mon.start()
        ...  mon.observe_rtf(done.rtf)          # after every finished request
        ...  StatusReply(throttle=mon.level, temperature_c=mon.temperature_c, ...)
        ...  mon.limits()                       # for the scheduler
        mon.close()

    Args:
        cfg: the whole config (``telemetry``, ``throttle``, ``service``).
        on_change: passed to :class:`Throttle`.
        telemetry: an opened :class:`~appliance.ops.telemetry.Telemetry` (default:
            ``open_telemetry`` of ``cfg.telemetry``'s source, interval and root).
        budget_mib: ``() -> MiB`` counted against the budget by the box's kind (the daemon gives
            ``service.memory.current_mib``; None from it: not known now); None: the telemetry's
            figure (:attr:`budget_mib`).

    Raises:
        ConfigError: ``telemetry.source`` names a source this machine does not have.
    """

    def __init__(self, cfg, on_change: Optional[Callable[[Change], None]] = None, telemetry=None,
                 budget_mib: Optional[Callable[[], Optional[float]]] = None) -> None:
        self.telemetry = telemetry if telemetry is not None else open_telemetry(
            cfg.telemetry.source, cfg.telemetry.interval_s, root=str(cfg.resolve(cfg.telemetry.root)))
        self.throttle = Throttle(cfg.throttle, self.telemetry.trips(), cfg.service.memory_budget_mb,
                                 len(cfg.service.channels), on_change=on_change)
        #: ``() -> MiB`` counted against the budget by the box's kind; None: the telemetry's figure
        self.budget_mib = budget_mib
        self.memory_mib: Optional[float] = None   # what the last reading fed the throttle

    def start(self) -> None:
        """Take a first reading now, then sample every ``telemetry.interval_s`` on a thread."""
        self.telemetry.start(self._on_reading)

    def _on_reading(self, reading: Reading) -> None:
        """Feed ``reading`` and the appliance's memory to the throttle. The memory is what
        :attr:`budget_mib` says: the figure the start-up fit and the health check count against the
        budget by the box's kind (:mod:`appliance.ops.footprint`). The telemetry's GPU figure (NVML:
        every process on the GPU and the CUDA context; NvMap: every allocation on the box) plus RSS
        stands in only where nothing set :attr:`budget_mib`: on an H200 NVML read 2204 MiB where
        the allocator held 804, and a budget the start-up check had passed sent the throttle to
        ``alerts_only`` at once."""
        if self.budget_mib is None:
            self.memory_mib = appliance_memory_mib(reading)
        else:
            try:
                self.memory_mib = self.budget_mib()
            except Exception:  # noqa: BLE001 - a probe must not stop the throttle
                self.memory_mib = None
        self.throttle.update(reading, app_mem_mib=self.memory_mib)

    def observe_rtf(self, rtf: float) -> None:
        """Record a finished request's RTF (used at the next reading)."""
        self.throttle.observe_rtf(rtf)

    @property
    def level(self) -> str:
        """Throttle level string for STATUS / MQTT (``normal`` ...)."""
        return self.throttle.level.value

    @property
    def temperature_c(self) -> Optional[float]:
        """The temperature the throttle uses (``tj`` or hottest sensor), C; None if unknown."""
        r = self.telemetry.latest
        return r.hot_c if r is not None else None

    def limits(self) -> Limits:
        """The scheduler's limits now."""
        return self.throttle.limits()

    def conditions(self) -> tuple:
        """Health's view: :meth:`Throttle.conditions`."""
        return self.throttle.conditions()

    def close(self) -> None:
        """Stop sampling (and the tegrastats subprocess, if any)."""
        self.telemetry.close()


def open_monitor(cfg, on_change: Optional[Callable[[Change], None]] = None,
                 budget_mib: Optional[Callable[[], Optional[float]]] = None) -> Optional[Monitor]:
    """A started :class:`Monitor`; None (logged) when telemetry cannot be opened (no throttle)."""
    try:
        mon = Monitor(cfg, on_change=on_change, budget_mib=budget_mib)
        mon.start()
    except ApplianceError as e:
        log.warning("throttle off: %s", e)
        return None
    return mon
