"""Make a bad engine again at start, when the builder is here (the daemon's
:data:`~appliance.engines.recover.Rebuild`), in a child process: the export's torch and its
memory never enter the daemon's heap.

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
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

from ..config import Config

log = logging.getLogger(__name__)


TIMEOUT_S = 3600.0
"""Longest a rebuild may take in its child process, s (a full-size export on a small CPU: minutes)."""


def rebuild_engine(cfg: Config, backend: str, error: BaseException) -> bool:
    """Export ``backend``'s engine again (module docstring) in a child process; True when it
    was written. The child (``python -m appliance.build.rebuild JOB``) imports torch and holds
    the export's memory, and gives it all back when it exits: the daemon's heap after a rebuild
    is a plain start's, and the memory fit that follows sees the true figure."""
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
    mc = cfg.model
    job = {"backend": backend, "out": str(cfg.resolve(mc.engine_dir)), "ckpt": str(cfg.resolve(mc.path)),
           "limits": dict(max_batch=mc.max_batch, max_seq_len=mc.max_seq_len,
                          max_prompt_tokens=min(mc.max_prompt_tokens, mc.max_seq_len - 1))}
    if backend == "onnxruntime":
        from ..engines.onnx.runner import PRECISIONS, find_export

        found = find_export(cfg)
        job["precision"] = found.name if found is not None else (mc.onnx_precision if mc.onnx_precision != "auto" else PRECISIONS[-1])
    else:
        from ..engines.llama.runner import TYPES, find_llama_export

        found = find_llama_export(cfg)
        job["precision"] = found.name if found is not None else (mc.llama_precision if mc.llama_precision != "auto" else TYPES[0])
    log.warning("rebuilding the %s engine (%s) in %s from %s in a child process ...", backend, job["precision"],
                job["out"], job["ckpt"])
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-m", __name__, json.dumps(job)], stdin=subprocess.DEVNULL,
                           timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.error("rebuilding the %s engine failed: %s", backend, e)
        return False
    if r.returncode != 0:
        log.error("rebuilding the %s engine failed: its process exited with %s (its log is above)", backend,
                  r.returncode if r.returncode >= 0 else f"signal {-r.returncode}")
        return False
    log.warning("rebuilt the %s engine in %.1f s (it failed with: %s)", backend, time.monotonic() - t0, error)
    return True


def _child(arg: str) -> int:
    """The rebuild's process: run the export ``arg`` (JSON: backend, ckpt, out, precision,
    limits) describes; exit 0 when it was written, 1 with the error on stderr."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    job = json.loads(arg)
    from .export import WINDOW_TOKENS

    limits = dict(job["limits"], window_tokens=WINDOW_TOKENS)
    try:
        if job["backend"] == "onnxruntime":
            from .export import export_all

            export_all(Path(job["ckpt"]), Path(job["out"]), precision=job["precision"], **limits)
        else:
            from .gguf_export import export_llama

            export_llama(Path(job["ckpt"]), Path(job["out"]), qtype=job["precision"], **limits)
    except Exception as e:  # noqa: BLE001 - any failure: the daemon falls back
        print(f"rebuild: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
