"""What the request core asks of a request's audio: the :class:`AudioSink` protocol.

One sink per request, opened when it starts (:meth:`~appliance.audio.output.AudioOutput.open`):
the sound device (:class:`~appliance.audio.request.RequestAudio`, with its WAV fallback), a WAV
file (the same class without a device), or nothing on the box
(:class:`~appliance.audio.request.ClientOnlyAudio`: the PCM only goes back to the client, which
gets it through the request's events as :class:`~appliance.core.PcmChunk`). Threads: ``write``
and ``release`` on the worker thread, ``abort`` from any thread, ``on_done`` on the sink's own.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class AudioSink(Protocol):
    """One request's audio on the box.

    Attributes:
        first_out_at: ``time.monotonic()`` when its first sample went out (device, file, client),
            None before.
    """

    first_out_at: Optional[float]

    def write(self, pcm: np.ndarray) -> None:
        """Take float32 ``[n]`` mono PCM at 24000 Hz, in order (may wait for room: back-pressure)."""

    def finish(self, on_done: Callable[[str], None]) -> None:
        """No more PCM: call ``on_done(output)`` (``device:<name>``, a WAV path, ``client``) once it
        is all played or written, from any thread; never after :meth:`abort`."""

    def abort(self) -> None:
        """Drop what is not played or written yet (cancel, preemption); idempotent."""

    def release(self) -> None:
        """Free what it holds (worker thread, after the request ended)."""
