"""How long a Wyoming connection may keep the box waiting, and its client waiting: the bounds
part of :class:`~appliance.transports.wyoming_handler.WyomingHandler`.

* Start timeout (``wyoming.start_timeout_s``, 5 s): a request that has not started that long
  after its text arrived (held by the throttle at ``alerts_only``, queued behind other requests
  on its channel) is answered at once with an ``error`` naming why (``throttled`` with the
  throttle's level and resource, or ``busy``) and cancelled. Home Assistant gives up after 10 s
  without a word and its satellites after about 2 s of silence; the daemon would otherwise hold
  the request up to ``service.max_hold_s`` (120 s) and speak to nobody.
* Write timeout (``wyoming.write_timeout_s``): a client that takes none of an event for that long
  (frozen, or gone without closing, its receive window full) is disconnected; the reader then
  sees the end and its requests are cancelled. TCP keepalive and ``TCP_USER_TIMEOUT``
  (:func:`~appliance.transports.wyoming_sink.keep_alive`) find an idle client that vanished.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from wyoming.event import Event as WyEvent

from ..audio.stream import EVENT
from ..errors import BusyError, ThrottledError
from ..messages.protocol import Cancel, ErrorEvent
from .wyoming_replies import Speech

log = logging.getLogger("appliance.transports.wyoming_handler")


class Bounded:
    """The mixin (module docstring); the handler has ``ctx``, ``name``, ``_loop``, ``reader``
    and ``writer``."""

    ctx: Any
    name: str
    _loop: asyncio.AbstractEventLoop
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def _on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:      # the loop is closed: the daemon is gone
            pass

    def _arm(self, req: Speech) -> None:
        if not req.started and not req.outbox.closed and req.timer is None:
            wait = max(0.0, req.born + self.ctx.start_timeout_s - self._loop.time())
            req.timer = self._loop.call_later(wait, self._not_started, req)

    def _disarm(self, req: Speech) -> None:
        req.started = True
        if req.timer is not None:
            req.timer.cancel()
            req.timer = None

    def _not_started(self, req: Speech) -> None:
        """``wyoming.start_timeout_s`` passed and ``req`` has not started: its client hears why
        (``throttled`` or ``busy``) at once and the request is cancelled."""
        req.timer = None
        if req.started or req.outbox.closed:
            return
        why = self.ctx.waiting(self.ctx.channel) if self.ctx.waiting is not None else None
        why = why.split(" (at most service.max_hold_s")[0] if why else why     # its bound here is ours
        err = ThrottledError if why and why.startswith("throttle") else BusyError
        msg = (f"the box could not start this request within {self.ctx.start_timeout_s:g} s "
               f"(wyoming.start_timeout_s): {why or 'other requests are ahead of it'}; it was cancelled")
        log.info("%s: %s not started in time: %s (%s)", self.name, req.id, why or "queued", err.code)
        req.outbox.put((EVENT, ErrorEvent(code=err.code, message=msg, id=req.id)), terminal=True)
        asyncio.ensure_future(self.ctx.dispatch.handle_request(Cancel(id=req.id), lambda ev: None))

    async def write_event(self, event: WyEvent) -> None:
        """Write one event; a client that takes none of it for ``wyoming.write_timeout_s`` is
        dropped (its requests are cancelled when the reader sees the connection end).

        Raises:
            ConnectionError: it was dropped.
        """
        try:
            await asyncio.wait_for(super().write_event(event), self.ctx.write_timeout_s)
        except asyncio.TimeoutError:
            log.info("%s: the client took no data for %g s (wyoming.write_timeout_s): disconnected, its "
                     "requests cancelled", self.name, self.ctx.write_timeout_s)
            self.writer.transport.abort()
            self.reader.feed_eof()
            raise ConnectionError("write timeout") from None



__all__ = ["Bounded"]
