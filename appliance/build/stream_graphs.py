"""The stateful vocoder graphs of the ONNX Runtime export (fp32 and int8 precisions).

ONNX Runtime's ``decoder`` and ``vocos`` graphs are the streaming passes of
:mod:`appliance.model.stream`: each call takes the new frames and every convolution's cache and
returns the output with the caches to keep (the runner holds them per KV slot).
``decoder_first`` and ``vocos_first`` are a sentence's first pass: no caches in, the layers padded
with zeros at the start as the one-shot pass, so no frame at a negative position is computed (in
the later-pass graph those frames, up to the receptive field per layer, cost as much as the first
window itself). The weights exist twice in the export and in memory (INT8: about 40 MiB at full
size); ONNX ``If`` would share them but the weight quantizer does not rewrite subgraphs. The
TensorRT input (fp16 export) keeps the stateless window graphs of :mod:`appliance.build.export`.

``decoder``
    in ``hidden [T, D] float32`` (new hidden states, T >= 1), ``pos0 [1] int64`` (mel frames
    already final: 2 x hidden states passed before), ``cache.i [C_i, 2 h_i]`` (graph dtype);
    out ``mel [100, rf + 2T] float32`` (mel frames ``[pos0 - rf, pos0 + 2T)``) and
    ``cache_out.i``. ``decoder_first``: in ``hidden`` only (pos0 = 0), the same outputs.
``vocos``
    in ``mel [100, F] float32`` (F >= 1), ``pos0 [1] int64`` (final mel frames passed before),
    ``n_final [1] int64`` (how many of the F frames are final), ``cache.i``; out ``real, imag
    [rf + F, 513] float32`` (spectrum frames ``[pos0 - rf, pos0 + F)``) and ``cache_out.i``.
    ``vocos_first``: in ``mel`` and ``n_final`` (pos0 = 0), the same outputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..model.checkpoint import ChatTTSModel
from ..model.stream import (
    decoder_cache_shapes,
    decoder_stream,
    vocos_cache_shapes,
    vocos_stream,
    zero_caches,
)


class DecoderStreamGraph(nn.Module):
    """Later passes: (hidden [T, D], pos0 [1], caches) -> (mel [100, rf + 2T] float32, *caches);
    ``first``: (hidden) -> the same outputs for a sentence's first pass (no caches read)."""

    def __init__(self, m: ChatTTSModel, first: bool = False):
        super().__init__()
        self.decoder, self.first = m.decoder, first

    def forward(self, hidden: torch.Tensor, pos0: torch.Tensor | None = None, caches: list[torch.Tensor] | None = None):
        x = hidden.to(self.decoder.out_conv.weight.dtype).t().unsqueeze(0)
        p = torch.zeros((), dtype=torch.int64) if self.first else pos0.reshape(())
        mel, new = decoder_stream(self.decoder, x, p, None if self.first else caches)
        return (mel[0].float(), *new)


class VocosStreamGraph(nn.Module):
    """Later passes: (mel [100, F], pos0 [1], n_final [1], caches) -> (real, imag [rf + F, 513]
    float32, *caches); ``first``: (mel, n_final) -> the same for a sentence's first pass."""

    def __init__(self, m: ChatTTSModel, first: bool = False):
        super().__init__()
        self.vocos, self.first = m.vocos, first

    def forward(self, mel: torch.Tensor, pos0: torch.Tensor, n_final: torch.Tensor | None = None,
                caches: list[torch.Tensor] | None = None):
        x = mel.to(self.vocos.head.out.weight.dtype).unsqueeze(0)
        if self.first:  # (mel, n_final)
            re, im, new = vocos_stream(self.vocos, x, torch.zeros((), dtype=torch.int64), pos0.reshape(()), None)
        else:
            re, im, new = vocos_stream(self.vocos, x, pos0.reshape(()), n_final.reshape(()), caches)
        return (re[0].float(), im[0].float(), *new)


def stream_specs(m: ChatTTSModel, window_tokens: int, dtype: torch.dtype) -> dict[str, dict[str, Any]]:
    """Export specs (module, example args, dynamic shapes, names) of the four stateful graphs."""
    s = m.shapes
    Dim = torch.export.Dim
    T = Dim("T", min=1, max=window_tokens)
    Fm = Dim("F", min=1, max=2 * window_tokens)
    dc = zero_caches(decoder_cache_shapes(m.decoder), dtype)
    vc = zero_caches(vocos_cache_shapes(m.vocos), dtype)
    one = torch.zeros(1, dtype=torch.int64)
    dco = [f"cache_out.{i}" for i in range(len(dc))]
    vco = [f"cache_out.{i}" for i in range(len(vc))]
    return {
        "decoder": dict(
            module=DecoderStreamGraph(m), args=(torch.randn(16, s.hidden), one + 32, dc),
            dynamic=({0: T}, None, [None] * len(dc)),
            inputs=["hidden", "pos0"] + [f"cache.{i}" for i in range(len(dc))], outputs=["mel"] + dco, profiles=[]),
        "decoder_first": dict(
            module=DecoderStreamGraph(m, first=True), args=(torch.randn(16, s.hidden),), dynamic=({0: T},),
            inputs=["hidden"], outputs=["mel"] + dco, profiles=[]),
        "vocos": dict(
            module=VocosStreamGraph(m), args=(torch.randn(s.n_mels, 32), one + 64, one + 24, vc),
            dynamic=({1: Fm}, None, None, [None] * len(vc)),
            inputs=["mel", "pos0", "n_final"] + [f"cache.{i}" for i in range(len(vc))], outputs=["real", "imag"] + vco,
            profiles=[]),
        "vocos_first": dict(
            module=VocosStreamGraph(m, first=True), args=(torch.randn(s.n_mels, 32), one + 24), dynamic=({1: Fm}, None),
            inputs=["mel", "n_final"], outputs=["real", "imag"] + vco, profiles=[]),
    }
