"""Ahead-of-time compiled decode steps: AOTInductor packages of the CUDA runner's step, per ``(b, L)``.

``torch.compile`` traces and compiles the step at every start (29-42 s with a warm cache, 115-218 s
cold on the H200). Here the step is compiled once, by ``chattts-appliance engines compile``, into
AOTInductor packages (``torch.export`` then ``torch._inductor.aoti_compile_and_package``; PyTorch
docs "AOTInductor: Ahead-Of-Time Compilation for Torch.Export-ed Models"), and a start only loads
them (``torch._inductor.aoti_load_package``, a ``dlopen`` each) and captures them in the runner's
CUDA graphs as it captures the plain step.

**What a package is.** The exported function is :meth:`CudaRunner._step_body` for one ``(b, L)``
(``b`` rows, attention over ``L`` positions) with *every* tensor it touches as an input: the GPT
and embedding weights, the KV cache, the sampler state and the runner's rings and positions
(:func:`step_tensors`, ~250 tensors at full size). The step mutates the state inputs in place,
as the eager step does. So a package holds code and no weights (a few MiB, not 450 MiB per
shape), the weights exist once on the device, and all packages and the plain fallback share the
same buffers. An export that would bake a tensor into the package as a constant is refused.

Built by :func:`appliance.build.aot.build` (``torch.export`` of :class:`Step`, then AOTInductor).

**Where they live and what keys them.** ``<model.engine_dir>/aot/<key>/`` with one
``step_b<b>_L<L>.pt2`` per shape and a ``manifest.json`` (:mod:`appliance.engines.manifest`
format) recording the *identity* the key is the sha256 of (:func:`identity`): checkpoint sha256,
backend, precision, engine id, torch version, device (GPU name, compute capability and CUDA
version, or the CPU's vector ISA), KV cache (slots, positions, dtype), ring size, compile mode,
the sha256 of the step's source code and of the input signature (names, shapes, dtypes), plus
each package's size and sha256. A load computes the identity of the runner it serves and takes
the directory whose manifest matches it exactly; a package whose sha256 differs is refused.

**Load canary.** Before a process loads a set in-process, a child process loads every package of
it and runs it once (:mod:`appliance.engines.torch.aot_canary`): on the H200 with torch 2.11 the
packages crashed torch's loader with a segmentation fault, which no ``try`` catches. The verdict
is recorded in the set's directory per torch version, so the child runs once per set and torch.

**Fallback.** Any mismatch, no package for any captured shape, a refused file, a set the child
could not load or a failed load raises :class:`~appliance.errors.EngineMismatchError` naming the
reason (and the command that rebuilds, :data:`REBUILD`); the runner then logs it and captures plain
CUDA graphs of the eager step.

Same seed, same codes: the package runs the eager step's operations in inductor's fused kernels,
as ``torch.compile`` does (tests: test_engines_aot.py on the CPU, test_gpu_cuda.py on a GPU).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from ...errors import EngineError, EngineMismatchError
from . import aot_canary
from .. import manifest as mf

log = logging.getLogger(__name__)

SUBDIR = "aot"
KIND = "aot-inductor"
REBUILD = "chattts-appliance engines compile"
#: The runner's own tensors the step reads or writes (besides the model's weights, the KV cache
#: and the sampler's state); a tensor the step reads that is not an input makes export fail
#: (:func:`export_step` refuses lifted constants).
RUNNER_STATE = ("codes_in", "pos", "_ar", "hid", "row_slot", "codes_ring", "t")
#: Modules whose source defines what the step computes (hashed into the identity).
CODE_MODULES = ("appliance.model.gpt", "appliance.model.kv", "appliance.model.embed", "appliance.model.quant",
                "appliance.engines.torch.sampler", "appliance.engines.rng")


def package_name(b: int, L: int) -> str:
    """File name of the package for ``b`` rows over ``L`` positions."""
    return f"step_b{b}_L{L}.pt2"


# --------------------------------------------------------------------------- inputs
def step_tensors(runner) -> tuple[list[str], list[torch.Tensor], list[list[tuple]]]:
    """The step's inputs, in package order: ``(names, tensors, slots)``.

    Each distinct tensor appears once; ``slots[i]`` lists where tensor ``i`` lives, as
    ``(container, key)`` pairs (a module's ``_parameters``/``_buffers`` dict, the KV list, an
    object's ``__dict__``), so that :func:`_bound` can put traced tensors there during export.
    Order: embedding and GPT parameters and buffers (``named_modules`` order), K then V caches
    per layer, :data:`RUNNER_STATE`, the sampler's tensors (attribute order).
    """
    seen: dict[int, int] = {}
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    slots: list[list[tuple]] = []

    def add(name: str, t: Optional[torch.Tensor], container, key) -> None:
        if t is None:
            return
        i = seen.get(id(t))
        if i is None:
            seen[id(t)] = i = len(tensors)
            names.append(name)
            tensors.append(t)
            slots.append([])
        slots[i].append((container, key))

    m = runner.model
    for top in ("embed", "gpt"):
        for mname, mod in getattr(m, top).named_modules(prefix=top):
            for n, t in mod._parameters.items():
                add(f"{mname}.{n}", t, mod._parameters, n)
            for n, t in mod._buffers.items():
                add(f"{mname}.{n}", t, mod._buffers, n)
    g = m.gpt
    for kind, cache in (("k", g.k_cache), ("v", g.v_cache)):
        for i, t in enumerate(cache):
            add(f"kv.{kind}.{i}", t, cache, i)
    for n in RUNNER_STATE:
        add(f"runner.{n}", getattr(runner, n), runner.__dict__, n)
    for n, t in list(vars(runner.sampler).items()):
        if isinstance(t, torch.Tensor):
            add(f"sampler.{n}", t, runner.sampler.__dict__, n)
    return names, tensors, slots


class _bound:
    """Context: put ``xs[i]`` in every slot of tensor ``i`` (see :func:`step_tensors`), restore after."""

    def __init__(self, slots: list[list[tuple]], xs):
        self.slots, self.xs, self.saved = slots, xs, []

    def __enter__(self):
        for where, x in zip(self.slots, self.xs):
            for container, key in where:
                self.saved.append((container, key, container[key]))
                container[key] = x

    def __exit__(self, *exc):
        for container, key, old in reversed(self.saved):
            container[key] = old


class Step(nn.Module):
    """``forward(*tensors)``: the runner's eager step for ``(b, L)`` on the given tensors (export only)."""

    def __init__(self, runner, slots, b: int, L: int):
        super().__init__()
        self._r, self._slots, self.b, self.L = runner, slots, b, L   # not submodules: nothing is lifted

    def forward(self, *xs):
        with _bound(self._slots, xs):
            self._r._step_body(self.b, self.L)
        return ()


# --------------------------------------------------------------------------- identity
def _code_sha256(runner) -> str:
    """sha256 of the step's source (``_step_body`` and :data:`CODE_MODULES`); the installed
    distribution's version stands in for a source that is not installed (bytecode only)."""
    import importlib
    import importlib.metadata as md

    h = hashlib.sha256()
    for obj in (type(runner)._step_body, *map(importlib.import_module, CODE_MODULES)):
        try:
            h.update(inspect.getsource(obj).encode())
        except (OSError, TypeError):
            h.update(f"{md.version('chattts-appliance')} {getattr(obj, '__name__', '')}".encode())
    return h.hexdigest()


def device_identity(device: torch.device) -> dict:
    """What a package's machine code depends on: GPU name, compute capability and CUDA version;
    on a CPU the architecture and the sha256 of the ``/proc/cpuinfo`` flags (inductor compiles the
    CPU kernels with ``-march=native``)."""
    if device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        return {"type": "cuda", "name": torch.cuda.get_device_name(device), "compute_capability": f"{cc[0]}.{cc[1]}",
                "cuda": torch.version.cuda}
    info = Path("/proc/cpuinfo")
    flags = next((ln for ln in info.read_text().splitlines() if ln.startswith("flags")), "") if info.is_file() else ""
    return {"type": device.type, "name": platform.machine(), "flags_sha256": hashlib.sha256(flags.encode()).hexdigest()}


def identity(runner, checkpoint_sha256: str, mode: str) -> dict:
    """The fields a package set is keyed by (module doc); JSON-serialisable, compared exactly."""
    names, tensors, _ = step_tensors(runner)
    sig = hashlib.sha256(json.dumps([[n, list(t.shape), str(t.dtype)] for n, t in zip(names, tensors)]).encode())
    g = runner.model.gpt
    info = runner.info
    return {"checkpoint_sha256": checkpoint_sha256, "backend": info.backend, "precision": info.precision,
            "engine_id": info.engine_id, "torch": torch.__version__, "device": device_identity(runner.device),
            "kv": {"max_batch": info.max_batch, "max_seq_len": info.max_seq_len, "dtype": str(g.k_cache[0].dtype)},
            "ring": runner.ring, "mode": mode, "code_sha256": _code_sha256(runner), "inputs_sha256": sig.hexdigest()}


def key_of(ident: dict) -> str:
    """Directory name of an identity: 16 hex digits of its sha256."""
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def _diff(have: dict, want: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(have) | set(want)):
        a, b = have.get(k), want.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{k}.")
        elif a != b:
            short = (lambda v: f"{v[:12]}..." if isinstance(v, str) and len(v) == 64 else repr(v))
            out.append(f"{prefix}{k} is {short(a)}, here {short(b)}")
    return out


# --------------------------------------------------------------------------- load
def verify_files(directory: Path, graphs: dict) -> None:
    """Each package's size and sha256 against the manifest.

    A local check until the shared verification helper (``appliance.engines.manifest`` /
    ``appliance.model.integrity``) lands; it should then call that.

    Raises:
        EngineMismatchError: a file is missing or differs, named.
    """
    for name, g in graphs.items():
        p = directory / g["file"]
        if not p.is_file():
            raise EngineMismatchError(f"{p} is missing; rebuild with: {REBUILD}")
        if p.stat().st_size != g["bytes"] or mf.file_sha256(p) != g["sha256"]:
            raise EngineMismatchError(f"{p} does not match the sha256 its manifest records (damaged or replaced); "
                                      f"rebuild with: {REBUILD}")


def find(runner, root: str | os.PathLike, ckpt_dir: str | os.PathLike, mode: str = "default") -> tuple[Path, dict]:
    """The directory under ``root`` whose manifest's identity equals this runner's, and its manifest.

    The checkpoint is hashed again only when a file's size or mtime differs from what a manifest
    recorded (:func:`appliance.engines.manifest.checkpoint_identity`).

    Raises:
        EngineMismatchError: nothing under ``root``, or no identity matches (the nearest one's
            differences are named).
    """
    root = Path(root)
    cands = sorted(root.glob(f"*/{mf.MANIFEST}")) if root.is_dir() else []
    if not cands:
        raise EngineMismatchError(f"no ahead-of-time compiled step in {root}; build with: {REBUILD}")
    best: Optional[list[str]] = None
    for c in cands:
        try:
            m = mf.read(c.parent, REBUILD)
        except EngineMismatchError as e:
            best = best or [str(e)]
            continue
        ident = identity(runner, mf.checkpoint_identity(ckpt_dir, m.get("checkpoint"))["sha256"], mode)
        d = _diff(m.get("identity", {}), ident)
        if not d:
            return c.parent, m
        if best is None or len(d) < len(best):
            best = [f"{c.parent.name}: " + "; ".join(d)]
    raise EngineMismatchError(f"no ahead-of-time compiled step in {root} matches this runner ({best[0]}); "
                              f"rebuild with: {REBUILD}")


class AotSteps:
    """The loaded packages of one directory, bound to one runner's tensors.

    Args:
        runner: the :class:`~appliance.engines.torch.cuda_runner.CudaRunner` whose tensors the packages
            read and write (allocated once; the same objects for the runner's lifetime).
        directory, manifest: from :func:`find`.
        shapes: the ``(b, L)`` to load; those the manifest lacks (a set built with ``--batches`` /
            ``--buckets``) are listed in ``missing`` and run the plain step.

    Raises:
        EngineMismatchError: none of the shapes is there, a file fails its sha256, the set failed
            its load check in a child process (now or recorded: :func:`aot_canary.check`), or a
            package does not load.
    """

    def __init__(self, runner, directory: Path, manifest: dict, shapes: list[tuple[int, int]]):
        graphs = manifest.get("graphs", {})
        self.missing = [(b, L) for b, L in shapes if package_name(b, L) not in graphs]
        shapes = [x for x in shapes if x not in self.missing]
        if not shapes:
            raise EngineMismatchError(f"{directory} holds none of the shapes this runner captures; rebuild with: {REBUILD}")
        verify_files(directory, {package_name(b, L): graphs[package_name(b, L)] for b, L in shapes})
        self.directory = directory
        self._xs = step_tensors(runner)[1]
        dev = runner.device.index if runner.device.type == "cuda" and runner.device.index is not None else -1
        self.verdict = aot_canary.check(directory, manifest, dev)   # a child process first: a fault kills
        if not self.verdict.ok:
            raise EngineMismatchError(self.verdict.reason)
        self._run = {}
        with aot_canary.loading(directory):
            for b, L in shapes:
                p = directory / package_name(b, L)
                try:
                    self._run[(b, L)] = aot_canary.load_package(p, dev)
                except Exception as e:  # the loader raises RuntimeError and others
                    raise EngineMismatchError(f"{p} does not load ({e}); rebuild with: {REBUILD}") from e

    def spans(self, batches: list[int], top: int) -> list[int]:
        """The attention spans loaded for every one of ``batches``, if they include ``top`` (the KV
        length), else []: a set built for fewer spans (``engines compile --buckets``) then serves
        every position with the compiled step, over a longer span, instead of the plain one."""
        have = sorted({L for _, L in self._run if all((b, L) in self._run for b in batches)})
        return have if top in have else []

    def fn(self, b: int, L: int) -> Optional[Callable[[], None]]:
        """The step for ``(b, L)`` as a no-argument callable (None: no package for that shape)."""
        run = self._run.get((b, L))
        if run is None:
            return None
        xs = self._xs
        return lambda: run(list(xs))   # the loader empties the list it is given


def open_steps(runner, root: Optional[str | os.PathLike], ckpt_dir: str | os.PathLike,
               shapes: list[tuple[int, int]], mode: str = "default") -> tuple[Optional[AotSteps], str]:
    """The runner's packages for ``shapes`` and what its step is, in one line: ``(AotSteps, "ahead-of-time
    compiled step from DIR")`` or ``(None, "plain CUDA graphs: <why>")`` (logged as a warning); never
    raises for a set that cannot be loaded, and never loads one in-process before a child process has
    loaded it under this torch (:mod:`appliance.engines.torch.aot_canary`)."""
    if root is None:
        return None, "plain CUDA graphs: no engine directory for ahead-of-time packages"
    t0 = time.perf_counter()
    try:
        d, m = find(runner, root, ckpt_dir, mode)
        steps = AotSteps(runner, d, m, shapes)
    except EngineMismatchError as e:
        why = f"plain CUDA graphs: {e}"
        log.warning("decode step: %s", why)
        return None, why
    plain = f"; plain step for {', '.join(f'b{b}_L{L}' for b, L in steps.missing)} (not built)" if steps.missing else ""
    check = "recorded" if steps.verdict.recorded else "passed now"
    return steps, (f"ahead-of-time compiled ({m['identity']['mode']}) from {d}, {len(steps._run)} packages loaded "
                   f"in {time.perf_counter() - t0:.2f} s (load check in a test process {check}){plain}")
