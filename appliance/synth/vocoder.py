"""Streaming Decoder + Vocos on overlapping windows: O(n) work, exact joins.

Upstream ChatTTS streams by re-decoding the *whole* prefix every 24 tokens (quadratic) and its
chunks click at the joins (chattts-internals.md §1, DESIGN.md §1). Both the Decoder and the
Vocos backbone are stacks of convolutions whose other layers are per frame (LayerNorm over
channels, GELU, pointwise Linear), so each output frame depends only on input frames within a
fixed receptive field ``rf`` on each side (``RunnerInfo.decoder_rf``, ``vocos_rf``). A window
``[a - rf, b + rf)`` therefore yields frames ``[a, b)`` *exactly* as the full-utterance forward
pass would (zero padding at the true start and end included). This class keeps every finished
mel frame, computes only the frames that became exact since the last push (plus ``rf`` of
context on each side), and finishes the waveform with :class:`~appliance.synth.istft.StreamingISTFT`.

Cost: each push recomputes ``2 * rf`` context frames; with 24-token chunks the Decoder does
about 3x the work of one full pass, the price of streaming without state inside the convs.
Latency: a frame is exact once ``rf`` frames to its right exist, so the first audio needs
:attr:`WindowedVocoder.lookahead_tokens` decode steps beyond the audio it carries (53 for the
full model, 13 for the tiny test model).

Buffers (hidden states, mel frames, ISTFT accumulators) are allocated once per instance for
``max_tokens`` tokens and reused across utterances via :meth:`reset`.
"""

from __future__ import annotations

import numpy as np

from ..core import HOP_LENGTH
from ..engines.runner import Runner
from ..errors import CapacityError
from .istft import StreamingISTFT

N_MELS = 100
N_FFT = 1024


class WindowedVocoder:
    """Turns GPT hidden states, pushed as they are decoded, into final PCM samples.

    Args:
        runner: backend providing ``decoder()`` and ``vocos()``.
        max_tokens: most tokens one utterance may have (decode steps).

    ``push(h)`` takes float32 ``[n, D]`` hidden states (the hidden that predicted each code)
    and returns float32 PCM (24 kHz, mono) that is now final (possibly empty); ``finish()``
    returns the rest. The concatenation equals ``vocos(decoder(all hiddens))`` followed by
    ``torch.istft(center=True)`` to FP32 rounding: ``512 * N - 256`` samples for N tokens.
    """

    def __init__(self, runner: Runner, max_tokens: int):
        info = runner.info
        self.runner = runner
        self.rf_dec = info.decoder_rf
        self.rf_voc = info.vocos_rf
        self.max_tokens = max_tokens
        self._h = np.zeros((max_tokens, info.hidden_size), np.float32)
        self._mel = np.zeros((N_MELS, 2 * max_tokens), np.float32)
        self._istft = StreamingISTFT(N_FFT, HOP_LENGTH, max_frames_per_push=2 * max_tokens)
        self.reset()

    @property
    def lookahead_tokens(self) -> int:
        """Decode steps that must exist beyond a token before its audio is final."""
        return (self.rf_dec + self.rf_voc + 2 + 1) // 2 + 1

    def reset(self) -> None:
        """Start a new utterance (buffers are kept)."""
        self.n = 0            # tokens pushed
        self.mel_done = 0     # exact mel frames stored in self._mel
        self.spec_done = 0    # spectrum frames handed to the ISTFT
        self._istft.reset()

    def push(self, hidden: np.ndarray) -> np.ndarray:
        """Append hidden states ``[n, D]``; return PCM samples that became final.

        Raises:
            CapacityError: more than ``max_tokens`` tokens in one utterance.
        """
        n = hidden.shape[0]
        if self.n + n > self.max_tokens:
            raise CapacityError(f"utterance longer than {self.max_tokens} decode steps")
        self._h[self.n:self.n + n] = hidden
        self.n += n
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
        if mel_end > self.mel_done:
            self._decode_mel(self.mel_done, mel_end)
        spec_end = self.mel_done if final else max(0, self.mel_done - self.rf_voc)
        if spec_end <= self.spec_done:
            return np.zeros(0, np.float32)
        m0 = max(0, self.spec_done - self.rf_voc)
        m1 = min(self.mel_done, spec_end + self.rf_voc)
        re, im = self.runner.vocos(self._mel[:, m0:m1])
        a, b = self.spec_done - m0, spec_end - m0
        pcm = self._istft.push(re[a:b], im[a:b])
        self.spec_done = spec_end
        return pcm

    def _decode_mel(self, start: int, end: int) -> None:
        """Compute exact mel frames ``[start, end)`` into ``self._mel``."""
        t0 = max(0, (start - self.rf_dec) // 2)
        t1 = min(self.n, (end + self.rf_dec + 1) // 2)
        mel = self.runner.decoder(self._h[t0:t1])  # [100, 2 * (t1 - t0)]
        self._mel[:, start:end] = mel[:, start - 2 * t0:end - 2 * t0]
        self.mel_done = end
