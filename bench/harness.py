"""The bench's shared harness: the machine it runs on, candidates in turns, one record schema.

Every benchmark (``python -m bench NAME``) writes its results through :func:`write`: one JSON object
per line appended to ``bench/results/<bench>.jsonl`` (or ``$BENCH_OUT/<bench>.jsonl``: the GPU
machine returns what it writes under ``$OUT``). A record is :func:`record`'s dict:

* the shared fields, in this order: ``bench`` (the command's name), ``date`` (UTC, ISO 8601 to the
  minute), ``machine`` (a label: ``cpu-2core``, ``h100``, ``h200``; ``--machine`` or ``$BENCH_MACHINE``
  or guessed by :func:`machine_label`), ``commit`` (``git rev-parse --short HEAD`` of this tree,
  ``+dirty`` when tracked files differ, else ``$BENCH_COMMIT``, else ``unknown``), ``checkpoint``
  (``tiny``/``full``/null), ``backend`` (``onnxruntime``, ``llama.cpp``, ``torch-cpu``,
  ``torch-cuda``, ... or null), ``notes`` (free text);
* ``host``: what the figures depend on: the CPU model and cores, and the host's read bandwidth
  (GB/s, :func:`host_read_gbps`) where the bench measured it, or the GPU's name, driver and clocks
  (:func:`gpu_info`);
* the figures (milliseconds ``_ms``, seconds ``_s``, MiB ``_mib``, ratios unitless).

:func:`in_turns` runs candidates round-robin so that a busy neighbour on a shared host slows all of
them alike; benchmarks state ratios between candidates of one run.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SHARED = ("bench", "date", "machine", "commit", "checkpoint", "backend", "notes")


def _git(*args: str) -> str | None:
    try:
        p = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def commit() -> str:
    """``$BENCH_COMMIT`` where set (a copied tree, e.g. the GPU machine's: its ``.git`` need not be
    the tree's), else this tree's commit, short hash, ``+dirty`` when tracked files differ from it;
    ``unknown`` without git."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    h = _git("rev-parse", "--short", "HEAD")
    if not h:
        return "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return h + ("+dirty" if dirty else "")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_info() -> dict | None:
    """The first NVIDIA GPU: ``name``, ``driver``, ``sm_clock_mhz``/``mem_clock_mhz`` (now) and
    their maxima, ``memory_mib``; through NVML (``nvidia-ml-py``) or ``nvidia-smi``. None without one."""
    try:
        import pynvml as n

        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        name = n.nvmlDeviceGetName(h)
        info = {"name": name.decode() if isinstance(name, bytes) else name,
                "driver": str(n.nvmlSystemGetDriverVersion()),
                "sm_clock_mhz": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
                "sm_clock_max_mhz": n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM),
                "mem_clock_mhz": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM),
                "mem_clock_max_mhz": n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_MEM),
                "memory_mib": n.nvmlDeviceGetMemoryInfo(h).total // 2**20}
        n.nvmlShutdown()
        return info
    except Exception:  # noqa: BLE001 - no NVML: try the command line tool
        pass
    q = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,memory.total"
    try:
        p = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0 or not p.stdout.strip():
        return None
    v = [x.strip() for x in p.stdout.splitlines()[0].split(",")]
    num = [int(float(x)) if x.replace(".", "", 1).isdigit() else None for x in v[2:]]
    return {"name": v[0], "driver": v[1], "sm_clock_mhz": num[0], "sm_clock_max_mhz": num[1],
            "mem_clock_mhz": num[2], "mem_clock_max_mhz": num[3], "memory_mib": num[4]}


def machine_label(explicit: str | None = None) -> str:
    """``explicit``, else ``$BENCH_MACHINE``, else the GPU's short name (``h100``, ``h200``), else
    ``cpu-<N>core`` with N the cores this process may use."""
    if explicit:
        return explicit
    if os.environ.get("BENCH_MACHINE"):
        return os.environ["BENCH_MACHINE"]
    g = gpu_info()
    if g:
        for word in g["name"].replace("-", " ").split():
            if any(c.isdigit() for c in word) and word[0].isalpha():
                return word.lower()
        return g["name"].lower().replace(" ", "-")
    return f"cpu-{len(os.sched_getaffinity(0))}core"


def host_read_gbps(threads: int, mib: int = 512, reps: int = 7) -> float:
    """The host's read bandwidth with ``threads`` threads: the best of ``reps`` numpy reductions
    of a ``mib`` MiB float32 array split over the threads (numpy releases the GIL), GB/s (1e9 B)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    a = np.ones(mib * 2**20 // 4, np.float32)
    parts = np.array_split(a, max(1, threads))
    best = 0.0
    with ThreadPoolExecutor(max(1, threads)) as ex:
        for _ in range(reps):
            t = time.perf_counter()
            list(ex.map(np.add.reduce, parts))
            best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return round(best, 2)


def host(read_gbps: float | None = None, gpu: bool = False) -> dict:
    """The ``host`` field: CPU model, usable cores, 1-min load average, the read bandwidth if
    measured, and :func:`gpu_info` when ``gpu``."""
    h = {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "load_1m": round(os.getloadavg()[0], 2)}
    if read_gbps is not None:
        h["read_gbps"] = read_gbps
    if gpu:
        h["gpu"] = gpu_info()
    return h


def checkpoint_size(ckpt: str | Path | None) -> str | None:
    """``full`` (20 GPT layers) or ``tiny`` for a checkpoint directory; None when unreadable."""
    if not ckpt:
        return None
    try:
        cfg = json.loads((Path(ckpt) / "asset" / "gpt" / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return "full" if cfg.get("num_hidden_layers") == 20 else "tiny"


def now() -> str:
    """UTC now, ISO 8601 to the minute (``2026-12-06T15:30Z``)."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")


def record(bench: str, *, checkpoint: str | None, backend: str | None, notes: str = "",
           machine: str | None = None, host_info: dict | None = None, **figures) -> dict:
    """One record: the shared fields (module docstring), ``host``, then ``figures`` as given.

    Raises:
        ValueError: a figure reuses a shared field's name.
    """
    clash = set(figures) & set(SHARED)
    if clash:
        raise ValueError(f"figures named like shared fields: {sorted(clash)}")
    rec = {"bench": bench, "date": now(), "machine": machine_label(machine), "commit": commit(),
           "checkpoint": checkpoint, "backend": backend, "notes": notes}
    if host_info is not None:
        rec["host"] = host_info
    rec.update(figures)
    return rec


def check(rec: dict) -> list[str]:
    """What is wrong with a record's shared fields (empty: nothing)."""
    bad = [f"missing {k}" for k in SHARED if k not in rec]
    for k in ("bench", "date", "machine", "commit"):
        if k in rec and not (isinstance(rec[k], str) and rec[k]):
            bad.append(f"{k} must be a non-empty string")
    if isinstance(rec.get("date"), str):
        try:
            dt.date.fromisoformat(rec["date"][:10])
        except ValueError:
            bad.append(f"date {rec['date']!r} is not ISO 8601")
    for k in ("checkpoint", "backend", "notes"):
        if rec.get(k) is not None and not isinstance(rec[k], str):
            bad.append(f"{k} must be a string or null")
    return bad


def results_dir() -> Path:
    """``$BENCH_OUT`` when set (the GPU machine's ``$OUT``), else ``bench/results``."""
    return Path(os.environ["BENCH_OUT"]) if os.environ.get("BENCH_OUT") else RESULTS


def write(records: Iterable[dict], out: str | Path | None = None) -> list[Path]:
    """Append each record as one JSON line to ``<out or results_dir()>/<bench>.jsonl``; print it.

    Raises:
        ValueError: a record lacks a shared field (:func:`check`).
    """
    d = Path(out) if out else results_dir()
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for rec in records:
        bad = check(rec)
        if bad:
            raise ValueError(f"bad record for {rec.get('bench')}: {bad}")
        p = d / f"{rec['bench']}.jsonl"
        with p.open("a", encoding="utf-8") as f:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        print(json.dumps(rec, ensure_ascii=False))
        paths.append(p)
    return paths


def read(d: str | Path | None = None) -> list[dict]:
    """Every record under ``d`` (default ``bench/results``), files by name, lines in order;
    ``_file``/``_line`` added to each."""
    out = []
    for p in sorted(Path(d or RESULTS).glob("*.jsonl")):
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                rec = json.loads(line)
                rec["_file"], rec["_line"] = p.name, i
                out.append(rec)
    return out


def in_turns(candidates: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Call each candidate once per round, in turns (the order rotates each round so none is
    always first); each call returns its own measurement. Returns name -> ``rounds`` values."""
    names = list(candidates)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            out[n].append(candidates[n]())
    return out


# ---------------------------------------------------------------- a process placed as its unit would be


def unit_cpu(tree: Path) -> dict:
    """``CPUWeight=``, ``Nice=``, ``LimitNICE=`` of ``tree``'s ``systemd/chattts-appliance.service``
    (systemd's defaults where unset: weight 100, nice 0, no limit)."""
    got = {"cpu_weight": 100, "nice": 0, "limit_nice": None}
    keys = {"CPUWeight": "cpu_weight", "Nice": "nice", "LimitNICE": "limit_nice"}
    f = tree / "systemd" / "chattts-appliance.service"
    for line in f.read_text().splitlines() if f.exists() else []:
        k, _, v = line.strip().partition("=")
        if k in keys and v.strip().lstrip("+-").isdigit():
            got[keys[k]] = int(v)
    return got


def cpu_cgroup(name: str, weight: int) -> tuple[Path | None, str]:
    """A fresh cgroup with the cpu controller and systemd's ``CPUWeight=`` ``weight`` (v2
    ``cpu.weight``; v1 ``cpu.shares`` = weight x 1024 / 100, systemd's mapping): (its directory, how),
    or (None, why not)."""
    v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")
    try:
        if (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.controllers").read_text().split():
            d = v2 / name
            d.mkdir(exist_ok=True)
            (d / "cpu.weight").write_text(str(weight))
            return d, f"cgroup v2 {d} cpu.weight {weight}"
        if (v1 / "cpu.shares").exists():
            d = v1 / name
            d.mkdir(exist_ok=True)
            (d / "cpu.shares").write_text(str(weight * 1024 // 100))
            return d, f"cgroup v1 {d} cpu.shares {weight * 1024 // 100} (CPUWeight={weight})"
        return None, "no cgroup with the cpu controller (neither v2 nor v1) under /sys/fs/cgroup"
    except OSError as e:
        return None, f"cannot make a cpu cgroup under /sys/fs/cgroup: {e}"


def rmdir_quiet(d: Path | None) -> None:
    """Remove the empty directory ``d`` (a cgroup) if it is there; errors ignored."""
    if d is not None:
        try:
            d.rmdir()
        except OSError:
            pass


def burners(n: int, where: dict | None = None) -> list:
    """``n`` busy-loop processes (a neighbour that wants whole cores): in ``where["dir"]`` (a cgroup
    of the default weight: another service as the daemon's unit sees it) at niceness ``where["nice"]``
    (the daemon's), or where this process is."""
    def enter() -> None:
        if where and where.get("dir"):
            (Path(where["dir"]) / "cgroup.procs").write_text(str(os.getpid()))
        if where:
            os.setpriority(os.PRIO_PROCESS, 0, where["nice"])
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=enter) for _ in range(n)]


def stop_all(procs: list) -> None:
    """Terminate ``procs`` and wait for each (10 s)."""
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(10)


def add_common(ap) -> None:
    """The options every benchmark takes: ``--machine`` (label) and ``--out`` (results folder)."""
    ap.add_argument("--machine", default=None, help="machine label (default: $BENCH_MACHINE or guessed)")
    ap.add_argument("--out", default=None, help="results folder (default: $BENCH_OUT or bench/results)")
