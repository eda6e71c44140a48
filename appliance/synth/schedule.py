"""The chunk schedule: how many decode steps each streamed chunk of a request carries.

The first chunk is small (``stream.first_chunk_tokens``, 4 steps = 85 ms of audio) so that the
first sound comes early. Later chunks grow by ``stream.chunk_growth`` up to ``stream.chunk_tokens``:
every window recomputes its Decoder/Vocos context, so larger chunks cost less per second of
audio once playback is ahead. A chunk never grows past what the audio already queued can
cover: with ``buffered`` seconds not yet played and ``step_s`` seconds per engine step (measured,
all channels and vocoder windows included), the next chunk takes at most
``safety * buffered / step_s`` steps, so the sound device does not run dry while it is decoded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkSchedule:
    """Chunk sizes in decode steps (see module doc).

    Attributes:
        first: steps in the first chunk. cap: largest chunk. growth: factor per chunk (>= 1).
        safety: share of the queued audio a chunk may take to decode (0 < safety <= 1).
    """

    first: int
    cap: int
    growth: float = 2.0
    safety: float = 0.5

    def next(self, prev: int, buffered_s: float, step_s: float, scale: int = 1) -> int:
        """The chunk after one of ``prev`` steps, with ``buffered_s`` s of audio queued and
        ``step_s`` s per step (0 = unknown); ``scale`` multiplies the cap (throttle)."""
        cap = max(self.first, self.cap * max(1, scale))
        grown = min(cap, max(self.first, math.ceil(prev * self.growth)))
        if step_s > 0:
            grown = min(grown, max(self.first, int(self.safety * max(0.0, buffered_s) / step_s)))
        return grown
