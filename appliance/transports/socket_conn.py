"""One socket client connection: its event sink, its requests' client audio, one outbox for both,
written in order by its own writer task (:mod:`.socket_server` accepts and reads it).

Everything a connection sends goes through ONE :class:`~appliance.audio.stream.Outbox` on its
:class:`~appliance.audio.stream.ClientStream` (the events of all its requests and their PCM, in
the order they happened); the writer task encodes each item (an event: one JSON line; PCM: an
``audio`` event and its raw bytes in ``stream.sample_format``), writes it and waits for the drain
before the next. A client that reads nothing while more than :data:`MAX_PENDING_EVENTS` events
wait is disconnected (its requests go on).
"""

from __future__ import annotations

import asyncio
import logging
import select
from typing import Optional

from ..audio.stream import AUDIO, EVENT, ClientStream, Outbox, StreamAudio
from ..audio.wav import encode_pcm
from ..core import SAMPLE_RATE
from ..messages.protocol import AudioChunk, Event, to_json
from ..service.peers import Peer, peer_of
from .socket_limits import BadLines

log = logging.getLogger(__name__)

MAX_PENDING_EVENTS = 100_000
"""Events a connection may hold unwritten (its client reads nothing) before it is dropped."""

FLUSH = "flush"
"""An outbox item ``(FLUSH, future)`` of :meth:`Connection.flushed`: resolved once written up to it."""


class Connection:
    """One client connection: :meth:`send` is its event sink, :meth:`audio` its requests' client
    audio, one outbox for both, written by its own writer task (module docstring).

    Args:
        writer: the connection's stream writer. loop: the event loop. name: ``#N``.
        max_buffered_ms: ``service.max_buffered_ms``. sample_format: ``stream.sample_format``.
        peer: its client (None: read from the socket). bad_lines_per_min: ``service.max_bad_lines_per_min``.
    """

    def __init__(self, writer: asyncio.StreamWriter, loop: asyncio.AbstractEventLoop, name: str,
                 max_buffered_ms: int = 30000, sample_format: str = "float32", peer: Optional[Peer] = None,
                 bad_lines_per_min: int = 0) -> None:
        self.writer = writer
        self.loop = loop
        self.name = name
        self.peer = peer or peer_of(writer.get_extra_info("socket"), name)
        self.bad = BadLines(bad_lines_per_min)
        self.format = sample_format
        self.stream = ClientStream(f"socket {name}", "socket client", max_buffered_ms, "service.max_buffered_ms")
        self.outbox = Outbox(loop, self.stream)
        self.closed = False
        self.eof = False                 # the client sent EOF (half-close or gone)
        self.gone = False                # on_gone ran
        self.pending: set[str] = set()   # accepted request ids without their done/error yet
        self.writing = loop.create_task(self._write_loop(), name=f"socket {name} writer")

    def send(self, msg: Event) -> None:
        """Queue an event for this client (any thread; never blocks)."""
        if self.closed:
            return
        self.outbox.put((EVENT, msg))
        if len(self.outbox) > MAX_PENDING_EVENTS:
            log.warning("client %s is not reading (%d events pending); disconnecting it (its requests go on)",
                        self.name, len(self.outbox))
            try:
                self.loop.call_soon_threadsafe(self.close)
            except RuntimeError:  # loop closed: the daemon is gone
                self.closed = True

    def audio(self, request_id: str) -> StreamAudio:
        """The sink of one start of ``request_id``'s PCM for this client (worker thread)."""
        return self.stream.audio(request_id, self.outbox)

    async def _write_loop(self) -> None:
        """Encode and write what the outbox holds, in order, each drained before the next."""
        w = self.writer
        try:
            while not self.closed:
                item = await self.outbox.get()
                if self.closed or w.is_closing():
                    break
                if item[0] == FLUSH:         # flushed(): all before it is written
                    item[1].done() or item[1].set_result(None)
                    continue
                if item[0] == AUDIO:         # a request's PCM: its audio event and raw bytes
                    _, sink, pcm, n = item
                    data = encode_pcm(pcm, self.format)
                    w.write(to_json(AudioChunk(id=sink.request_id, bytes=len(data), rate=SAMPLE_RATE,
                                               format=self.format)) + data)
                    await w.drain()
                    sink.written(n)
                    continue
                _, msg = item
                if msg.type == "accepted":
                    self.pending.add(msg.id)
                elif msg.type in ("done", "error") and getattr(msg, "id", None) in self.pending:
                    self.pending.discard(msg.id)
                w.write(to_json(msg))
                await w.drain()
                if self.eof and not self.pending:
                    break
        except (ConnectionError, RuntimeError, OSError):
            pass
        except asyncio.CancelledError:
            return
        self.close()

    def peer_closed(self) -> bool:
        """True when the client closed its end completely (not just its write side)."""
        sock = self.writer.get_extra_info("socket")
        if sock is None or self.writer.is_closing():
            return True
        try:
            p = select.poll()
            p.register(sock.fileno(), select.POLLHUP)
            return any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in p.poll(0))
        except (OSError, ValueError):
            return True

    async def flushed(self) -> None:
        """Wait until what was queued before this call is written (or the connection closed)."""
        if not self.closed and not self.writing.done():
            mark = self.loop.create_future()
            self.outbox.put((FLUSH, mark))
            await asyncio.wait([mark, self.writing], return_when=asyncio.FIRST_COMPLETED)
        await self.writer.drain()

    def close(self) -> None:
        """Close the connection (loop thread; bytes written so far are flushed by the transport)."""
        if not self.closed:
            self.closed = True
            if self.writing is not asyncio.current_task():
                self.writing.cancel()
            try:
                self.writer.close()
            except Exception:
                pass


__all__ = ["Connection", "MAX_PENDING_EVENTS", "FLUSH"]
