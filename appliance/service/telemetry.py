"""Telemetry: temperatures, memory, power and GPU load behind one interface.

One :class:`Reading` type, several sources, one chosen at start by :func:`open_telemetry`:

* ``jtop``       – jetson-stats' service (``/run/jtop.sock``); optional, AGPL, import guarded.
* ``tegrastats`` – NVIDIA's ``tegrastats --interval N`` on Jetson, one line per interval,
  parsed by :func:`parse_tegrastats` (JetPack 5/6/7 line formats, root and non-root).
* ``nvml``       – ``nvidia-ml-py`` on desktop/server NVIDIA GPUs; optional, import guarded.
* ``sysfs``      – ``/sys/class/thermal`` zones (+ trip points), INA3221 hwmon rails, the GPU
  devfreq load, and ``/proc/meminfo`` (incl. ``NvMapMemUsed``): readable without root, present
  on every Linux box, so it is always the *base*: the chosen source's values override the
  base's, and the base fills what the source lacks (e.g. ``NvMapMemUsed``, which tegrastats
  does not print, or rails that non-root tegrastats hides).

``auto`` tries them in the order above and records why each was or was not used
(:attr:`Telemetry.reason`). Units: degrees C, MiB, mW, percent. Field meanings follow the
tegrastats grammar in ``shared/reference/jetson-platform.md`` §1.2 and jtop's readers; the
parser is our own.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..errors import ConfigError

log = logging.getLogger(__name__)

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
                 "gpu_mem_total_mib", "power_mw", "gpu_load_pct"):
        v = getattr(top, name)
        kw[name] = v if v is not None else getattr(base, name)
    temps = {**base.temps_c, **top.temps_c}
    offline = tuple(sorted((set(base.offline) | set(top.offline)) - set(temps)))
    rails = {**base.rails_mw, **top.rails_mw}
    if top.power_mw is None and base.power_mw is None and rails:
        kw["power_mw"] = _total_power(rails)
    return Reading(t=top.t, source=f"{top.source}+{base.source}" if base.source else top.source,
                   temps_c=temps, offline=offline, rails_mw=rails,
                   cpu_load_pct=top.cpu_load_pct or base.cpu_load_pct, **kw)


def _total_power(rails: dict) -> Optional[float]:
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
        power_mw=_total_power(rails), rails_mw=rails,
        gpu_load_pct=float(g.group(1)) if g else None, cpu_load_pct=cpu,
    )


# ------------------------------------------------------------------------------- sources


class Source:
    """A telemetry source: :meth:`read` returns a :class:`Reading`; :meth:`close` frees it."""

    name = "none"

    def read(self) -> Reading:
        """One sample (may block briefly; never longer than about a second)."""
        return Reading(t=time.time(), source=self.name)

    def trips(self) -> list:
        """The board's trip points (:class:`Trip`); empty when unknown."""
        return []

    def close(self) -> None:
        """Stop subprocesses / connections."""


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _zone_name(kind: str) -> str:
    """``tj-thermal`` -> ``tj``, ``CPU-therm`` -> ``cpu``, ``x86_pkg_temp`` stays."""
    k = kind.strip().lower()
    for suffix in ("-thermal", "_thermal", "-therm", "_therm"):
        if k.endswith(suffix) and len(k) > len(suffix):
            return k[: -len(suffix)]
    return k


class SysfsSource(Source):
    """``/sys`` and ``/proc`` readers, no root needed.

    * temperatures: ``sys/class/thermal/thermal_zone*/{type,temp}`` (milli-degrees C; a read
      error or <= -200 C means the sensor is off, e.g. a rail-gated GPU);
    * trip points: ``thermal_zone*/trip_point_<i>_{type,temp}``;
    * memory: ``proc/meminfo`` ``MemTotal``, ``MemAvailable`` (used = total - available) and
      ``NvMapMemUsed`` (Jetson GPU allocations), kB;
    * power: INA3221 hwmon (``sys/class/hwmon/hwmon*`` whose ``name`` is ``ina3221``):
      ``in<i>_label`` names the rail, ``in<i>_input`` mV x ``curr<i>_input`` mA;
    * GPU load: devfreq devices whose name contains ``gpu``: ``device/load`` in per mille.

    Args:
        root: filesystem root to read under (tests use a fixture tree; default ``/``).
    """

    name = "sysfs"

    def __init__(self, root: str = "/") -> None:
        self.root = root
        self._zones = sorted(glob.glob(os.path.join(root, "sys/class/thermal/thermal_zone*")),
                             key=lambda p: int(re.sub(r"\D", "", os.path.basename(p)) or 0))
        self._hwmon = [d for d in glob.glob(os.path.join(root, "sys/class/hwmon/hwmon*"))
                       if (_read_text(os.path.join(d, "name")) or "").lower() == "ina3221"]
        self._gpu_load = [os.path.join(d, "device/load") for d in glob.glob(os.path.join(root, "sys/class/devfreq/*"))
                          if "gpu" in os.path.basename(d).lower() or "gpu" in (_read_text(os.path.join(d, "device/of_node/name")) or "")]
        self._gpu_load = [p for p in self._gpu_load if os.path.exists(p)]

    def describe(self) -> str:
        """What this box offers, e.g. ``6 thermal zones, 1 INA3221, GPU load, NvMapMemUsed``."""
        mem = _read_text(os.path.join(self.root, "proc/meminfo")) or ""
        parts = [f"{len(self._zones)} thermal zones", f"{len(self._hwmon)} INA3221"]
        if self._gpu_load:
            parts.append("GPU load")
        parts.append("NvMapMemUsed" if "NvMapMemUsed" in mem else "no NvMapMemUsed")
        return ", ".join(parts)

    def read(self) -> Reading:
        temps, offline = {}, []
        for z in self._zones:
            kind = _read_text(os.path.join(z, "type"))
            if kind is None:
                continue
            name = _zone_name(kind)
            raw = _read_text(os.path.join(z, "temp"))
            try:
                v = int(raw) / 1000.0 if raw is not None else None
            except ValueError:
                v = None
            if v is None or v <= OFFLINE_C:
                offline.append(name)
            elif name not in temps or v > temps[name]:
                temps[name] = v
        mem = self._meminfo()
        total, avail = mem.get("MemTotal"), mem.get("MemAvailable")
        rails = self._rails()
        load = None
        for p in self._gpu_load:
            raw = _read_text(p)
            if raw and raw.isdigit():
                load = int(raw) / 10.0
                break
        return Reading(
            t=time.time(), source=self.name, temps_c=temps, offline=tuple(o for o in offline if o not in temps),
            mem_total_mib=total, mem_available_mib=avail,
            mem_used_mib=(total - avail) if total is not None and avail is not None else None,
            nvmap_mib=mem.get("NvMapMemUsed"), power_mw=_total_power(rails), rails_mw=rails, gpu_load_pct=load,
        )

    def _meminfo(self) -> dict:
        """``/proc/meminfo`` values in MiB."""
        out = {}
        text = _read_text(os.path.join(self.root, "proc/meminfo")) or ""
        for line in text.splitlines():
            m = re.match(r"(\w+):\s+(\d+)\s*kB", line)
            if m:
                out[m.group(1)] = int(m.group(2)) / 1024.0
        return out

    def _rails(self) -> dict:
        rails = {}
        for d in self._hwmon:
            for label_path in glob.glob(os.path.join(d, "in*_label")):
                idx = re.search(r"in(\d+)_label$", label_path).group(1)
                label = _read_text(label_path)
                mv = _read_text(os.path.join(d, f"in{idx}_input"))
                ma = _read_text(os.path.join(d, f"curr{idx}_input"))
                if label and label != "NC" and mv and ma and mv.lstrip("-").isdigit() and ma.lstrip("-").isdigit():
                    rails[label] = int(mv) * int(ma) / 1000.0
        return rails

    def trips(self) -> list:
        out = []
        for z in self._zones:
            kind = _read_text(os.path.join(z, "type"))
            if kind is None:
                continue
            for tp in glob.glob(os.path.join(z, "trip_point_*_type")):
                ttype = _read_text(tp)
                ttemp = _read_text(tp[: -len("_type")] + "_temp")
                try:
                    out.append(Trip(_zone_name(kind), (ttype or "").lower(), int(ttemp) / 1000.0))
                except (TypeError, ValueError):
                    continue
        return out


class TegrastatsSource(Source):
    """Runs ``tegrastats --interval <ms>`` for the life of the daemon (it never exits by itself)
    and parses the newest line at each :meth:`read`.

    Args:
        binary: path of ``tegrastats``.
        interval_s: its sampling interval, s.

    Raises:
        OSError: the binary cannot be started.
    """

    name = "tegrastats"

    def __init__(self, binary: str, interval_s: float = 1.0) -> None:
        self.binary = binary
        self._proc = subprocess.Popen([binary, "--interval", str(max(1, int(interval_s * 1000)))],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        self._line: Optional[str] = None
        self._got = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="tegrastats", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for line in self._proc.stdout:
            if line.strip():
                self._line = line
                self._got.set()
        log.warning("tegrastats exited with status %s", self._proc.wait())

    def read(self) -> Reading:
        self._got.wait(timeout=1.0)
        line = self._line
        if line is None:
            return Reading(t=time.time(), source=self.name)
        try:
            return parse_tegrastats(line)
        except ValueError as e:
            log.warning("%s", e)
            return Reading(t=time.time(), source=self.name)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._thread.join(timeout=2)
        if self._proc.stdout:
            self._proc.stdout.close()


class JtopSource(Source):  # pragma: no cover - needs jetson-stats' root service on a Jetson
    """jetson-stats client (``from jtop import jtop``), connected to ``/run/jtop.sock``.

    Keys used: ``stats['Temp <zone>']``, ``stats['GPU']`` (load %), ``memory['RAM']``
    (``tot``/``used``/``shared`` in kB; ``shared`` = NvMapMemUsed), ``power['rail']`` and
    ``power['tot']`` (mW). jetson-stats is AGPL-3.0 and version-coupled to its service; it
    is never required.

    Raises:
        ImportError: jetson-stats is not installed. Exception from jtop: service unreachable.
    """

    name = "jtop"

    def __init__(self, interval_s: float = 1.0) -> None:
        from jtop import jtop  # noqa: PLC0415 - optional dependency

        self._j = jtop(interval=interval_s)
        self._j.start()

    def read(self) -> Reading:
        j = self._j
        stats = dict(j.stats)
        temps, offline = {}, []
        for k, v in stats.items():
            if k.startswith("Temp "):
                name = k[5:].lower()
                if isinstance(v, (int, float)) and v > OFFLINE_C:
                    temps[name] = float(v)
                else:
                    offline.append(name)
        ram = j.memory.get("RAM", {})
        rails = {n: float(r.get("power", 0)) for n, r in j.power.get("rail", {}).items() if r.get("online", True)}
        tot = j.power.get("tot", {}).get("power")
        total_mib = ram.get("tot", 0) / 1024 or None
        used_mib = ram.get("used", 0) / 1024 if "used" in ram else None
        return Reading(
            t=time.time(), source=self.name, temps_c=temps, offline=tuple(offline), mem_total_mib=total_mib,
            mem_used_mib=used_mib, mem_available_mib=(total_mib - used_mib) if total_mib and used_mib is not None else None,
            nvmap_mib=ram.get("shared", 0) / 1024 if "shared" in ram else None,
            power_mw=float(tot) if tot is not None else _total_power(rails), rails_mw=rails,
            gpu_load_pct=float(stats["GPU"]) if isinstance(stats.get("GPU"), (int, float)) else None,
        )

    def close(self) -> None:
        self._j.close()


class NvmlSource(Source):  # pragma: no cover - needs an NVIDIA driver
    """NVML (``nvidia-ml-py``, module ``pynvml``) for GPU ``index``: temperature, memory,
    power (``nvmlDeviceGetPowerUsage``, mW) and utilisation.

    Raises:
        ImportError: nvidia-ml-py missing. pynvml.NVMLError: no driver / no such GPU.
    """

    name = "nvml"

    def __init__(self, index: int = 0) -> None:
        import pynvml  # noqa: PLC0415 - optional dependency

        self._nv = pynvml
        pynvml.nvmlInit()
        self._h = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.device_name = pynvml.nvmlDeviceGetName(self._h)

    def read(self) -> Reading:
        nv, h = self._nv, self._h

        def safe(fn, *a):
            try:
                return fn(h, *a)
            except nv.NVMLError:
                return None

        temp = safe(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU)
        mem = safe(nv.nvmlDeviceGetMemoryInfo)
        power = safe(nv.nvmlDeviceGetPowerUsage)
        util = safe(nv.nvmlDeviceGetUtilizationRates)
        return Reading(
            t=time.time(), source=self.name, temps_c={"gpu": float(temp)} if temp is not None else {},
            gpu_mem_used_mib=mem.used / 2**20 if mem else None, gpu_mem_total_mib=mem.total / 2**20 if mem else None,
            power_mw=float(power) if power is not None else None, gpu_load_pct=float(util.gpu) if util else None,
        )

    def trips(self) -> list:
        try:
            slow = self._nv.nvmlDeviceGetTemperatureThreshold(self._h, self._nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
            return [Trip("gpu", "passive", float(slow))]
        except self._nv.NVMLError:
            return []

    def close(self) -> None:
        self._nv.nvmlShutdown()


# ------------------------------------------------------------------------------- front end


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


def find_tegrastats() -> Optional[str]:
    """Path of the ``tegrastats`` binary (``PATH``, then ``/usr/bin``), or None."""
    found = shutil.which("tegrastats")
    if found:
        return found
    return "/usr/bin/tegrastats" if os.access("/usr/bin/tegrastats", os.X_OK) else None


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
    text = _read_text(os.path.join(root, f"proc/{pid}/status")) or ""
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


__all__ = ["appliance_memory_mib", "Reading", "Trip", "Telemetry", "open_telemetry", "parse_tegrastats", "merge", "process_memory_mib",
           "SysfsSource", "TegrastatsSource", "JtopSource", "NvmlSource", "Source", "find_tegrastats"]
