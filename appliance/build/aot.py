"""``chattts-appliance engines compile``: the CUDA runner's decode step, compiled ahead of time.

Loads the configured checkpoint exactly as the daemon's CUDA runner does (``model.dtype``,
``model.quant``, ``model.max_batch`` x ``model.max_seq_len``, the default attention buckets),
then compiles one AOTInductor package per (batch, attention bucket) into
``<model.engine_dir>/aot/<key>/`` (:mod:`appliance.engines.torch.aot_step`). The daemon's next start
with ``model.compile: auto`` loads them in well under a second each instead of compiling; where
they do not match (another GPU, checkpoint, torch or config) it says why and runs plain CUDA graphs.

Right after building, the packages are loaded and run once in a child process, as every daemon
start does before it loads a set in-process (:mod:`appliance.engines.torch.aot_canary`): on the H200 with
torch 2.11.0+cu130 the freshly built packages crashed torch's loader with a segmentation fault. The
command prints that check's verdict and exits 1 when the packages cannot be loaded (the verdict is
recorded beside them, so the daemon runs plain CUDA graphs without trying them).

Building needs what ``torch.compile`` needs (Triton on a GPU; a C++ compiler on a CPU); running
the packages does not. Run it where the daemon will run (installers do), once per GPU, checkpoint,
torch version and config: about 15-40 s per package on a desktop GPU (12 packages at the default
3 x 2048 KV cache).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from ..config import Config, load_config
from ..errors import ConfigError, EngineError

log = logging.getLogger(__name__)


def compile_packages(cfg: Config, mode: str = "default", batches: Optional[list[int]] = None,
                     buckets: Optional[list[int]] = None, out: Optional[str] = None, progress=None) -> Path:
    """Build the packages for ``cfg`` and return their directory.

    Args:
        cfg: the daemon's configuration (``model.device`` auto/cuda; cpu for development).
        mode: ``default`` or ``max-autotune-no-cudagraphs`` (inductor's autotuned GEMMs).
        batches: batch sizes (default ``1..model.max_batch``); buckets: attention spans (default
            the runner's, :func:`appliance.engines.torch.cuda_graphs.kv_buckets`).
        out: the ``aot`` directory (default ``<model.engine_dir>/aot``).
        progress: called with each package's file name before it is compiled.

    Raises:
        ConfigError: no torch, an unknown mode, or a GPU without Triton (nothing can be compiled).
        CheckpointError, EngineError: the checkpoint does not load, or export/compilation failed.
    """
    if mode not in ("default", "max-autotune-no-cudagraphs"):
        raise ConfigError(f"compile mode {mode!r}: use default or max-autotune-no-cudagraphs")
    try:
        from ..engines.torch import aot_step
        from ..engines import manifest as mf
        from ..engines.torch.cuda_runner import CudaRunner
        from ..engines.torch.step_modes import has_triton
        from ..engines.torch.cpu_runner import pick_device
    except ImportError as e:
        raise ConfigError(f"engines compile needs PyTorch: pip install 'chattts-appliance[torch]' ({e})") from e
    dev = pick_device(cfg.model.device)
    if dev.type == "cuda" and not has_triton():
        raise ConfigError("this PyTorch has no working Triton (JetPack's has none): it cannot compile the step; "
                          "the daemon runs plain CUDA graphs (or TensorRT plans) instead")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, device=dev.type))
    ckpt = cfg.resolve(cfg.model.path)
    runner = CudaRunner(cfg, reason="engines compile", quant=cfg.model.quant, graphs=False)
    try:
        L = sorted(set(buckets)) if buckets else runner.buckets
        shapes = [(b, s) for b in (batches or range(1, cfg.model.max_batch + 1)) for s in L]
        root = Path(out) if out else cfg.resolve(cfg.model.engine_dir) / aot_step.SUBDIR
        return build(runner, root, mf.checkpoint_identity(ckpt), shapes, mode=mode, progress=progress)
    finally:
        runner.close()


def export_step(runner, b: int, L: int):
    """``torch.export`` (an ``ExportedProgram``) of the step for ``(b, L)`` with
    :func:`appliance.engines.torch.aot_step.step_tensors` as inputs.

    Raises:
        EngineError: the export failed, or it would bake a tensor into the package (a tensor
            the step reads that is not among the inputs).
    """
    import torch

    from ..engines.torch import aot_step

    _, tensors, slots = aot_step.step_tensors(runner)
    try:
        with torch.no_grad():
            ep = torch.export.export(aot_step.Step(runner, slots, b, L), tuple(tensors), strict=False)
    except Exception as e:  # export raises many types (UserError, RuntimeError, ...)
        raise EngineError(f"torch.export of the decode step (b={b}, L={L}) failed: {e}") from e
    baked = {**ep.constants, **ep.state_dict}
    if baked:
        raise EngineError(f"the exported step would carry tensors as constants ({', '.join(sorted(baked)[:5])}): "
                          "pass them as inputs (appliance.engines.torch.aot_step.RUNNER_STATE)")
    return ep


def build(runner, root: str | os.PathLike, checkpoint: dict, shapes: list[tuple[int, int]], mode: str = "default",
          progress: Optional[Callable[[str], None]] = None) -> Path:
    """Compile one package per ``(b, L)`` in ``shapes`` into ``root/<key>/`` and write its manifest.

    ``checkpoint`` is :func:`appliance.engines.manifest.checkpoint_identity` of the checkpoint the
    runner loaded. The set is written into a temporary directory and renamed into place, so a
    reader never sees half of it. Returns the directory.

    Raises:
        EngineError: export or compilation failed (the temporary directory is removed).
    """
    import torch
    import torch._inductor

    from ..engines.torch import aot_step
    from ..engines import manifest as mf

    ident = aot_step.identity(runner, checkpoint["sha256"], mode)
    root = Path(root)
    final = root / aot_step.key_of(ident)
    tmp = root / f".{final.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    graphs = {}
    try:
        for b, L in shapes:
            name = aot_step.package_name(b, L)
            if progress:
                progress(name)
            t0 = time.perf_counter()
            ep = export_step(runner, b, L)
            try:
                torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp / name), inductor_configs=(
                    {"max_autotune": True} if mode == "max-autotune-no-cudagraphs" else {}))
            except Exception as e:  # inductor/compiler errors come in many types
                raise EngineError(f"AOTInductor compilation of {name} failed: {e}") from e
            graphs[name] = {"file": name, "batch": b, "span": L, "bytes": (tmp / name).stat().st_size,
                            "sha256": mf.file_sha256(tmp / name), "compile_s": round(time.perf_counter() - t0, 1)}
        names, tensors, _ = aot_step.step_tensors(runner)
        mf.write(tmp, {"kind": aot_step.KIND, "key": final.name, "identity": ident, "checkpoint": checkpoint,
                       "runtime": {"name": "torch", "version": torch.__version__}, "graphs": graphs,
                       "inputs": [[n, list(t.shape), str(t.dtype)] for n, t in zip(names, tensors)]})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def cli_main(args) -> int:
    """``engines compile``; returns 0, or 1 when the built packages fail their load check (the
    reason on stderr). Errors propagate as ApplianceError (exit status 2)."""
    from ..engines.torch import aot_canary
    from ..engines import manifest as mf

    cfg = load_config(args.config)  # None: the built-in defaults
    if args.device:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, device=args.device))
    ints = (lambda s: [int(x) for x in s.split(",")] if s else None)
    t0 = time.perf_counter()
    d = compile_packages(cfg, mode=args.mode, batches=ints(args.batches), buckets=ints(args.buckets), out=args.out,
                         progress=lambda name: print(f"compiling {name} ({time.perf_counter() - t0:.0f} s)",
                                                     file=sys.stderr, flush=True))
    m = mf.read(d)
    total = sum(g["bytes"] for g in m["graphs"].values())
    print(f"compiled {len(m['graphs'])} packages ({total / 2**20:.1f} MiB) in {time.perf_counter() - t0:.0f} s into {d}")
    for name, g in m["graphs"].items():
        print(f"  {name:22s} {g['bytes'] / 2**20:7.1f} MiB  {g['compile_s']:6.1f} s")
    t1 = time.perf_counter()
    verdict = aot_canary.check(d, m, -1, force=True)
    if not verdict.ok:
        print(f"load check failed ({time.perf_counter() - t1:.0f} s): {verdict.reason}\n"
              "the daemon runs plain CUDA graphs with model.compile: auto", file=sys.stderr)
        return 1
    print(f"load check: {verdict.reason}")
    print("the daemon loads them at its next start with model.compile: auto")
    return 0
