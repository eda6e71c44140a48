"""A sound device's own timing: its reported output latency, pre-roll, drain, and closing its
stream while idle (:class:`IdleClose`, a base of :class:`~appliance.audio.device.DeviceOutput`).

Set by ``audio.preroll_ms`` / ``drain_ms`` / ``idle_close_s`` (the first two per channel too):

* ``done`` waits for the output latency the device reports: the larger of PortAudio's stream
  latency and the delay to the DAC it reports at each callback (``outputBufferDacTime``, from
  ALSA's ``snd_pcm_delay``: a Bluetooth or network sink's own buffer shows there);
* **idle**: a stream with no voice for ``idle_close_s`` is closed (a silent open stream costs a
  wake-up per period); the next request opens it again (:meth:`DeviceOutput.wake`), finding its
  device again (a re-pointed ``default`` plays on its new target), and plays ``preroll_ms`` of
  silence before its audio, for sinks that wake late (HDMI, Bluetooth, an amplifier in standby);
* **drain**: a stream is closed (idle, a re-listing, shutdown) only once ``drain_ms`` of silence
  has followed its last audio, for sinks that cut their last buffer when closed.

What an idle box costs with its streams open and closed: docs/using.md ("Quiet when idle").
"""

from __future__ import annotations

import logging
import time

from ..errors import AudioDeviceError
from .alsa import describe_route
from .devices import LOCK

log = logging.getLogger("appliance.audio.device")


class IdleClose:
    """:meth:`sleep` and :meth:`wake` of a :class:`~appliance.audio.device.DeviceOutput` (which
    owns every attribute used here: its stream, lock, voices, ``asleep``, ``route``, the pre-roll,
    drain and idle settings)."""

    def sleep(self) -> bool:
        """Close the stream of a device idle for :attr:`idle_close_s` (no voice, nothing pending,
        its last audio drained); it stays usable and :meth:`wake` opens it again. False: not now."""
        with LOCK:                # no re-listing meanwhile; the device's lock is not held while
            with self._lock:      # PortAudio stops the stream (it waits for the callback, which takes it)
                if (not self.ok or self.asleep or self._stream is None or self.lanes.voices or self._played
                        or time.monotonic() - self._last_sound < max(self.idle_close_s, self._out_latency + self.drain_s)):
                    return False
                self._closing = True
                stream, self._stream = self._stream, None
                self.asleep = True
            try:
                stream.stop()
                stream.close()
            except Exception as e:
                log.debug("closing idle sound device %r: %s", self.name, e)
        log.info("sound device %r idle for %.0f s: its stream is closed until the next request (pre-roll %.0f ms then)",
                 self.name, self.idle_close_s, 1000 * self.preroll_s)
        return True

    def wake(self) -> None:
        """Open the stream of a device closed while idle (a request is about to use it), finding
        its device again: a re-pointed route (``default``, an ``.asoundrc`` entry) plays on its new
        target, and the log says where. Its first :attr:`preroll_s` are silence. A device that is
        gone meanwhile fails (:attr:`fault`); a no-op unless :attr:`asleep`."""
        with self._open_lock:
            if not self.asleep:
                return
            try:
                with LOCK:
                    stream, dev, rate = self._start_stream()
            except AudioDeviceError as e:
                self.asleep = False
                self.ok = True            # so that _fail() tells, logs and sets the fault
                self._fail(str(e), e)
                return
            before = self.route
            with self._lock:
                self._stream, self.name, self.rate = stream, dev["name"], rate
                self._out_latency = float(stream.latency)
                self.asleep = False
                self._last_sound = time.monotonic()     # idle anew: not closed again before its request begins
            self.route = describe_route(dev)
            if self.route != before:
                log.info("sound device %r: the route changed while idle; it now plays on %s", self.name,
                         self.route or "(ALSA cannot say)")

