"""What the request core asks of a request's audio: the :class:`AudioSink` protocol.

One sink per request, opened when it starts (:meth:`~appliance.audio.output.AudioOutput.open`):
the sound device (:class:`~appliance.audio.request.RequestAudio`, with its WAV fallback), a WAV
file (the same class without a device), or a transport's own sink for its client (a
:data:`ClientAudio` passed down with the request: a socket or Wyoming connection's
:class:`~appliance.audio.stream.StreamAudio`, bounded: the core never imports transports); with
``play`` the box's and the client's together (:class:`TeeAudio`).
(:class:`~appliance.audio.request.ClientOnlyAudio`: neither, for the core used without a transport.) Threads: ``write`` and ``release`` on the worker thread,
``abort`` from any thread, ``on_done`` on the sink's own (or the worker's).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Protocol, Union, runtime_checkable

import numpy as np

from ..errors import ApplianceError

Outcome = Union[str, ApplianceError]
"""What a sink's ``finish`` reports: where the audio went (``device:<name>``, a WAV path,
``client``), or the error that kept it from being played or written (its device was lost and
nothing else takes it: ``device_lost``; its WAV file could not be written: ``no_space``). An
error is never reported as played."""


@runtime_checkable
class AudioSink(Protocol):
    """One request's audio on the box.

    Attributes:
        first_out_at: ``time.monotonic()`` when its first sample went out (device, file, client),
            None before.
        voice: its voice on a sound device (a :class:`~appliance.audio.request.RequestAudio`
            bound to a device: what the device's ``position`` and ``hold`` take), None where no
            device sounds it (a WAV file, the client's audio). Code that deals with the device's
            voices (the start hold, the order of aborts) goes through it.
    """

    first_out_at: Optional[float]
    voice: Optional[Any]

    def write(self, pcm: np.ndarray) -> None:
        """Take float32 ``[n]`` mono PCM at 24000 Hz, in order (may wait for room: back-pressure).

        Raises:
            ApplianceError: the sink can take no more (e.g. its client stopped reading): the
                request ends with this error (its code and message), the others go on.
        """

    def finish(self, on_done: Callable[[Outcome], None]) -> None:
        """No more PCM: call ``on_done(outcome)`` (:data:`Outcome`: ``device:<name>``, a WAV path,
        ``client``, or the error that kept it from being played or written) once it is all played,
        written or given up, from any thread; never after :meth:`abort`."""

    def abort(self) -> None:
        """Drop what is not played or written yet (cancel, preemption); idempotent."""

    def release(self) -> None:
        """Free what it holds (worker thread, after the request ended)."""


ClientAudio = Callable[[], AudioSink]
"""A transport's way to open the sink of a request's client: called on the worker thread each
time the request starts (again after a preemption with ``resume``); passed down with the request
(``Dispatcher.handle_request(..., audio=...)``) the way its event sink is."""


class TeeAudio:
    """One request's audio on the box and to its client at once (``wyoming.play: true``).

    ``box`` is the sound device or WAV file (:class:`~appliance.audio.request.RequestAudio`),
    ``client`` a transport's sink. Each chunk goes to the client first (it never waits), then to the
    box (which may wait for room). ``output`` is the box's; ``on_done`` fires once both are done.
    Code that deals with the device's voice (the start hold, the order of aborts) uses ``box``.
    """

    def __init__(self, box: Any, client: AudioSink) -> None:
        self.box, self.client = box, client
        self._lock = threading.Lock()
        self._left = 2
        self._output: Optional[Outcome] = None

    @property
    def output(self) -> str:
        return self.box.output

    @property
    def lane(self) -> Any:
        return self.box.lane

    @property
    def voice(self) -> Any:
        return self.box.voice

    @property
    def first_out_at(self) -> Optional[float]:
        """The earlier of the box's and the client's first sample out."""
        got = [t for t in (self.box.first_out_at, self.client.first_out_at) if t is not None]
        return min(got) if got else None

    def write(self, pcm: np.ndarray) -> None:
        self.client.write(pcm)
        self.box.write(pcm)

    def finish(self, on_done: Callable[[Outcome], None]) -> None:
        def one(outcome: Optional[Outcome]) -> None:
            with self._lock:
                self._left -= 1
                if outcome is not None and not isinstance(self._output, ApplianceError):
                    self._output = outcome                  # the box's error wins
                last = self._left == 0
            if last:
                on_done(self._output or self.box.output)

        self.client.finish(lambda _: one(None))
        self.box.finish(one)

    def abort(self) -> None:
        self.client.abort()
        self.box.abort()

    def release(self) -> None:
        self.client.release()
        self.box.release()


class ClientOnlyAudio:
    """The audio of a request that is neither played nor written (``Speak.play`` false) and has no
    client stream (every transport that returns audio passes one: :mod:`appliance.audio.stream`;
    this is the request core used without one): its PCM goes nowhere; :meth:`finish` completes
    at once."""

    output = "client"
    lane = None
    voice = None

    def __init__(self) -> None:
        self._aborted = False
        self.first_out_at: Optional[float] = None   # the first chunk handed to the client

    def write(self, pcm: np.ndarray) -> None:
        """Nothing to play or write (module docstring of the class)."""
        if self.first_out_at is None and len(pcm):
            self.first_out_at = time.monotonic()

    def finish(self, on_done: Callable[[str], None]) -> None:
        """``on_done("client")`` now (unless aborted)."""
        if not self._aborted:
            on_done(self.output)

    def abort(self) -> None:
        self._aborted = True

    def release(self) -> None:
        """Nothing is kept (see :meth:`RequestAudio.release`)."""
