"""What a TensorRT plan directory promises, read without a GPU: the manifest check, the buffer
plan, and the exact windowing of long Decoder/Vocos inputs.

These run (and are tested) on any machine; the runner that executes the plans,
:mod:`appliance.engines.tensorrt.runner`, builds on them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from ...config import Config
from ...errors import EngineError
from .. import manifest as mf
from . import trt as trtshim

log = logging.getLogger(__name__)

PRECISIONS = ("fp8", "int8", "fp16")
_NP = {"float": np.float32, "half": np.float16, "int64": np.int64, "int32": np.int32, "bool": np.bool_,
       "uint8": np.uint8, "int8": np.int8}


def find_plans(cfg: Config) -> Path | None:
    """First ``<engine_dir>/trt/<precision>`` (order fp8, int8, fp16) holding a manifest."""
    return mf.find_built(cfg.resolve(cfg.model.engine_dir), "trt", PRECISIONS)


def load_manifest(cfg: Config, plan_dir: Path) -> dict:
    """Read ``plan_dir``'s manifest and refuse it unless TensorRT flavour/version, device
    (compute capability, board, L4T where known), checkpoint and limits match.

    Raises:
        EngineMismatchError: with ``rebuild with: ...``.
    """
    cfg_path = cfg.file_hint
    hint = mf.rebuild_hint(cfg_path, plan_dir.name, tensorrt=True)
    m = mf.read(plan_dir, hint)
    facts = mf.device_facts()
    expect = mf.expect_common(cfg, m, "tensorrt")
    expect["runtime"] = {"name": trtshim.flavor(), "version": trtshim.version()}
    expect["device"] = {k: facts.get(k) for k in ("compute_capability", "board", "l4t")}
    mf.check(m, expect, hint)
    return m


def plan_buffers(m: dict) -> dict[str, dict[str, dict[str, Any]]]:
    """Device buffers to allocate once: ``{graph: {tensor: {shape, dtype, nbytes, mode}}}``.

    Shapes are the profile maxima for dynamic inputs; outputs' dynamic dims are resolved from
    the limits (B = max_batch, T = max_prompt_tokens, window = window_tokens). The decode
    graph's ``k_cache.i`` / ``v_cache.i`` are *not* planned here: they are the KV cache itself
    (``kv`` key: ``[S, M, H, hd]`` per layer and K/V, positions first).

    Raises:
        EngineError: a dtype or dimension the plan cannot resolve.
    """
    lim, s = m["limits"], m["shapes"]
    M, S, T, W = lim["max_batch"], lim["max_seq_len"], lim["max_prompt_tokens"], lim["window_tokens"]
    H, L, D = s["n_heads"], s["n_layers"], s["hidden"]
    hd = D // H
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for g, e in m["graphs"].items():
        plan: dict[str, dict[str, Any]] = {}
        prof: dict[str, list[int]] = {}  # elementwise maximum over the profiles
        for pr in e.get("profiles", []):
            for n, (_, _, mx) in pr.items():
                prof[n] = [max(a, b) for a, b in zip(prof.get(n, mx), mx)]
        for t in e["inputs"]:
            if t["name"].startswith(("k_cache.", "v_cache.")):
                continue
            shape = list(prof[t["name"]]) if t["name"] in prof else list(t["shape"])
            plan[t["name"]] = {"shape": shape, "mode": "input"}
        for t in e["outputs"]:
            shape = list(t["shape"])
            if -1 in shape:
                if g == "gpt":  # decode: B = M, T = 1; prefill: B = 1, T = max_prompt_tokens
                    shape = {"logits": [M, s["num_vq"], s["num_audio_tokens"]], "hidden": [M, D],
                             "k_new": [L, M, T, H, hd], "v_new": [L, M, T, H, hd]}[t["name"]]
                elif g == "decoder":
                    shape = [s["n_mels"], 2 * W]
                elif g == "vocos":
                    shape = [2 * W, s["n_fft"] // 2 + 1]
            plan[t["name"]] = {"shape": shape, "mode": "output"}
        for t in e["inputs"] + e["outputs"]:
            if t["name"] in plan:
                dt = _NP.get(t["dtype"])
                if dt is None:
                    raise EngineError(f"{g}: tensor {t['name']} has dtype {t['dtype']} that the runner cannot stage")
                p = plan[t["name"]]
                if any(int(x) < 0 for x in p["shape"]):
                    raise EngineError(f"{g}: cannot resolve the shape {p['shape']} of {t['name']}")
                p["dtype"] = np.dtype(dt).name
                p["nbytes"] = int(np.prod(p["shape"])) * np.dtype(dt).itemsize
        out[g] = plan
    kv_dt = np.float16 if m.get("kv", {}).get("dtype") == "float16" else np.float32
    out["kv"] = {f"{kv}_cache.{i}": {"shape": [S, M, H, hd], "dtype": np.dtype(kv_dt).name, "mode": "state",
                                     "nbytes": S * M * H * hd * np.dtype(kv_dt).itemsize}
                 for kv in ("k", "v") for i in range(L)}
    return out


def run_windowed(fn: Callable[[Any], Any], x: Any, axis: int, max_len: int, ctx: int, out_axis: int, scale: int,
                 cat: Optional[Callable[[list, int], Any]] = None) -> Any:
    """Apply a convolutional ``fn`` to ``x`` in windows of at most ``max_len`` along ``axis``.

    Each window carries ``ctx`` input positions of context on both sides (>= the receptive
    field), so every kept output equals the one-pass result. ``fn``'s output has ``scale``
    positions per input position along ``out_axis``.

    Works on numpy arrays and torch tensors alike (slicing only; ``cat`` joins the parts:
    ``np.concatenate`` by default, ``torch.cat`` for tensors).

    Raises:
        EngineError: ``max_len`` leaves no room beyond the context (``max_len <= 2 * ctx``).
    """
    n = x.shape[axis]
    if n <= max_len:
        return fn(x)
    core = max_len - 2 * ctx
    if core <= 0:
        raise EngineError(f"window of {max_len} cannot hold 2 x {ctx} context positions: rebuild with a larger --window-tokens")
    parts = []
    for a in range(0, n, core):
        b = min(n, a + core)
        w0, w1 = max(0, a - ctx), min(n, b + ctx)
        y = fn(x[(slice(None),) * axis + (slice(w0, w1),)])
        parts.append(y[(slice(None),) * out_axis + (slice((a - w0) * scale, (b - w0) * scale),)])
    return (cat or np.concatenate)(parts, out_axis)
