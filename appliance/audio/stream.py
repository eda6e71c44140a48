"""One client's audio: the PCM of its requests on their way to it, bounded in audio time.

A transport that sends a request's audio back to its client gives each connection one
:class:`ClientStream` and, for each start of a request, a :class:`StreamAudio` on it: the request's
:class:`~appliance.audio.sink.AudioSink` (handed down with the request as a
:data:`~appliance.audio.sink.ClientAudio`). The request's replies go into an :class:`Outbox` (the
socket connection's, shared by its requests; a Wyoming request's own), its events (from its event
sink) and its PCM (from :meth:`StreamAudio.write`, on the worker thread) in the order they happened;
the transport's writer takes them out on the event loop, encodes them
(its only part: 16-bit ``audio-chunk`` events for Wyoming, ``audio`` events for the socket) and
writes them, calling :meth:`StreamAudio.written` once a chunk is drained::

    worker thread                              event loop (the connection's writer)
    StreamAudio.write(pcm float32 [n], 24 kHz)
      -> Outbox (AUDIO, sink, pcm, n) ---------> encode -> write + drain -> client -> written(n)
    sink(Started / Done / error) -> Outbox (EVENT, event)

**The one back-pressure rule.** Nothing on the worker thread waits for a client: ``write`` only
appends. What a connection may hold is bounded in audio time: ``max_buffered_ms`` of audio
produced for it and not yet written to its client (the chunk being written counts until its
drain returns). **At the bound**, the chunk that would go over it is refused: the request's audio
still waiting is dropped, :meth:`StreamAudio.write` raises :class:`~appliance.errors.CancelledError`,
and that request ends ``cancelled`` in the same decode step (logged with the audio waiting, dropped
and the connection's peak); the connection's other requests and every other client go on. A chunk
is always taken when nothing of the connection waits, so one chunk longer than the bound (at most
about a second of audio: ``stream.chunk_tokens``, a sentence's tail) still goes. Memory per
connection: at most ``max_buffered_ms`` of float32 audio at 24000 Hz (96 bytes per ms) plus the
transport's write buffer and the kernel's send buffer.

**Time between chunks** (a keep-alive, or a bound on the gap a streaming client may see) is a
policy of the stream, so it lives in :class:`ClientStream`: it knows when audio last went into and
out of the connection (:attr:`ClientStream.last_put_at`, :attr:`ClientStream.last_written_at`) and
is the one object both the worker and the writer touch.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from ..core import SAMPLE_RATE
from ..errors import CancelledError

log = logging.getLogger(__name__)

AUDIO, EVENT = "audio", "event"
"""Kinds of :class:`Outbox` items: ``(AUDIO, sink, pcm float32 [n], n)``, ``(EVENT, event)``."""


def ms(samples: int) -> int:
    """Samples at 24000 Hz -> whole milliseconds."""
    return samples * 1000 // SAMPLE_RATE


class ClientStream:
    """The audio one connection holds that its client has not taken yet, in samples (thread-safe).

    Args:
        name: the connection, for the log (``wyoming#3``, ``pid 4242``).
        client: how the log names its client (``Wyoming client``, ``socket client``).
        max_buffered_ms: the bound (module docstring), ms of audio. bound_key: the config key that
            sets it, named in the error.

    Attributes:
        limit: the bound in samples. buffered: held now. peak: the most held at once.
        dropped: samples thrown away (cancel, preemption, the bound exceeded).
        last_put_at, last_written_at: ``time.monotonic()`` when audio last went in / was written
            (None before): what a gap policy reads.
    """

    def __init__(self, name: str, client: str, max_buffered_ms: int, bound_key: str) -> None:
        self.name, self.client, self.bound_key = name, client, bound_key
        self.limit = max(1, int(max_buffered_ms) * SAMPLE_RATE // 1000)
        self.buffered = 0
        self.peak = 0
        self.dropped = 0
        self.last_put_at: Optional[float] = None
        self.last_written_at: Optional[float] = None
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        """Hold ``n`` more samples; False (nothing held) when that would go over :attr:`limit`
        while something is held already."""
        with self._lock:
            if self.buffered and self.buffered + n > self.limit:
                return False
            self.buffered += n
            self.peak = max(self.peak, self.buffered)
            self.last_put_at = time.monotonic()
            return True

    def give(self, n: int, dropped: bool = False) -> None:
        """``n`` held samples were written to the client (or ``dropped``)."""
        with self._lock:
            self.buffered -= n
            if dropped:
                self.dropped += n
            else:
                self.last_written_at = time.monotonic()

    def refuse(self, n: int) -> None:
        """``n`` samples were refused by :meth:`take` and thrown away."""
        with self._lock:
            self.dropped += n

    def audio(self, request_id: str, outbox: Outbox,
              on_overflow: Optional[Callable[[StreamAudio], None]] = None) -> StreamAudio:
        """A :class:`StreamAudio` for one start of request ``request_id`` on this stream."""
        return StreamAudio(request_id, self, outbox, on_overflow)


class Outbox:
    """Replies to a client, in order (module docstring): a socket connection's (all its
    requests), or one Wyoming request's. :meth:`put` from any thread, :meth:`get` on ``loop``.
    The loop is woken with at most one pending callback however many items arrive.
    :attr:`closed` turns True with its terminal event (``done`` / ``error``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: ClientStream) -> None:
        self.loop = loop
        self.stream = stream
        self.closed = False
        self._items: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._ready = asyncio.Event()
        self._wake_pending = False

    def put(self, item: tuple, terminal: bool = False) -> bool:
        """Append ``item`` (any thread); False (not added) once the terminal event is in."""
        with self._lock:
            if self.closed:
                return False
            self._items.append(item)
            self.closed = terminal
            wake, self._wake_pending = not self._wake_pending, True
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._wake)
            except RuntimeError:      # the loop is closed: the daemon is gone
                pass
        return True

    def __len__(self) -> int:
        """Items not taken yet."""
        with self._lock:
            return len(self._items)

    def _wake(self) -> None:
        with self._lock:
            self._wake_pending = False
        self._ready.set()

    async def get(self) -> tuple:
        """The next item (the event loop)."""
        while True:
            with self._lock:
                if self._items:
                    return self._items.popleft()
                self._ready.clear()         # a wake still pending runs after this, on this loop
            await self._ready.wait()

    def drop(self, sink: object) -> int:
        """Remove ``sink``'s audio not yet taken; returns the samples dropped (given back)."""
        with self._lock:
            keep = [it for it in self._items if not (it[0] == AUDIO and it[1] is sink)]
            n = sum(it[3] for it in self._items if it[0] == AUDIO and it[1] is sink)
            self._items = collections.deque(keep)
        if n:
            self.stream.give(n, dropped=True)
        return n


class StreamAudio:
    """The :class:`~appliance.audio.sink.AudioSink` of one start of a request whose audio goes to
    its client: float32 mono PCM at 24000 Hz into ``outbox``, bounded by its :class:`ClientStream`.

    Args:
        request_id: for the log and the error. stream: the connection's :class:`ClientStream`.
        outbox: the request's :class:`Outbox`.
        on_overflow: called once (worker thread, quick, never raising) when the bound is exceeded,
            before :meth:`write` raises.

    Attributes:
        first_out_at: ``time.monotonic()`` when the connection's writer wrote its first audio.
        output: ``client``, as in ``done.output``.
    """

    output = "client"
    lane = None
    voice = None          # no sound device plays it

    def __init__(self, request_id: str, stream: ClientStream, outbox: Outbox,
                 on_overflow: Optional[Callable[[StreamAudio], None]] = None) -> None:
        self.request_id = request_id
        self.stream = stream
        self.outbox = outbox
        self.on_overflow = on_overflow
        self.first_out_at: Optional[float] = None
        self.aborted = False
        self.overflowed = False
        self._lock = threading.Lock()

    def write(self, pcm: np.ndarray) -> None:
        """Queue float32 ``[n]`` at 24000 Hz for the client; never waits.

        Raises:
            CancelledError: the connection holds its bound of audio its client has not taken:
                this request's waiting audio was dropped and it must end (module docstring).
        """
        n = int(pcm.size)
        if not n:
            return
        st = self.stream
        with self._lock:
            if self.aborted:
                return
            if st.take(n):
                self.outbox.put((AUDIO, self, pcm, n))
                return
            self.aborted = self.overflowed = True
        waiting = st.buffered
        dropped = self.outbox.drop(self) + n
        st.refuse(n)
        msg = (f"request {self.request_id} was cancelled: its {st.client} stopped reading its audio "
               f"({ms(waiting)} ms waiting to be sent, {ms(n)} ms more would pass {st.bound_key} = "
               f"{ms(st.limit)})")
        log.warning("%s: %s; %d ms of its audio dropped, connection peak %d ms", st.name, msg, ms(dropped),
                    ms(st.peak), extra={"request_id": self.request_id, "buffered_ms": ms(waiting),
                                        "dropped_ms": ms(dropped), "peak_ms": ms(st.peak)})
        if self.on_overflow is not None:
            try:
                self.on_overflow(self)
            except Exception:  # noqa: BLE001 - the request must still end
                log.exception("%s: on_overflow", st.name)
        raise CancelledError(msg)

    def written(self, n: int) -> None:
        """The connection's writer wrote ``n`` of its samples to the client (the event loop)."""
        if self.first_out_at is None:
            self.first_out_at = time.monotonic()
        self.stream.give(n)

    def finish(self, on_done: Callable[[str], Any]) -> None:
        """No more PCM: ``on_done("client")`` now (the audio is handed to the connection; its
        ``done`` event follows it in the outbox); never after :meth:`abort`."""
        with self._lock:
            if self.aborted:
                return
        on_done(self.output)

    def abort(self) -> None:
        """Drop its audio the writer has not taken yet (cancel, preemption); idempotent."""
        with self._lock:
            if self.aborted:
                return
            self.aborted = True
        self.outbox.drop(self)

    def release(self) -> None:
        """Nothing native is held (the samples go with the outbox)."""
