"""The voice side of one sound device: requests' voices registered, fed, held, dropped and waited
on, each change under the device's lock.

:class:`VoiceFeed` is the base of :class:`~appliance.audio.device.DeviceOutput`, which adds the
PortAudio stream that plays the voices and the watcher that notices a dead device; the voices
and their mixing themselves are :class:`~appliance.audio.mix.Lanes`. A writer that runs far
ahead of playback waits here (:meth:`VoiceFeed.wait_room`: back-pressure).
"""

from __future__ import annotations

import threading
from typing import Callable, Hashable, Optional

import numpy as np

from .mix import Lanes

MAX_BUFFER_S = 60.0
"""Audio (seconds) a device FIFO may hold before the writer waits (back-pressure)."""


class VoiceFeed:
    """The voices of one device (:class:`~appliance.audio.mix.Lanes`) behind the device's lock.

    The subclass keeps :attr:`ok` (the device plays) and :attr:`rate` (its stream rate, Hz)
    current and notifies :attr:`_lock` when audio was played. Thread-safety: every method may be
    called from any thread.
    """

    def __init__(self, lanes: Lanes) -> None:
        self._lock = threading.Condition()
        self.lanes = lanes
        self.ok = False
        self.rate = 0

    def begin(self, owner: object, on_failure: Callable[[str], None], lane: Optional[Hashable] = None,
              on_first: Optional[Callable[[float], None]] = None, pauses: Optional[list] = None) -> None:
        """Register a request as a voice of ``lane`` (a channel name; ignored in ``serialize``
        mode). Underruns count from its first :meth:`enqueue` until :meth:`end`;
        ``on_failure(reason)`` is called (watcher thread) if the device fails before :meth:`forget`;
        ``on_first(t)`` (watcher thread) with the ``time.monotonic()`` at which its first samples
        were written to the device; its silences go to ``pauses`` (:class:`~appliance.audio.mix.Pause`)."""
        with self._lock:
            self.lanes.begin(owner, lane, on_failure, on_first, pauses)

    def end(self, owner: object) -> None:
        """The request wrote its last chunk (it stays registered for failures until played)."""
        with self._lock:
            self.lanes.end(owner)

    def forget(self, owner: object) -> None:
        """The request was played or aborted: no more failure notifications for it."""
        with self._lock:
            if self.lanes.forget(owner):
                self._lock.notify_all()

    def enqueue(self, owner: object, data: np.ndarray, on_played: Optional[Callable[[], None]] = None) -> bool:
        """Append float32 ``[n]`` samples at :attr:`rate` to ``owner``'s voice; ``on_played``
        fires (watcher thread) about one latency after its last sample was played. False if the
        device has failed or ``owner`` is not registered."""
        with self._lock:
            return self.ok and self.lanes.push(owner, data, on_played)

    def wait_room(self, aborted: Callable[[], bool], beat: Optional[Callable[[], None]] = None,
                  owner: object = None) -> None:
        """Block while ``owner``'s voice is sounding and holds more than MAX_BUFFER_S of audio
        (returns early on abort/failure); ``beat()`` is called about every 0.1 s meanwhile.
        A voice that waits behind another in its lane is never held back (holding it would
        stall the synthesis the sounding voice needs)."""
        limit = int(MAX_BUFFER_S * max(self.rate, 1))
        while True:
            with self._lock:
                if not (self.ok and self.lanes.over(owner, limit) and not aborted()):
                    return
                self._lock.wait(0.1)
            if beat is not None:
                beat()

    def voice_do(self, fn: Callable[[Lanes], None]) -> None:
        """``fn(lanes)`` under the device's lock: one change to a voice (:class:`~appliance.audio.mix.Lanes`)."""
        with self._lock:
            fn(self.lanes)

    def hold(self, owner: object, seconds: float) -> None:
        """``owner``'s voice (re)starts only once it holds ``seconds`` of audio beyond one device
        wake-up (or its request has ended): at its first start, later at its next sentence
        boundary (:meth:`Lanes.hold <appliance.audio.mix.Lanes.hold>`)."""
        with self._lock:
            self.lanes.hold(owner, round(max(0.0, seconds) * self.rate))

    def position(self, owner: object) -> int:
        """Where ``owner``'s voice is in the order voices began on this device (0 = first), -1 if
        it has none (:func:`~appliance.audio.cancel.abort_all`)."""
        with self._lock:
            for i, o in enumerate(self.lanes.voices):
                if o is owner:
                    return i
            return -1

    def drop(self, owner: object) -> int:
        """Remove ``owner``'s unplayed chunks (cancel); returns samples dropped."""
        with self._lock:
            dropped = self.lanes.drop(owner)
            self._lock.notify_all()
            return dropped
