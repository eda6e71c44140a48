"""A bad engine at start: rebuild it, or run the next backend that can, or say why nothing can.

:func:`open_runner_recovering` opens what :func:`~appliance.engines.select.choose_backend` picks.
When that is a built engine (``onnxruntime``, ``llama``, ``tensorrt``) and it cannot be used
(a file whose sha256 differs from its manifest, a manifest that no longer matches the config,
checkpoint or device, a runtime that is missing or refuses the file):

1. ``rebuild(cfg, backend, error)`` (given by the daemon: the export the ``engines export``
   command runs, when its builder, torch, is installed and ``model.rebuild_engines`` is on)
   makes it again in ``model.engine_dir``, and it is opened again;
2. else (or if that fails too) the next backend that can run here is opened, in the order
   ``auto`` picks them (:func:`candidates`), with a loud warning; the pipeline then reports
   ``engine_fallback`` (degraded) to health, naming what failed and what runs instead;
3. else :class:`~appliance.errors.EngineError` names every backend tried and why it failed: the
   daemon exits with a status its systemd unit does not restart (``RestartPreventExitStatus=``).

A runner that loaded a slower way than configured (``info.fallback``: llama.cpp's GPU build
failing its load check in a child, :mod:`appliance.engines.llama.canary`) is reported the same
way: ``engine_fallback`` naming why.

A backend that is not a built engine (``torch``) failing, and the checkpoint's own files failing,
are not recovered here: every backend needs the checkpoint.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from dataclasses import dataclass
from typing import Callable, Optional

from ..config import Config
from ..errors import ApplianceError, EngineError
from ..model.integrity import verify_for_config
from . import manifest as mf
from .runner import Runner
from .select import choose_backend, llama_gpu_build, open_backend, trt_plans

log = logging.getLogger(__name__)

ENGINES = ("tensorrt", "llama", "onnxruntime")
"""Backends that load built engine files (which can go bad, or stale, after an upgrade)."""

Rebuild = Callable[[Config, str, BaseException], bool]
"""``rebuild(cfg, backend, error) -> True`` when it made that backend's engine again."""


@dataclass(frozen=True)
class Opened:
    """What :func:`open_runner_recovering` opened: the runner, and why it is not the backend
    that was picked (None when it is: possibly rebuilt at start, never a fallback)."""

    runner: Runner
    fallback: Optional[str] = None


def candidates(cfg: Config) -> list[tuple[str, str]]:
    """``(backend, why it can run)`` for every backend whose runtime and files are here, in the
    order ``auto`` prefers them (TensorRT plans, llama.cpp's CUDA build, torch on CUDA, llama.cpp,
    ONNX Runtime, torch on CPU)."""
    from .llama.runner import find_llama_export
    from .onnx.runner import find_export

    has = lambda m: importlib.util.find_spec(m) is not None     # noqa: E731
    cc = mf.device_facts().get("compute_capability")
    out = []
    if cc is not None and trt_plans(cfg, cc) is not None and (has("tensorrt") or has("tensorrt_rtx")):
        out.append(("tensorrt", f"TensorRT plans for sm {cc}"))
    llama = find_llama_export(cfg) is not None and has("llama_cpp") and has("onnxruntime")
    gpu_llama = llama and cc is not None and cfg.model.device != "cpu" and llama_gpu_build()
    if gpu_llama:
        out.append(("llama", f"the GGUF export in {find_llama_export(cfg)} on llama.cpp's CUDA build"))
    if cc is not None and has("torch"):
        out.append(("torch", f"torch on the GPU (sm {cc})"))
    if llama and not gpu_llama:
        out.append(("llama", f"the GGUF export in {find_llama_export(cfg)}"))
    if find_export(cfg) is not None and has("onnxruntime"):
        out.append(("onnxruntime", f"the ONNX graphs in {find_export(cfg)}"))
    if has("torch") and cc is None:
        out.append(("torch", "torch on the CPU, from the checkpoint"))
    return out


def open_runner_recovering(cfg: Config, rebuild: Optional[Rebuild] = None) -> Opened:
    """Open the backend ``cfg`` picks, recovering from a bad engine (module docstring).

    Raises:
        ConfigError, CheckpointError: the checkpoint or the config is wrong (no backend would run).
        EngineError: the picked engine is bad and no other backend could run (names each one tried).
    """
    verify_for_config(cfg, cfg.resolve(cfg.model.path))
    backend, reason = choose_backend(cfg)
    try:
        runner = open_backend(cfg, backend, reason)
        return Opened(runner, runner.info.fallback or None)   # loaded, but a slower way (llama.cpp on the CPU)
    except Exception as e:  # noqa: BLE001 - any failure of a built engine is recovered below
        if backend not in ENGINES:
            raise
        first = e
    log.error("the %s engine cannot be used: %s", backend, _said(first))
    if rebuild is not None and rebuild(cfg, backend, first):
        try:
            return Opened(open_backend(cfg, backend, f"{reason}; rebuilt at start after: {_said(first)}"))
        except Exception as e:  # noqa: BLE001
            log.error("the rebuilt %s engine cannot be used either: %s", backend, _said(e))
    tried = [f"{backend}: {_said(first)}"]
    for other, why in candidates(cfg):
        if other == backend:
            continue
        note = f"the {backend} engine cannot be used ({_said(first)}); running {other} instead ({why})"
        try:
            runner = open_backend(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, backend=other)),
                                  other, f"FALLBACK: {note}")
        except Exception as e:  # noqa: BLE001
            tried.append(f"{other}: {_said(e)}")
            continue
        log.warning("ENGINE FALLBACK: %s; health says engine_fallback until the engine is rebuilt "
                    "(chattts-appliance engines export) and the daemon restarted", note)
        return Opened(runner, note)
    raise EngineError("no inference backend can run: " + "; ".join(tried) +
                      "; rebuild the engine (chattts-appliance engines export) or install torch") from first


def _said(e: BaseException) -> str:
    return str(e) if isinstance(e, ApplianceError) else f"{type(e).__name__}: {e}"
