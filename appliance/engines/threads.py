"""The one thread budget of a CPU pipeline: how many threads, from the CPU set the process may
use, and how the ONNX Runtime pools share them.

The GPT, the Decoder and Vocos run on the one worker thread, one after the other; each ONNX
Runtime session has its own intra-op pool of :attr:`ThreadBudget.threads` threads (the caller
plus ``threads - 1`` workers), so at any moment only one pool has work. They must not *fight*:
an idle pool whose workers spin on after their session's run takes the cores from the next
stage's pool (measured on the 2-core host: three spinning pools made the pipeline slower than
the sum of its stages; ``bench/RESULTS.md``).
:func:`~appliance.engines.ort_vocoder.session_options` therefore lets
workers spin only *inside* a run (between the parallel sections of one graph, where spinning
saves a wake-up per section) and stops them when the run returns
(``session.force_spinning_stop``), or never spin (``model.spin_wait: false``). ONNX Runtime's
process-wide global pool would be one pool for all sessions, but Python can neither stop its
spinning nor size it twice in one process (a reload, tests), so it is not used.

How many threads, first match:

1. ``model.threads`` when it is not 0 (an explicit setting wins);
2. a CPU quota on the process's cgroup, the smallest along its path to the root: cgroup v2
   ``cpu.max`` (``"150000 100000"``: 1.5 CPUs; ``"max ..."``: none) or cgroup v1
   ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: none), what systemd's ``CPUQuota=``, Docker's
   ``--cpus`` and Kubernetes' CPU limits write. The threads are the quota rounded *down*, at least
   1: a thread beyond the quota is throttled in every period, and each parallel section then waits
   for it (measured on the 2-core host with a quota of 1 CPU: 2 threads made synthesis about 2x
   slower than 1, ``bench/RESULTS.md``);
3. the affinity mask (``os.sched_getaffinity``: ``taskset``, systemd's ``CPUAffinity=``, a
   cpuset cgroup), which already lists only the CPUs the process may run on.

The smaller of the quota and the affinity count wins. Every value says where it came from
(:attr:`ThreadBudget.source`): the runner logs it, ``status`` and ``calibrate`` report it.

Paths: ``/proc/self/cgroup`` names the process's cgroup per hierarchy, ``/proc/self/mountinfo``
where each hierarchy is mounted (inside a container its mount root is the container's own cgroup,
which ``/proc/self/cgroup`` then shows as ``/``). ``proc`` and the mount paths can be pointed
elsewhere for tests.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuQuota:
    """A CPU bandwidth limit found on the process's cgroup path.

    Attributes:
        cpus: CPUs' worth of time per period (quota / period), e.g. 1.0 or 1.5.
        where: the file it was read from and its content, e.g.
            ``/sys/fs/cgroup/system.slice/x.service/cpu.max "100000 100000"``.
    """

    cpus: float
    where: str


@dataclass(frozen=True)
class ThreadBudget:
    """The inference threads of a CPU runner and where the number came from.

    Attributes:
        threads: intra-op threads, >= 1.
        source: ``model.threads``, ``cgroup CPU quota of 1 CPU (<file> "<content>"), affinity 2
            CPUs`` or ``CPU affinity of 2 CPUs``.
        cpus: CPUs the process may use (the quota where one is set, else the affinity count).
    """

    threads: int
    source: str
    cpus: float

    def describe(self) -> str:
        """One line for the log and ``calibrate``: ``2 threads (CPU affinity of 2 CPUs)``."""
        return f"{self.threads} thread{'s' if self.threads != 1 else ''} ({self.source})"


def _mounts(proc: Path) -> list[tuple[str, str, str, set[str]]]:
    """Cgroup mounts from ``mountinfo``: (fstype, mount root, mount point, super options)."""
    out = []
    try:
        text = (proc / "self" / "mountinfo").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if not sep or len(f) < 5 or len(r) < 3 or r[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((r[0], f[3], f[4].replace("\\040", " "), set(r[2].split(","))))
    return out


def _read(p: Path) -> Optional[str]:
    try:
        return p.read_text().strip()
    except OSError:
        return None


def _walk(mount: str, root: str, path: str) -> list[Path]:
    """The cgroup directories from ``path`` (as ``/proc/self/cgroup`` names it) up to the mount."""
    if root not in ("", "/") and (path == root or path.startswith(root.rstrip("/") + "/")):
        path = path[len(root.rstrip("/")):] or "/"
    d = Path(mount) / path.lstrip("/")
    out = [d]
    while d != Path(mount) and d.parent != d:
        d = d.parent
        out.append(d)
    return out


def cpu_quota(proc: str | Path = "/proc") -> Optional[CpuQuota]:
    """The tightest CPU quota on the process's cgroup path (v2 ``cpu.max``, v1 CFS files), or
    None where none is set or none can be read. Never raises."""
    proc = Path(proc)
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    best: Optional[CpuQuota] = None
    mounts = _mounts(proc)
    for line in lines:
        hid, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        if hid == "0" and ctrls == "":
            cands = [(m, r) for t, r, m, _ in mounts if t == "cgroup2"]
            version = 2
        elif "cpu" in ctrls.split(","):
            cands = [(m, r) for t, r, m, opts in mounts if t == "cgroup" and "cpu" in opts]
            version = 1
        else:
            continue
        for mount, root in cands:
            for d in _walk(mount, root, path):
                q = _quota_v2(d) if version == 2 else _quota_v1(d)
                if q is not None and (best is None or q.cpus < best.cpus):
                    best = q
    return best


def _quota_v2(d: Path) -> Optional[CpuQuota]:
    raw = _read(d / "cpu.max")
    if not raw:
        return None
    parts = raw.split()
    try:
        if parts[0] == "max":
            return None
        return CpuQuota(int(parts[0]) / int(parts[1] if len(parts) > 1 else 100000), f'{d / "cpu.max"} "{raw}"')
    except (ValueError, ZeroDivisionError):
        return None


def _quota_v1(d: Path) -> Optional[CpuQuota]:
    quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
    try:
        q, p = int(quota or "-1"), int(period or "0")
    except ValueError:
        return None
    if q <= 0 or p <= 0:
        return None
    return CpuQuota(q / p, f'{d / "cpu.cfs_quota_us"} "{q}" / period {p}')


def affinity_cpus() -> int:
    """CPUs in the process's affinity mask (``os.cpu_count()`` where the platform has no mask)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def thread_budget(configured: int = 0, proc: str | Path = "/proc") -> ThreadBudget:
    """The inference threads (module docstring): ``configured`` (``model.threads``) when > 0,
    else the CPU quota rounded down and the affinity count, the smaller, at least 1. Never raises."""
    n = affinity_cpus()
    if configured > 0:
        return ThreadBudget(int(configured), "model.threads", float(n))
    q = cpu_quota(proc)
    if q is not None and math.floor(q.cpus) < n:
        return ThreadBudget(max(1, math.floor(q.cpus)), f"cgroup CPU quota of {_cpus(q.cpus)} ({q.where}), "
                            f"affinity {_cpus(n)}", q.cpus)
    return ThreadBudget(n, f"CPU affinity of {_cpus(n)}", float(n) if q is None else min(float(n), q.cpus))


def _cpus(n: float) -> str:
    return f"{n:g} CPU{'' if n == 1 else 's'}"

