"""The one place that chooses between ``tensorrt`` and ``tensorrt_rtx``.

Jetson (JetPack 5.1 / 6.x) and desktop installs ship ``tensorrt`` (8.5 ... 10.x); machines
without a JetPack can ``pip install tensorrt-rtx`` (module ``tensorrt_rtx``), whose builder
runs without a GPU (ahead-of-time builds in CI; its engines refuse sm_90).
Everything else in the appliance calls this module and never imports either directly, so no
``if tensorrt_rtx`` is scattered through the code.

Differences handled here:

* network creation: ``STRONGLY_TYPED`` where it exists (TensorRT 10.x, TensorRT-RTX; the
  precision lives in the ONNX graph), otherwise (TensorRT 8.x) ``BuilderFlag.FP16`` / ``INT8``
  are set from the graph's precision;
* target device: TensorRT-RTX can build for a named compute capability without that GPU;
  classic TensorRT builds for the GPU it runs on only;
* messages: a :class:`CaptureLogger` keeps every builder line, so the weight and activation
  memory that the builder reports ("Total Weights Memory: N bytes") can be read back.

Raises :class:`~appliance.errors.ConfigError` when neither module is installed.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
from types import ModuleType
from typing import Any

from ...errors import ConfigError, EngineError

log = logging.getLogger(__name__)

#: Import order: a real TensorRT (the one that runs engines on this box) before TensorRT-RTX.
#: ``APPLIANCE_TRT_MODULE`` (``tensorrt`` or ``tensorrt_rtx``) forces one.
MODULES = ("tensorrt", "tensorrt_rtx")


@functools.lru_cache(maxsize=1)
def module() -> ModuleType:
    """Return the imported TensorRT module (``tensorrt`` or ``tensorrt_rtx``).

    Raises:
        ConfigError: neither is importable (the message says how to install one).
    """
    forced = os.environ.get("APPLIANCE_TRT_MODULE")
    names = (forced,) if forced else MODULES
    errors = []
    for name in names:
        try:
            m = importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        log.debug("TensorRT module: %s %s", name, getattr(m, "__version__", "?"))
        return m
    raise ConfigError(
        "TensorRT is not installed: on Jetson use JetPack's python3 (venv with --system-site-packages); "
        "elsewhere pip install 'chattts-appliance[tensorrt-rtx]' (" + "; ".join(errors) + ")"
    )


def available() -> bool:
    """True when :func:`module` would succeed (no exception)."""
    try:
        module()
    except ConfigError:
        return False
    return True


def flavor() -> str:
    """``tensorrt`` or ``tensorrt_rtx``."""
    return module().__name__.split(".")[0]


def version() -> str:
    """The module's version string, e.g. ``10.3.0`` or ``1.7.1.116``."""
    return str(getattr(module(), "__version__", "unknown"))


def is_rtx() -> bool:
    """True for TensorRT-RTX (cross-builds for a named compute capability, strongly typed only)."""
    return flavor() == "tensorrt_rtx"


def strongly_typed() -> bool:
    """True when networks are created ``STRONGLY_TYPED`` (TensorRT >= 10 and TensorRT-RTX)."""
    return hasattr(module().NetworkDefinitionCreationFlag, "STRONGLY_TYPED")


def network_flags() -> int:
    """Flags for ``Builder.create_network``: STRONGLY_TYPED where available, else EXPLICIT_BATCH
    (TensorRT 8.x; implied and deprecated in 10.x)."""
    f = module().NetworkDefinitionCreationFlag
    if hasattr(f, "STRONGLY_TYPED"):
        return 1 << int(f.STRONGLY_TYPED)
    return 1 << int(f.EXPLICIT_BATCH)


def apply_precision(config: Any, precision: str) -> None:
    """Set builder flags a weakly typed TensorRT (8.x) needs to honour the graph's precision.

    With strongly typed networks this does nothing: FP16 weights/casts and Q/DQ nodes in the
    ONNX graph already fix every tensor's type.
    """
    if strongly_typed():
        return
    bf = module().BuilderFlag
    if precision in ("fp16", "int8"):
        config.set_flag(bf.FP16)
    if precision == "int8":
        config.set_flag(bf.INT8)
    if precision == "fp8":
        raise EngineError(f"TensorRT {version()} has no FP8 support; build fp16 or int8 (TensorRT >= 10 needed for fp8)")


def set_target(config: Any, cc: str | None) -> None:
    """Build for compute capability ``cc`` (``"8.9"``); None = the GPU of this machine.

    TensorRT-RTX accepts the capabilities in ``ComputeCapability`` (SM75, SM80, SM86, SM89,
    SM120, ...). Classic TensorRT builds only for the present GPU; asking for another raises.

    Raises:
        ConfigError: the target is not one this TensorRT can build for.
    """
    name = validate_target(cc)
    if name is not None:
        config.num_compute_capabilities = 1
        config.set_compute_capability(getattr(module().ComputeCapability, name), 0)


def validate_target(cc: str | None) -> str | None:
    """Check that this TensorRT can build for ``cc``; return TensorRT-RTX's ``SMxy`` name
    (None: build for the local GPU).

    Raises:
        ConfigError: see :func:`set_target`.
    """
    trt = module()
    if not is_rtx():
        if cc is not None:
            here = _local_cc()
            if here is not None and here != cc:
                raise ConfigError(f"--target {cc}: TensorRT {version()} builds only for this GPU (compute capability {here}); build on the target device")
        return None
    if cc is None:
        return None  # ComputeCapability.CURRENT, the default
    name = "SM" + cc.replace(".", "")
    known = [n for n in dir(trt.ComputeCapability) if n.startswith("SM")]
    if name not in known:
        raise ConfigError(f"--target {cc}: TensorRT-RTX {version()} builds for {', '.join(k[2:-1] + '.' + k[-1] for k in known)} only"
                          " (Jetson: build on the device with JetPack's TensorRT)")
    return name


def _local_cc() -> str | None:
    from ..manifest import device_facts

    return device_facts().get("compute_capability")


_MEM_RE = {
    "weights_bytes": re.compile(r"Total Weights Memory:\s*(\d+)\s*bytes"),
    "activation_bytes": re.compile(r"Total Activation Memory:\s*(\d+)\s*bytes"),
    "host_persistent_bytes": re.compile(r"Total Host Persistent Memory:\s*(\d+)\s*bytes"),
    "device_persistent_bytes": re.compile(r"Total Device Persistent Memory:\s*(\d+)\s*bytes"),
}


@functools.lru_cache(maxsize=1)
def _logger_class() -> type:
    trt = module()

    class CaptureLogger(trt.ILogger):
        """A TensorRT logger that keeps every line and forwards warnings/errors to ``log``.

        ``lines``: list of (severity name, message). ``errors()``: the ERROR/INTERNAL_ERROR lines.
        """

        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.lines: list[tuple[str, str]] = []

        def log(self, severity: Any, msg: str) -> None:  # noqa: D102 (TensorRT callback)
            name = getattr(severity, "name", str(severity))
            self.lines.append((name, msg))
            if name in ("ERROR", "INTERNAL_ERROR") and "cudaError 35" in msg:
                # TensorRT-RTX probing for a GPU on a machine without one: harmless for building
                log.debug("tensorrt (no GPU here): %s", msg)
            elif name in ("ERROR", "INTERNAL_ERROR"):
                log.error("tensorrt: %s", msg)
            elif name == "WARNING":
                log.debug("tensorrt: %s", msg)

        def errors(self) -> list[str]:
            return [m for s, m in self.lines if s in ("ERROR", "INTERNAL_ERROR")]

        def memory(self) -> dict[str, int]:
            """Builder memory report (bytes), the last value of each line kind; {} if none."""
            out: dict[str, int] = {}
            for _, m in self.lines:
                for k, rx in _MEM_RE.items():
                    hit = rx.search(m)
                    if hit:
                        out[k] = int(hit.group(1))
            return out

    return CaptureLogger


def capture_logger() -> Any:
    """A new :class:`CaptureLogger` (severity VERBOSE is kept: the memory report is INFO)."""
    return _logger_class()()


def progress_monitor(callback: Any) -> Any | None:
    """An ``IProgressMonitor`` calling ``callback(phase, step, n_steps)`` or None where the
    TensorRT version has no progress API (< 10.0)."""
    trt = module()
    if not hasattr(trt, "IProgressMonitor"):
        return None

    class _Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.n: dict[str, int] = {}

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            self.n[phase_name] = num_steps
            callback(phase_name, 0, num_steps)

        def step_complete(self, phase_name: str, step: int) -> bool:
            callback(phase_name, step + 1, self.n.get(phase_name, 0))
            return True

        def phase_finish(self, phase_name: str) -> None:
            callback(phase_name, self.n.get(phase_name, 0), self.n.get(phase_name, 0))

    return _Monitor()
