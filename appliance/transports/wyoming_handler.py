"""One Wyoming client connection: Wyoming events in, the daemon's requests out, audio back.

Every utterance (a one-shot ``synthesize``, or a ``synthesize-start`` ... ``synthesize-stop``
stream) is ONE ``speak`` request (``return_audio``, ``play`` = ``wyoming.play``) on
``wyoming.channel`` with ``wyoming.priority``, whose sentences are its parts: accepted with its
first sentence, each later sentence added as soon as it is complete
(:meth:`~appliance.service.dispatch.Dispatcher.add_text`: synthesized in order, the engine waits
for the next), closed at the end of the text. So a channel's queue counts utterances, and a
30-sentence answer plays in order. The dispatcher treats it like a socket or MQTT request (same
scheduler, same worker thread); its events come back through an
:data:`~appliance.messages.protocol.EventSink` and its PCM through an
:class:`~appliance.audio.sink.AudioSink` the handler passes down with it
(:class:`~appliance.audio.stream.StreamAudio` on the connection's
:class:`~appliance.audio.stream.ClientStream`, opened by the worker each time the request
starts), both into the request's outbox (any thread, never blocking), which this
connection's writer task empties on the loop::

    describe                      -> info
    ping                          -> pong
    synthesize (one-shot)         -> audio-start, audio-chunk* (as each PCM chunk is produced),
                                     audio-stop
    synthesize-start, synthesize-chunk*, [synthesize], synthesize-stop
                                  -> audio-start, audio-chunk* (each sentence spoken as soon as it is
                                     complete, text_stream.SentenceBuffer), audio-stop,
                                     synthesize-stopped

Audio: 16-bit signed little-endian mono PCM (width 2, channels 1) at 24000 Hz; every audio-chunk
says so. The audio a client has not read yet is bounded per connection by
``wyoming.max_buffered_ms`` (:mod:`appliance.audio.stream`: the one rule for every client): a
client that stops reading has the request that goes over it cancelled (logged), the rest of its
utterance is not spoken, and no other request or connection notices. One audio-start /
audio-stop pair frames each utterance (also without audio); a ``describe`` or ``ping`` sent
inside a stream is answered after its ``synthesize-stopped``. The
``synthesize`` a client sends inside a stream (Home Assistant does) is ignored. A one-shot text
over ``service.max_text_chars`` is cut into sentences the same way. With ``wyoming.streaming:
false`` the text of a stream is collected and spoken at ``synthesize-stop``; so is an SSML stream
(``text_format: ssml``: a document is read whole). Markdown, HTML and SSML tags are never spoken
(:mod:`appliance.text.markup`, in the normalizer, for every transport; an SSML text is read
as SSML only). Replies go out in the
order the requests came in (one writer task per connection; :mod:`.wyoming_replies` writes them).

Every event is checked before anything is queued (:mod:`.wyoming_frame`): a malformed one gets an
``error`` (``bad_request``, in plain words) and the connection goes on. An event over
``wyoming.max_payload_bytes`` (or a header over ``service.max_line_bytes``) gets an ``error`` and
the connection is closed, unread. A request's errors (``bad_text``, ``busy``, ``bad_speaker``...)
become ``error`` events; a failed one-shot (an unknown voice too) then closes the connection, as
Wyoming servers do: its client waits for audio-stop, and the close tells it at once. A stream is
never dropped: a refused event or sentence sends ``error`` at once (between the audio, always
before ``synthesize-stopped``) and the stream goes on; a ``synthesize-start`` with an unknown voice
(or malformed) gets its ``error``, the rest of its stream is read and not spoken (no other voice
speaks in its place: the client asked for that one), ``synthesize-stop`` answers
``synthesize-stopped``, and the connection takes the next event (``describe``, another stream).
``cancelled`` or ``preempted`` (dropped) ends the stream's audio. A request preempted with
``on_preempt: resume`` restarts from the beginning: the audio the client already has is skipped
(same seed, same audio). Unknown (well-formed) event types are dropped, as the protocol asks. A
client that disconnects has its requests cancelled; a long text whose client closed (one-shot,
chunk or the rest of a stream) stops being prepared at its next sentence. Nothing here can disturb another connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import uuid
from dataclasses import dataclass
from typing import Optional

from wyoming.error import Error
from wyoming.event import Event as WyEvent
from wyoming.info import Describe, SelectProgram
from wyoming.ping import Ping, Pong
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeStopped,
)

from ..audio.stream import EVENT, ClientStream, Outbox, StreamAudio, ms
from ..errors import ApplianceError, RequestError, SpeakerError
from ..messages.protocol import Accepted, Cancel, Done, ErrorEvent, Event, Speak, Started
from .text_stream import SentenceBuffer
from .wyoming_bounds import Bounded
from .wyoming_context import Context
from .wyoming_frame import CheckedHandler, FrameError, check_event
from .wyoming_replies import Fatal, ReplyWriter, Segment, Speech, Utterance, UtteranceEnd
from .wyoming_sink import keep_alive, limit_send_buffer

log = logging.getLogger(__name__)

_conn_ids = itertools.count(1)


@dataclass
class _Stream:
    """The open ``synthesize-start`` ... ``synthesize-stop`` of this connection."""

    utt: Utterance
    voice: Optional[str]
    text: SentenceBuffer       # wyoming.streaming false or SSML: the whole text, spoken at stop


class WyomingHandler(Bounded, CheckedHandler):
    """The handler of one Wyoming connection (module docstring). Built by the server's factory
    on the event loop."""

    def __init__(self, ctx: Context, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__(reader, writer)
        self.ctx = ctx
        self.max_header, self.max_payload = ctx.max_line, ctx.max_payload
        self.name = f"wyoming#{next(_conn_ids)}"
        self._tag = uuid.uuid4().hex[:6]
        self._n = 0
        self._loop = asyncio.get_running_loop()
        self._segments: asyncio.Queue[Segment] = asyncio.Queue()   # every reply, in order (wyoming_replies)
        self._held: list[WyEvent] = []           # answers that came inside a stream: after its end
        self._speeches: dict[str, Speech] = {}   # requests without their done/error yet (pruned)
        self.stream = ClientStream(self.name, "Wyoming client", ctx.max_buffered_ms, "wyoming.max_buffered_ms")
        limit_send_buffer(writer, self.name)
        keep_alive(writer, self.name, ctx.keepalive_s, ctx.write_timeout_s)
        self._stream: Optional[_Stream] = None
        self._gone = False
        self._writer_task = asyncio.create_task(self._write_loop(), name=f"{self.name} writer")
        log.debug("%s connected", self.name)

    # ------------------------------------------------------------------ events in

    async def handle_event(self, event: WyEvent) -> bool:
        """Handle one client event; never raises (a bad event becomes an ``error`` event).
        The event is checked before anything is queued."""
        try:
            event = check_event(event)
        except FrameError as e:
            if event.type == "synthesize-start":   # the stream is answered: error, then its end
                await self._start_stream(Utterance(streaming=True, ended=True), None)
            self.refuse(str(event.type), e)
            return not self._gone
        try:
            await self._handle(event)
        except Exception as e:  # noqa: BLE001 - one bad event must not end other work
            self.refuse(event.type, e)
        return not self._gone

    def send_error(self, error: WyEvent) -> None:
        """A refused event's ``error``: inside an open stream among its replies (the stream goes
        on), else as the next reply."""
        if self._stream is None:
            self._segments.put_nowait(error)
        else:
            self._error_in(self._stream.utt, error)

    def _error_in(self, utt: Utterance, error: WyEvent) -> None:
        """``error`` among ``utt``'s replies, in arrival order, before its audio-stop: between the
        audio of its open request while that runs (the writer is inside it), else after its requests."""
        req = utt.current
        if req is None or not req.outbox.put((EVENT, error)):    # not after its done / error
            self._segments.put_nowait(error)

    async def _handle(self, event: WyEvent) -> None:
        t = event.type
        if Describe.is_type(t):
            self._answer(self.ctx.info)
        elif Ping.is_type(t):
            self._answer(Pong(text=Ping.from_event(event).text).event())
        elif Synthesize.is_type(t):
            if self._stream is not None:
                return                      # the whole text again, for servers that do not stream
            syn = Synthesize.from_event(event)
            try:
                voice = self.ctx.voice(syn.voice)
            except SpeakerError as e:       # a one-shot with a voice this box lacks: error, then close
                self._segments.put_nowait(Fatal(Error(text=str(e), code=e.code).event()))
                return
            utt = Utterance(streaming=False)
            self._segments.put_nowait(utt)
            try:
                text = syn.text or ""
                ssml = syn.text_format == "ssml"
                pieces = [text] if len(text) <= self.ctx.max_chars and not ssml else self._pieces(text, ssml)
                await self._say_all(utt, [p for p in pieces if p.strip()], voice, closed=True)
            finally:                        # the utterance always ends (else its writer would wait)
                self._end_text(utt)
        elif SynthesizeStart.is_type(t):
            start = SynthesizeStart.from_event(event)
            try:
                voice = self.ctx.voice(start.voice)
            except SpeakerError:            # answered in the stream (error, its end); read, not spoken
                await self._start_stream(Utterance(streaming=True, ended=True), None)
                raise
            await self._start_stream(Utterance(streaming=True), voice, start.text_format == "ssml")
        elif SelectProgram.is_type(t):
            ours = self.ctx.info.data["tts"][0]["name"]
            if SelectProgram.from_event(event).name != ours:
                raise RequestError(f"select-program: this server's one program is {ours!r}")
        elif SynthesizeChunk.is_type(t):
            text = SynthesizeChunk.from_event(event).text
            st = self._stream
            if st is None:
                raise RequestError("synthesize-chunk without synthesize-start")
            if not st.utt.ended:
                await self._say_all(st.utt, st.text.add(text), st.voice)
        elif SynthesizeStop.is_type(t):
            if self._stream is None:
                self._segments.put_nowait(Error(text="synthesize-stop without synthesize-start",
                                                code=RequestError.code).event())
                self._segments.put_nowait(SynthesizeStopped().event())
                return
            await self._stop_stream()
        else:
            log.debug("%s: ignoring %s event", self.name, t)

    def _answer(self, reply: WyEvent) -> None:
        """A reply that is no part of an utterance: next, or after the open stream's end."""
        if self._stream is None:
            self._segments.put_nowait(reply)
        else:
            self._held.append(reply)

    async def _start_stream(self, utt: Utterance, voice: Optional[str], ssml: bool = False) -> None:
        if self._stream is not None:         # a new stream without a stop: end the old one first
            await self._stop_stream()
        self._stream = _Stream(utt, voice, SentenceBuffer(self.ctx.max_chars, whole=not self.ctx.streaming, ssml=ssml))
        self._segments.put_nowait(utt)

    async def _stop_stream(self) -> None:
        st, self._stream = self._stream, None
        assert st is not None
        if not st.utt.ended:
            await self._say_all(st.utt, st.text.finish(), st.voice)
        self._end_text(st.utt)

    def _pieces(self, text: str, ssml: bool = False) -> list[str]:
        buf = SentenceBuffer(self.ctx.max_chars, ssml=ssml)
        return buf.add(text) + buf.finish()

    def _client_left(self) -> bool:
        """The client closed its side and every event it sent has been read: what it asked for
        can no longer reach it (the reader's EOF would cancel it next, :meth:`disconnect`)."""
        return self._gone or self.reader.at_eof()

    async def _say_all(self, utt: Utterance, pieces: list[str], voice: Optional[str], closed: bool = False) -> None:
        """:meth:`_say` each of ``pieces`` in turn (each is prepared, i.e. normalized, before the
        next), stopping at the first the client can no longer get (a 60,000-character text whose
        client closed at once is not normalized for nobody). ``closed``: nothing follows the last."""
        for i, piece in enumerate(pieces):
            if self._client_left():
                log.info("%s: the client left; %d of %d sentences not prepared", self.name, len(pieces) - i, len(pieces))
                return
            await self._say(utt, piece, voice, last=closed and i == len(pieces) - 1)

    async def _say(self, utt: Utterance, text: str, voice: Optional[str], last: bool = False) -> None:
        """The next sentence(s) of ``utt``: added to its open request, or the request is opened
        with them (``last``: nothing follows, so it opens closed)."""
        if utt.ended or utt.stalled or self._gone:
            return
        req = utt.current
        if req is not None:
            try:
                if await self.ctx.dispatch.add_text(dataclasses.replace(req.speak, text=text)):
                    return
            except ApplianceError as e:          # this sentence is refused; the utterance goes on
                log.info("%s: a sentence of %s refused: %s (%s)", self.name, req.id, e, e.code)
                self._error_in(utt, Error(text=str(e), code=e.code).event())
                return
            utt.current = None                  # it ended (failed): the rest opens a new request
        self._n += 1
        req = Speech(id=f"wy-{self._tag}-{self._n}", outbox=Outbox(self._loop, self.stream), born=self._loop.time())
        self._segments.put_nowait(req)        # its place in the reply order is fixed now
        self._pending()                       # forget the ended ones
        self._speeches[req.id] = req
        c = self.ctx
        # the PCM goes through its audio sink (bounded), not as audio events: return_audio off
        req.speak = Speak(text=text, id=req.id, channel=c.channel, priority=c.priority, voice=voice,
                          return_audio=False, play=c.play)
        more = not last
        log.info("%s: speak %s (%d chars%s)", self.name, req.id, len(text), ", more to come" if more else "")
        await c.dispatch.handle_request(req.speak, lambda ev: self._sink(req, ev), more=more,
                                        audio=lambda: self._audio(utt, req))
        if more and not req.outbox.closed:
            utt.current = req
        if self._gone:                        # the client left while it was being prepared
            await self._cancel([req.id])

    def _end_text(self, utt: Utterance) -> None:
        """The utterance has all its text: close its open request; no more requests follow (then
        the answers held while it was open)."""
        if utt.current is not None:
            self.ctx.dispatch.close_text(utt.current.id)
            utt.current = None
        self._segments.put_nowait(UtteranceEnd(utt))
        for reply in self._held:
            self._segments.put_nowait(reply)
        self._held.clear()

    def _sink(self, req: Speech, ev: Event) -> None:
        """The request's EventSink: any thread -> its outbox, in order with its audio (never
        blocks, never raises); ``accepted`` arms its start timeout, ``started`` or its end disarms it."""
        req.outbox.put((EVENT, ev), terminal=isinstance(ev, (Done, ErrorEvent)))
        if isinstance(ev, Accepted) and self.ctx.start_timeout_s > 0:
            self._on_loop(self._arm, req)
        elif isinstance(ev, (Started, Done, ErrorEvent)):
            self._on_loop(self._disarm, req)

    def _audio(self, utt: Utterance, req: Speech) -> StreamAudio:
        """The request's AudioSink for one start (the worker thread, each time it starts)."""
        return self.stream.audio(req.id, req.outbox, on_overflow=lambda _: self._stalled(utt))

    def _stalled(self, utt: Utterance) -> None:
        """The client stopped reading (worker thread): the rest of ``utt`` is not spoken."""
        try:
            self._loop.call_soon_threadsafe(setattr, utt, "stalled", True)
        except RuntimeError:      # the loop is closed: the daemon is gone
            pass

    def _pending(self) -> list[str]:
        """Ids of its requests without their done / error yet (the loop)."""
        for rid in [rid for rid, s in self._speeches.items() if s.outbox.closed]:
            del self._speeches[rid]
        return list(self._speeches)

    # ------------------------------------------------------------------ events out

    async def _write_loop(self) -> None:
        out = ReplyWriter(self.write_event, lambda: self._cancel(self._pending()))
        try:
            while True:
                if not await out.write(await self._segments.get()):
                    await self.stop()
                    return
        except (ConnectionError, OSError, RuntimeError) as e:
            log.debug("%s: write failed: %s", self.name, e)
        except asyncio.CancelledError:
            pass

    # ------------------------------------------------------------------ end

    async def _cancel(self, ids: list[str]) -> None:
        for rid in ids:
            s = self._speeches.get(rid)
            if s is not None and not s.outbox.closed:
                await self.ctx.dispatch.handle_request(Cancel(id=rid), lambda ev: None)

    async def stop_writing(self) -> None:
        """Before the last error of a fatal one: no more replies (:meth:`disconnect` follows)."""
        self._gone = True
        self._writer_task.cancel()
        await asyncio.gather(self._writer_task, return_exceptions=True)

    async def disconnect(self) -> None:
        """The client is gone (EOF, error, or the server stops): cancel what it left running."""
        self._gone = True
        left = self._pending()
        if left:
            log.info("%s disconnected: cancelling %s", self.name, ", ".join(left))
            await self._cancel(left)
        else:
            log.debug("%s disconnected", self.name)
        b = self.stream
        log.debug("%s: its audio held for the client peaked at %d ms (wyoming.max_buffered_ms %d), %d ms dropped",
                  self.name, ms(b.peak), ms(b.limit), ms(b.dropped))
        if self._writer_task is not asyncio.current_task():
            self._writer_task.cancel()

