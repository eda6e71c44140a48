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
  sound comes early, but never so small that the device runs dry before the second chunk is made,
  even if one scheduling hiccup ``h`` (``stream.start_slack_ms``) delays it:
  ``first * a >= sustainable * s + W + h`` (on a fast GPU that is 5 steps; on a 2-core CPU the
  vocoder window alone outlasts 4 steps of audio, and the first chunk grows to cover it);
* later chunks grow by ``stream.chunk_growth`` up to ``stream.chunk_tokens`` (larger chunks
  amortize each window's context), as far as the audio already queued covers their making.

Where even chunks at the cap do not keep up (``s + W / cap > safety * a``: a slow or loaded box),
no schedule avoids a gap once playback starts at the first chunk; :func:`start_plan` says how much
audio the player must hold before it starts so that the whole request plays without one.

A client that receives the chunks as they are made (Wyoming, the socket's ``return_audio``) waits
``c * s + W`` between two of them. On a box slower than real time every chunk is at the cap, and
the throttle multiplies the cap (``throttle.chunk_scale``): 96 steps of a slow 3-channel step were
6-8.6 s, against Home Assistant's 10 s without audio before it gives up. So no chunk carries more
steps than can be made in ``max_gap_s`` (``stream.max_chunk_gap_ms``) at the measured times,
whatever the scale, the queued audio or the keep-up size: :meth:`ChunkSchedule.gap_cap`.
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
        slack_s: one scheduling hiccup the first chunk's audio must cover on top of the making of
            the second, s (``stream.start_slack_ms``).
        max_gap_s: the longest one chunk may take to make, s (``stream.max_chunk_gap_ms``; 0: no bound).
    """

    first: int
    cap: int
    growth: float = 2.0
    safety: float = 0.8
    slack_s: float = 0.0
    max_gap_s: float = 0.0

    def gap_cap(self, step_s: float, window_s: float) -> int | None:
        """The most steps a chunk may carry so that it is made within :attr:`max_gap_s` at ``step_s``
        per step and ``window_s`` per window (at least 1); None without a bound or a measurement."""
        if self.max_gap_s <= 0 or step_s <= 0:
            return None
        return max(1, math.floor((self.max_gap_s - window_s) / step_s))

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
        made (plus one hiccup of ``slack_s``) before the first one has played."""
        if step_s <= 0:
            return self.first
        c1 = self.sustainable(step_s, window_s)
        need = math.ceil((c1 * step_s + window_s + self.slack_s) / (self.safety * AUDIO_S_PER_STEP))
        out = max(self.first, min(self.cap, need))
        g = self.gap_cap(step_s, window_s)
        return out if g is None else min(out, g)

    def grow(self, prev: int, cap: int) -> int:
        """The chunk after one of ``prev`` steps by growth alone: ``ceil(prev * growth)``, at most ``cap``."""
        return min(cap, math.ceil(prev * self.growth))

    def plan(self) -> list[int]:
        """The chunk sizes by growth alone (nothing queued or measured yet): ``first``, then each
        one :meth:`grow` from the last, up to ``cap``; every later chunk is the last one's size."""
        out = [max(1, self.first)]
        while out[-1] < self.cap and self.grow(out[-1], self.cap) > out[-1]:
            out.append(self.grow(out[-1], self.cap))
        return out

    def next(self, prev: int, buffered_s: float, step_s: float, window_s: float = 0.0, scale: int = 1) -> int:
        """The chunk after one of ``prev`` steps, with ``buffered_s`` s of audio queued, ``step_s``
        s per step and ``window_s`` s per window (0 = unknown); ``scale`` multiplies the cap
        (throttle: fewer, larger chunks); never more than :meth:`gap_cap`."""
        cap = max(self.first, self.cap * max(1, scale))
        sus = self.sustainable(step_s, window_s, cap)
        grown = max(sus, self.grow(prev, cap))
        if step_s > 0:
            afford = math.floor((self.safety * buffered_s - window_s) / step_s)
            grown = min(grown, afford) if afford >= sus else sus   # short of audio: at least keep up
        g = self.gap_cap(step_s, window_s)                         # a streaming client never waits longer
        return max(1, grown if g is None else min(grown, g))


@dataclass(frozen=True)
class StartPlan:
    """How a request's playback starts (:func:`start_plan`).

    Attributes:
        predicted_rtf: synthesis seconds per second of its audio, predicted from the measured step
            and window times (None: nothing measured yet).
        expected_s: the audio it is expected to make, s.
        hold_s: audio the player should hold before it starts, beyond one device wake-up and the
            start slack, so that the rest is made before it is due (0: the stream keeps up).
    """

    predicted_rtf: float | None
    expected_s: float
    hold_s: float


def chunks_for(sched: ChunkSchedule, steps: int, cap: int) -> int:
    """Vocoder windows a request of ``steps`` decode steps makes when its chunks grow from
    ``sched.first`` by ``sched.growth`` up to ``cap`` (a short request pays more windows per step
    than chunks at the cap would: on the 2-core CPU, 150 steps make 6 windows, not 3.1)."""
    n, done, chunk = 0, 0, max(1, sched.first)
    while done < steps:
        done += chunk
        n += 1
        chunk = sched.grow(chunk, cap)
    return max(1, n)


def start_plan(sched: ChunkSchedule, step_s: float, window_s: float, steps: int, lookahead: int,
               rows: int = 1, scale: int = 1) -> StartPlan:
    """When to start playing a request of ``steps`` decode steps (all its sentences) that streams
    with ``lookahead`` steps of right context, made by an engine whose decode step takes
    ``step_s`` s (all ``rows`` rows together) and whose vocoder window takes ``window_s`` s (one
    per chunk per row, all on the same thread).

    Model (the chunk schedule's own): where the stream cannot keep up, every chunk is at the cap
    ``c = cap * scale`` steps; a step costs ``s' = step_s + rows * window_s * n / steps`` (``n``: the
    windows its growing chunks make, :func:`chunks_for`) and the stream
    may use ``safety`` of real time, so it makes audio at ``r = s' / (safety * a)`` seconds per
    second of audio. The last chunk is ready ``(lookahead + steps) * s' / safety`` after the start;
    the audio before it must last until then, so playback may start no earlier than
    ``t_s = L (r - 1) + c a + lookahead a r`` (``L = steps * a``), when ``t_s / r`` of audio is
    queued: that is ``hold_s`` (at most ``L``: a request that never keeps up plays once made).
    ``r <= 1``: the schedule keeps up and ``hold_s`` is 0.
    """
    a = AUDIO_S_PER_STEP
    expected = max(0, steps) * a
    if step_s <= 0 or steps <= 0:
        return StartPlan(None, expected, 0.0)
    c = max(sched.first, sched.cap * max(1, scale))
    g = sched.gap_cap(step_s, window_s)
    c = c if g is None else min(c, g)
    per_step = step_s + max(1, rows) * window_s * chunks_for(sched, steps, c) / steps
    rtf = per_step / a
    r = rtf / sched.safety
    if r <= 1.0:
        return StartPlan(rtf, expected, 0.0)
    t_s = expected * (r - 1.0) + c * a + lookahead * a * r
    return StartPlan(rtf, expected, min(expected, t_s / r))
