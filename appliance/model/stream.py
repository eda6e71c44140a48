"""Stateful streaming passes of the Decoder and Vocos: each frame's left context is computed once.

Both networks are stacks of convolutions whose other layers act per frame (LayerNorm over
channels, GELU, pointwise Linear, residual adds), so a pass over a growing sequence can keep,
per convolution, the last ``2h`` frames of its input that will not change again (``h`` =
dilation x (kernel // 2), the layer's half-width) and compute only what is new. This is the
"streaming convolution with a cache" pattern of streaming ASR/TTS encoders, applied to a
non-causal stack:

* a pass receives ``x_new``: frames ``[pos0, pos0 + n_final)`` that are *final* (they will not
  change) followed by frames that are *provisional* (they may change; Vocos reads mel frames
  that the Decoder computed with the hidden states available so far);
* layer ``l`` (cumulative half-width ``H_l`` of the layers before it) receives the frames
  ``[pos0 - H_l, end)`` of its input and prepends its cache, the frames ``[pos0 - H_l - 2h,
  pos0 - H_l)`` of the previous pass: so it computes its output ``[pos0 - H_l - h, end)`` with
  its true left context and zero padding past ``end`` (the one-shot pass's padding at the end);
* its new cache is its input ``[pos0 + n_final - H_l - 2h, pos0 + n_final - H_l)``: frames that
  depended only on final frames;
* frames at negative positions are zero (the one-shot pass's padding at the start), so every
  convolution's input is masked there.

The output of a pass covers ``[pos0 - H, end)`` (``H`` = the stack's whole half-width, the
receptive field ``rf``): the frames of the previous pass that were not yet final, recomputed, and
the new ones. Equal, up to floating-point rounding, to the one-shot pass over ``[0, end)`` (tests:
``tests/test_model_stream.py``), and so to the windows of :mod:`appliance.synth.vocoder` that
carry ``rf`` frames of left context. Work per pass: the new frames plus ``H_l`` recomputed frames
per layer, against ``2 rf`` more for a stateless window.

Caches: a list of tensors ``[C_l, 2 h_l]`` (batch 1) in the model's dtype; ``None`` starts a
sentence (zeros). The functions take and return them, so a runner keeps them per KV slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .decoder import ConvNeXtBlock, Decoder
from .vocos import Vocos


def _half(conv: nn.Conv1d) -> int:
    return conv.dilation[0] * (conv.kernel_size[0] // 2)


def _conv(conv: nn.Conv1d, x_new: torch.Tensor, cache: torch.Tensor | None, start: torch.Tensor,
          n_final: torch.Tensor, tail, drop=0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One cached convolution. ``x_new [1, C, T]``; ``cache [C, 2h]`` or None (a sentence's first
    pass: ``x_new`` starts at position 0 and the layer is padded with zeros on both sides, as the
    one-shot pass, so no frame at a negative position is computed); ``start``: the absolute
    position of the cache's first frame (int64, 0-d); ``tail``: the frames of this layer's input
    recomputed from the previous pass (``D_l``); ``drop``: output frames the next layer already
    holds frozen (later passes only; 0 for the exact stream). Returns (input as the residual sees
    it, aligned with the output; output ``[1, C_out, h - drop + T]`` (first pass: ``T``); new cache
    ``[C, 2h]``)."""
    h = _half(conv)
    keep = n_final + torch.arange(2 * h, device=x_new.device)
    if cache is None:
        y = F.conv1d(F.pad(x_new, (h, h)), conv.weight, conv.bias, 1, 0, conv.dilation, conv.groups)
        return x_new, y, F.pad(x_new, (tail + 2 * h, 0))[0].index_select(1, keep)
    x = torch.cat([cache.unsqueeze(0).to(x_new.dtype), x_new], dim=-1)
    pos = start + torch.arange(x.shape[-1], device=x.device)
    x = x * (pos >= 0).to(x.dtype)
    new = x[0].index_select(1, keep)
    if not (isinstance(drop, int) and drop == 0):   # the next layer holds these output frames frozen: not computed again
        x = x.narrow(-1, drop, x.shape[-1] - drop)   # not x[..., drop:]: a slice by a symbolic start has a
        #                                              data-dependent length in torch.export (2.11: no ONNX export)
    y = F.conv1d(F.pad(x, (0, h)), conv.weight, conv.bias, 1, 0, conv.dilation, conv.groups)
    return x[..., h:], y, new


def _block(blk: ConvNeXtBlock, x_new: torch.Tensor, cache: torch.Tensor | None, start: torch.Tensor,
           n_final: torch.Tensor, tail, drop=0) -> tuple[torch.Tensor, torch.Tensor]:
    x, y, new = _conv(blk.dwconv, x_new, cache, start, n_final, tail, drop)
    y = y.transpose(1, 2)
    y = blk.pwconv2(F.gelu(blk.pwconv1(blk.norm(y)))) * getattr(blk, blk.scale_name)
    return x + y.transpose(1, 2), new


def decoder_cache_shapes(dec: Decoder) -> list[tuple[int, int]]:
    """``[(channels, frames)]`` of the Decoder's caches, in the order of :func:`decoder_stream`."""
    st = dec.decoder
    convs = [st.conv_in[0], st.conv_in[2], *(b.dwconv for b in st.decoder_block), dec.out_conv]
    return [(c.in_channels, 2 * _half(c)) for c in convs]


def vocos_cache_shapes(voc: Vocos) -> list[tuple[int, int]]:
    """``[(channels, frames)]`` of Vocos' caches, in the order of :func:`vocos_stream`."""
    bb = voc.backbone
    convs = [bb.embed, *(b.dwconv for b in bb.convnext)]
    return [(c.in_channels, 2 * _half(c)) for c in convs]


def zero_caches(shapes: list[tuple[int, int]], dtype: torch.dtype, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Fresh caches (a sentence's start) for the shapes of :func:`decoder_cache_shapes` / :func:`vocos_cache_shapes`."""
    return [torch.zeros(c, f, dtype=dtype, device=device) for c, f in shapes]


def decoder_stream(dec: Decoder, hidden: torch.Tensor, pos0: torch.Tensor,
                   caches: list[torch.Tensor] | None, reach=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Streaming Decoder pass over new hidden states (all final).

    Args:
        hidden: ``[1, D, T]`` (T >= 1), the hidden states ``[pos0 / 2, pos0 / 2 + T)``.
        pos0: int64 0-d, mel frames already final = 2 x hidden states passed before.
        caches: from the previous pass, or None for a sentence's first pass (``pos0`` 0).
        reach: how many frames of right context a frame of each layer's input waits for before it
            is frozen (int, or a symbolic int in an export; None or >= ``rf``: the receptive
            field, exact). Layer ``l`` recomputes ``D_l = min(H_l, reach)`` frames of the previous
            pass instead of ``H_l``; a frame frozen with fewer than ``H_l`` frames of right context
            differs from the one-shot pass by what the weights read beyond it (the streaming error
            that ``chattts-appliance calibrate`` measures; the same reach for every pass of a
            sentence).

    Returns:
        mel ``[1, 100, R + 2T]`` covering mel frames ``[pos0 - R, pos0 + 2T)`` (``R`` =
        ``min(rf, reach)``, ``rf`` = ``RunnerInfo.decoder_rf``; frames at negative positions are
        meaningless), and the new caches. Frames ``< pos0 + 2T - R`` are final (frozen), the rest
        provisional.
    """
    b, d, t = hidden.shape
    x = hidden.reshape(b, 2, d // 2, t).permute(0, 2, 3, 1).flatten(2)  # [1, D/2, 2T]
    n_final = 2 * t + torch.zeros_like(pos0)
    st = dec.decoder
    first = caches is None
    new: list[torch.Tensor] = []
    depth = 0   # H_l: the exact stream's recomputed frames of this layer's input
    tail = 0    # D_l = min(H_l, reach): the frames this stream recomputes

    def step(h: int):
        """(start of the cache, output frames to drop) for a layer of half-width ``h``; advances."""
        nonlocal depth, tail
        nxt = depth + h if reach is None else torch.sym_min(depth + h, reach)
        start, drop = pos0 - tail - 2 * h, tail + h - nxt
        depth, tail = depth + h, nxt
        return start, (0 if first else drop)

    def conv(c: nn.Conv1d, x: torch.Tensor, i: int) -> torch.Tensor:
        t0 = tail
        start, drop = step(_half(c))
        _, y, nc = _conv(c, x, None if first else caches[i], start, n_final, t0, drop)
        new.append(nc)
        return y

    y = conv(st.conv_in[2], F.gelu(conv(st.conv_in[0], x, 0)), 1)
    for j, blk in enumerate(st.decoder_block):
        t0 = tail
        start, drop = step(_half(blk.dwconv))
        y, nc = _block(blk, y, None if first else caches[2 + j], start, n_final, t0, drop)
        new.append(nc)
    y = st.conv_out(y)
    y = conv(dec.out_conv, y, 2 + len(st.decoder_block))
    if first:  # frames [0, 2T): pad to the shape of a later pass (frames at negative positions are zero)
        y = F.pad(y, (tail, 0))
    return y * dec.coef, new


def vocos_stream(voc: Vocos, mel: torch.Tensor, pos0: torch.Tensor, n_final: torch.Tensor,
                 caches: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Streaming Vocos pass (up to the complex spectrum) over new mel frames.

    Args:
        mel: ``[1, 100, F]`` (F >= 1), mel frames ``[pos0, pos0 + F)``; the first ``n_final`` are
            final, the rest provisional (recomputed by the next pass).
        pos0, n_final: int64 0-d; ``pos0`` = final mel frames passed before.
        caches: from the previous pass, or None for a sentence's first pass (``pos0`` 0).

    Returns:
        (real, imag) ``[1, rf + F, n_fft/2 + 1]`` covering spectrum frames ``[pos0 - rf, pos0 + F)``
        (``rf`` = ``RunnerInfo.vocos_rf``), and the new caches.
    """
    bb = voc.backbone
    first = caches is None
    h = _half(bb.embed)
    _, x, c0 = _conv(bb.embed, mel, None if first else caches[0], pos0 - 2 * h, n_final, 0)
    x = bb.norm(x.transpose(1, 2)).transpose(1, 2)
    new = [c0]
    tail = h
    for j, blk in enumerate(bb.convnext):
        h = _half(blk.dwconv)
        x, nc = _block(blk, x, None if first else caches[1 + j], pos0 - tail - 2 * h, n_final, tail)
        new.append(nc)
        tail += h
    if first:
        x = F.pad(x, (tail, 0))
    x = voc.head.out(bb.final_layer_norm(x.transpose(1, 2)))
    logmag, phase = x.chunk(2, dim=-1)
    mag = torch.clip(torch.exp(logmag), max=1e2)
    return mag * torch.cos(phase), mag * torch.sin(phase), new
