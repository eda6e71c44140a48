"""Which CPUs the installed llama.cpp runs on, checked before its library is loaded.

``scripts/llama_build.sh`` records each build beside the library it installs,
``llama_cpp/lib/llama_build.json``: ``{"version", "cmake_args", "arch", "variants", "requires"}``.
A portable build (the default on x86-64: ``GGML_CPU_ALL_VARIANTS``, one CPU library per feature
level, ``libggml-cpu-<level>.so``, the best one loaded at start by
:func:`appliance.engines.llama.lib.lib`) requires nothing beyond its architecture; a native
build (``-march=native``: ``LLAMA_CPU=native``, and builds on other architectures) requires every
feature of the CPU it was built on (``/proc/cpuinfo`` flag names: ``avx2``, ``avx512f``, ...;
Arm: ``asimddp``, ``sve``, ...), since the compiler may have used any of them.

:func:`problem` compares the record with this CPU's ``/proc/cpuinfo`` flags, reading no native
code, so a CPU that lacks an instruction the library holds is refused with one line
(:class:`CpuUnsupportedError`: exit 2, which the unit does not restart) or passed over by
``model.backend: auto`` (ONNX Runtime instead, :mod:`appliance.engines.select`) instead of dying
with SIGILL at the first step. A library installed without a record (``pip install`` by hand) is
not checked (logged once).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import platform
from pathlib import Path
from typing import Optional

from ...errors import ConfigError

log = logging.getLogger(__name__)

#: The build record's file name, in ``llama_cpp/lib/``.
RECORD = "llama_build.json"
#: Where the CPU's features are read.
CPUINFO = "/proc/cpuinfo"
#: Exit status of a refused start (``RestartPreventExitStatus=2`` in the unit).
EXIT_STATUS = 2


class CpuUnsupportedError(ConfigError):
    """The installed llama.cpp needs CPU features this CPU lacks (one line; exit status 2)."""


def lib_dir() -> Optional[Path]:
    """``llama_cpp/lib`` of the installed llama-cpp-python, found without importing it (its
    import loads the native library); None when it is not installed."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).parent / "lib"


def read_record(d: Optional[Path] = None) -> Optional[dict]:
    """The build record beside the installed library (``d``: its ``lib`` directory), or None
    when there is none or it does not parse."""
    d = lib_dir() if d is None else d
    if d is None:
        return None
    try:
        rec = json.loads((d / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def cpu_features(cpuinfo: str = CPUINFO) -> set[str]:
    """The CPU's feature names: the first ``flags`` (x86) or ``Features`` (Arm) line of
    ``cpuinfo``; empty when unreadable."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k.strip() in ("flags", "Features"):
                    return set(v.split())
    except OSError:
        pass
    return set()


def describe(rec: Optional[dict]) -> str:
    """What a build record says the library runs on, for logs and ``status``."""
    if rec is None:
        return "a llama.cpp build without a record (CPU features not checked)"
    arch = rec.get("arch", "?")
    if rec.get("variants"):
        return f"every {arch} CPU (one CPU library per feature level, the best chosen at start)"
    need = rec.get("requires") or []
    return f"{arch} CPUs with {' '.join(need)}" if need else f"every {arch} CPU"


def problem(rec: Optional[dict], cpuinfo: str = CPUINFO, machine: Optional[str] = None) -> Optional[str]:
    """Why this CPU cannot run the build ``rec`` describes (one line), or None when it can (or
    when there is no record).

    Args:
        rec: a build record (:func:`read_record`).
        cpuinfo: where the CPU's features are read.
        machine: this machine's architecture (default ``platform.machine()``).
    """
    if rec is None:
        return None
    machine = machine or platform.machine()
    arch = rec.get("arch")
    if arch and arch != machine:
        return f"the installed llama.cpp was built for {arch}, this machine is {machine}"
    need = [f for f in rec.get("requires") or [] if isinstance(f, str)]
    if not need:
        return None
    have = cpu_features(cpuinfo)
    if not have:
        return None     # nothing readable to compare with (a container without /proc): let it load
    missing = [f for f in need if f not in have]
    if not missing:
        return None
    return (f"the installed llama.cpp was built for another CPU: it needs {' '.join(missing)}, which this CPU "
            f"lacks; build it here for every CPU (LLAMA_CPU=portable scripts/quickstart.sh, "
            f"scripts/llama_build.sh) or use model.backend: onnxruntime")


def require(cpuinfo: str = CPUINFO) -> Optional[dict]:
    """Check this CPU against the installed build's record before the library is loaded.

    Returns:
        the record (None when there is none: logged, not checked).

    Raises:
        CpuUnsupportedError: this CPU lacks a feature the build needs (:func:`problem`).
    """
    rec = read_record()
    why = problem(rec, cpuinfo)
    if why is not None:
        raise CpuUnsupportedError(why)
    if rec is None:
        log.info("llama.cpp: no build record (%s) beside the library: CPU features not checked", RECORD)
    return rec


__all__ = ["CpuUnsupportedError", "RECORD", "EXIT_STATUS", "lib_dir", "read_record", "cpu_features",
           "describe", "problem", "require"]
