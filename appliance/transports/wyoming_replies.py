"""What one Wyoming connection sends back, in the order the client's events came: the writer's half
of :mod:`.wyoming_handler`.

The handler queues *segments* on ONE queue per connection, in the order the client's events
came: a ready Wyoming event (``info``, ``pong``, an ``error``), a :class:`Fatal` (an ``error``
after which the connection closes), or an utterance (a one-shot ``synthesize`` or a stream): its
:class:`Utterance`, then its :class:`Speech` items (one ``speak`` request, another only after the
first ended early) and, between them, the ``error`` of an event refused while none of them ran,
then its :class:`UtteranceEnd`. Nothing else comes between an utterance and its end (the handler
holds a ``describe`` or ``ping`` answer that arrives inside a stream until the stream's end). A
speech's replies are in its :class:`~appliance.audio.stream.Outbox`: its events (from the
dispatcher's sink) and its PCM (float32, from its :class:`~appliance.audio.stream.StreamAudio`;
encoded here, 16-bit), in the order they happened; an ``error`` of a refused event or sentence can
be put among them, so it is written at once, between the audio. So a reply goes through two
queues: the connection's, and its request's outbox. :class:`ReplyWriter` turns one utterance
into::

    audio-start, audio-chunk* (16-bit mono PCM at 24000 Hz), [error*],
    audio-stop, [synthesize-stopped: a stream]

Each audio-chunk is written and drained before the next is taken out of the outbox, so the audio a
client has not read stays in the outbox, counted against ``wyoming.max_buffered_ms``
(:mod:`appliance.audio.stream`). One audio-start / audio-stop pair frames each utterance (also without
audio). A speech preempted with ``on_preempt: resume`` restarts from its beginning: the bytes the
client already has are skipped (same seed, same audio). ``cancelled`` or ``preempted`` (dropped)
ends a stream's audio (its later sentences are cancelled); any other error of a one-shot ends the
connection, as Wyoming servers do. An ``internal`` error is sent without its Python text (the log
has it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Union

from wyoming.audio import AudioChunk as WyAudioChunk
from wyoming.audio import AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event as WyEvent
from wyoming.tts import SynthesizeStopped

from ..audio.stream import AUDIO, Outbox
from ..audio.wav import to_int16
from ..core import SAMPLE_RATE
from ..errors import BusyError, CancelledError, PreemptedError, ThrottledError
from ..messages.protocol import Done, ErrorEvent, Preempted, Speak

WIDTH, CHANNELS = 2, 1
"""Wyoming audio format sent: 16-bit samples, mono."""

ENDS_STREAM = (CancelledError.code, PreemptedError.code, ThrottledError.code, BusyError.code)
"""Error codes that end a stream's audio (the rest of its text is not spoken): cancelled,
preempted, and a request the box could not start in time (``wyoming.start_timeout_s``)."""


@dataclass(eq=False)
class Speech:
    """One ``speak`` request of a connection and its :class:`~appliance.audio.stream.Outbox`:
    ``(EVENT, event)`` from the sink (or ``(EVENT, error WyEvent)``: a refused event
    or sentence, not its end) and ``(AUDIO, sink, pcm float32 [n], n)``."""

    id: str
    outbox: Outbox
    speak: Optional[Speak] = None
    sent: int = 0        # PCM bytes forwarded to the client
    skip: int = 0        # bytes to drop after a resume (the client has them already)
    born: float = 0.0    # the loop's time when it was made (wyoming.start_timeout_s counts from it)
    started: bool = False   # its 'started' came (the handler's, on the loop)
    timer: Optional[Any] = None   # the loop's handle of its start timeout


@dataclass(eq=False)
class Utterance:
    """One one-shot ``synthesize`` or stream (its speeches follow it on the connection's queue)."""

    streaming: bool
    ended: bool = False   # cancelled / preempted: the rest is not spoken
    stalled: bool = False   # its client stopped reading (wyoming.max_buffered_ms): no more sentences
    current: Optional[Speech] = None   # the open request its next sentences are added to
    started: bool = False   # audio-start written (the writer's)


@dataclass(frozen=True)
class UtteranceEnd:
    """The utterance has all its requests: audio-stop (and synthesize-stopped) once they are written."""

    utt: Utterance


@dataclass(frozen=True)
class Fatal:
    """A segment that sends ``error`` and closes the connection."""

    event: WyEvent


Segment = Union[WyEvent, Fatal, Utterance, Speech, UtteranceEnd]


class ReplyWriter:
    """Writes a connection's segments (module docstring) with ``write_event``, one at a time, in
    order; ``end_stream`` cancels the requests still running when a stream's audio ends."""

    def __init__(self, write_event: Callable[[WyEvent], Awaitable[None]],
                 end_stream: Callable[[], Awaitable[None]]) -> None:
        self.write_event, self.end_stream = write_event, end_stream
        self.utt: Optional[Utterance] = None    # the utterance being written

    async def write(self, seg: Segment) -> bool:
        """Write ``seg``; False when the connection must close (a :class:`Fatal`, a failed one-shot)."""
        if isinstance(seg, Fatal):
            await self.write_event(seg.event)
            return False
        if isinstance(seg, Utterance):
            self.utt = seg
            return True
        utt = self.utt
        if isinstance(seg, UtteranceEnd):
            self.utt = None
            if not seg.utt.started:
                await self.write_event(AudioStart(rate=SAMPLE_RATE, width=WIDTH, channels=CHANNELS).event())
            await self.write_event(AudioStop().event())
            if seg.utt.streaming:
                await self.write_event(SynthesizeStopped().event())
            return True
        if isinstance(seg, Speech):
            assert utt is not None, "a speech outside its utterance"
            return await self._speech(utt, seg)
        await self.write_event(seg)            # a reply, or an error while none of the speeches ran
        return utt is None or utt.streaming    # a refused sentence of a one-shot ends it

    async def _speech(self, utt: Utterance, req: Speech) -> bool:
        """Forward one speech's outbox up to its done / error."""
        while True:
            item = await req.outbox.get()
            if item[0] == AUDIO:
                _, sink, pcm, n = item
                if not utt.ended:
                    await _write_audio(utt, req, to_int16(pcm).tobytes(), self.write_event)
                sink.written(n)               # after its drain: it no longer counts against the bound
                continue
            _, ev = item
            if isinstance(ev, WyEvent):       # a refused event or sentence, not the speech's end
                await self.write_event(ev)
                if not utt.streaming:
                    return False
            elif isinstance(ev, Preempted) and ev.action == "resume":
                req.skip = req.sent           # it starts again from the beginning: same audio
            elif isinstance(ev, Done):
                return True
            elif isinstance(ev, ErrorEvent):
                if utt.ended:
                    return True
                text = ev.message if ev.code != "internal" else "the server failed to speak this text (its log has the details)"
                await self.write_event(Error(text=text, code=ev.code).event())
                if not utt.streaming:
                    return False
                if ev.code in ENDS_STREAM:
                    utt.ended = True
                    await self.end_stream()   # its later sentences
                return True


async def _write_audio(utt: Utterance, req: Speech, data: bytes,
                       write_event: Callable[[WyEvent], Awaitable[None]]) -> None:
    """Write one chunk of ``req``'s audio (after the utterance's audio-start, once)."""
    if req.skip:
        cut = min(req.skip, len(data))
        data, req.skip = data[cut:], req.skip - cut
    if not data:
        return
    if not utt.started:
        await write_event(AudioStart(rate=SAMPLE_RATE, width=WIDTH, channels=CHANNELS).event())
        utt.started = True
    await write_event(WyAudioChunk(rate=SAMPLE_RATE, width=WIDTH, channels=CHANNELS, audio=data).event())
    req.sent += len(data)


__all__ = ["Speech", "Utterance", "UtteranceEnd", "Fatal", "Segment", "ReplyWriter", "WIDTH", "CHANNELS"]
