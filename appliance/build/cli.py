"""``chattts-appliance engines export`` and ``engines build``.

``export``: checkpoint -> ``<engine_dir>/onnx/<precision>/`` (needs torch; see
:mod:`appliance.build.export`), or for a GGUF type (``q8_0``, ...) ``<engine_dir>/llama/<type>/``
(the GPT as ``gpt.gguf`` for llama.cpp, :mod:`appliance.build.gguf_export`). ``build``: ``<engine_dir>/onnx/fp16/`` -> TensorRT plans in
``<engine_dir>/trt/<precision>/`` (:mod:`appliance.build.trt_build`). Both show progress
(a tqdm bar per graph; builder phases as its postfix) and print where the results went and
the memory the builder reported.

Defaults come from the config (``--config``, default ``config.yaml``; built-in defaults when
that file does not exist): checkpoint ``model.path``, output ``model.engine_dir``, limits
``model.max_batch`` / ``max_seq_len`` / ``max_prompt_tokens``, workspace
``min(1024, service.memory_budget_mb)`` MiB.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from ..config import Config, load_config

log = logging.getLogger(__name__)

#: The oldest torch whose ONNX export of these graphs is tested (pyproject.toml's floor): CI runs the
#: export tests under 2.10.0 (scripts/test_torch_floor.sh) and 2.13; 2.11 on the lent H200. Older
#: ones fail (2026-12-04, tiny checkpoint): 2.9.1 cannot export the GPT (a guard T != 1 against the
#: declared range), 2.8.0 falls back to a draft export that fixes the TensorRT GPT graph's T at the
#: example's 3, 2.5.1 cannot translate the Decoder stream's padding by a symbolic length.
TORCH_FLOOR = (2, 10)


def torch_problem() -> str | None:
    """Why this torch cannot export the graphs (too old, or none), with what to do; None when it can.
    ``scripts/install_jetson.sh`` asks this before it exports on a box."""
    try:
        import torch
    except ImportError:
        return "no torch here: export on a machine with torch >= 2.10 and copy the graphs (install_jetson.sh --onnx-dir DIR)"
    have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2] if x.isdigit())
    if have >= TORCH_FLOOR:
        return None
    want = ".".join(map(str, TORCH_FLOOR))
    return (f"torch {torch.__version__} is older than {want}, the oldest whose ONNX export of these graphs is tested: "
            f"run 'chattts-appliance engines export --precision fp16 --out DIR' on a machine with torch >= {want} "
            f"and pass the DIR here (install_jetson.sh --onnx-dir DIR), or install torch >= {want} "
            f"(JetPack 6's NVIDIA wheels are 2.3-2.5; see README: GPU boxes)")


def _bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="graph", file=sys.stderr, disable=None)


def cli_export(args) -> int:
    """Export the ONNX graphs (or the llama.cpp GGUF); returns 0. Errors propagate as ApplianceError (exit status 2)."""
    from ..engines.llama.lib import FTYPES
    from .export import GRAPHS, WINDOW_TOKENS, export_all

    cfg = load_config(args.config)  # None: the built-in defaults
    mc = cfg.model
    logging.getLogger("onnx_ir").setLevel(logging.WARNING)  # the exporter's passes log every rewrite at INFO
    ckpt = Path(args.checkpoint) if args.checkpoint else cfg.resolve(mc.path)
    out = Path(args.out) if args.out else cfg.resolve(mc.engine_dir)
    if args.precision in FTYPES:
        return _export_llama(cfg, args, ckpt, out)
    problem = torch_problem()
    if problem:
        from ..errors import ConfigError

        raise ConfigError(problem)
    n_graphs = len(GRAPHS) + (2 if args.precision != "fp16" else 0)  # ONNX Runtime: + the first passes (merged after)
    bar = _bar(n_graphs, f"export {args.precision}")

    def step(name: str) -> None:
        if bar.n or getattr(step, "started", False):
            bar.update(1)
        step.started = True
        bar.set_postfix_str(name)

    try:
        d = export_all(ckpt, out, precision=args.precision, max_batch=mc.max_batch, max_seq_len=mc.max_seq_len,
                       max_prompt_tokens=min(mc.max_prompt_tokens, mc.max_seq_len - 1),
                       window_tokens=getattr(args, "window_tokens", None) or WINDOW_TOKENS, progress=step)
        bar.update(bar.total - bar.n)
    finally:
        bar.close()
    print(f"exported {n_graphs} graphs to {d}")
    if getattr(args, "calibrate", False) and args.precision in ("fp32", "int8", "int4") and not args.checkpoint and not args.out:
        _calibrate(cfg, backend="onnxruntime")
    return 0


def _export_llama(cfg: Config, args, ckpt: Path, out: Path) -> int:
    """``engines export --precision <GGUF type>`` (:func:`appliance.build.gguf_export.export_llama`)."""
    from .export import WINDOW_TOKENS
    from .gguf_export import export_llama

    mc = cfg.model
    bar = _bar(3, f"export {args.precision}")  # vocoder graphs, gpt.gguf, quantization

    def step(name: str) -> None:
        if name != "vocoder":  # the first step
            bar.update(1)
        bar.set_postfix_str(name)

    try:
        d = export_llama(ckpt, out, qtype=args.precision, max_batch=mc.max_batch, max_seq_len=mc.max_seq_len,
                         max_prompt_tokens=min(mc.max_prompt_tokens, mc.max_seq_len - 1),
                         window_tokens=getattr(args, "window_tokens", None) or WINDOW_TOKENS, progress=step)
        bar.update(bar.total - bar.n)
    finally:
        bar.close()
    print(f"exported gpt.gguf ({args.precision}) and the vocoder graphs to {d}")
    if getattr(args, "calibrate", False) and not args.checkpoint and not args.out:
        _calibrate(cfg, backend="llama")
    return 0


def _calibrate(cfg: Config, backend: str) -> None:
    """Run ``chattts-appliance calibrate`` on what was just built (the configured checkpoint and
    engine dir); a failure is reported, not fatal (the daemon then uses the exact look-ahead)."""
    import dataclasses

    from ..errors import ApplianceError
    from .calibrate import report, run

    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, backend=backend))
    try:
        cal, path = run(cfg)
    except ApplianceError as e:
        print(f"look-ahead calibration skipped ({e}); run 'chattts-appliance calibrate' where the engines run")
        return
    print(report(cal, path, cfg.stream.lookahead))


def cli_build(args) -> int:
    """Build TensorRT plans; returns 0. Errors propagate as ApplianceError (exit status 2)."""
    from .trt_build import build_all

    cfg = load_config(args.config)  # None: the built-in defaults
    d = Path(args.dir) if args.dir else cfg.resolve(cfg.model.engine_dir)
    ws = args.workspace_mib if getattr(args, "workspace_mib", None) else min(1024, cfg.service.memory_budget_mb)
    graphs = tuple(g.strip() for g in args.graphs.split(",")) if getattr(args, "graphs", None) else None
    n = len(graphs) if graphs else 3  # gpt, decoder, vocos
    bar = _bar(n, f"build {args.precision}")
    seen: list[str] = []

    def on_phase(graph: str, phase: str, i: int, n: int) -> None:
        if graph not in seen:
            if seen:
                bar.update(1)
            seen.append(graph)
        bar.set_postfix_str(f"{graph}: {phase} {i}/{n}" if n else f"{graph}: {phase}")

    try:
        out = build_all(d, args.precision, target=args.target, workspace_mib=ws, graphs=graphs, progress=on_phase)
        bar.update(bar.total - bar.n)
    finally:
        bar.close()
    from ..engines import manifest as mf

    m = mf.read(out)
    print(f"built {len(m['graphs'])} plans ({m['runtime']['name']} {m['runtime']['version']}, {args.precision}) in {out}")
    for name, e in m["graphs"].items():
        w, a = e.get("weights_bytes") or 0, e.get("activation_bytes") or 0
        print(f"  {name:12s} weights {w / 2**20:8.1f} MiB  activations {a / 2**20:8.1f} MiB  plan {e['plan_bytes'] / 2**20:8.1f} MiB")
    mem = m["memory"]
    print(f"  {'total':12s} weights {mem['weights_bytes'] / 2**20:8.1f} MiB  activations {mem['activation_bytes'] / 2**20:8.1f} MiB"
          f"  (budget service.memory_budget_mb = {cfg.service.memory_budget_mb} MiB, KV cache not included)")
    if getattr(args, "calibrate", False) and not args.dir:
        _calibrate(cfg, backend="tensorrt")
    return 0
