"""Telemetry samples: the :class:`Reading` and :class:`Trip` types every source produces,
:func:`merge` (a source over the sysfs base), and :func:`parse_tegrastats`, the parser of
NVIDIA's ``tegrastats`` lines (JetPack 5/6/7, root and non-root; field meanings follow the
tegrastats output grammar and jetson-stats' readers; the parser is our own).

Units: degrees C, MiB, mW, percent.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Optional

#: temperatures at or below this are "sensor off" (tegrastats prints -256C, sysfs -256000).
OFFLINE_C = -200.0
#: sensors that are not die temperatures (Xavier's PMIC reads a constant 50C): never "hottest".
_NOT_DIE = frozenset({"pmic"})


@dataclass(frozen=True)
class Trip:
    """A thermal trip point of the board (``thermal_zone*/trip_point_*``).

    Attributes:
        zone: zone name (``tj``, ``gpu``, ``cpu``, ...). kind: ``passive`` (the kernel/BPMP
        starts throttling clocks), ``active`` (fan step), ``hot`` or ``critical`` (shutdown).
        temp_c: degrees C.
    """

    zone: str
    kind: str
    temp_c: float


@dataclass(frozen=True)
class Reading:
    """One telemetry sample. None = not known from this source.

    Attributes:
        t: wall-clock time of the sample, s since the epoch.
        source: which source produced it (``tegrastats+sysfs``, ``sysfs``, ...).
        temps_c: online temperatures by lower-case zone name (``tj``, ``gpu``, ``cpu``, ``soc0``,
            ``tboard``...), degrees C. Offline sensors (``-256C``) are left out and listed in
            ``offline``.
        offline: names of sensors reported as off.
        mem_used_mib / mem_total_mib / mem_available_mib: system RAM, MiB (on Jetson this is
            the unified CPU+GPU memory).
        nvmap_mib: Jetson GPU/multimedia allocations (``NvMapMemUsed``), MiB.
        gpu_mem_used_mib / gpu_mem_total_mib: memory of a discrete GPU (NVML), MiB.
        power_mw: total input power, mW: ``VDD_IN`` (or ``POM_5V_IN``) when present, else the
            sum of the rails (AGX Orin has no ``VDD_IN``), else the GPU's own power (NVML).
        rails_mw: instantaneous power per rail, mW.
        gpu_load_pct: GPU utilisation, %.
        cpu_load_pct: per-core load, %, None for an offline core.
        cgroup_limit_mib / cgroup_available_mib: the tightest cgroup memory limit over this
            process and what it leaves (:mod:`appliance.ops.cgroup`), MiB; None without one.
    """

    t: float
    source: str = ""
    temps_c: dict = field(default_factory=dict)
    offline: tuple = ()
    mem_used_mib: Optional[float] = None
    mem_total_mib: Optional[float] = None
    mem_available_mib: Optional[float] = None
    nvmap_mib: Optional[float] = None
    gpu_mem_used_mib: Optional[float] = None
    gpu_mem_total_mib: Optional[float] = None
    power_mw: Optional[float] = None
    rails_mw: dict = field(default_factory=dict)
    gpu_load_pct: Optional[float] = None
    cpu_load_pct: tuple = ()
    cgroup_limit_mib: Optional[float] = None
    cgroup_available_mib: Optional[float] = None

    @property
    def free_mib(self) -> Optional[float]:
        """Free memory as the box sees it for this process, MiB: the least of ``MemAvailable``
        (or tegrastats' RAM total - used, on a Jetson the unified CPU+GPU memory) and the
        cgroup's headroom; None when neither is known."""
        known = [v for v in (self.mem_available_mib, self.cgroup_available_mib) if v is not None]
        return min(known) if known else None

    @property
    def total_mib(self) -> Optional[float]:
        """The memory total that bounds this process, MiB: RAM, or the cgroup's limit when smaller."""
        known = [v for v in (self.mem_total_mib, self.cgroup_limit_mib) if v is not None]
        return min(known) if known else None

    @property
    def tj_c(self) -> Optional[float]:
        """Junction temperature (``tj``), degrees C, or None."""
        return self.temps_c.get("tj")

    @property
    def gpu_c(self) -> Optional[float]:
        """GPU temperature, degrees C, or None (offline when the GPU is rail-gated)."""
        return self.temps_c.get("gpu")

    @property
    def hot_c(self) -> Optional[float]:
        """The temperature to throttle on: ``tj`` when known (it is the junction maximum), else
        the hottest die sensor, degrees C; None without any."""
        if "tj" in self.temps_c:
            return self.temps_c["tj"]
        die = [v for k, v in self.temps_c.items() if k not in _NOT_DIE]
        return max(die) if die else None


def merge(base: Reading, top: Reading) -> Reading:
    """``top`` over ``base``: every field of ``top`` that is known wins; dicts are merged key by
    key (``top`` wins); ``source`` becomes ``"<top>+<base>"``."""
    kw = {}
    for name in ("mem_used_mib", "mem_total_mib", "mem_available_mib", "nvmap_mib", "gpu_mem_used_mib",
                 "gpu_mem_total_mib", "power_mw", "gpu_load_pct", "cgroup_limit_mib", "cgroup_available_mib"):
        v = getattr(top, name)
        kw[name] = v if v is not None else getattr(base, name)
    temps = {**base.temps_c, **top.temps_c}
    offline = tuple(sorted((set(base.offline) | set(top.offline)) - set(temps)))
    rails = {**base.rails_mw, **top.rails_mw}
    if top.power_mw is None and base.power_mw is None and rails:
        kw["power_mw"] = total_power(rails)
    return Reading(t=top.t, source=f"{top.source}+{base.source}" if base.source else top.source,
                   temps_c=temps, offline=offline, rails_mw=rails,
                   cpu_load_pct=top.cpu_load_pct or base.cpu_load_pct, **kw)


def total_power(rails: dict) -> Optional[float]:
    """``VDD_IN``/``POM_5V_IN`` when present (the module input), else the sum of the rails
    (jetson-stats' ``total_power`` rule), mW."""
    for total in ("VDD_IN", "POM_5V_IN"):
        if total in rails:
            return float(rails[total])
    return float(sum(rails.values())) if rails else None


# ------------------------------------------------------------------------------- tegrastats

_TS_RE = re.compile(r"^\s*\d{2}-\d{2}-\d{4} \d{2}:\d{2}:\d{2}\s+")
_RAM_RE = re.compile(r"\bRAM (\d+)/(\d+)([kMG])B")
_CPU_RE = re.compile(r"\bCPU \[([^\]]*)\]")
_GR3D_RE = re.compile(r"\bGR3D_FREQ (\d+)%")
# name@value C, optionally a second value (JetPack 7: cpu@52.968C/52.968C). The name must start
# with a letter and touch the '@', so CPU entries (0%@729) and GR3D (39%@[305,0]) never match.
_TEMP_RE = re.compile(r"(?<![\w%])([A-Za-z][A-Za-z0-9_]*)@(-?\d+(?:\.\d+)?)C(?:/-?\d+(?:\.\d+)?C)*(?=\s|$)")
# NAME cur[mW]/avg[mW][/third[mW]] (third value on JetPack 7). RAM/SWAP end in MB and cannot match.
_RAIL_RE = re.compile(r"\b([A-Z][A-Z0-9_]*) (\d+)(?:mW)?/(\d+)(?:mW)?(?:/(\d+)(?:mW)?)?(?=\s|$)")
_UNIT_MIB = {"k": 1 / 1024, "M": 1.0, "G": 1024.0}


def parse_tegrastats(line: str, t: Optional[float] = None) -> Reading:
    """Parse one ``tegrastats`` output line (JetPack 5, 6 or 7; root or not).

    Handles: the optional ``MM-DD-YYYY HH:MM:SS`` prefix; ``RAM used/totalMB``; ``CPU [..]`` with
    ``off`` cores; ``GR3D_FREQ x%``, ``x%@f`` and ``x%@[f0,f1]`` (non-root lines have no clock);
    sensors in upper case (JP5) or lower case (JP6), one or two values (JP7), ``-256C`` = off;
    rails ``NAME cur/avg`` in mW or bare numbers, three values on JP7, ``NC`` (not connected)
    skipped. Missing fields stay None. Power: ``VDD_IN`` if present, else the sum of the rails.

    Args:
        line: the text line (trailing newline allowed).
        t: sample time, s since the epoch (default: now).

    Raises:
        ValueError: the line has neither a ``RAM`` field nor any sensor (not tegrastats output).
    """
    s = _TS_RE.sub("", line.strip())
    ram = _RAM_RE.search(s)
    temps: dict = {}
    offline: list = []
    for name, value in _TEMP_RE.findall(s):
        key = name.lower()
        v = float(value)
        if v <= OFFLINE_C:
            offline.append(key)
        else:
            temps[key] = v
    if ram is None and not temps and not offline:
        raise ValueError(f"not a tegrastats line: {line[:80]!r}")
    mem_used = mem_total = None
    if ram is not None:
        scale = _UNIT_MIB[ram.group(3)]
        mem_used, mem_total = int(ram.group(1)) * scale, int(ram.group(2)) * scale
    cpu: tuple = ()
    m = _CPU_RE.search(s)
    if m:
        loads = []
        for entry in m.group(1).split(","):
            entry = entry.strip()
            pct = re.match(r"(\d+)%", entry)
            loads.append(float(pct.group(1)) if pct else None)  # 'off' (or garbage) -> None
        cpu = tuple(loads)
    g = _GR3D_RE.search(s)
    rails = {name: float(cur) for name, cur, _avg, _third in _RAIL_RE.findall(s)
             if name not in ("NC", "RAM", "SWAP")}
    return Reading(
        t=time.time() if t is None else t, source="tegrastats", temps_c=temps,
        offline=tuple(k for k in offline if k not in temps), mem_used_mib=mem_used, mem_total_mib=mem_total,
        mem_available_mib=(mem_total - mem_used) if ram is not None else None,
        power_mw=total_power(rails), rails_mw=rails,
        gpu_load_pct=float(g.group(1)) if g else None, cpu_load_pct=cpu,
    )
