"""Telemetry: temperatures, memory, power and GPU load behind one interface.

One :class:`~appliance.ops.readings.Reading` type, several sources
(:mod:`appliance.ops.sources`), one chosen at start by :func:`open_telemetry`:

* ``jtop``       – jetson-stats' service (``/run/jtop.sock``); optional, AGPL, import guarded.
* ``tegrastats`` – NVIDIA's ``tegrastats --interval N`` on Jetson, one line per interval,
  parsed by :func:`~appliance.ops.readings.parse_tegrastats`.
* ``nvml``       – ``nvidia-ml-py`` on desktop/server NVIDIA GPUs; optional, import guarded.
* ``sysfs``      – ``/sys/class/thermal`` zones (+ trip points), INA3221 hwmon rails, the GPU
  devfreq load, and ``/proc/meminfo`` (incl. ``NvMapMemUsed``): readable without root, present
  on every Linux box, so it is always the *base*: the chosen source's values override the
  base's, and the base fills what the source lacks (e.g. ``NvMapMemUsed``, which tegrastats
  does not print, or rails that non-root tegrastats hides).

``auto`` tries them in the order above and records why each was or was not used
(:attr:`Telemetry.reason`). Units: degrees C, MiB, mW, percent.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import Callable, Optional

from ..errors import ConfigError
from .readings import Reading, merge
from .sources import (
    JtopSource,
    NvmlSource,
    Source,
    SysfsSource,
    TegrastatsSource,
    find_tegrastats,
    read_text,
)

log = logging.getLogger(__name__)


class Telemetry:
    """The chosen source over the sysfs base. Build it with :func:`open_telemetry`.

    Attributes:
        source_name: ``jtop``, ``tegrastats``, ``nvml``, ``sysfs`` or ``none``.
        reason: why it was chosen (and why the others were not); logged at start.
        latest: the newest :class:`Reading` (None before the first).
    """

    def __init__(self, source: Optional[Source], base: Optional[SysfsSource], reason: str,
                 interval_s: float = 2.0) -> None:
        self._source = source
        self._base = base
        self.source_name = source.name if source is not None else (base.name if base is not None else "none")
        self.reason = reason
        self.interval_s = interval_s
        self.latest: Optional[Reading] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._listeners: list = []

    def read(self) -> Reading:
        """One merged sample (source over base); also stored in :attr:`latest`.

        A failing source is logged and the base sample is returned instead."""
        base = self._base.read() if self._base is not None else Reading(t=time.time(), source="none")
        r = base
        if self._source is not None:
            try:
                r = merge(base, self._source.read())
            except Exception as e:  # noqa: BLE001 - a sensor must never stop the daemon
                log.warning("telemetry source %s failed: %s; using %s only", self.source_name, e, base.source)
        self.latest = r
        return r

    def trips(self) -> list:
        """Trip points: the source's when it knows them (NVML), plus sysfs zones'."""
        out = list(self._source.trips()) if self._source is not None else []
        if self._base is not None:
            out += self._base.trips()
        return out

    def start(self, on_reading: Optional[Callable[[Reading], None]] = None) -> None:
        """Sample every ``interval_s`` on thread ``telemetry`` and pass each reading to
        ``on_reading`` (e.g. ``throttle.update``). Listener errors are logged, never raised."""
        if on_reading is not None:
            self._listeners.append(on_reading)
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="telemetry", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            r = self.read()
            for fn in self._listeners:
                try:
                    fn(r)
                except Exception:  # noqa: BLE001
                    log.exception("telemetry listener %r failed", fn)
            if self._stop.wait(self.interval_s):
                return

    def close(self) -> None:
        """Stop the sampling thread and the source."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._source is not None:
            self._source.close()



def open_telemetry(source: str = "auto", interval_s: float = 2.0, root: str = "/",
                   tegrastats: Optional[str] = None, jtop_socket: str = "/run/jtop.sock") -> Telemetry:
    """Choose and open the telemetry source (``telemetry.source`` / ``telemetry.interval_s``).

    ``auto`` tries jtop (only when ``jtop_socket`` exists and jetson-stats imports), then
    tegrastats (binary found), then NVML (nvidia-ml-py imports and a GPU answers), else sysfs
    alone. The sysfs base is always read underneath; ``none`` disables telemetry.

    Args:
        source: ``auto``, ``jtop``, ``tegrastats``, ``nvml``, ``sysfs`` or ``none``.
        interval_s: seconds between samples.
        root: filesystem root for sysfs/procfs (tests).
        tegrastats: path of the tegrastats binary (default: :func:`find_tegrastats`).
        jtop_socket: jetson-stats' service socket.

    Raises:
        ConfigError: an explicitly named source is not available here (message says why).
    """
    if source == "none":
        return Telemetry(None, None, "telemetry.source is 'none'", interval_s)
    base = SysfsSource(root)
    notes: list = []

    def try_jtop() -> Optional[Source]:
        if not os.path.exists(jtop_socket):
            notes.append(f"jtop: {jtop_socket} absent")
            return None
        try:
            return JtopSource(interval_s)
        except ImportError:
            notes.append("jtop: jetson-stats not installed")
        except Exception as e:  # noqa: BLE001 - jtop raises its own JtopException
            notes.append(f"jtop: {e}")
        return None

    def try_tegrastats() -> Optional[Source]:
        binary = tegrastats or find_tegrastats()
        if not binary:
            notes.append("tegrastats: not found (not a Jetson)")
            return None
        try:
            return TegrastatsSource(binary, interval_s)
        except OSError as e:
            notes.append(f"tegrastats: {binary}: {e}")
        return None

    def try_nvml() -> Optional[Source]:
        try:
            return NvmlSource()
        except ImportError:
            notes.append("nvml: nvidia-ml-py not installed")
        except Exception as e:  # noqa: BLE001 - pynvml.NVMLError (no driver / no GPU)
            notes.append(f"nvml: {e}")
        return None

    tries = {"jtop": try_jtop, "tegrastats": try_tegrastats, "nvml": try_nvml}
    order = list(tries) if source == "auto" else ([source] if source in tries else [])
    if source not in ("auto", "sysfs") and source not in tries:
        raise ConfigError(f"telemetry.source: unknown source {source!r} (auto, jtop, tegrastats, nvml, sysfs, none)")
    for name in order:
        src = tries[name]()
        if src is not None:
            extra = f" ({'; '.join(notes)})" if notes else ""
            reason = f"{name}{extra}, over sysfs: {base.describe()}"
            log.info("telemetry: %s", reason)
            return Telemetry(src, base, reason, interval_s)
    if source not in ("auto", "sysfs"):
        raise ConfigError(f"telemetry.source is {source!r} but it is not available here: {'; '.join(notes)}. "
                          f"Use 'auto' or 'sysfs'.")
    why = "requested" if source == "sysfs" else "; ".join(notes)
    reason = f"sysfs ({why}): {base.describe()}"
    log.info("telemetry: %s", reason)
    return Telemetry(None, base, reason, interval_s)


def process_memory_mib(pid: str = "self", root: str = "/") -> Optional[float]:
    """Resident memory (``VmRSS``) of a process, MiB, from ``/proc/<pid>/status``; None if unreadable."""
    text = read_text(os.path.join(root, f"proc/{pid}/status")) or ""
    m = re.search(r"^VmRSS:\s+(\d+)\s*kB", text, re.M)
    return int(m.group(1)) / 1024.0 if m else None


def appliance_memory_mib(reading: Optional[Reading] = None, rss_mib: Optional[float] = None) -> Optional[float]:
    """Memory the appliance uses, for ``throttle.update(app_mem_mib=...)`` against
    ``service.memory_budget_mb``, MiB: this process's RSS plus the GPU memory in ``reading``
    (``nvmap_mib`` on Jetson, ``gpu_mem_used_mib`` from NVML). Those GPU figures are for the
    whole device, so this assumes the appliance is the box's only GPU user (what an appliance is).

    Args:
        reading: the latest telemetry reading (None: RSS only).
        rss_mib: RSS to use instead of reading ``/proc/self/status`` (tests).
    """
    rss = process_memory_mib() if rss_mib is None else rss_mib
    gpu = None
    if reading is not None:
        gpu = reading.nvmap_mib if reading.nvmap_mib is not None else reading.gpu_mem_used_mib
    if rss is None and gpu is None:
        return None
    return (rss or 0.0) + (gpu or 0.0)
