"""ONNX export of the engine graphs (``chattts-appliance engines export``).

Graphs (``torch.onnx.export(..., dynamo=True, opset_version=18)``), one file each under
``<engine_dir>/onnx/<precision>/`` with a ``manifest.json`` (:mod:`appliance.engines.manifest`).
D = hidden, L = layers, H = heads, hd = head dim, Q = 4, V = 626, S = ``max_seq_len``,
M = ``max_batch``:

``gpt`` (prefill and decode step in one graph, so the GPT weights exist once)
    in ``emb [B, T, D] float32`` (the input embeddings of T new tokens per row, computed on the
    host from ``embed.safetensors``: text rows for a prompt, with the L2-normalised speaker at
    ``[spk_emb]`` positions as upstream ``Speaker.apply``; the sum of the 4 code rows for a
    decode step), ``pos [B] int64`` (position of each row's first new token), ``slots [B] int64``
    and per layer ``k_cache.i`` / ``v_cache.i [P, M, H, hd]`` (graph dtype): the filled prefix of
    the runner's position-major cache ``[S, M, H, hd]`` (P >= max(pos), >= 1), bound by pointer
    (no copy in, nothing copied out); only the filled part of the cache is read;
    out ``logits [B, Q, V] float32`` and ``hidden [B, D] float32`` of each row's last new token,
    ``k_new`` / ``v_new [L, B, T, H, hd]`` that the runner writes at ``[pos[b] + j, slots[b]]``.
    Prefill is B=1, T=prompt, pos=0; a decode step is T=1 (B x L x 2 x D values written).
    New token j of row b attends to cache positions ``< pos[b]`` of slot ``slots[b]`` and to new
    tokens ``<= j``; the scores against the cache and against the new keys are joined on the
    score tensor, so keys/values are never concatenated (measured: copies of the cache were 60 %
    of a step with the first, concatenating graph; see :mod:`appliance.engines.onnx.runner`).
    The fp16 export (TensorRT's input) binds the whole cache ``k_cache.i [S, M, H, hd]`` instead,
    with an input ``past [P] uint8`` whose length is P, slices ``[:P]`` in the graph and uses the
    standard attention pattern that TensorRT fuses (builder-reported activations of the decode
    graph: 18 MiB, against 555 MiB for the ONNX Runtime form, full size, B <= 3, S = 2048). It
    carries two optimization profiles: 0 = decode (B 1..M, T = 1), 1 = prefill (B = 1,
    T 1..``max_prompt_tokens``).

``decoder`` (TensorRT's input; ONNX Runtime's exports carry the *stateful* ``decoder`` and
``vocos`` of :mod:`appliance.build.stream_graphs` instead, ``build.vocoder: stream-reach``)
    ``hidden [T, D] float32`` -> ``mel [100, 2T] float32``; T dynamic (TensorRT: a profile
    2..``window_tokens``). No padding: the streaming code
    (:mod:`appliance.synth.vocoder`) cuts overlapping windows, and a variable window keeps the
    joins exact, which a zero-padded fixed window would not (padding changes the convs' edge).

``vocos``
    ``mel [100, F] float32`` -> ``real, imag [F, n_fft/2 + 1] float32``; F dynamic (TensorRT
    profile 2..2 x ``window_tokens``). **The inverse STFT stays on the host in numpy**
    (:mod:`appliance.synth.istft`). Measured on this 2-core CPU (2026-11-30, 1 s of audio =
    94 frames): numpy rfft-based ISTFT 0.6-0.8 ms; the in-graph form (inverse-DFT basis as a
    [F, 1026] x [1026, 1024] matrix product, ~100 MFLOP, plus overlap-add) 19.6 ms for the same
    frames in numpy. On a GPU the product would be cheap, but the streaming overlap-add needs host
    state across windows anyway and the ISTFT is < 0.5 % of real time on the host, so the graph
    stops at the complex spectrum.

Precision lives in the graph (TensorRT-RTX and TensorRT 10 are strongly typed): ``fp32``,
``fp16`` (weights and activations FP16, RMSNorm/RoPE tables in FP32; input of TensorRT plans),
``int8`` / ``int4`` (ONNX Runtime: the fp32 ``gpt`` graph with every constant-weight MatMul as
``MatMulNBits`` 8 / 4-bit blockwise, weight-only, :mod:`appliance.build.graph_precision`; the
Decoder and Vocos stay FP32). TensorRT int8/fp8 graphs are made from the fp16 export at build time.

Why the vocoder stays FP32 in an ``int8`` export (measured on the 2-core CPU, ONNX Runtime 1.32,
AVX2 without VNNI, 2026-12-01): ``MatMulNBits`` wins where a step reads each weight once for one
row (the GPT decode step: a 768x3072 GEMV 2.7x faster than FP32), but the vocoder's matrices see
20-150 frames per pass, where MLAS's FP32 GEMM is faster (512x2048 at 70 rows: 25.5 ms FP32 against
45.1 ms INT8 for 16 products); streamed through the chunk schedule the FP32 vocoder cost 351-363
ms per second of audio against 441-470 ms (first window 85-97 ms against 108-140 ms), side by
side in one run (``bench_vocoder.py``, retired: bench/HISTORY.md). It is also exact: INT8 rounds matrices of at most 64
rows another way than larger ones, so small passes differed from a one-shot pass by -36 dB and
the INT8 vocoder itself is -34 dB off FP32. Its FP32 weights (Decoder 104 MB, Vocos 54 MB) are held
once: each first pass shares its network's graph (:func:`~.stream_graphs.merge_stream_pair`).

Errors: :class:`~appliance.errors.CheckpointError`, :class:`~appliance.errors.ConfigError` (bad
precision/limits), :class:`~appliance.errors.EngineError` (the exporter failed; names the graph).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..engines import manifest as mf
from ..errors import ConfigError, EngineError
from ..model.checkpoint import ChatTTSModel, load_model
from .graphs import DecoderGraph, GptGraph, VocosGraph

log = logging.getLogger(__name__)

GRAPHS = ("gpt", "decoder", "vocos")
#: Host-side embedding tables written beside the graphs (float32): ``emb_text [N, D]``, ``emb_code [Q, V, D]``.
EMBED_FILE = "embed.safetensors"
OPSET = 18
#: Default longest Decoder window in tokens (Vocos: twice that in mel frames) for TensorRT profiles.
WINDOW_TOKENS = 256
#: Graphs whose MatMuls an ``int8`` export rewrites to ``MatMulNBits``: the GPT only. The vocoder
#: graphs stay FP32 (see module doc: faster on the CPU at vocoder window sizes, and exact).
INT8_GRAPHS = ("gpt",)
#: ONNX Runtime weight-only precisions: bits of the GPT's ``MatMulNBits`` weights (block 32,
#: int8 activations); the graphs are the fp32 export's.
NBITS = {"int8": 8, "int4": 4}


def _dtype(precision: str) -> torch.dtype:
    if precision in ("fp32", "int8", "int4"):
        return torch.float32
    if precision == "fp16":
        return torch.float16
    raise ConfigError(f"--precision {precision}: export writes fp32, fp16 or int8 graphs (TensorRT fp8 is made from fp16 at build time)")


def _specs(m: ChatTTSModel, max_batch: int, max_seq_len: int, max_prompt_tokens: int, window_tokens: int,
           dtype: torch.dtype, static_cache: bool = False) -> dict[str, dict[str, Any]]:
    """Per graph: module, example args, dynamic shapes, input/output names, TensorRT profiles."""
    s = m.shapes
    D, L, H, hd = s.hidden, s.n_layers, s.n_heads, s.head_dim
    Dim = torch.export.Dim
    T = Dim("T", min=1, max=max_prompt_tokens)
    B = Dim("B", min=1, max=max_batch)
    P = Dim("P", min=2, max=max_seq_len - 1)
    W = Dim("W", min=2, max=window_tokens)
    Fm = Dim("F", min=2, max=2 * window_tokens)
    opt_t = min(64, max_prompt_tokens)
    cache = [torch.zeros(5, max_batch, H, hd, dtype=dtype) for _ in range(2 * L)]  # prefix [P, M, H, hd]
    full = [torch.zeros(max_seq_len, max_batch, H, hd, dtype=dtype) for _ in range(2 * L)] if static_cache else []
    b0 = min(2, max_batch)
    kin = [f"k_cache.{i}" for i in range(L)]
    vin = [f"v_cache.{i}" for i in range(L)]
    opt_p = min(256, max_seq_len - 1)
    return {
        "gpt": dict(
            module=GptGraph(m, static=True),
            args=(torch.randn(b0, 3, D), torch.full((b0,), 5, dtype=torch.int64), torch.arange(b0, dtype=torch.int64),
                  full[:L], full[L:], torch.zeros(5, dtype=torch.uint8)),
            dynamic=({0: B, 1: T}, {0: B}, {0: B}, [None] * L, [None] * L, {0: P}),
            inputs=["emb", "pos", "slots"] + kin + vin + ["past"],
            outputs=["logits", "hidden", "k_new", "v_new"],
            profiles=[  # 0: decode step (T = 1), 1: prefill (B = 1)
                {"emb": ([1, 1, D], [max_batch, 1, D], [max_batch, 1, D]), "pos": ([1], [max_batch], [max_batch]),
                 "slots": ([1], [max_batch], [max_batch]), "past": ([1], [opt_p], [max_seq_len - 1])},
                {"emb": ([1, 1, D], [1, opt_t, D], [1, max_prompt_tokens, D]), "pos": ([1], [1], [1]),
                 "slots": ([1], [1], [1]), "past": ([1], [1], [max_seq_len - 1])},
            ],
        ) if static_cache else dict(
            module=GptGraph(m),
            args=(torch.randn(b0, 3, D), torch.full((b0,), 5, dtype=torch.int64), torch.arange(b0, dtype=torch.int64),
                  cache[:L], cache[L:]),
            dynamic=({0: B, 1: T}, {0: B}, {0: B}, [{0: P}] * L, [{0: P}] * L),
            inputs=["emb", "pos", "slots"] + kin + vin,
            outputs=["logits", "hidden", "k_new", "v_new"],
            profiles=[],  # ONNX Runtime only
        ),
        "decoder": dict(
            module=DecoderGraph(m),
            args=(torch.randn(16, D),),
            dynamic=({0: W},),
            inputs=["hidden"],
            outputs=["mel"],
            profiles=[{"hidden": ([1, D], [min(128, window_tokens), D], [window_tokens, D])}],
        ),
        "vocos": dict(
            module=VocosGraph(m),
            args=(torch.randn(s.n_mels, 32),),
            dynamic=({1: Fm},),
            inputs=["mel"],
            outputs=["real", "imag"],
            profiles=[{"mel": ([s.n_mels, 1], [s.n_mels, min(256, 2 * window_tokens)], [s.n_mels, 2 * window_tokens])}],
        ),
    }


def _io(path: Path) -> tuple[list[dict], list[dict]]:
    """(inputs, outputs) of an ONNX file: name, shape (int or symbol), dtype name."""
    import onnx

    mdl = onnx.load(str(path), load_external_data=False)

    def one(v):
        tt = v.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or -1) for d in tt.shape.dim]
        return {"name": v.name, "shape": shape, "dtype": onnx.TensorProto.DataType.Name(tt.elem_type).lower()}

    return [one(v) for v in mdl.graph.input], [one(v) for v in mdl.graph.output]


def export_graph(name: str, spec: dict, path: Path) -> None:
    """Export one graph to ``path`` (+ ``path.data`` for weights).

    Raises:
        EngineError: the exporter failed (message names the graph and the cause).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in (path, path.with_name(path.name + ".data")):
        stale.unlink(missing_ok=True)
    try:
        with torch.no_grad():
            prog = torch.onnx.export(
                spec["module"].eval(), spec["args"], dynamic_shapes=spec["dynamic"], dynamo=True,
                opset_version=OPSET, input_names=spec["inputs"], output_names=spec["outputs"],
                external_data=True, optimize=True, verbose=False,
            )
            prog.save(str(path), external_data=True)
    except Exception as e:  # the exporter raises many kinds; one wrapper here
        raise EngineError(f"ONNX export of {name} failed: {type(e).__name__}: {str(e)[:2000]}") from e


def export_all(ckpt_dir: str | Path, engine_dir: str | Path, *, precision: str = "fp32", max_batch: int = 3,
               max_seq_len: int = 2048, max_prompt_tokens: int = 256, window_tokens: int = WINDOW_TOKENS,
               graphs: tuple[str, ...] = GRAPHS, progress: Callable[[str], None] | None = None) -> Path:
    """Export the graphs of checkpoint ``ckpt_dir`` into ``<engine_dir>/onnx/<precision>/``.

    Returns the directory (with ``manifest.json``). ``progress(graph_name)`` is called before
    each graph. Precision ``int8`` exports fp32 and rewrites MatMuls to ``MatMulNBits``.

    Raises:
        CheckpointError, ConfigError, EngineError: see module doc.
    """
    dtype = _dtype(precision)
    if "decoder" in graphs or "vocos" in graphs:  # ONNX Runtime's stateful vocoder has a first-pass graph each
        graphs = tuple(graphs) + tuple(f"{g}_first" for g in ("decoder", "vocos") if g in graphs and precision != "fp16")
    unknown = set(graphs) - set(GRAPHS) - {"decoder_first", "vocos_first"}
    if unknown:
        raise ConfigError(f"unknown graph(s) {sorted(unknown)}; known: {', '.join(GRAPHS)}")
    if max_prompt_tokens >= max_seq_len:
        raise ConfigError(f"max_prompt_tokens {max_prompt_tokens} must be below max_seq_len {max_seq_len}")
    out = Path(engine_dir) / "onnx" / precision
    ident = mf.checkpoint_identity(ckpt_dir)
    m = load_model(ckpt_dir, dtype=dtype)
    s = m.shapes
    if max_seq_len > s.max_pos:
        raise ConfigError(f"model.max_seq_len {max_seq_len} exceeds the model's {s.max_pos} positions")
    # fp16 graphs are TensorRT's input: static cache + SDPA (fused by TensorRT); fp32/int8 are ONNX Runtime's
    static = precision == "fp16"
    specs = _specs(m, max_batch, max_seq_len, max_prompt_tokens, window_tokens, dtype, static_cache=static)
    if not static:  # ONNX Runtime: the stateful vocoder passes (appliance.build.stream_graphs)
        from .stream_graphs import stream_specs

        specs.update(stream_specs(m, window_tokens, dtype))
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    entries: dict[str, Any] = {}
    for name in graphs:
        if progress:
            progress(name)
        t0 = time.perf_counter()
        f = out / f"{name}.onnx"
        export_graph(name, specs[name], f)
        if precision in NBITS and name in INT8_GRAPHS:
            from .graph_precision import matmul_nbits

            matmul_nbits(f, f, bits=NBITS[precision])
        ins, outs = _io(f)
        entries[name] = {"file": f.name, "inputs": ins, "outputs": outs,
                         "profiles": [{k: [list(x) for x in v] for k, v in pr.items()} for pr in specs[name]["profiles"]],
                         "export_s": round(time.perf_counter() - t0, 2)}
        log.info("exported %s in %.1f s", name, time.perf_counter() - t0)
    if not static:  # one graph per vocoder network: the first pass shares the stateful pass's weights
        from .stream_graphs import merge_first_passes

        merge_first_passes(out, entries, _io)
    from safetensors.torch import save_file

    with torch.no_grad():  # host-side embeddings (float32): the graphs take embeddings as input
        save_file({"emb_text": m.embed.emb_text.weight.float().contiguous(),
                   "emb_code": m.embed.code_tables().float().contiguous()},
                  str(out / EMBED_FILE))
    kv_el = 2 if dtype == torch.float16 else 4
    mf.write(out, {
        "kind": "onnx",
        "precision": precision,
        "runtime": {"name": "onnx", "version": f"opset{OPSET}", "torch": torch.__version__},
        "device": {},
        "checkpoint": {"path": str(Path(ckpt_dir).resolve()), **ident},
        "limits": {"max_batch": max_batch, "max_seq_len": max_seq_len, "max_prompt_tokens": max_prompt_tokens,
                   "window_tokens": window_tokens},
        "shapes": {k: getattr(s, k) for k in s.__dataclass_fields__},
        "special": {"spk_emb_id": m.spk_emb_id},
        "embed": {"file": EMBED_FILE, "sha256": mf.file_sha256(out / EMBED_FILE)},
        "kv": {"dtype": "float16" if kv_el == 2 else "float32", "bytes_per_token": 2 * s.n_layers * s.hidden * kv_el},
        "build": {"opset": OPSET, "exporter": "torch.onnx dynamo", "decode_cache": "static" if static else "prefix",
                  "quantization": ({g: f"MatMulNBits-{NBITS[precision]}" for g in graphs if g in INT8_GRAPHS}
                                   if precision in NBITS else None),
                  "vocoder": "window" if static else mf.ONNX_VOCODER,
                  "vocoder_precision": "fp32" if precision in NBITS else precision},
        "graphs": entries,
    })
    return out
