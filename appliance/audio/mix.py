"""The voices of one sound device and how they are mixed into the output stream.

Each request is a *voice* with its own FIFO of float32 mono chunks, so a cancel drops exactly
that request's unplayed audio. Voices belong to a *lane*: the voices of one lane play one
after the other, in the order they began (requests of one channel never overlap). In ``mix``
mode each channel is its own lane and :meth:`Lanes.mix` sums the lanes' current voices
(hard-clipped to [-1, 1] by the caller when two or more sound at once; a lone voice is copied
unchanged), each scaled by its channel's play-out gain as it is copied (:mod:`.volume`; a voice
raised above 0 dB is clipped to [-1, 1]); in ``serialize`` mode every voice is in one lane, so a
second channel's request waits until the first one has played out. Samples of two requests are never interleaved.

Sentences. A request's audio is a run of sentences; the chunk that ends one is marked
(:meth:`Lanes.end_sentence_next`). A voice that reaches such a mark while its request is still
being written goes on only if it holds what the next sentence needs (:meth:`Lanes.hold`: decided
by the start policy from the measured synthesis rate when that sentence's first chunk is made;
at least one device wake-up); otherwise it *pauses at the sentence boundary* until it does. Where
synthesis falls below real time mid-request (a busy neighbour, a lower clock, more channels),
the listener then hears a longer pause between two sentences instead of gaps inside words at
chunk boundaries. Every silence inside a streaming voice is recorded as a :class:`Pause` (at a
sentence boundary or mid-sentence, its length) in the list its owner gave to :meth:`Lanes.begin`.

No threads and no locking here: :class:`~appliance.audio.device.DeviceOutput` holds its
lock around every call (the PortAudio callback calls :meth:`Lanes.mix`).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, Hashable, Optional

import numpy as np


class _Chunk:
    __slots__ = ("data", "pos", "on_played", "ends_sentence", "next_hold")

    def __init__(self, data: np.ndarray, on_played: Optional[Callable[[], None]], ends_sentence: bool = False):
        self.data, self.pos, self.on_played = data, 0, on_played
        self.ends_sentence = ends_sentence
        self.next_hold = 0          # samples the next sentence must hold before it plays on


@dataclass
class Pause:
    """A silence inside a streaming voice, in samples at the device rate.

    Attributes:
        sentence: the sentence that starts (``at_boundary``) or was playing when it ran dry
            (0 = the request's first).
        at: the voice's samples played before the silence.
        samples: the silence's length so far (final once the voice plays again or ends).
        at_boundary: True: it held at a sentence boundary for the next sentence (a re-hold);
            False: it ran dry mid-sentence (an underrun; it then re-buffers).
    """

    sentence: int
    at: int
    samples: int = 0
    at_boundary: bool = False


class Voice:
    """One request on a device: its chunks, its lane, whether it is still being written.

    Attributes:
        buffered: samples queued and not yet played.
        writing: False (no audio yet), True (streaming: running dry is an underrun), None (ended).
        started: whether it is sounding (see :meth:`Lanes.mix`: start threshold, re-buffering).
        need: samples it must hold to resume after an underrun (0: it has not run dry).
        hold: samples it must hold beyond the start threshold before it (re)starts: at its first
            start (the start slack, and more for a request the box cannot keep up with) and after
            a pause at a sentence boundary (:meth:`Lanes.hold`).
        rebuffer: samples it must hold to resume after running dry mid-sentence (0: the device's
            default, :meth:`Lanes.mix` ``rebuffer_frames``; :meth:`Lanes.rebuffer`).
        on_failure: ``on_failure(reason)`` when the device fails.
        pauses: where its :class:`Pause` records go (its owner's list), or None.
        sentence: sentences whose end it has played. played: samples it has played.
    """

    __slots__ = ("lane", "channel", "chunks", "buffered", "writing", "started", "need", "hold", "rebuffer",
                 "on_failure", "on_first", "pauses", "pause", "sentence", "played", "sounded", "end_next", "boundary")

    def __init__(self, lane: Optional[Hashable], on_failure: Callable[[str], None],
                 on_first: Optional[Callable[[float], None]] = None, pauses: Optional[list] = None,
                 channel: Optional[Hashable] = None):
        self.lane = lane
        self.channel = channel       # whose play-out gain it gets (its lane is None when serializing)
        self.chunks: collections.deque[_Chunk] = collections.deque()
        self.buffered = 0
        self.writing: Optional[bool] = False
        self.started = False
        self.need = 0                # samples to hold before resuming after an underrun (0: none)
        self.hold = 0                # samples to hold beyond the start threshold before (re)starting
        self.rebuffer = 0            # samples to hold after running dry mid-sentence (0: the device's)
        self.on_failure = on_failure
        self.on_first = on_first     # on_first(monotonic time) once its first samples go out
        self.pauses = pauses
        self.pause: Optional[Pause] = None     # the silence it is in now
        self.sentence = 0
        self.played = 0
        self.sounded = False
        self.end_next = False        # the next chunk pushed ends a sentence
        self.boundary: Optional[_Chunk] = None  # the last sentence-ending chunk not yet played out

    def silence(self, at_boundary: bool) -> None:
        """It stops while its request is still being written: a new :class:`Pause`."""
        self.started = False
        self.pause = Pause(self.sentence, self.played, 0, at_boundary)
        if self.pauses is not None:
            self.pauses.append(self.pause)


class Lanes:
    """The voices of one device, in begin order (see the module docstring).

    Args:
        serialize: put every voice in one lane (``audio.same_device: serialize``).
        gain: ``gain(channel) -> float``, the linear play-out gain of a channel, read for each
            voice in each block (a reload changes it at once); None: 1.0.

    Attributes:
        voices: owner -> :class:`Voice`, in begin order.
        buffered: samples queued over all voices.
    """

    def __init__(self, serialize: bool = False, gain: Optional[Callable[[Optional[Hashable]], float]] = None) -> None:
        self.serialize = serialize
        self.gain = gain if gain is not None else (lambda channel: 1.0)
        self.voices: dict[object, Voice] = {}
        self.buffered = 0
        self._mixbuf = np.zeros(0, np.float32)

    def begin(self, owner: object, lane: Optional[Hashable], on_failure: Callable[[str], None],
              on_first: Optional[Callable[[float], None]] = None, pauses: Optional[list] = None) -> None:
        """Register ``owner`` as a voice of ``lane`` (ignored when serializing); ``on_first(t)`` is
        queued like a played callback when its first samples are written to the device (``t``:
        the ``written_at`` of that block); its :class:`Pause` records are appended to ``pauses``."""
        self.voices[owner] = Voice(None if self.serialize else lane, on_failure, on_first, pauses, channel=lane)

    def end(self, owner: object) -> None:
        """``owner`` wrote its last chunk (it stays registered until :meth:`forget`)."""
        v = self.voices.get(owner)
        if v is not None:
            v.writing = None

    def forget(self, owner: object) -> bool:
        """Unregister ``owner`` (its unplayed samples leave the count); True if it was there."""
        v = self.voices.pop(owner, None)
        if v is None:
            return False
        self.buffered -= v.buffered
        return True

    def hold(self, owner: object, samples: int) -> None:
        """``owner``'s voice (re)starts only once it holds ``samples`` more than the start threshold
        (or its request has ended): before it has sounded, at its first start; after that, at the
        last sentence boundary queued (call it before the next sentence's first chunk is pushed),
        or now if it is paused at one."""
        v = self.voices.get(owner)
        if v is None:
            return
        n = max(0, int(samples))
        if not v.sounded or (v.pause is not None and v.pause.at_boundary):
            v.hold = n
        elif v.boundary is not None:
            v.boundary.next_hold = n

    def rebuffer(self, owner: object, samples: int) -> None:
        """Samples ``owner``'s voice must hold to resume if it runs dry mid-sentence (0: the default)."""
        v = self.voices.get(owner)
        if v is not None:
            v.rebuffer = max(0, int(samples))

    def end_sentence_next(self, owner: object) -> None:
        """The next chunk pushed for ``owner`` is the last of a sentence."""
        v = self.voices.get(owner)
        if v is not None:
            v.end_next = True

    def push(self, owner: object, data: np.ndarray, on_played: Optional[Callable[[], None]]) -> bool:
        """Append float32 ``[n]`` samples to ``owner``'s voice; False if it is not registered."""
        v = self.voices.get(owner)
        if v is None:
            return False
        if v.writing is False and len(data):
            v.writing = True      # first audio: from now on a dry voice is an underrun
        c = _Chunk(np.ascontiguousarray(data, dtype=np.float32), on_played, v.end_next and len(data) > 0)
        if c.ends_sentence:
            v.end_next, v.boundary = False, c
        v.chunks.append(c)
        v.buffered += len(data)
        self.buffered += len(data)
        return True

    def drop(self, owner: object) -> int:
        """Remove ``owner``'s unplayed chunks (cancel: the voice is over, so running dry until
        :meth:`forget` is no underrun); returns samples dropped."""
        v = self.voices.get(owner)
        if v is None:
            return 0
        dropped = v.buffered
        v.chunks.clear()
        v.buffered = 0
        v.writing = None
        self.buffered -= dropped
        return dropped

    def clear(self) -> list[Callable[[str], None]]:
        """Forget every voice (the device failed); returns their ``on_failure`` callbacks."""
        listeners = [v.on_failure for v in self.voices.values()]
        self.voices.clear()
        self.buffered = 0
        return listeners

    def sounding(self) -> list[Voice]:
        """The voice that plays now in each lane: the first begun one that is not played out
        (ended and empty; such a voice stays registered for failures until :meth:`forget`)."""
        seen: dict[object, Voice] = {}
        for v in self.voices.values():
            if v.writing is None and not v.chunks:
                continue
            if v.lane not in seen:
                seen[v.lane] = v
        return list(seen.values())

    def over(self, owner: object, limit: int) -> bool:
        """True when ``owner``'s voice is sounding and holds more than ``limit`` samples (a voice
        waiting behind another in its lane never is); without a voice, all voices together."""
        v = self.voices.get(owner) if owner is not None else None
        if v is None:
            return self.buffered > limit
        return v.buffered > limit and any(x is v for x in self.sounding())

    def mix(self, out: np.ndarray, frames: int, played_at: float,
            played: list[tuple[float, Callable[[], None]]], written_at: Optional[float] = None,
            start_frames: int = 0, rebuffer_frames: int = 0) -> tuple[int, int, int, int, int]:
        """Fill ``out[:frames]`` (float32) from the sounding voices, summing lanes. The
        ``on_played`` of every chunk finished here is appended to ``played`` as
        ``(played_at, callback)``.

        Start threshold (as ALSA's ``start_threshold``): a voice that has not sounded yet and is
        still being written starts only once it holds ``max(frames, start_frames) + hold``
        samples (``start_frames``: what the device takes in one wake-up, e.g. two 25 ms blocks
        back to back for an ALSA period at 100 ms latency; ``hold``: :meth:`hold`, the start
        slack for one scheduling hiccup, and more where the box cannot keep up). A request's
        first chunk (4 decode steps = 85 ms, less the ISTFT's and the resampler's hold-back) can
        be shorter than one wake-up, and starting on less would play the chunk, then a gap of
        silence inside the first word; starting on one wake-up exactly leaves nothing for a
        late second chunk. A voice that has ended starts with whatever it holds.

        Sentence boundaries (module docstring): a voice whose sentence-ending chunk has played and
        that holds less than ``max(frames, start_frames) + hold`` of the next sentence (and not
        all of it) pauses there (``hold``: :meth:`hold`, 0 until decided) and restarts like a
        first start. A voice that has sounded also resumes once the rest of its sentence is queued
        whole (its end is marked in the FIFO): nothing of it can then run dry.

        Underrun and re-buffering (as a media player does): a started voice that runs dry
        mid-sentence while its request is still being written stops and resumes only once it holds
        ``max(frames, start_frames, rebuffer)`` samples (:meth:`rebuffer`, else
        ``rebuffer_frames``). Where synthesis is slower than playback the silence is then one pause
        per stall instead of a gap at every chunk; the total gap is the same, and is counted.

        Returns:
            ``(sounding, underruns, gap, samples, held)``: voices that sounded (the caller zeroes
            ``out`` for 0 and clips it for 2 or more), voices that ran dry mid-sentence in this
            block (new underruns), samples of silence inside streaming voices (running dry,
            re-buffering, holding at a sentence boundary), samples taken from the FIFOs, and voices
            that began to hold at a sentence boundary in this block.
        """
        if len(self._mixbuf) < frames:
            self._mixbuf = np.zeros(frames, np.float32)
        sounding = underruns = gap = taken = held_n = 0
        start = max(frames, start_frames)
        for v in self.sounding():
            if (not v.started and v.writing is True and v.buffered < max(start + v.hold, v.need)
                    and not (v.sounded and v.boundary is not None)):   # (the rest of) a sentence queued whole
                if v.pause is not None:                    # silent inside the request (not its first start)
                    v.pause.samples += frames
                    gap += frames
                continue                                   # below the (re)start threshold: not yet
            if not v.chunks:
                if v.writing is True:                      # a started voice ran dry at a block's edge
                    underruns += 1
                    gap += frames
                    v.silence(at_boundary=False)
                    v.pause.samples, v.need = frames, max(1, v.rebuffer or rebuffer_frames)
                continue
            v.started, v.need, v.hold, v.pause, v.sounded = True, 0, 0, None, True
            dst = out if sounding == 0 else self._mixbuf
            g = self.gain(v.channel)
            n = 0
            held = False
            while n < frames and v.chunks:
                c = v.chunks[0]
                take = min(frames - n, len(c.data) - c.pos)
                if g == 1.0:
                    dst[n:n + take] = c.data[c.pos:c.pos + take]
                else:                                      # its channel's volume, in place
                    np.multiply(c.data[c.pos:c.pos + take], g, out=dst[n:n + take])
                c.pos += take
                n += take
                if c.pos == len(c.data):
                    v.chunks.popleft()
                    if c.on_played is not None:
                        played.append((played_at, c.on_played))
                    if c.ends_sentence:
                        v.sentence += 1
                        if v.boundary is c:
                            v.boundary = None
                        if v.writing is True and v.buffered - n < start + c.next_hold and v.boundary is None:
                            v.hold, held = c.next_hold, True   # the next sentence is not far enough along
                            break
            if g > 1.0 and n:
                np.clip(dst[:n], -1.0, 1.0, out=dst[:n])
            if n and v.on_first is not None:   # the voice's first samples go out in this block
                first, v.on_first = v.on_first, None
                t = played_at if written_at is None else written_at
                played.append((played_at, lambda f=first, t=t: f(t)))
            v.played += n
            if held:
                held_n += 1
                v.silence(at_boundary=True)
                v.pause.samples = frames - n
            if n < frames:
                dst[n:frames] = 0.0
                if v.writing is True:
                    gap += frames - n
                    if not held:
                        underruns += 1
                        v.silence(at_boundary=False)
                        v.pause.samples, v.need = frames - n, max(1, v.rebuffer or rebuffer_frames)
            if sounding > 0:
                out[:frames] += self._mixbuf[:frames]
            sounding += 1
            v.buffered -= n
            taken += n
        self.buffered -= taken
        return sounding, underruns, gap, taken, held_n
