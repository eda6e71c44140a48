"""The CUDA runner's Decoder and Vocos: the stateful streaming passes on the device, per KV slot.

:class:`DeviceVocoder` runs :func:`appliance.model.stream.decoder_stream` and
:func:`~appliance.model.stream.vocos_stream` (FP32, as every backend's vocoder) over the hidden
states the captured decode step stores (``hid [S, Lmax, D]``), keeps the mel frames
(``mel [S, 100, 2 Lmax]`` FP32) and each slot's convolution caches on the device
(:class:`~appliance.engines.vocoder_state.VocoderCursor` plans the passes), and copies back only
the spectrum frames a window asks for (one pinned buffer, one sync per window).

The passes run eagerly, and their convolutions run **without cuDNN** (PyTorch's own CUDA kernels:
depthwise convolution and an implicit GEMM). Each pass has a length of its own (the new hidden
states, the provisional frames recomputed), and cuDNN sets up every input length it has not seen
before: on an H200 (torch 2.11+cu130, cuDNN 9.19, full size, 2026-12-04) a Decoder + Decoder +
Vocos pass of a new length took 17-27 ms against 9.2-9.4 ms for a length seen before, and
8.6-9.0 ms for any length with cuDNN off (the retired ``parts`` section of ``python -m bench gpu``, bench/HISTORY.md). A stream's
lengths follow its chunk sizes, which follow the measured step and window times, so with cuDNN
every request met new lengths: its first audio came 10-20 ms late and the first five requests
after a start were the slowest (the window times they fed back also grew the first chunk).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ...model.stream import decoder_stream, vocos_stream
from ..runner import VocodeWindow
from ..vocoder_state import VocoderCursor


class DeviceVocoder:
    """Decoder + Vocos passes of one runner's slots (module doc).

    Args:
        model: the loaded :class:`~appliance.model.checkpoint.ChatTTSModel` (``decoder``, ``vocos``
            in FP32). hid: the runner's hidden states ``[S, Lmax, D]`` (any float dtype; read only).
        rf_dec, rf_voc: receptive fields in mel frames (``RunnerInfo.decoder_rf`` / ``vocos_rf``).
        sync: waits for the device (the runner's event), after the spectrum copies.
    """

    def __init__(self, model, hid: torch.Tensor, rf_dec: int, rf_voc: int, sync: Callable[[], None]):
        s = model.shapes
        S, Lmax = hid.shape[0], hid.shape[1]
        self.model, self.hid, self.device, self._sync = model, hid, hid.device, sync
        self.mel = torch.zeros(S, s.n_mels, 2 * Lmax, device=hid.device)        # FP32, as the passes
        nf = s.n_fft // 2 + 1
        self.h_spec = torch.zeros(2, 2 * Lmax, nf, pin_memory=hid.device.type == "cuda")
        self._none = np.zeros((0, nf), np.float32)
        self.cursor = VocoderCursor(S, rf_dec, rf_voc)

    def reset(self, slot: int) -> None:
        """A new sentence in ``slot``: its caches start empty."""
        self.cursor.reset(slot)

    def __call__(self, slot: int, w: VocodeWindow) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`Runner.vocode <appliance.engines.runner.Runner.vocode>` for ``slot`` (checked by
        the runner): (real, imag) ``[f, 513]`` float32 views of the pinned buffer, valid until the
        next call. Raises RuntimeError from torch."""
        cur, dev, m = self.cursor, self.device, self.model
        with torch.inference_mode(), torch.backends.cudnn.flags(enabled=False):
            d = cur.decoder(slot, w)
            if d is not None:
                x = self.hid[slot, d.n0:d.n1].T.unsqueeze(0).float()
                mel, cur.dec_cache[slot] = decoder_stream(m.decoder, x, torch.tensor(2 * d.n0, device=dev),
                                                          cur.dec_cache[slot], d.reach)
                a = max(0, d.first)
                self.mel[slot, :, a:2 * d.n1] = mel[0, :, a - d.first:]
            v = cur.vocos(slot, w)
            if v is None:
                return self._none, self._none
            re, im, cur.voc_cache[slot] = vocos_stream(
                m.vocos, self.mel[slot, :, v.v0:v.v1].unsqueeze(0), torch.tensor(v.v0, device=dev),
                torch.tensor(v.n_final, device=dev), cur.voc_cache[slot])
            f = v.hi - v.lo
            self.h_spec[0, :f].copy_(re[0, v.lo:v.hi], non_blocking=True)
            self.h_spec[1, :f].copy_(im[0, v.lo:v.hi], non_blocking=True)
            self._sync()
        spec = self.h_spec.numpy()
        return spec[0, :f], spec[1, :f]
