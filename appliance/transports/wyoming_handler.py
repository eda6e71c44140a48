"""One Wyoming client connection: Wyoming events in, the daemon's requests out, audio back.

Every utterance (a one-shot ``synthesize``, or a ``synthesize-start`` ... ``synthesize-stop``
stream) is ONE ``speak`` request (``return_audio``, ``play`` = ``wyoming.play``) on
``wyoming.channel`` with ``wyoming.priority``, whose sentences are its parts: accepted with its
first sentence, each later sentence added as soon as it is complete
(:meth:`~appliance.service.dispatch.Dispatcher.add_text`: synthesized in order, the engine waits
for the next), closed at the end of the text. So a channel's queue counts utterances, and a
30-sentence answer plays in order. The dispatcher treats it like a socket or MQTT request (same
scheduler, same worker thread); its events come back through an
:data:`~appliance.messages.protocol.EventSink` (any thread -> ``call_soon_threadsafe``)::

    describe                      -> info
    ping                          -> pong
    synthesize (one-shot)         -> audio-start, audio-chunk* (as each PCM chunk is produced),
                                     audio-stop
    synthesize-start, synthesize-chunk*, [synthesize], synthesize-stop
                                  -> audio-start, audio-chunk* (each sentence spoken as soon as it is
                                     complete, text_stream.SentenceBuffer), audio-stop,
                                     synthesize-stopped

Audio: 16-bit signed little-endian mono PCM (width 2, channels 1) at 24000 Hz; every audio-chunk
says so. One audio-start / audio-stop pair frames each utterance (also without audio). The
``synthesize`` a client sends inside a stream (Home Assistant does) is ignored. A one-shot text
over ``service.max_text_chars`` is cut into sentences the same way. With ``wyoming.streaming:
false`` the text of a stream is collected and spoken at ``synthesize-stop``. Replies go out in the
order the requests came in (one writer task per connection).

Errors (our codes: ``bad_text``, ``busy``, ``bad_speaker``...) become Wyoming ``error`` events. A
failed one-shot (or an unknown voice) sends ``error`` and closes the connection, as Wyoming
servers do. In a stream, a refused sentence sends ``error`` and the stream goes on; ``cancelled``
or ``preempted`` (dropped) ends the stream's audio. An alert that preempts with ``on_preempt:
resume`` restarts the request from the beginning: the audio the client already has is skipped
(same seed, same audio). Unknown event types are ignored. A client that disconnects has its
requests cancelled. Nothing here can disturb another connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import uuid
from dataclasses import dataclass, field
from typing import Optional, Union

from wyoming.audio import AudioChunk as WyAudioChunk
from wyoming.audio import AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event as WyEvent
from wyoming.info import Describe
from wyoming.ping import Ping, Pong
from wyoming.server import AsyncEventHandler
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeStopped,
    SynthesizeVoice,
)

from ..audio.wav import to_int16
from ..core import SAMPLE_RATE, PcmChunk
from ..errors import (
    ApplianceError,
    CancelledError,
    PreemptedError,
    RequestError,
    SpeakerError,
)
from ..messages.protocol import (
    AudioChunk,
    Cancel,
    Done,
    ErrorEvent,
    Event,
    Preempted,
    Speak,
    error_event,
)
from ..service.dispatch import Dispatcher
from .text_stream import SentenceBuffer

log = logging.getLogger(__name__)

WIDTH, CHANNELS = 2, 1
"""Wyoming audio format sent: 16-bit samples, mono."""

_ENDS_STREAM = (CancelledError.code, PreemptedError.code)
_conn_ids = itertools.count(1)


@dataclass(frozen=True)
class Context:
    """What every connection of one server shares (built by
    :class:`~appliance.transports.wyoming_server.WyomingServer`).

    Attributes:
        dispatch: the daemon's dispatcher. info: the ``info`` event (``describe``'s answer).
        voices: voice name -> the same name (a ``speak`` carries it; the pipeline resolves it); the first
            is the default. channel, priority, play: of every request. streaming:
            ``wyoming.streaming``. max_chars: ``service.max_text_chars``.
    """

    dispatch: Dispatcher
    info: WyEvent
    voices: dict
    channel: str
    priority: str
    play: bool
    streaming: bool
    max_chars: int


@dataclass(eq=False)
class _Request:
    """One ``speak`` of this connection and its events (from the sink, on the loop)."""

    id: str
    speak: Optional[Speak] = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent: int = 0        # PCM bytes forwarded to the client
    skip: int = 0        # bytes to drop after a resume (the client has them already)


@dataclass(eq=False)
class _Utterance:
    """One one-shot ``synthesize`` or stream: its request (another only after the first ended
    early), None at the end."""

    streaming: bool
    requests: asyncio.Queue = field(default_factory=asyncio.Queue)
    ended: bool = False   # cancelled / preempted: the rest is not spoken
    current: Optional[_Request] = None   # the open request its next sentences are added to


@dataclass
class _Stream:
    """The open ``synthesize-start`` ... ``synthesize-stop`` of this connection."""

    utt: _Utterance
    voice: Optional[str]
    text: SentenceBuffer
    collected: list = field(default_factory=list)     # wyoming.streaming false: all text, spoken at stop


class _Fatal:
    """A segment that sends ``error`` and closes the connection."""

    def __init__(self, event: WyEvent) -> None:
        self.event = event


_Segment = Union[WyEvent, _Utterance, _Fatal]


class WyomingHandler(AsyncEventHandler):
    """The handler of one Wyoming connection (module docstring). Built by the server's factory
    on the event loop."""

    def __init__(self, ctx: Context, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__(reader, writer)
        self.ctx = ctx
        self.name = f"wyoming#{next(_conn_ids)}"
        self._tag = uuid.uuid4().hex[:6]
        self._n = 0
        self._loop = asyncio.get_running_loop()
        self._segments: asyncio.Queue[_Segment] = asyncio.Queue()
        self._pending: set[str] = set()          # request ids without their done/error yet
        self._stream: Optional[_Stream] = None
        self._gone = False
        self._writer_task = asyncio.create_task(self._write_loop(), name=f"{self.name} writer")
        log.debug("%s connected", self.name)

    # ------------------------------------------------------------------ events in

    async def handle_event(self, event: WyEvent) -> bool:
        """Handle one client event; never raises (a bad event becomes an ``error`` event)."""
        try:
            await self._handle(event)
        except Exception as e:  # noqa: BLE001 - one bad event must not end other work
            code = getattr(e, "code", "bad_request" if isinstance(e, (KeyError, TypeError, ValueError)) else "internal")
            log.info("%s: %s event refused: %s (%s)", self.name, event.type, e, code)
            self._segments.put_nowait(Error(text=f"{event.type}: {e}", code=code).event())
        return not self._gone

    async def _handle(self, event: WyEvent) -> None:
        t = event.type
        if Describe.is_type(t):
            self._segments.put_nowait(self.ctx.info)
        elif Ping.is_type(t):
            self._segments.put_nowait(Pong(text=Ping.from_event(event).text).event())
        elif Synthesize.is_type(t):
            if self._stream is not None:
                return                      # the whole text again, for servers that do not stream
            syn = Synthesize.from_event(event)
            voice = self._voice(syn.voice)
            utt = _Utterance(streaming=False)
            self._segments.put_nowait(utt)
            if voice is not _BAD:
                text = syn.text or ""
                pieces = [p for p in ([text] if len(text) <= self.ctx.max_chars else self._pieces(text)) if p.strip()]
                for i, piece in enumerate(pieces):
                    await self._say(utt, piece, voice, last=i == len(pieces) - 1)
            self._end_text(utt)
        elif SynthesizeStart.is_type(t):
            if self._stream is not None:     # a new stream without a stop: end the old one first
                await self._stop_stream()
            start = SynthesizeStart.from_event(event)
            voice = self._voice(start.voice)
            utt = _Utterance(streaming=True, ended=voice is _BAD)
            self._stream = _Stream(utt, None if voice is _BAD else voice, SentenceBuffer(self.ctx.max_chars))
            self._segments.put_nowait(utt)
        elif SynthesizeChunk.is_type(t):
            text = SynthesizeChunk.from_event(event).text
            st = self._stream
            if st is None:
                raise RequestError("synthesize-chunk without synthesize-start")
            if st.utt.ended:
                return
            if not self.ctx.streaming:
                st.collected.append(text)
                return
            for sentence in st.text.add(text):
                await self._say(st.utt, sentence, st.voice)
        elif SynthesizeStop.is_type(t):
            if self._stream is None:
                self._segments.put_nowait(Error(text="synthesize-stop without synthesize-start",
                                                code=RequestError.code).event())
                self._segments.put_nowait(SynthesizeStopped().event())
                return
            await self._stop_stream()
        else:
            log.debug("%s: ignoring %s event", self.name, t)

    async def _stop_stream(self) -> None:
        st, self._stream = self._stream, None
        assert st is not None
        if not st.utt.ended:
            rest = st.text.finish() if self.ctx.streaming else self._pieces("".join(st.collected))
            for piece in rest:
                await self._say(st.utt, piece, st.voice)
        self._end_text(st.utt)

    def _pieces(self, text: str) -> list[str]:
        buf = SentenceBuffer(self.ctx.max_chars)
        return buf.add(text) + buf.finish()

    def _voice(self, v: Optional[SynthesizeVoice]) -> object:
        """The voice string for a requested voice name (None = the default voice); ``_BAD`` (after
        queueing a fatal error) for a name this server does not offer."""
        name = v.name if v is not None and v.name else None
        if name is None:
            return next(iter(self.ctx.voices.values()))
        if name in self.ctx.voices:
            return self.ctx.voices[name]
        msg = f"unknown voice {name!r}; this box offers: {', '.join(self.ctx.voices)}"
        self._segments.put_nowait(_Fatal(Error(text=msg, code=SpeakerError.code).event()))
        return _BAD

    async def _say(self, utt: _Utterance, text: str, voice: Optional[str], last: bool = False) -> None:
        """The next sentence(s) of ``utt``: added to its open request, or the request is opened
        with them (``last``: nothing follows, so it opens closed)."""
        if utt.ended or self._gone:
            return
        req = utt.current
        if req is not None:
            try:
                if await self.ctx.dispatch.add_text(dataclasses.replace(req.speak, text=text)):
                    return
            except ApplianceError as e:          # this sentence is refused; the utterance goes on
                log.info("%s: a sentence of %s refused: %s (%s)", self.name, req.id, e, e.code)
                req.events.put_nowait((error_event(e, req.id), _NOTE))
                return
            utt.current = None                  # it ended (failed): the rest opens a new request
        self._n += 1
        req = _Request(id=f"wy-{self._tag}-{self._n}")
        utt.requests.put_nowait(req)          # its place in the reply order is fixed now
        self._pending.add(req.id)
        c = self.ctx
        req.speak = Speak(text=text, id=req.id, channel=c.channel, priority=c.priority, voice=voice,
                          return_audio=True, play=c.play)
        more = not last
        log.info("%s: speak %s (%d chars%s)", self.name, req.id, len(text), ", more to come" if more else "")
        await c.dispatch.handle_request(req.speak, lambda ev, payload: self._sink(req, ev, payload), more=more)
        if more and req.id in self._pending:
            utt.current = req
        if self._gone:                        # the client left while it was being prepared
            await self._cancel([req.id])

    def _end_text(self, utt: _Utterance) -> None:
        """The utterance has all its text: close its open request; no more requests follow."""
        if utt.current is not None:
            self.ctx.dispatch.close_text(utt.current.id)
            utt.current = None
        utt.requests.put_nowait(None)

    def _sink(self, req: _Request, ev: Event, payload: Optional[PcmChunk]) -> None:
        """The request's EventSink: any thread -> the loop (never blocks, never raises)."""
        try:
            self._loop.call_soon_threadsafe(self._on_event, req, ev, payload)
        except RuntimeError:      # the loop is closed: the daemon is gone
            pass

    def _on_event(self, req: _Request, ev: Event, payload: Optional[PcmChunk]) -> None:
        if isinstance(ev, (Done, ErrorEvent)):
            self._pending.discard(req.id)
        req.events.put_nowait((ev, payload))

    # ------------------------------------------------------------------ events out

    async def _write_loop(self) -> None:
        try:
            while True:
                seg = await self._segments.get()
                if isinstance(seg, _Fatal):
                    await self.write_event(seg.event)
                    await self.stop()
                    return
                if isinstance(seg, _Utterance):
                    if not await self._write_utterance(seg):
                        await self.stop()
                        return
                else:
                    await self.write_event(seg)
        except (ConnectionError, OSError, RuntimeError) as e:
            log.debug("%s: write failed: %s", self.name, e)
        except asyncio.CancelledError:
            pass

    async def _write_utterance(self, utt: _Utterance) -> bool:
        """Forward one utterance's audio; False when the connection must close (a failed one-shot)."""
        started = False
        while (req := await utt.requests.get()) is not None:
            while True:
                ev, payload = await req.events.get()
                if isinstance(ev, AudioChunk) and isinstance(payload, PcmChunk) and not utt.ended:
                    data = to_int16(payload.samples).tobytes()      # encoded once, here
                    if req.skip:
                        cut = min(req.skip, len(data))
                        data, req.skip = data[cut:], req.skip - cut
                    if not data:
                        continue
                    if not started:
                        await self.write_event(AudioStart(rate=ev.rate, width=WIDTH, channels=CHANNELS).event())
                        started = True
                    await self.write_event(WyAudioChunk(rate=ev.rate, width=WIDTH, channels=CHANNELS, audio=data).event())
                    req.sent += len(data)
                elif payload is _NOTE:          # a refused sentence (not the end of the request)
                    if not utt.ended:
                        await self.write_event(Error(text=ev.message, code=ev.code).event())
                    if not utt.streaming:
                        return False
                elif isinstance(ev, Preempted) and ev.action == "resume":
                    req.skip = req.sent           # it starts again from the beginning: same audio
                elif isinstance(ev, Done):
                    break
                elif isinstance(ev, ErrorEvent):
                    if utt.ended:
                        break
                    await self.write_event(Error(text=ev.message, code=ev.code).event())
                    if not utt.streaming:
                        return False
                    if ev.code in _ENDS_STREAM:
                        utt.ended = True
                        await self._cancel([r for r in self._pending])   # its later sentences
                    break
        if not started:
            await self.write_event(AudioStart(rate=SAMPLE_RATE, width=WIDTH, channels=CHANNELS).event())
        await self.write_event(AudioStop().event())
        if utt.streaming:
            await self.write_event(SynthesizeStopped().event())
        return True

    # ------------------------------------------------------------------ end

    async def _cancel(self, ids: list[str]) -> None:
        for rid in ids:
            if rid in self._pending:
                await self.ctx.dispatch.handle_request(Cancel(id=rid), lambda ev, payload: None)

    async def disconnect(self) -> None:
        """The client is gone (EOF, error, or the server stops): cancel what it left running."""
        self._gone = True
        left = list(self._pending)
        if left:
            log.info("%s disconnected: cancelling %s", self.name, ", ".join(left))
            await self._cancel(left)
        else:
            log.debug("%s disconnected", self.name)
        if self._writer_task is not asyncio.current_task():
            self._writer_task.cancel()


_BAD = object()      # marker: the requested voice does not exist (a fatal error was queued)
_NOTE = object()     # payload marker of an ``error`` that does not end its request (a refused sentence)
