"""A Wyoming connection's audio as an :class:`~appliance.audio.sink.AudioSink`, with a bound.

Each ``speak`` request of a connection (a :class:`~appliance.transports.wyoming_replies.Speech`)
has one :class:`Outbox`: what goes back to the client for it, in the order it happened, from any
thread (its events from the request's event sink, its PCM from :class:`WyomingAudio` on the worker
thread); the connection's writer task takes the items out on the event loop and writes them
(:func:`~appliance.transports.wyoming_replies.write_utterance`)::

    worker thread                          event loop (the connection's writer)
    WyomingAudio.write(pcm float32 [n])
      -> int16 bytes -> Outbox  ---------> audio-chunk -> StreamWriter.write + drain -> client
    sink(Started / Done / error) -> Outbox

Nothing on the worker thread waits for the client: :meth:`WyomingAudio.write` only appends. What
bounds the daemon's memory is the connection's :class:`Budget` (``wyoming.max_buffered_ms``): the
audio of all its requests that was produced but not yet written to the client (the chunk being
written counts until its ``drain`` returns). A client that stops reading fills the socket's kernel
send buffer (fixed by :func:`limit_send_buffer`), then asyncio's write buffer (its high-water
mark, 64 KiB), then the budget; the chunk that would go over it is refused: the request's audio
still waiting is dropped and :meth:`WyomingAudio.write` raises
:class:`~appliance.errors.CancelledError`, which ends that request (``error`` ``cancelled``, logged
with the numbers) at once, in the same decode step. Other requests and connections go on. A chunk
is always taken when nothing of the connection waits, so a single chunk longer than the bound (a
chunk is at most about a second of audio: ``stream.chunk_tokens``, a sentence's tail) still goes.

Memory per connection: at most ``wyoming.max_buffered_ms`` of 16-bit audio at 24000 Hz (48 bytes
per ms: 1.4 MiB at the default 30000 ms) plus asyncio's 64 KiB and a few small events, and the
kernel's send buffer (:data:`SNDBUF_BYTES`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from ..audio.wav import to_int16
from ..core import SAMPLE_RATE
from ..errors import CancelledError

log = logging.getLogger(__name__)

AUDIO, EVENT = "audio", "event"
"""Kinds of :class:`Outbox` items: ``(AUDIO, sink, bytes, samples)``, ``(EVENT, event, payload)``."""


SNDBUF_BYTES = 65536
"""The kernel send buffer each Wyoming connection asks for (Linux doubles it for its bookkeeping:
128 KiB, 2.7 s of audio) instead of TCP's autotuning up to ``net.ipv4.tcp_wmem`` (4 MiB, 87 s of
audio): with autotuning a client that never read took all 30.7 s (1.4 MiB) of a six-sentence
request into the box's kernel and the bound was never met. 128 KiB still moves audio hundreds of
times faster than it plays on a LAN."""


def limit_send_buffer(writer: asyncio.StreamWriter, name: str) -> None:
    """Fix the kernel send buffer of ``writer``'s socket at :data:`SNDBUF_BYTES` (logged, never
    raised, where it cannot be set)."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF_BYTES)
    except OSError as e:
        log.debug("%s: cannot set SO_SNDBUF: %s", name, e)


def ms(samples: int) -> int:
    """Samples at 24000 Hz -> whole milliseconds."""
    return samples * 1000 // SAMPLE_RATE


class Budget:
    """The audio one connection holds that its client has not taken yet, in samples (thread-safe).

    Attributes:
        limit: ``wyoming.max_buffered_ms`` in samples. buffered: held now. peak: the most held at
            once. dropped: samples thrown away (cancel, preemption, the bound exceeded).
    """

    def __init__(self, max_buffered_ms: int) -> None:
        self.limit = max(1, int(max_buffered_ms) * SAMPLE_RATE // 1000)
        self.buffered = 0
        self.peak = 0
        self.dropped = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        """Hold ``n`` more samples; False (nothing held) when that would go over :attr:`limit`
        while something is held already."""
        with self._lock:
            if self.buffered and self.buffered + n > self.limit:
                return False
            self.buffered += n
            self.peak = max(self.peak, self.buffered)
            return True

    def give(self, n: int, dropped: bool = False) -> None:
        """``n`` held samples were written to the client (or ``dropped``)."""
        with self._lock:
            self.buffered -= n
            if dropped:
                self.dropped += n

    def refuse(self, n: int) -> None:
        """``n`` samples were refused by :meth:`take` and thrown away."""
        with self._lock:
            self.dropped += n


class Outbox:
    """One request's replies to its client, in order (module docstring): :meth:`put` from any
    thread, :meth:`get` on ``loop``. The loop is woken with at most one pending callback however
    many items arrive. :attr:`closed` turns True with its terminal event (``done`` / ``error``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, budget: Budget) -> None:
        self.loop = loop
        self.budget = budget
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
            self.budget.give(n, dropped=True)
        return n


class WyomingAudio:
    """The :class:`~appliance.audio.sink.AudioSink` of one start of a Wyoming request: its PCM goes
    to the connection as 16-bit mono at 24000 Hz, through ``outbox``, bounded by its budget.

    Args:
        request_id: for the log and the error. conn: the connection's name (``wyoming#N``).
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

    def __init__(self, request_id: str, conn: str, outbox: Outbox,
                 on_overflow: Optional[Callable[[WyomingAudio], None]] = None) -> None:
        self.request_id = request_id
        self.conn = conn
        self.outbox = outbox
        self.on_overflow = on_overflow
        self.first_out_at: Optional[float] = None
        self.on_sounding: Optional[Callable[[], None]] = None   # set by the worker; nothing sounds here
        self.aborted = False
        self.overflowed = False
        self._lock = threading.Lock()

    def write(self, pcm: np.ndarray) -> None:
        """Queue float32 ``[n]`` at 24000 Hz for the client; never waits.

        Raises:
            CancelledError: the connection holds ``wyoming.max_buffered_ms`` of audio its client
                has not taken: this request's waiting audio was dropped and it must end.
        """
        data = to_int16(pcm).tobytes()
        n = len(data) // 2
        if not n:
            return
        budget = self.outbox.budget
        with self._lock:
            if self.aborted:
                return
            if budget.take(n):
                self.outbox.put((AUDIO, self, data, n))
                return
            self.aborted = self.overflowed = True
        waiting = budget.buffered
        dropped = self.outbox.drop(self) + n
        budget.refuse(n)
        msg = (f"request {self.request_id} was cancelled: its Wyoming client stopped reading its audio "
               f"({ms(waiting)} ms waiting to be sent, {ms(n)} ms more would pass wyoming.max_buffered_ms = "
               f"{ms(budget.limit)})")
        log.warning("%s: %s; %d ms of its audio dropped, connection peak %d ms", self.conn, msg, ms(dropped),
                    ms(budget.peak), extra={"request_id": self.request_id, "buffered_ms": ms(waiting),
                                            "dropped_ms": ms(dropped), "peak_ms": ms(budget.peak)})
        if self.on_overflow is not None:
            try:
                self.on_overflow(self)
            except Exception:  # noqa: BLE001 - the request must still end
                log.exception("%s: on_overflow", self.conn)
        raise CancelledError(msg)

    def written(self, n: int) -> None:
        """The connection's writer wrote ``n`` of its samples to the client (the event loop)."""
        if self.first_out_at is None:
            self.first_out_at = time.monotonic()
        self.outbox.budget.give(n)

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
        """Nothing native is held (the bytes go with the outbox)."""


__all__ = ["Budget", "Outbox", "WyomingAudio", "AUDIO", "EVENT", "SNDBUF_BYTES", "limit_send_buffer", "ms"]
