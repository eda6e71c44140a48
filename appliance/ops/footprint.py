"""What counts against ``service.memory_budget_mb``, by the kind of memory the box has.

Three kinds (:func:`memory_kind`), one rule each:

* ``unified`` (a Jetson: the GPU allocates from system RAM, ``NvMapMemUsed`` in ``/proc/meminfo``
  or ``/etc/nv_tegra_release`` present): **RSS + NvMap** against the budget. NvMap is the GPU's
  allocations (weights, KV cache, CUDA context) that RSS does not show.
* ``discrete`` (a desktop or server GPU): the process's **device memory** against the budget, as
  NVML reports it for this PID, **CUDA context included** (weights, KV cache, activations,
  workspaces, loaded kernels, the context: one basis for every backend; before, torch's 621 MiB
  context was left out and llama.cpp's was not). Where NVML is missing, the backend's own figure
  plus the context it measured. Host **RSS** is held against its own limit,
  ``service.host_rss_limit_mb``: a discrete card's memory and the host's are separate pools, and
  torch's CUDA libraries alone keep about 0.7 GiB resident on the host (measured on an H200:
  ``import torch`` 491 MiB, + CUDA context 614, + one cuBLAS FP16 GEMM 767; bench/HISTORY.md).
* ``cpu``: **RSS** against the budget.

Every kind also reports the **all-in** figure (:attr:`Footprint.all_in_mib`): host RSS + device
memory with the context (RSS + NvMap on a Jetson, RSS on a CPU), what the box holds in total and
what ``status`` and ``bench: shipped`` record, comparable across backends and boxes.

The service layer holds no tensors: the backend's device figure comes in as a number.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional

from .sources import read_text
from .telemetry import process_memory_mib

log = logging.getLogger(__name__)

KINDS = ("unified", "discrete", "cpu")


def is_jetson(root: str = "/") -> bool:
    """True on an NVIDIA Jetson (unified memory): ``/etc/nv_tegra_release`` exists or
    ``/proc/meminfo`` has ``NvMapMemUsed``."""
    if os.path.exists(os.path.join(root, "etc/nv_tegra_release")):
        return True
    return "NvMapMemUsed" in (read_text(os.path.join(root, "proc/meminfo")) or "")


def memory_kind(device: str, root: str = "/") -> str:
    """``unified``, ``discrete`` or ``cpu`` for a backend running on ``device`` (``cpu``,
    ``cuda``, ``cuda:0``, ...)."""
    if is_jetson(root):
        return "unified"
    return "discrete" if device.startswith("cuda") else "cpu"


def nvmap_mib(root: str = "/") -> Optional[float]:
    """``NvMapMemUsed`` from ``/proc/meminfo``, MiB (None where absent)."""
    m = re.search(r"^NvMapMemUsed:\s+(\d+)\s*kB", read_text(os.path.join(root, "proc/meminfo")) or "", re.M)
    return int(m.group(1)) / 1024.0 if m else None


def smi_process_mib(pid: int) -> Optional[float]:
    """Device memory ``nvidia-smi --query-compute-apps`` reports for ``pid`` summed over the GPUs,
    MiB (NVML through the driver's own tool, for a box without ``nvidia-ml-py``); None when the tool
    is missing, fails, or does not list the process."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("nvidia-smi: %s", e)
        return None
    mib = [float(m) for p, m in (ln.split(",")[:2] for ln in out.splitlines() if ln.count(",") >= 1)
           if p.strip() == str(pid) and m.strip().replace(".", "", 1).isdigit()]
    return sum(mib) if mib else None


def nvml_process_mib(pid: Optional[int] = None) -> Optional[float]:
    """Device memory NVML reports for process ``pid`` (default: this one) summed over the GPUs,
    MiB, CUDA context included; without ``nvidia-ml-py``, ``nvidia-smi``'s figure
    (:func:`smi_process_mib`); None without a driver, or the process on no GPU.
    """
    pid = os.getpid() if pid is None else pid
    try:
        import pynvml
    except ImportError:
        return smi_process_mib(pid)
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - pynvml.NVMLError: no driver or no GPU
        log.debug("nvml: %s", e)
        return None
    try:
        total, seen = 0, False
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == pid and p.usedGpuMemory is not None:
                    total += int(p.usedGpuMemory)
                    seen = True
        return total / (1024.0 * 1024.0) if seen else None
    except Exception as e:  # noqa: BLE001
        log.debug("nvml: %s", e)
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


@dataclass(frozen=True)
class Footprint:
    """One reading of the appliance's memory, by the rule of its kind (module docstring).

    Attributes:
        kind: ``unified``, ``discrete`` or ``cpu``.
        rss_mib: the process's resident host memory, MiB.
        device_mib: GPU memory counted for it (NvMap on a Jetson, NVML or the backend's figure on
            a desktop GPU, 0 on a CPU), MiB.
        source: where ``device_mib`` came from: ``nvmap``, ``nvml``, ``backend`` or ``none``.
        context_mib: the bare CUDA context the runner measured (inside ``device_mib`` and
            ``budget_mib``; reported apart), MiB.
        budget_mib: what counts against ``service.memory_budget_mb``, MiB.
        host_mib: what counts against ``service.host_rss_limit_mb`` (RSS on a desktop GPU;
            None on the other kinds, whose RSS is in ``budget_mib``).
    """

    kind: str
    rss_mib: float
    device_mib: float
    source: str
    budget_mib: float
    host_mib: Optional[float]
    context_mib: float = 0.0

    @property
    def all_in_mib(self) -> float:
        """Host RSS + device memory (CUDA context included; NvMap on a Jetson; 0 on a CPU), MiB."""
        return self.rss_mib + self.device_mib

    def describe(self) -> str:
        """One phrase for logs and STATUS, e.g. ``812 MiB device memory (nvml) + 1100 MiB host RSS``."""
        if self.kind == "discrete":
            ctx = f", {self.context_mib:.0f} MiB of it the CUDA context" if self.context_mib else ", CUDA context included"
            return (f"{self.device_mib:.0f} MiB device memory ({self.source}{ctx}) against the budget, "
                    f"{self.rss_mib:.0f} MiB host RSS against service.host_rss_limit_mb; all-in {self.all_in_mib:.0f} MiB")
        if self.kind == "unified":
            return f"{self.rss_mib:.0f} MiB RSS + {self.device_mib:.0f} MiB GPU memory ({self.source})"
        return f"{self.rss_mib:.0f} MiB RSS"


def combine(kind: str, rss_mib: float, nvmap: Optional[float], nvml: Optional[float],
            backend_mib: float, context_mib: float = 0.0) -> Footprint:
    """The :class:`Footprint` of one set of readings (pure; :func:`measure` reads them).

    Args:
        kind: :data:`KINDS`.
        rss_mib: resident host memory, MiB.
        nvmap: ``NvMapMemUsed`` MiB (Jetson) or None. nvml: this process's NVML figure or None.
        backend_mib: the backend's own device memory figure (caching allocator), MiB.
        context_mib: the bare CUDA context (``RunnerInfo.context_bytes``), MiB: inside NVML's
            figure; added to the backend's own figure (the allocator's, which never held it).
    """
    if kind not in KINDS:
        raise ValueError(f"memory kind {kind!r}: one of {KINDS}")
    if kind == "unified":
        dev, src = (nvmap, "nvmap") if nvmap is not None else (backend_mib, "backend")
        return Footprint(kind, rss_mib, dev, src, rss_mib + dev, None)
    if kind == "discrete":
        if nvml is not None:
            return Footprint(kind, rss_mib, nvml, "nvml", nvml, rss_mib, context_mib)
        dev = backend_mib + context_mib
        return Footprint(kind, rss_mib, dev, "backend", dev, rss_mib, context_mib)
    return Footprint(kind, rss_mib, 0.0, "none", rss_mib, None)


def measure(kind: str, backend_mib: float = 0.0, context_mib: float = 0.0, root: str = "/") -> Optional[Footprint]:
    """Read this process's :class:`Footprint` now (None when ``/proc`` is unreadable).

    Args:
        kind: :func:`memory_kind` of the running backend.
        backend_mib: the backend's own device memory figure, MiB (``Pipeline.device_memory_bytes``).
        context_mib: the bare CUDA context, MiB (``RunnerInfo.context_bytes``).
    """
    rss = process_memory_mib(root=root)
    if rss is None:
        return None
    nvmap = nvmap_mib(root) if kind == "unified" else None
    nvml = nvml_process_mib() if kind == "discrete" else None
    return combine(kind, rss, nvmap, nvml, backend_mib, context_mib)
