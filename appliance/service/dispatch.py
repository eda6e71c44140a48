"""Request dispatch: one parsed request from any transport -> the worker, and its events.

Transport-neutral. The UNIX socket hands every line to :meth:`Dispatcher.handle_line` (which
parses it); other inputs parse their own messages into the same request dataclasses
(:data:`~appliance.service.protocol.Request`) and call :meth:`Dispatcher.handle_request`, or,
from their own thread (paho-mqtt's network thread), :meth:`Dispatcher.handle_request_threadsafe`.
Each passes its own :data:`~appliance.service.protocol.EventSink` (thread-safe, non-blocking).
Every failure becomes an ``error`` event on that sink; nothing raises back into the transport.

``normalize`` (a dry run) runs the same ``Pipeline.prepare`` as ``speak`` and answers with the
sentences it would say. ``speak``: limits and channel are checked here, then ``Pipeline.prepare`` runs on its own single
``prepare`` thread (so bad text is answered at once, even while a long request synthesizes)
concurrently with the worker thread, which drives the pipeline's ``BatchEngine``: prepare must
only read the tokenizer/normalizer, never the runner or decode state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import TYPE_CHECKING, Callable, Optional

from ..config import ServiceConfig
from ..errors import (
    ApplianceError,
    BusyError,
    CancelledError,
    RequestError,
    TextError,
    UnknownChannelError,
)
from ..text.scripts import describe
from .protocol import (
    Cancel,
    CancelDone,
    ErrorEvent,
    EventSink,
    HealthReply,
    HealthRequest,
    Normalized,
    NormalizeRequest,
    Request,
    Speak,
    StatusReply,
    StatusRequest,
    error_event,
    parse_line,
)
from .scheduler import Item

if TYPE_CHECKING:
    from ..synth.pipeline import Pipeline
    from .worker import Worker

log = logging.getLogger(__name__)


class Dispatcher:
    """Handles parsed requests for the daemon.

    Args:
        service: ``cfg.service`` (``max_line_bytes``, ``max_text_chars``, ``channels``).
        state: ``() -> str``, the daemon's state; requests are taken only while ``ready``.
        status: ``() -> StatusReply`` (``status`` requests).
        health: ``() -> HealthReply``, run on the worker thread (``health`` requests).

    Attributes:
        pipeline, worker: set by the daemon once they are loaded.
        loop: the daemon's event loop, set once it runs.
    """

    def __init__(self, service: ServiceConfig, state: Callable[[], str], status: Callable[[], StatusReply],
                 health: Callable[[], HealthReply]) -> None:
        self.max_line_bytes = service.max_line_bytes
        self.max_text_chars = service.max_text_chars
        self.channels = [c.name for c in service.channels]
        self.state = state
        self.status = status
        self.health = health
        self.pipeline: Optional[Pipeline] = None
        self.worker: Optional[Worker] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._prep = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare")

    def close(self) -> None:
        """Stop the prepare thread (a running prepare finishes in the background)."""
        self._prep.shutdown(wait=False)

    async def handle_line(self, line: bytes, sink: EventSink) -> None:
        """Parse one request line (socket) and handle it; a bad line becomes an ``error`` event."""
        try:
            req = parse_line(line, self.max_line_bytes)
        except ApplianceError as e:
            log.info("bad request line: %s", e)
            sink(error_event(e), None)
            return
        await self.handle_request(req, sink)

    def handle_request_threadsafe(self, req: Request, sink: EventSink) -> concurrent.futures.Future:
        """:meth:`handle_request` for inputs living on other threads (e.g. paho-mqtt's network
        thread): schedules it on the event loop and returns at once.

        Raises:
            BusyError: the daemon is not serving (before ready or after stop).
        """
        loop = self.loop
        if loop is None or loop.is_closed() or self.state() != "ready":
            raise BusyError(f"the daemon is {self.state()}; send the request again later")
        return asyncio.run_coroutine_threadsafe(self.handle_request(req, sink), loop)

    async def handle_request(self, req: Request, sink: EventSink) -> None:
        """Handle a parsed request (Speak, Cancel, StatusRequest, HealthRequest, NormalizeRequest)."""
        rid = req.id if isinstance(req, (Speak, Cancel, NormalizeRequest)) else None
        try:
            if isinstance(req, Speak):
                await self._speak(req, sink)
            elif isinstance(req, NormalizeRequest):
                await self._normalize(req, sink)
            elif isinstance(req, StatusRequest):
                sink(self.status(), None)
            elif isinstance(req, Cancel):
                self._cancel(req, sink)
            elif isinstance(req, HealthRequest):
                if self.state() != "ready" or self.worker is None:
                    raise BusyError(f"the daemon is {self.state()}; ask again later")
                self.worker.run_task(self.health, sink)
            else:
                raise RequestError(f"unsupported request {type(req).__name__}")
        except ApplianceError as e:
            log.info("request %s refused: %s (%s)", rid or "-", e.code, e)
            sink(error_event(e, rid), None)
        except Exception as e:
            log.exception("request %s failed", rid or "-")
            sink(error_event(e, rid), None)

    def _check_text(self, text: str) -> None:
        if self.state() != "ready" or self.worker is None or self.pipeline is None:
            raise BusyError(f"the daemon is {self.state()}; send the request again later")
        n = len(text)
        limit = self.max_text_chars
        if n > limit:
            raise TextError(f"text of {n} characters is over the limit of {limit} (service.max_text_chars); split it")
        if not text.strip():
            raise TextError("text is empty; send something to say")

    async def _normalize(self, req: NormalizeRequest, sink: EventSink) -> None:
        self._check_text(req.text)
        job = await asyncio.get_running_loop().run_in_executor(self._prep, self.pipeline.prepare,
                                                               req.synthesis_request())
        sink(Normalized(id=req.id, spoken=list(job.sentences), tokens=[int(p.size) for p in job.prompts],
                        unspeakable=list(job.unspeakable), unspeakable_names=[describe(u) for u in job.unspeakable]),
             None)

    async def _speak(self, req: Speak, sink: EventSink) -> None:
        self._check_text(req.text)
        channel = req.channel if req.channel is not None else self.channels[0]
        if channel not in self.channels:
            raise UnknownChannelError(f"unknown channel {channel!r}; configured channels: {', '.join(self.channels)}")
        loop = asyncio.get_running_loop()
        job = await loop.run_in_executor(self._prep, self.pipeline.prepare, req.synthesis_request())
        self.worker.submit(Item(speak=req, job=job, channel=channel, sink=sink))

    def _cancel(self, req: Cancel, sink: EventSink) -> None:
        if self.worker is None:
            raise BusyError(f"the daemon is {self.state()}; send the request again later")
        if req.channel is not None and req.channel not in self.channels:
            raise UnknownChannelError(f"unknown channel {req.channel!r}; configured channels: {', '.join(self.channels)}")
        items = self.worker.cancel(request_id=req.id, channel=req.channel)
        if not items:
            what = f"has id {req.id!r}" if req.id is not None else f"is on channel {req.channel!r}"
            raise RequestError(f"nothing to cancel: no queued, running or playing request {what}")
        for it in items:   # the request's own client got its event; tell a different canceller too
            if it.sink != sink:
                sink(ErrorEvent(code=CancelledError.code, message=f"request {it.id} was cancelled", id=it.id), None)
        sink(CancelDone(cancelled=len(items), ids=[it.id for it in items], id=req.id, channel=req.channel), None)
