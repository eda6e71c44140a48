"""What a backend will hold, known before it loads: weight bytes and KV bytes per position.

The daemon decides whether the model fits ``service.memory_budget_mb`` from these sizes *before*
anything is loaded, compiled or captured (a compiled CUDA start takes minutes; a refusal after it
is four minutes wasted), then checks the measured footprint after warm-up.

Sources: the checkpoint's safetensors headers (tensor shapes and dtypes, read with
``safetensors.safe_open``; no tensor data is read) and ``model.dtype`` / ``model.quant`` for the
torch backends; the manifest and the files of the built engines for ONNX Runtime and TensorRT.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..config import Config
from ..model import layout
from . import manifest as mf

_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_GPU_FP32_PARTS = (layout.DECODER_FILE, layout.VOCOS_FILE)
"""On a GPU the Decoder and Vocos stay float32 (cuda_runner)."""


@dataclass(frozen=True)
class PlannedSizes:
    """Sizes of the backend ``model.backend`` resolves to, before it loads.

    Attributes:
        backend: ``torch``, ``onnxruntime``, ``llama.cpp`` or ``tensorrt``. device: ``cpu`` or ``cuda``.
        weight_bytes: bytes of weights the backend will hold (bytes).
        kv_bytes_per_token: KV-cache bytes per position per slot (bytes).
        resizable: the backend can be opened with other ``max_seq_len`` / ``max_batch`` (torch, llama.cpp);
            built engines (ONNX, TensorRT) are fixed to the sizes they were built for.
        what: one phrase naming the sizes' source, for logs.
        int8_saving_bytes: what INT8 weight-only GPT linears would save where the fit may choose
            them (``model.quant: auto`` on a GPU; 0 otherwise), bytes.
        host_weight_bytes: the part of ``weight_bytes`` that stays in host memory on a GPU box
            (llama.cpp's vocoder graphs and embedding tables beside the offloaded GGUF), bytes.
    """

    backend: str
    device: str
    weight_bytes: int
    kv_bytes_per_token: int
    resizable: bool
    what: str
    int8_saving_bytes: int = 0
    host_weight_bytes: int = 0


def _numel_by_file(asset: Path, files: tuple[str, ...], skip: tuple[str, ...] = ()) -> dict[str, int]:
    """Elements per file (shapes from the safetensors headers; names in ``skip`` left out)."""
    from safetensors import safe_open

    out = {}
    for f in files:
        n = 0
        with safe_open(str(asset / f), framework="numpy") as st:
            for k in st.keys():
                if k not in skip:
                    n += math.prod(st.get_slice(k).get_shape())
        out[f] = n
    return out


def torch_sizes(cfg: Config, gpu: bool) -> PlannedSizes:
    """Sizes of the torch backend on a GPU (``gpu``) or the CPU, from the checkpoint's headers.

    Raises:
        OSError, KeyError, ValueError: a checkpoint file is missing or unreadable (the load then
            fails the same way, with the integrity check's message: the caller skips the estimate).
    """
    mc = cfg.model
    dtype = mc.torch_dtype(gpu=gpu)
    el = _BYTES[dtype]
    asset = _asset(cfg.resolve(mc.path))
    n = _numel_by_file(asset, (layout.GPT_FILE, layout.EMBED_FILE, *_GPU_FP32_PARTS), skip=layout.GPT_IGNORED)
    gc = json.loads((asset / layout.GPT_CONFIG).read_text())
    hidden, n_layers, ffn = int(gc["hidden_size"]), int(gc["num_hidden_layers"]), int(gc["intermediate_size"])
    gpt = n[layout.GPT_FILE] * el
    one_byte = n_layers * (4 * hidden * hidden + 3 * hidden * ffn) * (el - 1)   # block linears at 1 byte per weight
    if gpu and mc.quant in ("int8", "fp8"):
        gpt -= one_byte
    vocoder_el = 4 if gpu else el
    weights = gpt + n[layout.EMBED_FILE] * el + sum(n[f] for f in _GPU_FP32_PARTS) * vocoder_el
    kvpt = 2 * n_layers * hidden * el
    return PlannedSizes("torch", "cuda" if gpu else "cpu", int(weights), int(kvpt), True,
                        f"{dtype} weights from the checkpoint's headers",
                        int(one_byte) if gpu and mc.quant == "auto" else 0)


def built_sizes(cfg: Config, backend: str, d: Path) -> PlannedSizes:
    """Sizes of built engines in ``d`` (ONNX graphs or TensorRT plans): the files' bytes and the
    KV bytes per token their manifest records (fixed sizes: not resizable)."""
    m = mf.read(d)
    weights = sum(p.stat().st_size for p in d.iterdir() if p.is_file() and p.suffix not in (".json", ".txt"))
    kv = int((m.get("kv") or {}).get("bytes_per_token") or 0)
    return PlannedSizes(backend, "cuda" if backend == "tensorrt" else "cpu", weights, kv, False,
                        f"the engine files in {d}")


def llama_sizes(cfg: Config, d: Path) -> PlannedSizes:
    """Sizes of the llama.cpp export in ``d``: the GGUF, the vocoder graphs and the embedding
    tables (the text head, mapped only while refine-text runs, is left out), and the KV bytes per
    position of ``model.llama_kv_cache`` (``2 x layers x width x`` its bytes per value). The
    context is made at load from the config's sizes: resizable. On ``cuda`` where a CUDA build of
    llama.cpp will offload the GPT (:func:`~appliance.engines.llama.lib.offloads`)."""
    from .llama.lib import KV_BYTES, kv_type, kv_wanted, offloads

    m = mf.read(d)
    head = (m.get("head_text") or {}).get("file")
    weights = sum(p.stat().st_size for p in d.iterdir()
                  if p.is_file() and p.suffix not in (".json", ".txt") and p.name != head)
    s = m["shapes"]
    d_model = int(s["hidden"])
    gpu = offloads(cfg.model.device)
    kv = 2 * int(s["n_layers"]) * d_model * KV_BYTES[kv_type(kv_wanted(cfg.model.llama_kv_cache, gpu),
                                                             d_model // int(s["n_heads"]))]
    dev = "cuda" if gpu else "cpu"
    host = weights - (d / m["graphs"]["gpt"]["file"]).stat().st_size if gpu else 0
    return PlannedSizes("llama.cpp", dev, weights, int(kv), True, f"the GGUF export in {d}", host_weight_bytes=host)


def _asset(path: Path) -> Path:
    """``path/asset`` where it exists, else ``path`` (the checkpoint's two spellings; the
    loader's :func:`appliance.model.checkpoint.asset_dir` imports torch, this must not)."""
    return path / "asset" if (path / "asset").is_dir() else path


def plan_sizes(cfg: Config) -> PlannedSizes:
    """The sizes of the backend ``cfg`` will load (:func:`~appliance.engines.select.choose_backend`),
    without loading it.

    Raises:
        ConfigError: no backend is usable (as the load would).
        OSError, KeyError, ValueError: the checkpoint or the engine files cannot be read.
    """
    from .select import choose_backend

    backend, _ = choose_backend(cfg)
    if backend == "torch":
        dev = cfg.model.device
        gpu = dev == "cuda" or (dev == "auto" and mf.device_facts().get("compute_capability") is not None)
        return torch_sizes(cfg, gpu)
    if backend == "llama":
        from .llama.runner import find_llama_export

        d = find_llama_export(cfg)
        if d is None:
            raise FileNotFoundError(f"no GGUF export under {cfg.resolve(cfg.model.engine_dir) / 'llama'}")
        return llama_sizes(cfg, d)
    if backend == "onnxruntime":
        from .onnx.runner import find_export

        d = find_export(cfg)
    else:
        from .select import trt_plans

        d = trt_plans(cfg, mf.device_facts().get("compute_capability"))
    if d is None:
        raise FileNotFoundError(f"no built {backend} engines under {cfg.resolve(cfg.model.engine_dir)}")
    return built_sizes(cfg, backend, d)
