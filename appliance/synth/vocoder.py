"""Streaming Decoder + Vocos on overlapping windows: O(n) work, exact joins.

Upstream ChatTTS streams by re-decoding the *whole* prefix every 24 tokens (quadratic), and its
chunks click at the joins. Both the Decoder and the Vocos backbone are stacks of convolutions
whose other layers act per frame (LayerNorm over channels, GELU, pointwise Linear), so each
output frame depends only on input frames within a fixed receptive field ``rf`` on each side
(``RunnerInfo.decoder_rf``, ``vocos_rf``). A window ``[a - rf, b + rf)`` therefore yields frames
``[a, b)`` *exactly* as the full-utterance pass would (zero padding at the true start and end
included). :class:`WindowedVocoder` plans those windows; the runner runs them on its own device
over the hidden states and mel frames it keeps per slot (:meth:`Runner.vocode
<appliance.engines.runner.Runner.vocode>`), and only the spectrum of the new frames comes back
for the inverse STFT (:class:`~appliance.synth.istft.StreamingISTFT`).

Cost: each window recomputes ``2 * rf`` context frames; with 24-token chunks the Decoder does
about 3x the work of one full pass, the price of streaming without state inside the convs.
Latency: a frame is exact once ``rf`` frames to its right exist, so the first audio needs
:attr:`WindowedVocoder.lookahead_tokens` decode steps beyond the audio it carries (53 for the
full model, 13 for the tiny test model).
"""

from __future__ import annotations

import numpy as np

from ..core import HOP_LENGTH, N_FFT
from ..engines.runner import Runner, VocodeWindow
from ..errors import CapacityError
from .istft import StreamingISTFT


class WindowedVocoder:
    """Turns a slot's hidden states, as the decode loop produces them, into final PCM samples.

    Args:
        runner: the backend that holds the hidden states and runs the windows.
        max_tokens: most tokens one sentence may have (decode steps).

    ``reset(slot)`` starts a sentence held in KV slot ``slot``; ``push(n)`` says that ``n``
    hidden states exist now and returns float32 PCM (24 kHz, mono) that is final (possibly
    empty); ``finish()`` returns the rest. The concatenation equals ``vocos(decoder(all
    hiddens))`` followed by ``torch.istft(center=True)`` to FP32 rounding: ``512 * N - 256``
    samples for N tokens.
    """

    def __init__(self, runner: Runner, max_tokens: int):
        info = runner.info
        self.runner = runner
        self.rf_dec = info.decoder_rf
        self.rf_voc = info.vocos_rf
        self.max_tokens = max_tokens
        self._istft = StreamingISTFT(N_FFT, HOP_LENGTH, max_frames_per_push=2 * max_tokens)
        self.slot = -1
        self.reset(-1)

    @property
    def lookahead_tokens(self) -> int:
        """Decode steps that must exist beyond a token before its audio is final."""
        return (self.rf_dec + self.rf_voc + 2 + 1) // 2 + 1

    def reset(self, slot: int) -> None:
        """Start a new sentence whose hidden states the runner keeps in ``slot``."""
        self.slot = slot
        self.n = 0            # hidden states available
        self.mel_done = 0     # exact mel frames the runner holds
        self.spec_done = 0    # spectrum frames handed to the ISTFT
        self._istft.reset()

    def push(self, n: int) -> np.ndarray:
        """``n`` hidden states exist now (n never decreases); return the PCM that became final.

        Raises:
            CapacityError: more than ``max_tokens`` tokens in one sentence.
        """
        if n > self.max_tokens:
            raise CapacityError(f"utterance longer than {self.max_tokens} decode steps")
        self.n = max(self.n, int(n))
        return self._advance(final=False)

    def finish(self) -> np.ndarray:
        """Flush: every remaining frame is exact now (true zero padding past the end)."""
        if self.n == 0:
            return np.zeros(0, np.float32)
        tail = self._advance(final=True)
        return np.concatenate([tail, self._istft.finish()])

    # ------------------------------------------------------------------ internals

    def _advance(self, final: bool) -> np.ndarray:
        total_mel = 2 * self.n
        mel_end = total_mel if final else max(0, total_mel - self.rf_dec)
        h0 = h1 = m0 = m1 = 0
        if mel_end > self.mel_done:   # new exact mel frames [mel_done, mel_end)
            m0, m1 = self.mel_done, mel_end
            h0 = max(0, (m0 - self.rf_dec) // 2)
            h1 = min(self.n, (m1 + self.rf_dec + 1) // 2)
            self.mel_done = mel_end
        spec_end = self.mel_done if final else max(0, self.mel_done - self.rf_voc)
        if spec_end <= self.spec_done:
            if h1 > h0:   # nothing to hear yet, but the runner keeps the new mel frames
                self.runner.vocode(self.slot, VocodeWindow(h0, h1, m0, m1, 0, 0, 0, 0))
            return np.zeros(0, np.float32)
        v0 = max(0, self.spec_done - self.rf_voc)
        v1 = min(self.mel_done, spec_end + self.rf_voc)
        re, im = self.runner.vocode(self.slot, VocodeWindow(h0, h1, m0, m1, v0, v1, self.spec_done, spec_end))
        self.spec_done = spec_end
        return self._istft.push(re, im)
