"""Make a bad engine again at start, when the builder is here (the daemon's
:data:`~appliance.engines.recover.Rebuild`).

The same export ``chattts-appliance engines export`` runs (:func:`appliance.build.export.export_all`
for the ONNX graphs, :func:`appliance.build.gguf_export.export_llama` for a GGUF), into
``model.engine_dir``, at the precision of the engine that failed and the limits of the config.
Its builder is torch: on a box without it (the usual Jetson install), or with
``model.rebuild_engines: false``, nothing is rebuilt and the daemon falls back to another backend.
TensorRT plans are not rebuilt at start (``engines build`` needs the ONNX graphs and minutes of
the GPU): they fall back. A rebuild that fails (a read-only engine directory, a full disk) is
logged and the daemon falls back as well.
"""

from __future__ import annotations

import importlib.util
import logging
import time

from ..config import Config

log = logging.getLogger(__name__)


def rebuild_engine(cfg: Config, backend: str, error: BaseException) -> bool:
    """Export ``backend``'s engine again (module docstring); True when it was written."""
    from ..engines.llama.cpu import CpuUnsupportedError

    if isinstance(error, CpuUnsupportedError):     # the files are fine: this CPU cannot run the library
        log.warning("not rebuilding the %s engine: %s", backend, error)
        return False
    if not cfg.model.rebuild_engines:
        log.warning("not rebuilding the %s engine: model.rebuild_engines is false", backend)
        return False
    if backend not in ("onnxruntime", "llama"):
        log.warning("the %s engine is not rebuilt at start (chattts-appliance engines build)", backend)
        return False
    if importlib.util.find_spec("torch") is None:
        log.warning("cannot rebuild the %s engine here: its builder needs torch (pip install 'chattts-appliance[torch]')",
                    backend)
        return False
    from .export import WINDOW_TOKENS

    mc = cfg.model
    out = cfg.resolve(mc.engine_dir)
    ckpt = cfg.resolve(mc.path)
    limits = dict(max_batch=mc.max_batch, max_seq_len=mc.max_seq_len,
                  max_prompt_tokens=min(mc.max_prompt_tokens, mc.max_seq_len - 1), window_tokens=WINDOW_TOKENS)
    t0 = time.monotonic()
    try:
        if backend == "onnxruntime":
            from ..engines.onnx.runner import PRECISIONS, find_export
            from .export import export_all

            found = find_export(cfg)
            precision = found.name if found is not None else (mc.onnx_precision if mc.onnx_precision != "auto" else PRECISIONS[-1])
            log.warning("rebuilding the ONNX engine (%s) in %s from %s ...", precision, out, ckpt)
            export_all(ckpt, out, precision=precision, **limits)
        else:
            from ..engines.llama.runner import TYPES, find_llama_export
            from .gguf_export import export_llama

            found = find_llama_export(cfg)
            qtype = found.name if found is not None else (mc.llama_precision if mc.llama_precision != "auto" else TYPES[0])
            log.warning("rebuilding the llama.cpp engine (%s) in %s from %s ...", qtype, out, ckpt)
            export_llama(ckpt, out, qtype=qtype, **limits)
    except Exception as e:  # noqa: BLE001 - a failed rebuild means: fall back
        log.error("rebuilding the %s engine failed: %s: %s", backend, type(e).__name__, e)
        return False
    log.warning("rebuilt the %s engine in %.1f s (it failed with: %s)", backend, time.monotonic() - t0, error)
    return True
