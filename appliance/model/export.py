"""ONNX export of the four engine graphs (``chattts-appliance engines export``).

Graphs (``torch.onnx.export(..., dynamo=True, opset_version=18)``), one file each under
``<engine_dir>/onnx/<precision>/`` with a ``manifest.json`` (:mod:`appliance.runtime.manifest`).
D = hidden, L = layers, H = heads, hd = head dim, Q = 4, V = 626, S = ``max_seq_len``,
M = ``max_batch``:

``gpt_prefill``
    in ``ids [1, T] int64``, ``spk_emb [1, D] float32``, ``spk_mask [1, T] bool`` (True where the
    L2-normalised speaker replaces the text embedding, upstream ``Speaker.apply``);
    out ``logits [1, Q, V] float32`` and ``hidden [1, D] float32`` of the last position,
    ``k_new`` / ``v_new [L, T, H, hd]`` (graph dtype) for the runner to store at positions 0..T-1.
    T in 1..``max_prompt_tokens``.

``gpt_decode`` (static KV cache that stays in place)
    in ``codes [B, Q] int64``, ``pos [B] int64``, ``slots [B] int64`` and per layer
    ``k_cache.i`` / ``v_cache.i [P, M, H, hd]`` (graph dtype): the filled prefix of the runner's
    position-major cache ``[S, M, H, hd]`` (``P = max(pos)``), bound by pointer (no copy in,
    nothing copied out); only the filled part of the cache is read (DESIGN.md §2), never ``S``;
    out ``logits [B, Q, V] float32``, ``hidden [B, D] float32``, ``k_new`` / ``v_new [L, B, H, hd]``
    that the runner writes at ``[pos[b], slots[b]]`` (B x L x 2 x D values per step).
    The fp16 export (TensorRT's input) binds the whole cache ``k_cache.i [S, M, H, hd]`` instead,
    with an input ``past [P] uint8`` whose length is P, slices ``[:P]`` in the graph and uses the
    standard attention pattern that TensorRT fuses (builder-reported activations: 18 MiB,
    against 555 MiB for the ONNX Runtime form below, full size, B <= 3, S = 2048).
    Row b attends to cache positions ``< pos[b]`` of slot ``slots[b]`` plus its own new key;
    the scores against the cache and against the new key are joined on the small ``[B, H, 1,
    P+1]`` score tensor, so keys/values are never concatenated (measured: copies of the cache
    were 60 % of a step with the first, concatenating graph; see :mod:`appliance.runtime.onnx_runner`).

``decoder``
    ``hidden [T, D] float32`` -> ``mel [100, 2T] float32``; T dynamic (ONNX Runtime: any T;
    TensorRT: a profile 2..``window_tokens``). No padding: the streaming code
    (:mod:`appliance.tts.stream`) cuts overlapping windows, and a variable window keeps the
    joins exact, which a zero-padded fixed window would not (padding changes the convs' edge).

``vocos``
    ``mel [100, F] float32`` -> ``real, imag [F, n_fft/2 + 1] float32``; F dynamic (TensorRT
    profile 2..2 x ``window_tokens``). **The inverse STFT stays on the host in numpy**
    (:mod:`appliance.tts.istft`). Measured on this 2-core CPU (2026-11-30, 1 s of audio =
    94 frames): numpy rfft-based ISTFT 0.6-0.8 ms; the in-graph form (inverse-DFT basis as a
    [F, 1026] x [1026, 1024] matrix product, ~100 MFLOP, plus overlap-add) 19.6 ms for the same
    frames in numpy. On a GPU the product would be cheap, but the streaming overlap-add needs host
    state across windows anyway and the ISTFT is < 0.5 % of real time on the host, so the graph
    stops at the complex spectrum.

Precision lives in the graph (TensorRT-RTX and TensorRT 10 are strongly typed): ``fp32``
(ONNX Runtime default), ``fp16`` (weights and activations FP16, RMSNorm/RoPE tables in FP32 as
the model computes them; input of TensorRT plans), ``int8`` (ONNX Runtime: the fp32 graphs
with every constant-weight MatMul replaced by ``MatMulNBits`` 8-bit blockwise, weight-only;
see :mod:`appliance.runtime.graph_precision`). TensorRT int8/fp8 graphs are made from the fp16
export at build time.

Errors: :class:`~appliance.errors.CheckpointError` (bad checkpoint),
:class:`~appliance.errors.ConfigError` (bad precision/limits), :class:`~appliance.errors.EngineError`
(the exporter failed; the message names the graph).
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, EngineError
from ..runtime import manifest as mf
from .checkpoint import ChatTTSModel, load_model

log = logging.getLogger(__name__)

GRAPHS = ("gpt_prefill", "gpt_decode", "decoder", "vocos")
OPSET = 18
#: Default longest Decoder window in tokens (Vocos: twice that in mel frames) for TensorRT profiles.
WINDOW_TOKENS = 256


class PrefillGraph(nn.Module):
    """Prompt -> last logits/hidden and the prompt's keys/values (see module doc)."""

    def __init__(self, m: ChatTTSModel):
        super().__init__()
        self.gpt, self.embed = m.gpt, m.embed

    def forward(self, ids: torch.Tensor, spk_emb: torch.Tensor, spk_mask: torch.Tensor):
        gpt = self.gpt
        emb = self.embed.embed_text(ids)  # [1, T, D]
        spk = F.normalize(spk_emb, p=2.0, dim=-1, eps=1e-12).to(emb.dtype)  # [1, D]
        x = torch.where(spk_mask.unsqueeze(-1), spk.unsqueeze(1), emb)
        t = ids.shape[1]
        pos = torch.arange(t, device=ids.device).unsqueeze(0)
        cos, sin = gpt._rope(pos, x.dtype)
        ks, vs = [], []
        for blk in gpt.layers:
            a, k, v = blk.self_attn.forward_causal(blk.input_layernorm(x), cos, sin)
            ks.append(k[0].transpose(0, 1))  # [T, H, hd]: the cache's position-major layout
            vs.append(v[0].transpose(0, 1))
            x = x + a
            x = x + blk.mlp(blk.post_attention_layernorm(x))
        h = gpt.norm(x)[:, -1]  # [1, D]
        logits = self.embed.audio_logits(h)  # [1, Q, V]
        return logits.float(), h.float(), torch.stack(ks), torch.stack(vs)


class DecodeGraph(nn.Module):
    """One decode step over the in-place static KV cache (see module doc).

    ``static=False`` (ONNX Runtime): ``k_cache.i [P, M, H, hd]`` is the bound prefix.
    ``static=True`` (TensorRT): ``k_cache.i [S, M, H, hd]`` is the whole buffer and an extra
    input ``past [P] uint8`` gives the prefix length; the graph slices ``[:P]``.
    """

    def __init__(self, m: ChatTTSModel, static: bool = False):
        super().__init__()
        self.gpt, self.embed = m.gpt, m.embed
        self.static = static

    def forward(self, codes: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], past: torch.Tensor | None = None):
        gpt = self.gpt
        b = codes.shape[0]
        if self.static:
            p = past.shape[0]
            k_cache = [k[:p] for k in k_cache]
            v_cache = [v[:p] for v in v_cache]
        else:
            p = k_cache[0].shape[0]  # positions read: the runner binds the cache prefix [:P]
        x = self.embed.embed_codes(codes).unsqueeze(1)  # [B, 1, D]
        cos, sin = gpt._rope(pos.unsqueeze(1), x.dtype)  # [B, 1, 1, hd]
        seen = torch.arange(p, device=codes.device).unsqueeze(0) < pos.unsqueeze(1)  # [B, P]
        bias = torch.zeros(b, 1, 1, p, dtype=torch.float32, device=codes.device).masked_fill(
            ~seen.view(b, 1, 1, p), float("-inf"))
        scale = 1.0 / math.sqrt(gpt.shapes.head_dim)
        mask = torch.cat([seen, torch.ones(b, 1, dtype=torch.bool, device=codes.device)], 1).view(b, 1, 1, p + 1)
        ks, vs = [], []
        for i, blk in enumerate(gpt.layers):
            att = blk.self_attn
            q, k, v = att._qkv(blk.input_layernorm(x), cos, sin)  # [B, H, 1, hd]
            if self.static:
                # TensorRT: the standard attention pattern, which its compiler fuses (measured:
                # the split-score form below made TensorRT-RTX reserve 555 MiB of activations)
                keys = torch.cat([k_cache[i].index_select(1, slots).permute(1, 2, 0, 3), k], 2)  # [B, H, P+1, hd]
                vals = torch.cat([v_cache[i].index_select(1, slots).permute(1, 2, 0, 3), v], 2)
                y = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
            else:
                kp = k_cache[i].index_select(1, slots).permute(1, 2, 3, 0)  # [P, B, H, hd] -> [B, H, hd, P]
                vp = v_cache[i].index_select(1, slots).permute(1, 2, 0, 3)  # -> [B, H, P, hd]
                # scores against the cache and against the new key, joined on the small score tensor
                s_past = (q @ kp).float() * scale + bias  # [B, H, 1, P]
                s_new = (q * k).sum(-1, keepdim=True).float() * scale  # [B, H, 1, 1]
                w = torch.softmax(torch.cat([s_past, s_new], -1), -1).to(x.dtype)
                y = w[..., :p] @ vp + w[..., p:] * v  # [B, H, 1, hd]
            x = x + att._out(y)
            x = x + blk.mlp(blk.post_attention_layernorm(x))
            ks.append(k[:, :, 0])
            vs.append(v[:, :, 0])
        h = gpt.norm(x)[:, 0]  # [B, D]
        logits = self.embed.audio_logits(h)
        return logits.float(), h.float(), torch.stack(ks), torch.stack(vs)


class DecoderGraph(nn.Module):
    """hidden [T, D] -> mel [100, 2T] float32."""

    def __init__(self, m: ChatTTSModel):
        super().__init__()
        self.decoder = m.decoder

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dt = self.decoder.out_conv.weight.dtype
        return self.decoder(hidden.to(dt).t().unsqueeze(0))[0].float()


class VocosGraph(nn.Module):
    """mel [100, F] -> (real, imag) [F, n_fft/2+1] float32."""

    def __init__(self, m: ChatTTSModel):
        super().__init__()
        self.vocos = m.vocos

    def forward(self, mel: torch.Tensor):
        dt = self.vocos.head.out.weight.dtype
        re, im = self.vocos(mel.to(dt).unsqueeze(0))
        return re[0].float(), im[0].float()


def _dtype(precision: str) -> torch.dtype:
    if precision in ("fp32", "int8"):
        return torch.float32
    if precision == "fp16":
        return torch.float16
    raise ConfigError(f"--precision {precision}: export writes fp32, fp16 or int8 graphs (TensorRT fp8 is made from fp16 at build time)")


def _specs(m: ChatTTSModel, max_batch: int, max_seq_len: int, max_prompt_tokens: int, window_tokens: int,
           dtype: torch.dtype, static_cache: bool = False) -> dict[str, dict[str, Any]]:
    """Per graph: module, example args, dynamic shapes, input/output names, profile."""
    s = m.shapes
    D, L, H, hd = s.hidden, s.n_layers, s.n_heads, s.head_dim
    Dim = torch.export.Dim
    T = Dim("T", min=2, max=max_prompt_tokens)
    B = Dim("B", min=1, max=max_batch)
    P = Dim("P", min=2, max=max_seq_len - 1)
    W = Dim("W", min=2, max=window_tokens)
    Fm = Dim("F", min=2, max=2 * window_tokens)
    t0 = min(8, max_prompt_tokens)
    ids = torch.randint(0, s.num_text_tokens, (1, t0))
    cache = [torch.zeros(5, max_batch, H, hd, dtype=dtype) for _ in range(2 * L)]  # prefix [P, M, H, hd]
    full = [torch.zeros(max_seq_len, max_batch, H, hd, dtype=dtype) for _ in range(2 * L)] if static_cache else []
    b0 = min(2, max_batch)
    kin = [f"k_cache.{i}" for i in range(L)]
    vin = [f"v_cache.{i}" for i in range(L)]
    opt_p = min(256, max_seq_len - 1)
    return {
        "gpt_prefill": dict(
            module=PrefillGraph(m),
            args=(ids, torch.randn(1, D), ids == ids[0, 0]),
            dynamic=({1: T}, None, {1: T}),
            inputs=["ids", "spk_emb", "spk_mask"],
            outputs=["logits", "hidden", "k_new", "v_new"],
            profile={"ids": ([1, 1], [1, min(64, max_prompt_tokens)], [1, max_prompt_tokens]),
                     "spk_mask": ([1, 1], [1, min(64, max_prompt_tokens)], [1, max_prompt_tokens])},
        ),
        "gpt_decode": dict(
            module=DecodeGraph(m, static=True),
            args=(torch.zeros(b0, s.num_vq, dtype=torch.int64), torch.full((b0,), 5, dtype=torch.int64),
                  torch.arange(b0, dtype=torch.int64), full[:L], full[L:], torch.zeros(5, dtype=torch.uint8)),
            dynamic=({0: B}, {0: B}, {0: B}, [None] * L, [None] * L, {0: P}),
            inputs=["codes", "pos", "slots"] + kin + vin + ["past"],
            outputs=["logits", "hidden", "k_new", "v_new"],
            profile={"codes": ([1, s.num_vq], [max_batch, s.num_vq], [max_batch, s.num_vq]),
                     "pos": ([1], [max_batch], [max_batch]), "slots": ([1], [max_batch], [max_batch]),
                     "past": ([1], [opt_p], [max_seq_len - 1])},
        ) if static_cache else dict(
            module=DecodeGraph(m),
            args=(torch.zeros(b0, s.num_vq, dtype=torch.int64), torch.full((b0,), 5, dtype=torch.int64),
                  torch.arange(b0, dtype=torch.int64), cache[:L], cache[L:]),
            dynamic=({0: B}, {0: B}, {0: B}, [{0: P}] * L, [{0: P}] * L),
            inputs=["codes", "pos", "slots"] + kin + vin,
            outputs=["logits", "hidden", "k_new", "v_new"],
            profile={"codes": ([1, s.num_vq], [max_batch, s.num_vq], [max_batch, s.num_vq]),
                     "pos": ([1], [max_batch], [max_batch]), "slots": ([1], [max_batch], [max_batch]),
                     **{n: ([1, max_batch, H, hd], [opt_p, max_batch, H, hd], [max_seq_len - 1, max_batch, H, hd])
                        for n in kin + vin}},
        ),
        "decoder": dict(
            module=DecoderGraph(m),
            args=(torch.randn(16, D),),
            dynamic=({0: W},),
            inputs=["hidden"],
            outputs=["mel"],
            profile={"hidden": ([1, D], [min(128, window_tokens), D], [window_tokens, D])},
        ),
        "vocos": dict(
            module=VocosGraph(m),
            args=(torch.randn(s.n_mels, 32),),
            dynamic=({1: Fm},),
            inputs=["mel"],
            outputs=["real", "imag"],
            profile={"mel": ([s.n_mels, 1], [s.n_mels, min(256, 2 * window_tokens)], [s.n_mels, 2 * window_tokens])},
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
    unknown = set(graphs) - set(GRAPHS)
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
        if precision == "int8":
            from ..runtime.graph_precision import matmul_nbits

            matmul_nbits(f, f, bits=8)
        ins, outs = _io(f)
        entries[name] = {"file": f.name, "inputs": ins, "outputs": outs,
                         "profile": {k: list(v) for k, v in specs[name]["profile"].items()},
                         "export_s": round(time.perf_counter() - t0, 2)}
        log.info("exported %s in %.1f s", name, time.perf_counter() - t0)
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
        "kv": {"dtype": "float16" if kv_el == 2 else "float32", "bytes_per_token": 2 * s.n_layers * s.hidden * kv_el},
        "build": {"opset": OPSET, "exporter": "torch.onnx dynamo", "decode_cache": "static" if static else "prefix", "quantization": "MatMulNBits-8" if precision == "int8" else None},
        "graphs": entries,
    })
    return out
