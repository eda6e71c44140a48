"""The one thread budget of a CPU pipeline: how many threads, from the CPU set the process may
use, and how the ONNX Runtime pools share them.

The GPT, the Decoder and Vocos run on the one worker thread, one after the other; each ONNX
Runtime session has its own intra-op pool of :attr:`ThreadBudget.threads` threads (the caller
plus ``threads - 1`` workers), so at any moment only one pool has work. They must not *fight*:
an idle pool whose workers spin on after their session's run takes the cores from the next
stage's pool (measured on the 2-core host, quiet: with three spinning pools the vocoder windows
took 0.17 s per second of audio inside the pipeline against 0.05 with one budget, and the
pipeline's RTF was 1.28x the sum of its stages; ``bench/HISTORY.md``).
:func:`~appliance.engines.onnx.vocoder.session_options` therefore lets workers sleep when idle
(``model.spin_wait: false``, the default: the lowest pipeline RTF in four interleaved rounds from
quiet to loaded), or spin only *inside* a run and stop when it returns
(``session.force_spinning_stop``; ``true``: the vocoder no longer slows down, but the GPT step
inside the pipeline did not beat sleeping, and on a loaded host it was 2x slower). ONNX Runtime's
process-wide global pool would be one pool for all sessions, but Python can neither stop its
spinning nor size it twice in one process (a reload, tests), so it is not used.

How many threads, first match:

1. ``model.threads`` when it is not 0 (an explicit setting wins);
2. a CPU quota on the process's cgroup, the smallest along its path to the root: cgroup v2
   ``cpu.max`` (``"150000 100000"``: 1.5 CPUs; ``"max ..."``: none) or cgroup v1
   ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: none), what systemd's ``CPUQuota=``, Docker's
   ``--cpus`` and Kubernetes' CPU limits write. The threads are the quota rounded *down*, at least
   1: a thread beyond the quota is throttled in every period, and each parallel section then waits
   for it (measured on the 2-core host in a cgroup with a quota of 1 CPU: ONNX Runtime INT8 at 2
   threads made the pipeline's RTF 0.92 against 0.65 at 1, ``bench/HISTORY.md``);
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



class StepThreads:
    """The decode step's threads, chosen by measurement while it runs, within the budget.

    A decode step reads every weight once: on the 2-core host one thread already reads most of
    the bandwidth, and llama.cpp's threads meet at a spinning barrier after every operation. On
    a quiet host two threads made the q8_0 step 1.2x faster than one (7.8 against 9.4 ms); on a
    contended one (other processes runnable, CPU pressure 75-96 %) two threads were 6x *slower*
    (58.7 against 9.9 ms: a descheduled thread holds every barrier), ``bench/HISTORY.md``. No
    fixed count is right for both, and a box changes between them (a neighbour starts), so a
    runner that can change its threads between two steps (llama.cpp: ``llama_set_n_threads``)
    asks this object before every step and reports how long it took:

    * it runs at the count chosen for the step's row count (:meth:`at`; every row count starts at
      ``most``) and keeps a moving average of the step time per thread count and row count;
    * every ``probe_every`` steps (the first time after ``first_probe``) it runs ``probe_steps``
      steps at the next of the other candidates (``most``, ``most // 2``, 1) and moves that row
      count to it when their mean is below ``gain`` times the current average at the same rows.

    Each row count has its own choice: one row is bandwidth-bound, where a second thread gains
    little and loses much to a busy neighbour, while three rows on llama.cpp's q8_0 / q4_K kernels
    are compute-bound and need both cores (in the daemon on a quiet 2-core host one row measured
    6.4 ms at 1 thread against 8.7 at 2; one choice for all rows then ran three channels' steps on
    one thread: ``bench/HISTORY.md``).

    Two steps in a row at more than one thread that take over ``collapse`` times their average
    probe at once (against those two times) instead of at the next turn: with two threads on two
    cores, a busy neighbour makes every barrier wait for a descheduled thread (89 ms against 26 ms
    at one thread, measured in the daemon beside two busy loops), and waiting up to
    ``probe_every`` steps for the next probe was a pause of seconds in the speech.

    The cost is the probes: at most ``probe_steps`` slower steps every ``probe_every``. Not
    thread-safe (the worker thread's runner owns it).
    """

    def __init__(self, most: int, probe_every: int = 256, probe_steps: int = 2, first_probe: int = 16,
                 gain: float = 0.85, collapse: float = 2.0) -> None:
        self.candidates = sorted({max(1, most), max(1, most // 2), 1}, reverse=True)
        self.probe_every, self.probe_steps, self.gain, self.collapse = probe_every, probe_steps, gain, collapse
        self._due = first_probe
        self._cur: dict[int, int] = {}                   # rows -> threads chosen for them
        self._rows = 1                                   # the last step's rows
        self._avg: dict[tuple[int, int], float] = {}     # (threads, rows) -> step s
        self._probe: Optional[tuple[int, int, list[float]]] = None   # (threads, rows, times)
        self._turn = 0
        self._slow: list[float] = []                    # consecutive steps over collapse x the average
        self.switches = 0

    def at(self, rows: int) -> int:
        """The threads chosen for steps of ``rows`` rows."""
        return self._cur.get(rows, self.candidates[0])

    @property
    def current(self) -> int:
        """The threads chosen for the last step's row count (prompts run at it too)."""
        return self.at(self._rows)

    def next(self, rows: int) -> int:
        """The threads for the next step of ``rows`` rows."""
        self._rows = rows
        if self._probe is not None:
            return self._probe[0]
        cur = self.at(rows)
        others = [c for c in self.candidates if c != cur]
        if self._due <= 0 and others and (cur, rows) in self._avg:
            t = others[self._turn % len(others)]
            self._turn += 1
            self._probe = (t, rows, [])
            return t
        return cur

    def observe(self, rows: int, threads: int, seconds: float) -> Optional[str]:
        """The step of ``rows`` rows just run at ``threads`` took ``seconds``. Returns a line for the
        log when this moved the choice for ``rows``, else None."""
        p = self._probe
        if p is not None and p[0] == threads:
            if p[1] != rows:                     # the batch changed under the probe: start over later
                self._probe, self._due = None, self.probe_every
                return None
            p[2].append(seconds)
            if len(p[2]) < self.probe_steps:
                return None
            self._probe, self._due = None, self.probe_every
            old = self.at(rows)
            mean, cur = sum(p[2]) / len(p[2]), self._avg[(old, rows)]
            if mean >= self.gain * cur:
                return None
            self._cur[rows] = threads
            self._avg[(threads, rows)] = mean
            self.switches += 1
            return (f"decode step at {threads} thread{'s' if threads != 1 else ''} now: {1000 * mean:.1f} ms against "
                    f"{1000 * cur:.1f} ms at {old} ({rows} row{'s' if rows != 1 else ''})")
        a = self._avg.get((threads, rows))
        self._due -= 1
        if a is not None and seconds > self.collapse * a and threads > 1:
            self._slow.append(seconds)
            if len(self._slow) >= 2:         # twice in a row: a neighbour took a core; probe now,
                self._avg[(threads, rows)] = sum(self._slow) / len(self._slow)   # against these times
                self._slow, self._due = [], min(self._due, 0)
            return None
        self._slow = []
        self._avg[(threads, rows)] = seconds if a is None else 0.8 * a + 0.2 * seconds
        return None
