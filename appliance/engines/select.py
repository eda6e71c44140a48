"""Choose the inference backend once, at load, and say why.

``open_runner(cfg)`` returns a :class:`~appliance.engines.runner.Runner`. ``model.backend``
``auto`` picks, in order:

1. ``tensorrt``: a GPU is present (``nvidia-smi`` or a Jetson board, no torch import) and
   ``<engine_dir>/trt/<precision>/manifest.json`` exists for this GPU's compute capability;
2. ``llama`` on the GPU: a GPU is present, llama-cpp-python is a CUDA build
   (``llama_supports_gpu_offload``), a GGUF export exists and ``model.device`` is not ``cpu``: the
   GPT offloaded, the Decoder and Vocos on ONNX Runtime, no torch. Measured on one H100 with
   the shipped config: host RSS 731-742 MiB + GPU 1,164 MiB against torch CUDA's 1,723-1,769 +
   1,750-1,868 (about half all-in), READY 3.7 s against 8.4 s restarted, decode step 0.94 / 1.13 ms
   at 1 / 3 channels against 1.61 / 1.75 (plain CUDA graphs); torch's compiled step (0.83 ms) and
   first audio (10-20 % sooner) are the only figures where torch wins, none of them audible
   (bench/HISTORY.md);
3. ``torch`` on CUDA: a GPU is present and torch is importable (the reference path, and the
   exporter's check);
4. ``llama``: a GGUF export exists under ``<engine_dir>/llama/`` and llama-cpp-python is
   installed (the GPT on llama.cpp, the vocoder on ONNX Runtime; no torch);
5. ``onnxruntime``: exported graphs exist under ``<engine_dir>/onnx/`` (the daemon then runs
   without torch);
6. ``torch`` on CPU: nothing exported yet (the reason names the export command).

The choice and its reason (e.g. ``auto: no GPU, exported graphs in ...: onnxruntime``) are
logged once and stored in ``runner.info.reason``. This module never falls back by itself: a
built engine that cannot be used is rebuilt, or replaced by the next backend with a loud warning,
by :mod:`appliance.engines.recover` (the daemon's path).
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from ..config import Config
from ..errors import ConfigError
from ..model.integrity import verify_for_config
from . import manifest as mf
from .runner import Runner

log = logging.getLogger(__name__)


def trt_plans(cfg: Config, cc: str | None) -> Path | None:
    """A ``trt/<precision>`` directory whose manifest targets compute capability ``cc``."""
    base = cfg.resolve(cfg.model.engine_dir) / "trt"
    for p in ("fp8", "int8", "fp16"):
        d = base / p
        if (d / mf.MANIFEST).is_file():
            try:
                m = mf.read(d)
            except Exception:  # an unreadable manifest is reported by the runner if chosen explicitly
                continue
            if m.get("device", {}).get("compute_capability") in (cc, None):
                return d
    return None


def llama_gpu_build() -> bool:
    """True when the installed llama-cpp-python was built with a GPU backend (loads its library;
    no torch); False where it is missing or cannot load."""
    from .llama import lib as llama_lib

    try:
        return bool(llama_lib.lib().llama_supports_gpu_offload())
    except Exception as e:  # noqa: BLE001 - ConfigError, OSError of a broken build: not this path
        log.debug("llama.cpp GPU build check: %s", e)
        return False


def choose_backend(cfg: Config) -> tuple[str, str]:
    """(backend, reason) for ``cfg.model.backend`` (``auto`` resolved as in the module doc).

    Raises:
        ConfigError: ``auto`` finds nothing usable (no exported graphs and no torch).
    """
    requested = cfg.model.backend
    if requested != "auto":
        return requested, f"{requested} requested in config"
    from .llama.runner import find_llama_export
    from .onnx.runner import find_export

    cc = mf.device_facts().get("compute_capability")
    gguf = find_llama_export(cfg)
    has_llama = gguf is not None and bool(importlib.util.find_spec("llama_cpp") and importlib.util.find_spec("onnxruntime"))
    unfit = None
    if has_llama:   # this CPU against the llama.cpp build, before its library loads
        from .llama import cpu

        unfit = cpu.problem(cpu.read_record())
        if unfit is not None:
            log.warning("model.backend auto: not llama.cpp: %s", unfit)
            has_llama = False
    if cc is not None:
        plans = trt_plans(cfg, cc)
        if plans is not None and (importlib.util.find_spec("tensorrt") or importlib.util.find_spec("tensorrt_rtx")):
            return "tensorrt", f"auto: GPU sm {cc} and plans built for it in {plans}"
        cuda_llama = has_llama and cfg.model.device != "cpu" and llama_gpu_build()
        if cuda_llama:
            return "llama", (f"auto: GPU sm {cc}, no TensorRT plans, llama.cpp's CUDA build and a GGUF export in {gguf}: "
                             f"the GPT on llama.cpp (offloaded), the vocoder on ONNX Runtime, no torch")
        if importlib.util.find_spec("torch") is not None:
            lack = ("model.device is cpu" if cfg.model.device == "cpu" else
                    "llama.cpp is a CPU build (scripts/install_jetson.sh builds the CUDA one)" if has_llama
                    else "no GGUF export (chattts-appliance engines export --precision q8_0)" if gguf is None
                    else "llama-cpp-python or onnxruntime not installed")
            return "torch", f"auto: GPU sm {cc}, no TensorRT plans, {lack}: torch on CUDA"
    why = "no GPU" if cc is None else f"GPU sm {cc} without plans or torch"
    if has_llama:
        return "llama", f"auto: {why}, a GGUF export in {gguf}: llama.cpp"
    if unfit is not None:
        why = f"{why}, llama.cpp unusable here ({unfit})"
    exported = find_export(cfg)
    if exported is not None and importlib.util.find_spec("onnxruntime") is not None:
        return "onnxruntime", f"auto: {why}, exported graphs in {exported}: onnxruntime"
    if importlib.util.find_spec("torch") is not None:
        return "torch", ("auto: no exported ONNX graphs (chattts-appliance engines export) and no GPU: torch on CPU")
    raise ConfigError(
        "model.backend=auto found no usable backend: export the ONNX graphs "
        "(pip install 'chattts-appliance[torch]' then chattts-appliance engines export) or install torch")


def _torch_runner(cfg: Config, reason: str) -> Runner:
    """TorchRunner on the CPU; on a CUDA GPU the fast path (CudaRunner: CUDA graphs, on-device
    sampling; appliance.engines.torch.cuda_runner).

    Raises:
        ConfigError: PyTorch is not installed.
    """
    try:
        from .torch.cpu_runner import TorchRunner, pick_device
    except ImportError as e:  # torch missing
        raise ConfigError(f"model.backend=torch needs PyTorch: pip install 'chattts-appliance[torch]' ({e})") from e

    if pick_device(cfg.model.device).type == "cuda":
        from .torch.cuda_runner import CudaRunner, compile_mode

        mode, why = compile_mode(cfg.model.compile)
        log.info("decode step: %s", why)
        eng = cfg.resolve(cfg.model.engine_dir)
        return CudaRunner(cfg, reason=reason, quant=cfg.model.quant, compile=mode or False, aot_dir=str(eng / "aot"),
                          compile_cache=str(eng / "torch_compile") if mode not in (None, "aot") else None)
    return TorchRunner(cfg, reason=reason)


def open_runner(cfg: Config) -> Runner:
    """Load the configured backend and return its runner.

    Raises:
        ConfigError: the requested backend is not installed or not usable here.
        CheckpointError: the checkpoint is missing or malformed.
        IntegrityError: a file it reads or maps (checkpoint, ONNX graph or data, plan) fails its sha256 check.
        EngineMismatchError: engines exist but do not match the config, checkpoint or device.
    """
    # sha256 of the checkpoint's config and tokenizer; each backend verifies the weight files it maps
    verify_for_config(cfg, cfg.resolve(cfg.model.path))
    backend, reason = choose_backend(cfg)
    return open_backend(cfg, backend, reason)


def open_backend(cfg: Config, backend: str, reason: str) -> Runner:
    """Load ``backend`` (one :func:`choose_backend` named) and return its runner; ``reason`` goes
    to ``runner.info.reason``. Raises as :func:`open_runner`."""
    if backend == "torch":
        runner: Runner = _torch_runner(cfg, reason)
    elif backend == "onnxruntime":
        from .onnx.runner import OnnxRunner

        runner = OnnxRunner(cfg, reason=reason)
    elif backend == "llama":
        from .llama.runner import LlamaRunner

        runner = LlamaRunner(cfg, reason=reason)
    elif backend == "tensorrt":
        from .tensorrt.runner import TensorRTRunner

        runner = TensorRTRunner(cfg, reason=reason)
    else:
        raise ConfigError(f"model.backend={backend} is not a known backend")
    log.info("inference backend: %s (%s)", runner.info.backend, runner.info.reason)
    return runner
