"""Request dispatch: one parsed request from any transport -> the worker, and its events.

Transport-neutral. The UNIX socket hands every line to :meth:`Dispatcher.handle_line` (which
parses it); other inputs parse their own messages into the same request dataclasses
(:data:`~appliance.messages.protocol.Request`) and call :meth:`Dispatcher.handle_request`, or,
from their own thread (paho-mqtt's network thread), :meth:`Dispatcher.handle_request_threadsafe`.
Each passes its own :data:`~appliance.messages.protocol.EventSink` (thread-safe, non-blocking).
Every failure becomes an ``error`` event on that sink; nothing raises back into the transport.

``normalize`` (a dry run) runs the same ``Pipeline.prepare`` as ``speak`` and answers with the
sentences it would say. ``speak``: a client returning after a restart with the id of a replayed
request is attached to it (:meth:`~appliance.service.recovery.Recovery.attach`: ``replayed``, never
spoken twice); otherwise the state and channel are checked here, then ONE hop to the single
``prepare`` thread (:meth:`Dispatcher._accept`): ``Pipeline.prepare`` (the text's limits, its
length included, are checked there, once; bad text is answered at once, even while a long request
synthesizes; prepare only reads the tokenizer/normalizer, never the runner or decode state), the
journal (:mod:`appliance.service.journal`, fsynced), and the queue, which sends ``accepted`` and
wakes the worker: an accepted request survives a crash (except ``play: false`` ones, whose audio
only goes back to their client: not journaled). The
journal is a safety net, not a gate: a request it cannot write (disk full, read-only) is queued
all the same, its ``accepted`` saying ``not_crash_safe`` and why.

An *utterance* whose text still arrives (a Wyoming stream, a long text sent in pieces) is ONE
request: :meth:`Dispatcher.handle_request` with ``more=True`` accepts it with its first piece, then
:meth:`Dispatcher.add_text` prepares each next piece (same thread) and appends its sentences to
the running request, and :meth:`Dispatcher.close_text` ends it. It takes one queue place on its
channel. It is not journaled (its text lives in its client's connection, gone after a crash).

Socket clients (a :class:`~appliance.service.peers.Peer` each) are rate limited
(``safety.max_requests_per_s``); one that closes its connection has its requests cancelled on
channels with ``on_disconnect: cancel`` (:meth:`Dispatcher.client_gone`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING, Callable, Optional

from ..config import ServiceConfig
from ..errors import (
    ApplianceError,
    BusyError,
    CancelledError,
    JournalError,
    RequestError,
    UnknownChannelError,
)
from ..messages.protocol import (
    DEFAULT_CANCEL_SCOPE,
    Cancel,
    CancelDone,
    ErrorEvent,
    EventSink,
    HealthReply,
    HealthRequest,
    Normalized,
    NormalizeRequest,
    Speak,
    StatusReply,
    StatusRequest,
    error_event,
    parse_line,
    to_dict,
)
from ..messages.protocol import Request as Message
from ..text.scripts import describe
from .peers import Peer, RateLimiter
from .request import Request

if TYPE_CHECKING:
    from ..audio.sink import AudioSink, ClientAudio
    from ..synth.pipeline import Pipeline
    from .journal import Journal
    from .recovery import Recovery
    from .worker import Worker

log = logging.getLogger(__name__)


class Dispatcher:
    """Handles parsed requests for the daemon; built complete by :mod:`appliance.daemon.build`.

    Args:
        service: ``cfg.service`` (``max_line_bytes``, ``channels``).
        pipeline: the loaded :class:`~appliance.synth.pipeline.Pipeline` (``prepare`` only).
        worker: the started :class:`~appliance.service.worker.Worker`.
        loop: the daemon's event loop (where :meth:`handle_request_threadsafe` schedules).
        state: ``() -> str``, the daemon's state; requests are taken only while ``ready``.
        status: ``() -> StatusReply`` (``status`` requests).
        health: ``() -> HealthReply``, run on the worker thread (``health`` requests).
        limiter: the per-client :class:`~appliance.service.peers.RateLimiter` (None: no limit).
        journal, recovery: the request journal and the replay state (None: journal off).
    """

    def __init__(self, service: ServiceConfig, pipeline: Pipeline, worker: Worker,
                 loop: asyncio.AbstractEventLoop, state: Callable[[], str], status: Callable[[], StatusReply],
                 health: Callable[[], HealthReply], limiter: Optional[RateLimiter] = None,
                 journal: Optional[Journal] = None, recovery: Optional[Recovery] = None) -> None:
        self.max_line_bytes = service.max_line_bytes
        self.channels = [c.name for c in service.channels]
        self.cancel_on_disconnect = {c.name for c in service.channels if c.on_disconnect == "cancel"}
        self.limiter = limiter
        self.journal = journal
        self.recovery = recovery
        self.state = state
        self.status = status
        self.health = health
        self.pipeline = pipeline
        self.worker = worker
        self.loop = loop
        self._prep = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare")

    def close(self) -> None:
        """Stop the prepare thread (a running prepare finishes in the background)."""
        self._prep.shutdown(wait=False)

    async def handle_line(self, line: bytes, sink: EventSink, peer: Optional[Peer] = None,
                          audio_for: Optional[Callable[[str], AudioSink]] = None) -> Optional[ApplianceError]:
        """Parse one request line (socket) and handle it; a bad line becomes an ``error`` event
        (with the request's id where it had a valid one). ``speak`` and ``health`` count against
        ``peer``'s rate limit. ``audio_for(request_id)``: the connection's sink for a
        ``return_audio`` request's PCM (its client stream). Returns the error a line was refused
        with before it became a request (malformed, rate limited; answered already, logged at
        DEBUG only: the transport counts and summarises them), else None."""
        arrived = time.monotonic()
        try:
            req = parse_line(line, self.max_line_bytes)
        except ApplianceError as e:
            log.debug("bad request line%s: %s", f" from {peer}" if peer else "", e)
            sink(error_event(e, getattr(e, "request_id", None)))
            return e
        if self.limiter is not None and peer is not None and isinstance(req, (Speak, HealthRequest)):
            try:
                self.limiter.check(peer)
            except ApplianceError as e:
                log.debug("request from %s refused: %s", peer, e)
                sink(error_event(e, req.id if isinstance(req, Speak) else None))
                return e
        audio = None
        if isinstance(req, Speak) and req.return_audio and audio_for is not None:
            audio = lambda rid=req.id: audio_for(rid)   # noqa: E731 - opened by the worker at each start
        await self.handle_request(req, sink, peer=peer, arrived=arrived, audio=audio)
        return None

    def client_gone(self, sink: EventSink, peer: Optional[Peer] = None) -> None:
        """A socket client closed its connection: cancel its queued, running and playing
        requests on channels with ``on_disconnect: cancel`` (loop thread)."""
        if not self.cancel_on_disconnect:
            return
        items = self.worker.cancel(sink=sink, channels=self.cancel_on_disconnect)
        if items:
            log.info("%s went away: cancelled %s (on_disconnect: cancel)", peer or "a client",
                     ", ".join(it.id for it in items))

    def handle_request_threadsafe(self, req: Message, sink: EventSink, origin: str = "mqtt") -> concurrent.futures.Future:
        """:meth:`handle_request` for inputs living on other threads (e.g. paho-mqtt's network
        thread): schedules it on the event loop and returns at once.

        Raises:
            BusyError: the daemon is not serving (before ready or after stop).
        """
        if self.loop.is_closed() or self.state() != "ready":
            raise BusyError(f"the daemon is {self.state()}; send the request again later")
        return asyncio.run_coroutine_threadsafe(self.handle_request(req, sink, origin, arrived=time.monotonic()),
                                                self.loop)

    async def handle_request(self, req: Message, sink: EventSink, origin: str = "socket",
                             peer: Optional[Peer] = None, arrived: Optional[float] = None, more: bool = False,
                             audio: Optional[ClientAudio] = None) -> None:
        """Handle a parsed request (Speak, Cancel, StatusRequest, HealthRequest, NormalizeRequest);
        ``origin`` (``socket``, ``mqtt``) is journaled with a ``speak`` (where its events go after a
        restart). ``more``: a ``speak`` whose text goes on (:meth:`add_text`, :meth:`close_text`).
        ``audio``: how the transport opens the sink its client gets a ``speak``'s PCM through
        (:data:`~appliance.audio.sink.ClientAudio`; None: ``audio`` events, with ``return_audio``)."""
        rid = req.id if isinstance(req, (Speak, Cancel, NormalizeRequest)) else None
        try:
            if isinstance(req, Speak):
                await self._speak(req, sink, origin, peer, arrived or time.monotonic(), more, audio)
            elif isinstance(req, NormalizeRequest):
                await self._normalize(req, sink)
            elif isinstance(req, StatusRequest):
                sink(self.status())
            elif isinstance(req, Cancel):
                self._cancel(req, sink)
            elif isinstance(req, HealthRequest):
                if self.state() != "ready":
                    raise BusyError(f"the daemon is {self.state()}; ask again later")
                self.worker.run_task(self.health, sink)
            else:
                raise RequestError(f"unsupported request {type(req).__name__}")
        except ApplianceError as e:
            log.info("request %s refused: %s (%s)", rid or "-", e.code, e)
            sink(error_event(e, rid))
        except Exception as e:
            log.exception("request %s failed", rid or "-")
            sink(error_event(e, rid))

    def _check_ready(self) -> None:
        """Requests are taken only while the daemon is ready (the text's own limits, its length
        included, are :meth:`Pipeline.prepare <appliance.synth.pipeline.Pipeline.prepare>`'s)."""
        if self.state() != "ready":
            raise BusyError(f"the daemon is {self.state()}; send the request again later")

    async def _normalize(self, req: NormalizeRequest, sink: EventSink) -> None:
        self._check_ready()
        job = await asyncio.get_running_loop().run_in_executor(self._prep, self.pipeline.prepare,
                                                               req.synthesis_request())
        sink(Normalized(id=req.id, spoken=[s.text for s in job.sentences], tokens=[int(s.ids.size) for s in job.sentences],
                        steps=[s.max_steps for s in job.sentences], notes=list(job.notes),
                        unspeakable=list(job.unspeakable), unspeakable_names=[describe(u) for u in job.unspeakable]))

    async def add_text(self, req: Speak) -> bool:
        """Append the next piece of an utterance: ``req`` is its ``speak`` with ``text`` the piece
        (same id, voice, params). False when the request has ended (nothing was added).

        Raises:
            ApplianceError: the piece is refused (``TextError``: empty, too long, unspeakable).
        """
        self._check_ready()
        return await asyncio.get_running_loop().run_in_executor(
            self._prep, lambda: self.worker.add_text(req.id, self.pipeline.prepare(req)))

    def close_text(self, request_id: str) -> None:
        """The utterance ``request_id`` has all its text (a no-op once it ended)."""
        self.worker.close_text(request_id)

    async def _speak(self, req: Speak, sink: EventSink, origin: str, peer: Optional[Peer], arrived: float,
                     more: bool = False, audio: Optional[ClientAudio] = None) -> None:
        if not more and self.recovery is not None and self.recovery.attach(req, sink):
            return
        self._check_ready()
        channel = req.channel if req.channel is not None else self.channels[0]
        if channel not in self.channels:
            raise UnknownChannelError(f"unknown channel {channel!r}; configured channels: {', '.join(self.channels)}")
        if peer is not None:
            log.info("request %s from %s", req.id, peer)
        # one hop: prepared, journaled and queued on the prepare thread (the loop waits on neither
        # the text's normalization nor the journal's fsync); the worker takes it from the queue
        await asyncio.get_running_loop().run_in_executor(
            self._prep, self._accept, req, sink, channel, origin, arrived, more, audio)

    def _accept(self, req: Speak, sink: EventSink, channel: str, origin: str, arrived: float, more: bool,
                audio: Optional[ClientAudio]) -> None:
        """Prepare, journal and queue ``req`` (the prepare thread)."""
        job = self.pipeline.prepare(req)
        if more:
            job = job.opened()                      # the rest of its text comes through its feed
        item = Request(speak=req, job=job, channel=channel, sink=sink, arrived_at=arrived, client_audio=audio)
        if self.journal is not None and req.play and not more:   # play: false goes only to its client: not replayed
            self.worker.check(item)                 # refused requests are never journaled
            rec = dict(to_dict(req), channel=channel, seed=job.seed)
            try:
                item.journal = self.journal.accept(rec, origin)
            except JournalError as e:               # a safety net, not a gate: it plays, not crash-safe
                item.not_crash_safe = str(e)
                log.warning("request %s is not journaled (not crash-safe), it plays anyway: %s", req.id, e)
        self._submit(item)

    def _submit(self, item: Request) -> None:
        try:
            self.worker.submit(item)
        except ApplianceError as e:                 # refused after all (a race): not to be replayed
            if self.journal is not None and item.journal is not None:
                self.journal.end(item.journal, to_dict(error_event(e, item.id)))
            raise

    async def resubmit(self, req: Speak, channel: str, sink: EventSink, journal_n: int) -> None:
        """Queue a request replayed from the journal (already journaled as ``journal_n``), even
        before the daemon is ready (:class:`~appliance.service.recovery.Recovery`).

        Raises:
            ApplianceError: the daemon refuses it now (unknown channel, bad text, busy, ...).
        """
        if channel not in self.channels:
            raise UnknownChannelError(f"channel {channel!r} is no longer configured ({', '.join(self.channels)})")
        await asyncio.get_running_loop().run_in_executor(self._prep, lambda: self._submit(
            Request(speak=req, job=self.pipeline.prepare(req), channel=channel, sink=sink, journal=journal_n)))

    def _cancel(self, req: Cancel, sink: EventSink) -> None:
        if req.channel is not None and req.channel not in self.channels:
            raise UnknownChannelError(f"unknown channel {req.channel!r}; configured channels: {', '.join(self.channels)}")
        scope = (req.scope or DEFAULT_CANCEL_SCOPE) if req.channel is not None else None
        items = self.worker.cancel(request_id=req.id, channel=req.channel, scope=scope or DEFAULT_CANCEL_SCOPE)
        if not items:
            what = f"has id {req.id!r}" if req.id is not None else f"is on channel {req.channel!r} (scope {scope})"
            raise RequestError(f"nothing to cancel: no queued, running or playing request {what}")
        for it in items:   # the request's own client got its event; tell a different canceller too
            if it.sink != sink:
                sink(ErrorEvent(code=CancelledError.code, message=f"request {it.id} was cancelled", id=it.id))
        sink(CancelDone(cancelled=len(items), ids=[it.id for it in items], id=req.id, channel=req.channel, scope=scope))
