"""Build TensorRT plans from the exported ONNX graphs (``chattts-appliance engines build``).

Input: ``<engine_dir>/onnx/fp16/`` (``engines export --precision fp16``). Output:
``<engine_dir>/trt/<precision>/<graph>.plan`` plus ``manifest.json``, and the timing cache
``<engine_dir>/trt/timing.cache`` shared by every build on this machine (loaded before, saved
after each graph; classic TensorRT only: TensorRT-RTX 1.2+ ignores timing caches).

Precision (strongly typed: it lives in the graph, :mod:`appliance.build.graph_precision`):
``fp16`` builds the fp16 graphs as they are; ``int8`` first rewrites their MatMul/Gemm weights
to INT8 + DequantizeLinear (weight-only; for Orin and GPUs without FP8); ``fp8`` to FP8 E4M3,
only for a target of compute capability >= 8.9 — any other target is refused by
:func:`check_request` before any file is read.

The module calls TensorRT only through :mod:`appliance.engines.tensorrt.trt` (``tensorrt`` on Jetson,
``tensorrt_rtx`` from pip elsewhere). Optimization profiles come from the export manifest
(min/opt/max per dynamic input; the limits are the config's ``model.max_batch``,
``max_seq_len``, ``max_prompt_tokens``). The workspace (memory-pool) limit is ``workspace_mib``.
The builder's own report of weight and activation memory ("Total Weights Memory",
"Total Activation Memory") is captured into the manifest per graph.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from ..engines import manifest as mf
from ..engines.tensorrt import trt as trtshim
from ..errors import ConfigError, EngineError

log = logging.getLogger(__name__)

PRECISIONS = ("fp16", "int8", "fp8")
FP8_MIN_CC = (8, 9)


def resolve_target(target: str | None) -> str | None:
    """The compute capability to build for: ``target``, else this machine's GPU, else None."""
    if target:
        if mf.cc_tuple(target) is None:
            raise ConfigError(f"--target {target!r}: give a compute capability such as 8.7")
        return target
    return mf.device_facts().get("compute_capability")


def check_request(precision: str, target: str | None) -> None:
    """Refuse impossible builds before any work.

    Raises:
        ConfigError: unknown precision; ``fp8`` for a target below sm 8.9 (e.g. Orin, 8.7) or
            for an unknown target.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision {precision}: TensorRT plans are built as {', '.join(PRECISIONS)}")
    if precision == "fp8":
        cc = mf.cc_tuple(target)
        if cc is None:
            raise ConfigError("--precision fp8 needs a known target of compute capability >= 8.9: "
                              "no GPU found here, pass --target (e.g. 8.9 for RTX 40xx)")
        if cc < FP8_MIN_CC:
            raise ConfigError(f"--precision fp8: the target has compute capability {target}, FP8 needs >= 8.9 "
                              f"(Jetson Orin is 8.7): build --precision int8 (weight-only) or fp16 instead")


def _dtype_name(dt: Any) -> str:
    return str(getattr(dt, "name", dt)).lower()


def build_graph(onnx_path: Path, plan_path: Path, profiles: list[dict[str, list]], *, precision: str, target: str | None,
                workspace_mib: int, timing_cache: Path | None,
                on_phase: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Parse ``onnx_path`` and build one plan to ``plan_path``.

    Returns the manifest entry: ``file``, ``inputs`` / ``outputs`` (name, shape, dtype),
    ``profiles`` (optimization profiles in order: min/opt/max per dynamic input),
    ``weights_bytes``, ``activation_bytes`` (builder report), ``plan_bytes``,
    ``build_s``.

    Raises:
        EngineError: the parser or the builder failed (their error lines are in the message).
    """
    trt = trtshim.module()
    logger = trtshim.capture_logger()
    builder = trt.Builder(logger)
    network = builder.create_network(trtshim.network_flags())
    parser = trt.OnnxParser(network, logger)
    t0 = time.perf_counter()
    if not parser.parse_from_file(str(onnx_path)):
        errs = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"TensorRT cannot parse {onnx_path.name}: {errs}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_mib) << 20)
    trtshim.apply_precision(config, precision)
    trtshim.set_target(config, target)
    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    outputs = [network.get_output(i) for i in range(network.num_outputs)]
    if any(-1 in tuple(t.shape) for t in inputs):
        for profile in profiles:
            prof = builder.create_optimization_profile()
            for t in inputs:
                if -1 in tuple(t.shape):
                    if t.name not in profile:
                        raise EngineError(f"{onnx_path.name}: input {t.name} has dynamic shape {tuple(t.shape)} but no profile in the export manifest")
                    mn, opt, mx = (tuple(x) for x in profile[t.name])
                    prof.set_shape(t.name, mn, opt, mx)
            config.add_optimization_profile(prof)
    cache = None
    if timing_cache is not None:
        blob = timing_cache.read_bytes() if timing_cache.is_file() else b""
        cache = config.create_timing_cache(blob)
        config.set_timing_cache(cache, False)
    if on_phase is not None:
        mon = trtshim.progress_monitor(on_phase)
        if mon is not None:
            config.progress_monitor = mon
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineError(f"TensorRT build of {onnx_path.name} failed: {'; '.join(logger.errors()) or 'no error message'}")
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    with open(plan_path, "wb") as f:
        f.write(memoryview(plan))
    if cache is not None:
        tc = config.get_timing_cache()
        if tc is not None:
            timing_cache.write_bytes(bytes(memoryview(tc.serialize())))
    mem = logger.memory()
    return {
        "file": plan_path.name,
        "inputs": [{"name": t.name, "shape": list(t.shape), "dtype": _dtype_name(t.dtype)} for t in inputs],
        "outputs": [{"name": t.name, "shape": list(t.shape), "dtype": _dtype_name(t.dtype)} for t in outputs],
        "profiles": profiles,
        "weights_bytes": mem.get("weights_bytes"),
        "activation_bytes": mem.get("activation_bytes"),
        "plan_bytes": plan_path.stat().st_size,
        "build_s": round(time.perf_counter() - t0, 2),
    }


def build_all(engine_dir: str | Path, precision: str = "fp16", *, target: str | None = None, workspace_mib: int = 1024,
              graphs: tuple[str, ...] | None = None, progress: Callable[[str, str, int, int], None] | None = None) -> Path:
    """Build every exported graph of ``<engine_dir>/onnx/fp16`` into ``<engine_dir>/trt/<precision>``.

    ``progress(graph, phase, step, n_steps)`` is called for each builder phase.
    Returns the output directory (with ``manifest.json``).

    Raises:
        ConfigError: see :func:`check_request` (raised before anything is read), TensorRT missing.
        EngineMismatchError: no fp16 export (message says how to make it).
        EngineError: a parse or build failed.
    """
    target = resolve_target(target)
    check_request(precision, target)
    trtshim.validate_target(target)  # TensorRT missing or target impossible -> ConfigError before work
    engine_dir = Path(engine_dir)
    src = engine_dir / "onnx" / "fp16"
    exp = mf.read(src, "chattts-appliance engines export --precision fp16")
    out = engine_dir / "trt" / precision
    entries: dict[str, Any] = {}
    if graphs and (out / mf.MANIFEST).is_file():
        entries = dict(mf.read(out).get("graphs", {}))  # a subset rebuild keeps the other plans
    elif out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    # TensorRT-RTX: timing caches are no-ops (deprecated in 1.2); it tunes at run time instead
    cache_path = None if trtshim.is_rtx() else engine_dir / "trt" / "timing.cache"
    names = graphs or tuple(exp["graphs"])
    unknown = set(names) - set(exp["graphs"])
    if unknown:
        raise ConfigError(f"--graphs: {sorted(unknown)} not exported; exported: {', '.join(exp['graphs'])}")
    for name in names:
        e = exp["graphs"][name]
        onnx_path = src / e["file"]
        n_q = None
        if precision in ("int8", "fp8"):
            from .graph_precision import qdq_weights

            q_path = out / f"{name}.{precision}.onnx"
            n_q = qdq_weights(onnx_path, q_path, precision)
            onnx_path = q_path
        cb = (lambda ph, i, n, name=name: progress(name, ph, i, n)) if progress else None
        entry = build_graph(onnx_path, out / f"{name}.plan", e["profiles"], precision=precision, target=target,
                            workspace_mib=workspace_mib, timing_cache=cache_path, on_phase=cb)
        entry["quantized_weights"] = n_q
        entries[name] = entry
        log.info("built %s (%s): weights %s B, activations %s B, %.1f s", name, precision,
                 entry["weights_bytes"], entry["activation_bytes"], entry["build_s"])
    emb_file = exp.get("embed", {}).get("file")
    if emb_file:  # the host-side embedding tables travel with the plans
        shutil.copy2(src / emb_file, out / emb_file)
    facts = dict(mf.device_facts())
    facts["compute_capability"] = target
    mf.write(out, {
        "kind": "tensorrt",
        "precision": precision,
        "runtime": {"name": trtshim.flavor(), "version": trtshim.version()},
        "device": facts,
        "checkpoint": exp["checkpoint"],
        "limits": exp["limits"],
        "shapes": exp["shapes"],
        "special": exp.get("special", {}),
        "embed": exp.get("embed", {}),
        "kv": exp.get("kv", {}),
        "build": {"workspace_mib": workspace_mib, "timing_cache": str(cache_path) if cache_path else None, "strongly_typed": trtshim.strongly_typed(),
                  "flavor": trtshim.flavor(), "source": str(src), "quantization": None if precision == "fp16" else f"{precision} weight-only Q/DQ"},
        "memory": {"weights_bytes": sum(e["weights_bytes"] or 0 for e in entries.values()),
                   "activation_bytes": sum(e["activation_bytes"] or 0 for e in entries.values()),
                   "activation_bytes_max": max((e["activation_bytes"] or 0 for e in entries.values()), default=0)},
        "graphs": entries,
    })
    return out
