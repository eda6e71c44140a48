"""Vocos vocoder up to the complex spectrum (Siuzdak 2023, ``vocos`` 0.1.0 ``VocosBackbone`` +
``ISTFTHead``; our own code with vocos's parameter names).

* ``backbone.embed``: Conv1d(100 -> dim, k7, pad 3); ``backbone.norm``: LayerNorm(eps 1e-6);
* ``backbone.convnext.N``: ConvNeXt blocks (dwconv k7, LN, Linear -> GELU -> Linear, ``gamma``);
* ``backbone.final_layer_norm``;
* ``head.out``: Linear(dim -> n_fft + 2), split into log-magnitude and phase (n_fft/2+1 each),
  ``mag = min(exp(logmag), 100)``, ``S = mag * (cos p + i sin p)``.

The inverse STFT (``torch.istft(center=True)``, hann window n_fft, hop 256) is not part of the
module: runners return (real, imag) and the host does the inverse (:mod:`appliance.synth.istft`).
:func:`reference_istft` is the torch version, for tests.
"""

from __future__ import annotations

import torch
from torch import nn

from .decoder import ConvNeXtBlock
from .shapes import ModelShapes


class _Backbone(nn.Module):
    def __init__(self, s: ModelShapes):
        super().__init__()
        d = s.voc_dim
        self.embed = nn.Conv1d(s.n_mels, d, 7, padding=3)
        self.norm = nn.LayerNorm(d, eps=1e-6)
        self.convnext = nn.ModuleList([ConvNeXtBlock(d, s.voc_intermediate, 7, 1, "gamma") for _ in range(s.voc_layers)])
        self.final_layer_norm = nn.LayerNorm(d, eps=1e-6)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        # mel: [B, 100, F] -> [B, F, dim]
        x = self.norm(self.embed(mel).transpose(1, 2)).transpose(1, 2)
        for blk in self.convnext:
            x = blk(x)
        return self.final_layer_norm(x.transpose(1, 2))


class _Head(nn.Module):
    def __init__(self, s: ModelShapes):
        super().__init__()
        self.out = nn.Linear(s.voc_dim, s.n_fft + 2)


class Vocos(nn.Module):
    """mel ``[B, 100, F]`` -> (real, imag) ``[B, F, n_fft/2+1]`` of the STFT to invert."""

    def __init__(self, s: ModelShapes):
        super().__init__()
        self.shapes = s
        self.backbone = _Backbone(s)
        self.head = _Head(s)

    def forward(self, mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.head.out(self.backbone(mel))  # [B, F, n_fft + 2]
        logmag, phase = x.chunk(2, dim=-1)
        mag = torch.clip(torch.exp(logmag), max=1e2)
        return mag * torch.cos(phase), mag * torch.sin(phase)


def reference_istft(real: torch.Tensor, imag: torch.Tensor, n_fft: int = 1024, hop: int = 256,
                    window: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse STFT as vocos ``ISTFT(padding="center")``: (real, imag) ``[B, F, n_fft/2+1]`` ->
    waveform ``[B, hop * (F - 1)]`` (float32). ``window``: the synthesis window ``[n_fft]``
    (default ``torch.hann_window``; vocos uses its checkpoint buffer ``head.istft.window``).
    For tests and reference only."""
    spec = torch.complex(real.float(), imag.float()).transpose(1, 2)  # [B, bins, F]
    win = torch.hann_window(n_fft, device=real.device) if window is None else window.float()
    return torch.istft(spec, n_fft, hop, n_fft, win, center=True)
