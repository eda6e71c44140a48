"""The chunk schedule: how many decode steps each streamed chunk of a request carries.

A chunk of ``c`` steps costs ``c * s + W`` seconds to make (``s``: one engine decode step, all
channels together; ``W``: one vocoder window, taken as a constant: the provisional tail that each
pass recomputes, whatever the chunk size, is the part a larger chunk amortizes) and carries
``c * a`` seconds of audio (``a`` = 512 samples at 24 kHz = 21.3 ms). ``s`` and ``W`` are
measured while the engine runs (the warm-up gives the first values). So:

* the stream keeps up only with chunks of at least ``sustainable = W / (safety * a - s)`` steps;
  smaller ones lose ground with every window (measured on the 2-core CPU: a buffer-limited
  schedule that kept chunks at 4 steps doubled the RTF);
* the first chunk is small (``stream.first_chunk_tokens``, 4 steps = 85 ms of audio) so the first
  sound comes early, but never so small that the device runs dry before the second chunk is made:
  ``first * a >= sustainable * s + W`` (on a fast GPU that is 1-2 steps; on a 2-core CPU the
  vocoder window alone outlasts 4 steps of audio, and the first chunk grows to cover it);
* later chunks grow by ``stream.chunk_growth`` up to ``stream.chunk_tokens`` (larger chunks
  amortize each window's context), as far as the audio already queued covers their making.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Seconds of audio per decode step (512 samples at 24 kHz).
AUDIO_S_PER_STEP = 512 / 24000


@dataclass(frozen=True)
class ChunkSchedule:
    """Chunk sizes in decode steps (see module doc).

    Attributes:
        first: the smallest first chunk. cap: the largest chunk. growth: factor per chunk (>= 1).
        safety: share of real time the stream may use (0 < safety <= 1).
    """

    first: int
    cap: int
    growth: float = 2.0
    safety: float = 0.8

    def sustainable(self, step_s: float, window_s: float, cap: int | None = None) -> int:
        """The smallest chunk that keeps up with playback (``cap`` when none does; 1 when unknown)."""
        cap = self.cap if cap is None else cap
        if step_s <= 0:
            return 1
        room = self.safety * AUDIO_S_PER_STEP - step_s
        if room <= 0:
            return cap
        return max(1, min(cap, math.ceil(window_s / room)))

    def first_chunk(self, step_s: float, window_s: float) -> int:
        """Steps in a request's first chunk: ``first``, or more where the second chunk would not be
        made before the first one has played."""
        if step_s <= 0:
            return self.first
        c1 = self.sustainable(step_s, window_s)
        need = math.ceil((c1 * step_s + window_s) / (self.safety * AUDIO_S_PER_STEP))
        return max(self.first, min(self.cap, need))

    def next(self, prev: int, buffered_s: float, step_s: float, window_s: float = 0.0, scale: int = 1) -> int:
        """The chunk after one of ``prev`` steps, with ``buffered_s`` s of audio queued, ``step_s``
        s per step and ``window_s`` s per window (0 = unknown); ``scale`` multiplies the cap
        (throttle: fewer, larger chunks)."""
        cap = max(self.first, self.cap * max(1, scale))
        sus = self.sustainable(step_s, window_s, cap)
        grown = min(cap, max(sus, math.ceil(prev * self.growth)))
        if step_s > 0:
            afford = math.floor((self.safety * buffered_s - window_s) / step_s)
            grown = min(grown, afford) if afford >= sus else sus   # short of audio: at least keep up
        return max(1, grown)
