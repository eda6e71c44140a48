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

Cost: a stateless window recomputes ``2 * rf`` context frames (with 24-token chunks the Decoder
did about 3x the work of one full pass). The runners keep each convolution's state between the
windows of a sentence (:mod:`appliance.model.stream`, :mod:`appliance.engines.vocoder_state`), so
the left context is never recomputed; what a pass still recomputes is the provisional tail: the
Decoder's frames that lacked right context in the previous pass (up to ``rf`` per layer), and the
mel frames Vocos read before the Decoder finished them. Larger chunks amortize it
(:mod:`appliance.synth.schedule`); a shorter look-ahead also shortens it (below).

Look-ahead. Exactly, a frame is final once ``rf`` frames to its right exist: the first audio
waits :attr:`WindowedVocoder.exact_lookahead` decode steps beyond the audio it carries (53 for
the full model, 14 for the tiny test model). That is the *theoretical* field; how far trained
weights really look is measured per checkpoint and backend (``chattts-appliance calibrate``,
:mod:`appliance.build.calibrate`). With a shorter look-ahead ``r``:

* a spectrum frame is committed once ``2r`` mel frames exist to its right, and Vocos' own right
  context is cut at the newest mel frame;
* the Decoder freezes a frame of each layer once ``2r`` frames exist to its right
  (:attr:`VocodeWindow.reach <appliance.engines.runner.VocodeWindow.reach>` = ``min(rf_dec, 2r)``
  mel frames): it recomputes at most ``2r`` provisional frames per layer and pass instead of up to
  ``rf_dec`` (75 at full size), and Vocos reads at most ``rf_voc`` mel frames that are not frozen
  yet (provisional: recomputed by the next window, never stored as final) instead of up to
  ``rf_dec``. Measured at full size (``bench_vocoder.py``, retired): see ``bench/HISTORY.md``.

Every frame is committed once, and the inverse STFT overlap-adds consecutive frames (75 %
overlap), so chunks join without a step: the streamed PCM differs from the one-shot PCM by the
per-frame error that the calibration bounds (it measures exactly this stream, frozen frames
included, with 2-token chunks, the worst case: a frame frozen or committed later has more
context, and with the production chunk schedule). ``lookahead=None`` is exact (tests: streamed ==
one-shot to FP32 rounding).
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

    def __init__(self, runner: Runner, max_tokens: int, lookahead: int | None = None):
        info = runner.info
        self.runner = runner
        self.rf_dec = info.decoder_rf
        self.rf_voc = info.vocos_rf
        self.quantum = max(1, info.window_quantum)
        self.max_tokens = max_tokens
        self._istft = StreamingISTFT(N_FFT, HOP_LENGTH, max_frames_per_push=2 * max_tokens)
        self.slot = -1
        self.set_lookahead(lookahead)
        self.reset(-1)

    @property
    def exact_lookahead(self) -> int:
        """Decode steps beyond a token before its audio is exact (the theoretical receptive field)."""
        return (self.rf_dec + self.rf_voc + 2 + 1) // 2 + 1

    def set_lookahead(self, tokens: int | None) -> None:
        """Use ``tokens`` of right context (None or >= :attr:`exact_lookahead`: exact).

        Sets :attr:`lookahead_tokens` (decode steps that must exist beyond a token before its
        audio is committed), the right context in mel frames a spectrum frame waits for, and
        :attr:`reach` (mel frames of right context after which the Decoder freezes a frame).

        Raises:
            ValueError: ``tokens`` < 1.
        """
        exact = self.exact_lookahead
        if tokens is not None and tokens < 1:
            raise ValueError(f"look-ahead of {tokens} tokens: must be >= 1")
        self.exact = tokens is None or tokens >= exact
        self.lookahead_tokens = exact if self.exact else int(tokens)
        self._right = self.rf_dec + self.rf_voc if self.exact else 2 * int(tokens)
        #: mel frames of right context after which the Decoder's frames are frozen (rf_dec: exact)
        self.reach = self.rf_dec if self.exact else min(self.rf_dec, 2 * int(tokens))

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

    @staticmethod
    def _widen(n: int, q: int) -> int:
        return -(-n // q) * q

    def finish(self) -> np.ndarray:
        """Flush: every remaining frame is exact now (true zero padding past the end)."""
        if self.n == 0:
            return np.zeros(0, np.float32)
        tail = self._advance(final=True)
        return np.concatenate([tail, self._istft.finish()])

    # ------------------------------------------------------------------ internals

    def _advance(self, final: bool) -> np.ndarray:
        total = 2 * self.n
        spec_end = total if final else max(0, total - self._right)     # spectrum frames committed now
        if spec_end <= self.spec_done:
            return np.zeros(0, np.float32)
        need = total if final else min(total, spec_end + self.rf_voc)   # mel frames Vocos reads
        exact_end = total if final else max(0, total - self.reach)      # mel frames that are final (frozen)
        h0 = h1 = m0 = m1 = 0
        if need > self.mel_done:   # new mel frames [mel_done, need); those past exact_end are provisional
            m0, m1 = self.mel_done, need
            h0 = max(0, (m0 - self.rf_dec) // 2)
            h1 = min(self.n, (m1 + self.rf_dec + 1) // 2)
            h0 = max(0, h1 - self._widen(h1 - h0, self.quantum))   # more left context: same frames
            self.mel_done = min(need, exact_end)
        v0 = max(0, self.spec_done - self.rf_voc)
        v0 = max(0, need - self._widen(need - v0, 2 * self.quantum))
        re, im = self.runner.vocode(self.slot, VocodeWindow(h0, h1, m0, m1, v0, need, self.spec_done, spec_end,
                                                          0 if self.exact else self.reach))
        self.spec_done = spec_end
        return self._istft.push(re, im)
