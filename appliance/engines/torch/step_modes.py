"""How the CUDA runner's decode step is made fast: ``model.compile`` -> a step mode, and the
just-in-time ``torch.compile`` set-up.

Modes (``CudaRunner(compile=...)``):

* ``None`` — the eager step, captured as plain CUDA graphs (ready in seconds; 1.6 ms/step on the H200);
* ``"aot"`` — the ahead-of-time compiled packages of :mod:`appliance.engines.torch.aot_step`, loaded
  from ``<model.engine_dir>/aot`` (built by ``chattts-appliance engines compile``) and captured
  in the same graphs; where none matches, plain graphs with the reason logged;
* ``"default"`` / ``"max-autotune-no-cudagraphs"`` — ``torch.compile`` at every start (inductor's
  kernels cached in ``<model.engine_dir>/torch_compile``; dynamo traces each shape again at
  every start: 29-42 s warm, 115-218 s cold on the H200).
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

# CudaRunner(compile=...) -> step mode (None = plain graphs of the eager step)
COMPILE_MODES = {False: None, True: "default", "none": None, "off": None, "default": "default", "aot": "aot",
                 "max-autotune-no-cudagraphs": "max-autotune-no-cudagraphs"}


def compile_mode(setting: str) -> tuple[Optional[str], str]:
    """``model.compile`` -> (step mode, why). ``auto`` is the ahead-of-time package where one was
    built for this GPU, checkpoint and config (``chattts-appliance engines compile``; it needs
    Triton to build, not to run), else plain CUDA graphs: a start never compiles."""
    if setting == "off":
        return None, "plain CUDA graphs (model.compile: off)"
    if setting == "auto":
        return "aot", "ahead-of-time compiled step where built, else plain CUDA graphs (model.compile: auto)"
    return setting, f"compiled ({setting}) at start inside CUDA graphs (model.compile: {setting})"


def has_triton() -> bool:
    """Whether inductor can make GPU kernels here (it writes Triton; JetPack's PyTorch has none)."""
    try:
        from torch.utils._triton import has_triton as _has
        return bool(_has())
    except ImportError:
        return False


def jit_compile(fn: Callable, mode: str, cache: Optional[str]) -> Callable:
    """``torch.compile(fn)`` for static shapes, without inductor's own CUDA graphs (the runner
    captures the compiled step in its own). ``cache``: ``TORCHINDUCTOR_CACHE_DIR`` (set here: torch
    fills that variable with its default as soon as inductor is imported)."""
    import torch._dynamo as dyn

    if cache:
        os.makedirs(cache, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    for k in ("cache_size_limit", "recompile_limit"):
        if hasattr(dyn.config, k):
            setattr(dyn.config, k, max(getattr(dyn.config, k), 64))
    return torch.compile(fn, dynamic=False, fullgraph=True, mode=None if mode == "default" else mode)
