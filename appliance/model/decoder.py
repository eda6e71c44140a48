"""The hidden-state Decoder: GPT last hidden states -> 100-bin log-mel (times ``coef``).

Same network as upstream's ``DVAE`` built without encoder and VQ (``ChatTTS/model/dvae.py``,
``config.decoder``), our own code, upstream's parameter names:

* input ``[B, D, T]`` reshaped as upstream ``view(B, 2, D/2, T).permute(0, 2, 3, 1).flatten(2)``
  to ``[B, D/2, 2T]`` (each hidden state becomes two frames, interleaved);
* ``decoder.conv_in``: Conv1d(D/2 -> bn, k3) + GELU + Conv1d(bn -> hidden, k3);
* ``decoder.decoder_block.N``: ConvNeXt blocks (Liu et al. 2022; as Vocos): depthwise k7
  dilation 2, LayerNorm(eps 1e-6), Linear x4 + GELU + Linear, layer scale ``weight``, residual;
* ``decoder.conv_out``: 1x1 conv, no bias; ``out_conv``: Conv1d(-> 100 mel, k3, no bias);
* output multiplied by ``coef [1, 100, 1]``.

Non-causal: receptive field about +-75 frames (conv_in 2, blocks 12 x 6, out_conv 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .shapes import ModelShapes


class ConvNeXtBlock(nn.Module):
    """ConvNeXt 1-D block: dwconv(k, dilation) -> LN -> Linear(4x) -> GELU -> Linear -> scale, + x.

    ``scale_name`` is the layer-scale parameter's name: ``weight`` (upstream DVAE) or ``gamma`` (vocos).
    """

    def __init__(self, dim: int, inter: int, kernel: int, dilation: int, scale_name: str):
        super().__init__()
        self.dwconv = nn.Conv1d(dim, dim, kernel, padding=dilation * (kernel // 2), dilation=dilation, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, inter)
        self.pwconv2 = nn.Linear(inter, dim)
        self.scale_name = scale_name
        self.register_parameter(scale_name, nn.Parameter(torch.ones(dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, C, T]
        y = self.dwconv(x).transpose(1, 2)  # [B, T, C]
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y))))
        y = y * getattr(self, self.scale_name)
        return x + y.transpose(1, 2)


class _DecoderStack(nn.Module):
    def __init__(self, idim: int, odim: int, hidden: int, n_layer: int, bn: int):
        super().__init__()
        self.conv_in = nn.Sequential(nn.Conv1d(idim, bn, 3, 1, 1), nn.GELU(), nn.Conv1d(bn, hidden, 3, 1, 1))
        self.decoder_block = nn.ModuleList([ConvNeXtBlock(hidden, 4 * hidden, 7, 2, "weight") for _ in range(n_layer)])
        self.conv_out = nn.Conv1d(hidden, odim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv_in(x)
        for blk in self.decoder_block:
            y = blk(y)
        return self.conv_out(y)


class Decoder(nn.Module):
    """Hidden states ``[B, D, T]`` -> mel ``[B, 100, 2T]`` (log-mel x coef)."""

    def __init__(self, s: ModelShapes):
        super().__init__()
        self.shapes = s
        self.register_buffer("coef", torch.ones(1, s.n_mels, 1))
        self.decoder = _DecoderStack(s.dec_idim, s.dec_odim, s.dec_hidden, s.dec_layers, s.dec_bn)
        self.out_conv = nn.Conv1d(s.dec_odim, s.n_mels, 3, 1, 1, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, d, t = hidden.shape
        x = hidden.reshape(b, 2, d // 2, t).permute(0, 2, 3, 1).flatten(2)  # [B, D/2, 2T]
        return self.out_conv(self.decoder(x)) * self.coef
