"""Loading the ahead-of-time packages, and trying that in a child process first (the *load canary*).

On the H200 with torch 2.11.0+cu130 the six packages ``engines compile`` had just built crashed
torch's own loader with a segmentation fault (``torch/export/pt2_archive/_package.py`` line 1045,
``_load_aoti``), with the private C++ loader and with the public ``aoti_load_package`` alike; the
cause is not known. A fault kills the process and no ``try`` catches it, and a daemon that dies at
every start under systemd is a crash loop. So before a process loads a package set in-process,
:func:`check` has a child process (``sys.executable``) load every package of the set with the same
loader (:func:`load_package`) and run each once on zero inputs of the recorded shapes. Its exit
status decides: a signal, an exception, another exit status or a timeout is a failure (the caller
runs plain CUDA graphs with the reason); success lets the caller load in-process. On a fault the
child prints the native frames of every thread (c10's fatal-signal handler) besides
faulthandler's Python frames, and the reason names the innermost native frames of the faulting
thread (:func:`_native_frames`), so a crash in the loader says in which library it happened.

**Markers.** The verdict is written into the package directory as
``load-check-torch-<torch version>.json`` (:func:`marker_path`) with the sha256 of every package
it covers, so later starts with the same torch and the same files take the recorded verdict and
skip the child (a rebuild replaces the directory and so the marker; deleting the file makes the
next start try again). While a process loads the set in-process it holds a ``.loading-<pid>``
file (:class:`loading`); a start that finds one whose process is gone records a failure: the
previous start died while loading in-process even though the child had loaded them.

The child's loader is named by :data:`LOADER` (``module:function``, called as ``fn(path,
device_index)`` returning ``run(list of tensors)``); tests point it at one that kills itself.
"""

from __future__ import annotations

import datetime as dt
import inspect
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)

#: The loader the child uses, as ``module:function`` (read at each :func:`check`).
LOADER = "appliance.engines.torch.aot_canary:load_package"
#: Seconds the child may take: a base (its imports) plus this much per package.
TIMEOUT_BASE_S, TIMEOUT_PER_PACKAGE_S = 90.0, 30.0
_CHILD = ("import json, sys; job = json.loads(sys.argv[1]); sys.path[:0] = job['path']; "
          "from appliance.engines.torch.aot_canary import _child; sys.exit(_child(job))")


def load_package(path: str | os.PathLike, device_index: int) -> Callable[[list], list]:
    """A package's ``run(flat tensors) -> outputs``: one runner without thread synchronisation
    (``run_single_threaded``: what a CUDA-graph capture needs) on device ``device_index`` (-1: the
    current one).

    Through AOTInductor's own C++ loader (``torch._C._aoti.AOTIModelPackageLoader``, what
    ``torch._inductor.aoti_load_package`` wraps), so a start imports no inductor: the public
    wrapper imports inductor (sympy, dynamo; 5-8 s) and, to print a warning when the CPU differs
    from the one that built the package, finds this CPU's vector ISA by compiling and loading test
    programs in subprocesses that import torch again. On the H200 (torch 2.11, 2026-12-04) that made
    loading three packages take 45-54 s. Where the loader's signature differs (another torch), the
    public wrapper.

    Raises:
        RuntimeError (and others): the loader's own errors. A fault in the loader is not raised:
            it kills the process (what :func:`check` is for).
    """
    native = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    try:
        loader = native(str(path), "model", True, 1, device_index) if native is not None else None
    except TypeError:   # another signature
        loader = None
    if loader is not None:
        run = getattr(loader, "boxed_run", None) or loader.run
        return lambda xs: run(xs)
    from torch._inductor import aoti_load_package

    try:
        params = set(inspect.signature(aoti_load_package).parameters)
    except (TypeError, ValueError):
        params = set()
    kw = {k: v for k, v in (("run_single_threaded", True), ("device_index", device_index)) if k in params}
    pkg = aoti_load_package(str(path), **kw)
    return lambda xs: pkg(*xs)


@dataclass(frozen=True)
class Verdict:
    """What :func:`check` found: ``ok``; ``reason`` in one line (why not, or what loaded);
    ``recorded``: taken from the marker (no child ran); ``marker``: the file holding it (None when
    it could not be written)."""

    ok: bool
    reason: str
    recorded: bool
    marker: Optional[Path]


def marker_path(directory: str | os.PathLike) -> Path:
    """The marker of this torch version in a package directory."""
    return Path(directory) / f"load-check-torch-{torch.__version__}.json"


def _digests(manifest: dict) -> dict[str, str]:
    return {name: g["sha256"] for name, g in sorted(manifest.get("graphs", {}).items())}


def check(directory: str | os.PathLike, manifest: dict, device_index: int = -1, *, force: bool = False,
          loader: Optional[str] = None, timeout_s: Optional[float] = None) -> Verdict:
    """Whether this process may load the package set in ``directory`` (its ``manifest``).

    The recorded verdict when the marker covers these packages under this torch (and no start died
    loading them since), unless ``force``; else the child's verdict, recorded. Never raises for
    what the child does; a marker that cannot be written is logged and the verdict still returned.
    """
    d = Path(directory)
    mark, digests = marker_path(d), _digests(manifest)
    dead = _dead_loads(d)
    old = _read(mark)
    valid = old is not None and old.get("torch") == torch.__version__ and old.get("packages") == digests
    if dead and not (valid and old.get("ok") is False):
        reason = (f"a start (pid {dead[0]}) died while loading the ahead-of-time packages in {d} in-process, "
                  f"after a test process had loaded them with torch {torch.__version__}")
        return _record(mark, False, reason, digests)
    if valid and not force:
        return Verdict(bool(old.get("ok")), f"{old.get('reason', '')} (recorded {old.get('checked', '?')})",
                       True, mark)
    ok, reason = _run_child(d, manifest, device_index, loader or LOADER, timeout_s)
    if ok:
        log.info("ahead-of-time packages in %s: %s", d, reason)
    return _record(mark, ok, reason, digests)


def _record(mark: Path, ok: bool, reason: str, digests: dict[str, str]) -> Verdict:
    if not ok:
        reason += (f"; recorded in {mark}: later starts with this torch skip them without trying "
                   f"(rebuild with chattts-appliance engines compile, or delete that file to try again)")
    data = {"torch": torch.__version__, "ok": ok, "reason": reason, "packages": digests,
            "checked": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    try:
        tmp = mark.with_name(f".{mark.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, mark)
    except OSError as e:
        log.warning("cannot record the load check in %s (%s): the next start checks again", mark, e)
        return Verdict(ok, reason, False, None)
    return Verdict(ok, reason, False, mark)


def _read(p: Path) -> Optional[dict]:
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# --------------------------------------------------------------------------- the child
def _run_child(d: Path, manifest: dict, device_index: int, loader: str,
               timeout_s: Optional[float]) -> tuple[bool, str]:
    graphs = manifest.get("graphs", {})
    job = {"path": sys.path, "loader": loader, "device_index": device_index,
           "device": manifest.get("identity", {}).get("device", {}).get("type", "cpu"),
           "packages": [str(d / g["file"]) for _, g in sorted(graphs.items())], "inputs": manifest.get("inputs")}
    timeout = timeout_s or TIMEOUT_BASE_S + TIMEOUT_PER_PACKAGE_S * len(graphs)
    tv, t0 = torch.__version__, time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _CHILD, json.dumps(job)],
                           capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        return False, (f"the ahead-of-time packages in {d} did not load within {timeout:.0f} s in a test process "
                       f"({_stage(e.stdout)})")
    except OSError as e:
        return False, f"the load check of the ahead-of-time packages in {d} could not start a test process ({e})"
    if r.returncode == 0:
        return True, (f"{len(graphs)} packages loaded and run once on zero inputs in a test process "
                      f"in {time.perf_counter() - t0:.1f} s")
    stage = _stage(r.stdout)
    if r.returncode < 0:
        try:
            name = signal.Signals(-r.returncode).name
        except ValueError:
            name = "unknown signal"
        where, native = _fault_frame(r.stderr), _native_frames(r.stderr)
        log.warning("load check of %s: the test process died by %s; its stderr ends:\n%s", d, name, r.stderr[-4000:])
        return False, (f"the ahead-of-time packages in {d} crash torch {tv}'s loader (signal {-r.returncode}, "
                       f"{name}, {stage} in a test process{', at ' + where if where else ''}"
                       f"{'; native: ' + native if native else ''}){_compiler_hint(native)}")
    last = next((ln.strip() for ln in reversed(r.stderr.splitlines()) if ln.strip()), f"exit status {r.returncode}")
    return False, f"the ahead-of-time packages in {d} fail with torch {tv}'s loader ({last[:300]}; {stage} in a test process)"


def _compiler_hint(native: str) -> str:
    """A sentence when the fault lies in the C++ standard library inside a package's own ``.so``.

    Measured on the H200 image (torch 2.11+cu130): inductor compiled the packages with ``$CXX`` =
    ``/opt/gcc/bin/g++`` (another GCC than the system's), and every package, even the documentation's
    one-Linear example, faulted at load in ``std::regex_traits`` code inside its ``wrapper.so``;
    the same packages built with ``CXX=/usr/bin/g++`` (the system GCC 13, whose C++ runtime the
    process loads) loaded and ran (bench/HISTORY.md)."""
    if "std::" not in (native or "") or ".so" not in native:
        return ""
    try:
        from torch._inductor import config as ic
        cxx = ic.cpp.cxx[-1] if isinstance(ic.cpp.cxx, tuple) else str(ic.cpp.cxx)
    except Exception:  # noqa: BLE001 - the hint is best effort
        cxx = os.environ.get("CXX", "g++")
    return (f"; the fault is in C++ standard library code compiled into the package by {cxx}: build with the "
            f"system's compiler, whose C++ runtime this process loads (CXX=/usr/bin/g++ chattts-appliance "
            f"engines compile)")


def _stage(stdout) -> str:
    """What the child was doing last, from its progress lines."""
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    last = None
    for ln in (stdout or "").splitlines():
        try:
            last = json.loads(ln)
        except ValueError:
            continue
    if not isinstance(last, dict) or "doing" not in last:
        return "before loading any package"
    return f"{last['doing']} {Path(last['package']).name}"


def _fault_frame(stderr: str) -> str:
    """The innermost Python frame of a faulthandler report (``pkg/file.py:LINE in FUNC``), or ''."""
    m = re.search(r'File "([^"]+)", line (\d+) in (\S+)', stderr or "")
    if not m:
        return ""
    path = m.group(1)
    path = path.split("site-packages/")[-1] if "site-packages/" in path else "/".join(Path(path).parts[-3:])
    return f"{path}:{m.group(2)} in {m.group(3)}"


_FRAME = re.compile(r"^\s*frame #\d+: (.*?) \(0x[0-9a-f]+ in (.+?)\)\s*$")


def _native_frames(stderr: str, n: int = 3) -> str:
    """The innermost ``n`` native frames of the faulting thread from c10's fatal-signal report
    (the child turns it on), ``sym (lib) <- ...``, the handler's own frames left out; '' if none."""
    frames = []
    for ln in (stderr or "").splitlines():
        m = _FRAME.match(ln)
        if m:
            frames.append((m.group(1), Path(m.group(2)).name))
        elif frames and not ln.strip():
            break                                  # the first block is the faulting thread
    seen_handler = next((i for i, (sym, _) in enumerate(frames) if "fatalSignalHandler" in sym), None)
    if seen_handler is not None:
        frames = frames[seen_handler + 1:]
        if frames and frames[0][0].startswith("<unknown function>") and frames[0][1].startswith("libc.so"):
            frames = frames[1:]                    # the kernel's signal trampoline
    out = [f"{sym.replace('<unknown function> ', '')} ({lib})" for sym, lib in frames[:n]]
    return " <- ".join(out)[:400]


def _child(job: dict) -> int:
    """In the child: load each package with the named loader, then run it once on zeros of the
    recorded input shapes and dtypes; progress on stdout, one JSON line before each stage. A fault
    prints the native frames of every thread on stderr (c10's fatal-signal handler, where torch
    has it) besides faulthandler's Python frames."""
    import importlib

    traces = getattr(torch._C, "_set_print_stack_traces_on_fatal_signal", None)
    if traces is not None:
        traces(True)

    mod, _, fn = job["loader"].partition(":")
    load = getattr(importlib.import_module(mod), fn)
    dev = job["device_index"]
    device = torch.device("cuda", max(dev, 0)) if job["device"] == "cuda" else torch.device(job["device"])
    xs = None
    for p in job["packages"]:
        print(json.dumps({"doing": "loading", "package": p}), flush=True)
        run = load(p, dev)
        if job.get("inputs"):
            print(json.dumps({"doing": "running", "package": p}), flush=True)
            if xs is None:
                xs = [torch.zeros(shape, dtype=getattr(torch, dtype.rpartition(".")[2]), device=device)
                      for _, shape, dtype in job["inputs"]]
            with torch.inference_mode():
                run(list(xs))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    print(json.dumps({"doing": "done", "package": ""}), flush=True)
    return 0


# --------------------------------------------------------------------------- in-process sentinel
class loading:
    """Context: a ``.loading-<pid>`` file in ``directory`` while this process loads the packages
    in-process; removed on leaving (an exception is not a crash). A file left behind by a process
    that is gone tells the next :func:`check` that loading killed it."""

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / f".loading-{os.getpid()}"

    def __enter__(self):
        try:
            self.path.write_text(f"{torch.__version__}\n")
        except OSError as e:
            log.warning("cannot mark the in-process load in %s (%s)", self.path.parent, e)
        return self

    def __exit__(self, *exc):
        self.path.unlink(missing_ok=True)


def _dead_loads(d: Path) -> list[int]:
    """The pids of processes gone while loading in ``d`` under this torch (their files removed)."""
    out = []
    for p in d.glob(".loading-*"):
        pid = p.name.rpartition("-")[2]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        try:
            version = p.read_text().strip()
        except OSError:
            version = ""
        p.unlink(missing_ok=True)
        if version == torch.__version__:
            out.append(int(pid))
    return sorted(out)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True   # someone else's process
    return True
