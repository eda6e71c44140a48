"""Telemetry sources: each reads one kind of sensor interface into a
:class:`~appliance.ops.readings.Reading`.

* :class:`SysfsSource` – ``/sys/class/thermal`` zones (+ trip points), INA3221 hwmon rails, the
  GPU devfreq load and ``/proc/meminfo`` (incl. ``NvMapMemUsed``); no root needed, present on
  every Linux box (the base under every other source).
* :class:`TegrastatsSource` – NVIDIA's ``tegrastats --interval N`` on Jetson.
* :class:`JtopSource` – jetson-stats' service (``/run/jtop.sock``); optional, AGPL, import guarded.
* :class:`NvmlSource` – ``nvidia-ml-py`` on desktop/server NVIDIA GPUs; optional, import guarded.

:func:`~appliance.ops.telemetry.open_telemetry` picks one.
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
from typing import Optional

from .cgroup import cgroup_memory
from .readings import OFFLINE_C, Reading, Trip, parse_tegrastats, total_power

log = logging.getLogger(__name__)



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


def read_text(path: str) -> Optional[str]:
    """The stripped text of a small sysfs/procfs file, or None if it cannot be read."""
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
      ``NvMapMemUsed`` (Jetson GPU allocations), kB; the tightest cgroup limit over this process
      and its headroom (:func:`~appliance.ops.cgroup.cgroup_memory`: ``MemoryMax=``, a container);
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
                       if (read_text(os.path.join(d, "name")) or "").lower() == "ina3221"]
        self._gpu_load = [os.path.join(d, "device/load") for d in glob.glob(os.path.join(root, "sys/class/devfreq/*"))
                          if "gpu" in os.path.basename(d).lower() or "gpu" in (read_text(os.path.join(d, "device/of_node/name")) or "")]
        self._gpu_load = [p for p in self._gpu_load if os.path.exists(p)]

    def describe(self) -> str:
        """What this box offers, e.g. ``6 thermal zones, 1 INA3221, GPU load, NvMapMemUsed``."""
        mem = read_text(os.path.join(self.root, "proc/meminfo")) or ""
        parts = [f"{len(self._zones)} thermal zones", f"{len(self._hwmon)} INA3221"]
        if self._gpu_load:
            parts.append("GPU load")
        parts.append("NvMapMemUsed" if "NvMapMemUsed" in mem else "no NvMapMemUsed")
        cg = cgroup_memory(self.root)
        parts.append(f"cgroup memory limit {cg.limit_mib:.0f} MiB ({cg.path})" if cg else "no cgroup memory limit")
        return ", ".join(parts)

    def read(self) -> Reading:
        temps, offline = {}, []
        for z in self._zones:
            kind = read_text(os.path.join(z, "type"))
            if kind is None:
                continue
            name = _zone_name(kind)
            raw = read_text(os.path.join(z, "temp"))
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
        cg = cgroup_memory(self.root)
        rails = self._rails()
        load = None
        for p in self._gpu_load:
            raw = read_text(p)
            if raw and raw.isdigit():
                load = int(raw) / 10.0
                break
        return Reading(
            t=time.time(), source=self.name, temps_c=temps, offline=tuple(o for o in offline if o not in temps),
            mem_total_mib=total, mem_available_mib=avail,
            mem_used_mib=(total - avail) if total is not None and avail is not None else None,
            nvmap_mib=mem.get("NvMapMemUsed"), power_mw=total_power(rails), rails_mw=rails, gpu_load_pct=load,
            cgroup_limit_mib=cg.limit_mib if cg else None, cgroup_available_mib=cg.available_mib if cg else None,
        )

    def _meminfo(self) -> dict:
        """``/proc/meminfo`` values in MiB."""
        out = {}
        text = read_text(os.path.join(self.root, "proc/meminfo")) or ""
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
                label = read_text(label_path)
                mv = read_text(os.path.join(d, f"in{idx}_input"))
                ma = read_text(os.path.join(d, f"curr{idx}_input"))
                if label and label != "NC" and mv and ma and mv.lstrip("-").isdigit() and ma.lstrip("-").isdigit():
                    rails[label] = int(mv) * int(ma) / 1000.0
        return rails

    def trips(self) -> list:
        out = []
        for z in self._zones:
            kind = read_text(os.path.join(z, "type"))
            if kind is None:
                continue
            for tp in glob.glob(os.path.join(z, "trip_point_*_type")):
                ttype = read_text(tp)
                ttemp = read_text(tp[: -len("_type")] + "_temp")
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
            power_mw=float(tot) if tot is not None else total_power(rails), rails_mw=rails,
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



def find_tegrastats() -> Optional[str]:
    """Path of the ``tegrastats`` binary (``PATH``, then ``/usr/bin``), or None."""
    found = shutil.which("tegrastats")
    if found:
        return found
    return "/usr/bin/tegrastats" if os.access("/usr/bin/tegrastats", os.X_OK) else None
