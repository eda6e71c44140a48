"""Cancelling several requests' audio at once (a cancel by channel or by client).

A channel's requests are voices of one lane on their device (:mod:`appliance.audio.mix`): the
first sounds, the others wait behind it, already synthesized. Aborting them one by one in
request order removes the sounding voice first, and the next one, cancelled too but not yet
aborted, starts sounding at the device's next callback; it plays until its own abort, which may
be a journal ``fsync`` or a loaded scheduler later (a cancel by channel on a loaded machine
played 2-50 ms of the queued request after the cancelled one, which is how
``test_cancel_stops_playback_within_one_window_and_queue_full_is_busy`` once found a played
prefix 0.0153 off its one-shot synthesis). :func:`abort_all` aborts them from the back of each
lane, so a cancelled voice never becomes the sounding one.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Protocol


class Abortable(Protocol):
    """A request's audio (an :class:`~appliance.audio.sink.AudioSink`)."""

    voice: Optional[Any]

    def abort(self) -> None: ...


def abort_all(audios: Iterable[Abortable]) -> None:
    """Abort every audio of ``audios``: on each sound device in the reverse of the order its
    voices began (the voice sounding in a lane goes last), the others (WAV, client-only) first."""
    def begun(a: Abortable) -> int:
        v = a.voice
        return v.device.position(v) if v is not None else -1

    for a in sorted(audios, key=begun, reverse=True):
        a.abort()
