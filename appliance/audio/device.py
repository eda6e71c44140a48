"""One sound device: a long-lived PortAudio output stream fed from the voices' FIFOs.

:class:`DeviceOutput` owns ONE ``sounddevice.OutputStream`` (callback mode, float32 mono) for
one device, opened at start and kept running (silence when idle); its voices are fed through
:class:`~appliance.audio.feed.VoiceFeed` (its base) and mixed by :class:`~appliance.audio.mix.Lanes`.
A watcher thread fires "played" callbacks (about one output latency after a chunk's last
sample was handed to PortAudio), logs
underruns, and detects a dead device: one that stops calling back or whose stream stops with
an error. A failed device tells every voice (``on_failure``) and is opened again by
:class:`~appliance.audio.output.AudioOutput` (which re-lists the devices first when that can find
it: :mod:`appliance.audio.devices`); :attr:`DeviceOutput.fault` says what is wrong meanwhile
(``device_lost`` or ``device_busy``, naming what was looked for and what was found). For a
re-listing the stream of an idle device is closed and opened again around it
(:meth:`DeviceOutput.pause`, :meth:`DeviceOutput.resume`): its voices and FIFOs stay.

The sink's own timing (output latency, pre-roll, drain, closing an idle stream): :mod:`appliance.audio.idle`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Hashable, Optional

import numpy as np

from ..errors import AudioDeviceError, DeviceLostError
from .alsa import describe_route, pcm_of, plug_of
from .devices import LOCK, find_output_device, list_output_devices, load_sounddevice, open_error
from .feed import VoiceFeed
from .priority import raise_thread_priority
from .idle import IdleClose
from .mix import Lanes

log = logging.getLogger(__name__)

REOPEN_INTERVAL_S = 1.0
"""Seconds (monotonic) between attempts to open a failed device again."""

BURST_GAP_S = 0.004
"""Callbacks closer than this (s) belong to one device wake-up (their frames add up to a burst)."""

REBUFFER_S = 0.4
"""Audio (s) a voice that ran dry mid-stream must hold again before it resumes (one pause per
stall rather than a gap at every chunk where synthesis is slower than playback)."""

ASLEEP_POLL_S = 0.25
"""How often (s) the watcher looks at a device whose stream is closed while idle."""
MAX_REPORTED_LATENCY_S = 5.0
"""A DAC delay above this (s) is taken as a bogus timestamp, not a latency."""

BURSTS_KEPT = 15
"""Wake-ups whose median frames is the start threshold (:meth:`Lanes.mix`)."""

class DeviceOutput(VoiceFeed, IdleClose):
    """One long-lived output stream on one sound device, fed from a FIFO of PCM chunks.

    Args:
        query: device name substring (None = PortAudio's default output).
        sample_rate: stream rate in Hz; None = the device's default rate.
        latency_ms: requested output latency (PortAudio buffer), ms.
        mode: ``mix`` (lanes sound at once, summed) or ``serialize`` (one lane for all), see
            :mod:`appliance.audio.mix`.
        setting: the config key ``query`` came from (named in error messages).
        gain: ``gain(channel) -> float``, each channel's linear play-out gain, read in every block
            (:mod:`appliance.audio.volume`); None: 1.0.
        preroll_ms: silence played when the stream (re)opens, before any voice, ms.
        drain_ms: silence that must follow the last audio before the stream is closed, ms.
        idle_close_s: close the stream after this long without a voice, s (0: keep it open).

    Its voices are fed through :class:`~appliance.audio.feed.VoiceFeed`'s methods (any thread);
    the PortAudio callback and a watcher thread run inside.
    """

    def __init__(self, query: Optional[str], sample_rate: Optional[int], latency_ms: float,
                 mode: str = "mix", setting: str = "audio.device",
                 gain: Optional[Callable[[Optional[Hashable]], float]] = None, preroll_ms: float = 0.0,
                 drain_ms: float = 0.0, idle_close_s: float = 0.0) -> None:
        self.query = query
        self.preroll_s = max(0.0, preroll_ms) / 1000.0
        self.drain_s = max(0.0, drain_ms) / 1000.0
        self.idle_close_s = max(0.0, idle_close_s)
        self.asleep = False         # the stream is closed while idle (wake() opens it again)
        self.route: Optional[str] = None    # where ALSA says the PCM leads (alsa.describe)
        self._preroll = 0           # frames of silence still to play before any voice
        self._last_sound = time.monotonic()   # when audio was last handed to the device
        self._reported = 0.0        # the largest DAC delay reported since the stream opened, s
        self.setting = setting
        self._fault: Optional[AudioDeviceError] = DeviceLostError(f"sound device {query or 'default'!r} not opened yet")
        self.mode = mode
        super().__init__(Lanes(serialize=mode == "serialize", gain=gain))
        self.want_rate = sample_rate
        self.latency_s = latency_ms / 1000.0
        self.name = query or "default"
        self.rate = sample_rate or 0
        self.error: Optional[str] = "not opened"
        self.underruns = 0          # a sounding voice ran dry mid-sentence while its request was mid-stream
        self.sentence_holds = 0     # a voice held at a sentence boundary for its next sentence instead
        self.gap_frames = 0         # silence inside streaming voices (dry, re-buffering, held), frames
        self.xruns = 0              # PortAudio reported output underflow
        self.mixed_blocks = 0       # callbacks that summed two or more voices
        self._logged_underruns = 0
        self._played: list[tuple[float, Callable[[], None]]] = []
        self._last_cb = 0.0
        self._burst = 0             # frames asked in the current run of back-to-back callbacks
        self._bursts: collections.deque[int] = collections.deque(maxlen=BURSTS_KEPT)
        self.burst_frames = 0       # the median frames of the last wake-ups (start threshold)
        self._stream = None
        self._closing = False
        self._dead: Optional[str] = None    # set by PortAudio's finished callback
        self._out_latency = self.latency_s  # what PortAudio granted, s
        self._last_open_attempt = 0.0
        self._open_lock = threading.Lock()
        self._watcher: Optional[threading.Thread] = None
        self._stop_watcher = threading.Event()
        self._cb_tid = 0
        self.cb_nice: Optional[int] = None  # the callback thread's niceness once raised (None: not raised)

    # ------------------------------------------------------------------ lifecycle

    @property
    def fault(self) -> Optional[AudioDeviceError]:
        """Why the device cannot play now (a :class:`~appliance.errors.DeviceLostError` or
        :class:`~appliance.errors.DeviceBusyError` naming what was looked for and what was found,
        or another :class:`~appliance.errors.AudioDeviceError`), None while it plays. Read-only;
        health's ``device_missing`` / ``device_busy``."""
        return None if self.ok else self._fault

    def open(self) -> None:
        """Find the device (by name or ALSA card, :func:`~appliance.audio.devices.find_output_device`),
        open and start the stream.

        Raises:
            DeviceLostError: no such device; DeviceBusyError: another process holds it;
            AudioDeviceError: the rate is refused, other PortAudio errors (the message says which).
        """
        self._last_open_attempt = time.monotonic()
        try:
            with LOCK:
                stream, dev, rate = self._start_stream()
        except AudioDeviceError as e:
            self.ok, self.error, self._fault = False, str(e), e
            raise
        self._stream, self.rate, self.name = stream, rate, dev["name"]
        self._out_latency = float(stream.latency)
        self.ok, self.error = True, None
        self.route = describe_route(dev)
        log.info("sound device %r open: %d Hz float32 mono, latency %.0f ms (asked %.0f ms), pre-roll %.0f ms, "
                 "drain %.0f ms; it plays on %s", self.name, rate, 1000 * stream.latency, 1000 * self.latency_s,
                 1000 * self.preroll_s, 1000 * self.drain_s, self.route or "(ALSA cannot say)")
        if self._watcher is None:
            self._stop_watcher.clear()
            self._watcher = threading.Thread(target=self._watch, name=f"sound-watch-{self.name}", daemon=True)
            self._watcher.start()

    def _start_stream(self):
        """(stream, device dict, rate): the stream open and started (:data:`LOCK` held)."""
        sd = load_sounddevice()
        dev = find_output_device(self.query, self.setting)
        plug = plug_of(pcm_of(dev["name"]))       # formats PortAudio cannot write: through ALSA's plug
        via = next((d for d in list_output_devices() if d["name"] == plug), dev) if plug is not None else dev
        rate = self.want_rate or int(via["default_samplerate"])
        try:
            stream = sd.OutputStream(
                device=via["index"], samplerate=rate, channels=1, dtype="float32",
                latency=self.latency_s, callback=self._callback, finished_callback=self._finished,
            )
            with self._lock:
                self._last_cb = time.monotonic()
                self._closing = False
                self._dead = None
                self._preroll = round(self.preroll_s * rate)
                self._reported = 0.0
            stream.start()
        except Exception as e:  # sounddevice.PortAudioError and friends
            raise open_error(dev, rate, e, f"looked for {self.query or 'the default'!r} in {self.setting}",
                             "audio.sample_rate" if self.want_rate else "the device's default rate") from e
        return stream, dev, rate

    def pause(self) -> bool:
        """Close the stream of an idle device (no voice) for a re-listing of the devices, keeping
        it usable (:attr:`ok`); False (nothing done) when a voice is on it or its last audio has not
        drained yet. :meth:`resume` opens it again. A stream closed while idle (:attr:`asleep`) stays so."""
        with self._lock:
            if self.ok and self.asleep:
                return True
            if (not self.ok or self._stream is None or self.lanes.voices
                    or time.monotonic() - self._last_sound < self._out_latency + self.drain_s):
                return False
            self._closing = True
            stream, self._stream = self._stream, None
        try:
            stream.stop()
            stream.close()
        except Exception as e:
            log.debug("pausing sound device %r: %s", self.name, e)
        return True

    def resume(self) -> None:
        """Open the stream again after :meth:`pause` (a device that is gone meanwhile fails); one
        closed while idle stays closed until :meth:`wake`."""
        if self.asleep:
            return
        try:
            with LOCK:
                stream, dev, rate = self._start_stream()
        except AudioDeviceError as e:
            self._fail(str(e), e)
            return
        self._stream, self.name = stream, dev["name"]
        before, self.route = self.route, describe_route(dev)
        if self.route != before:
            log.info("sound device %r: its route changed; it now plays on %s", self.name, self.route or "(ALSA cannot say)")

    def ensure_open(self, force: bool = False) -> bool:
        """True if the device is usable; tries a failed one again (at most every
        :data:`REOPEN_INTERVAL_S` unless ``force``; :attr:`fault` says why not)."""
        with self._open_lock:      # the worker and AudioOutput's watch thread may both ask
            if self.ok:
                return True
            if not force and time.monotonic() - self._last_open_attempt < REOPEN_INTERVAL_S:
                return False
            try:
                self.open()
                log.info("sound device %r is back", self.name)
                return True
            except AudioDeviceError as e:
                log.debug("sound device still unusable: %s", e)
                return False

    def close(self, drain_timeout_s: float = 30.0) -> None:
        """Play what is queued (up to ``drain_timeout_s``), fire pending callbacks, close the stream."""
        deadline = time.monotonic() + drain_timeout_s
        with self._lock:
            while self.ok and self.lanes.buffered > 0 and time.monotonic() < deadline:
                self._lock.wait(0.05)
            self._closing = True
        # the last samples leave the device; a timed Event wait, not time.sleep: Python's sleep is an
        # absolute clock_nanosleep, which libfaketime (tests/test_faults_clock.py) breaks with EINVAL
        threading.Event().wait(max(0.0, self._last_sound + self._out_latency + self.drain_s - time.monotonic())
                               if self.ok and not self.asleep else 0)
        self._stop_watcher.set()
        if self._watcher is not None:
            self._watcher.join(timeout=2.0)
            self._watcher = None
        self._fire_played(force=True)
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                stream.stop()
                stream.close()
            except Exception as e:
                log.warning("closing sound device %r: %s", self.name, e)
        self.ok = False
        self.error = "closed"

    # ------------------------------------------------------------------ feeding

    def status(self) -> dict:
        """Device state for StatusReply: name, rate (Hz), ok, error, underruns (a streaming voice ran dry
        mid-sentence), sentence_holds (it held at a sentence boundary instead), underrun_ms (the
        silence both left), xruns, buffered_ms."""
        return {
            "device": self.name, "rate": self.rate, "ok": self.ok, "error": self.error,
            "underruns": self.underruns, "sentence_holds": self.sentence_holds, "xruns": self.xruns, "mode": self.mode,
            "underrun_ms": round(1000.0 * self.gap_frames / self.rate, 1) if self.rate else 0.0,
            "voices": len(self.lanes.voices), "asleep": self.asleep, "route": self.route,
            "latency_ms": round(1000.0 * max(self._out_latency, self._reported), 1),
            "preroll_ms": round(1000.0 * self.preroll_s, 1), "drain_ms": round(1000.0 * self.drain_s, 1),
            "buffered_ms": round(1000.0 * self.lanes.buffered / self.rate, 1) if self.rate else 0.0,
        }

    # ------------------------------------------------------------------ threads

    def _callback(self, outdata, frames, time_info, status) -> None:  # PortAudio thread
        out = outdata[:, 0]
        now = time.monotonic()
        if self._cb_tid != threading.get_native_id():   # a new stream's thread: above the decode threads
            self._cb_tid = threading.get_native_id()
            self.cb_nice = raise_thread_priority()
        with self._lock:
            # ALSA wakes PortAudio once per period and may ask for several blocks back to back: a
            # voice must hold a whole wake-up's worth before it starts (Lanes.mix start threshold)
            if now - self._last_cb < BURST_GAP_S:
                self._burst += frames
            else:
                if self._burst:       # a catch-up after a stall is rare: the median ignores it
                    self._bursts.append(self._burst)
                    self.burst_frames = sorted(self._bursts)[len(self._bursts) // 2]
                self._burst = frames
            self._last_cb = now
            if status.output_underflow:
                self.xruns += 1
            try:                      # the delay to the DAC the device reports now (a sink's own buffer)
                dac = float(time_info.outputBufferDacTime - time_info.currentTime)
            except Exception:  # noqa: BLE001 - no timestamps from this host API
                dac = 0.0
            if 0.0 < dac < MAX_REPORTED_LATENCY_S and dac > self._reported:
                self._reported = dac
            if self._preroll > 0:     # the sink is waking: silence first, the voices wait
                self._preroll -= frames
                out[:] = 0.0
                return
            sounding, dry, gap, played, held = self.lanes.mix(out, frames, now + max(self._out_latency, self._reported),
                                                        self._played, written_at=now,
                                                        start_frames=self.burst_frames,
                                                        rebuffer_frames=int(REBUFFER_S * self.rate))
            if sounding:
                self._last_sound = now
            self.underruns += dry
            self.sentence_holds += held
            self.gap_frames += gap
            if sounding > 1:
                self.mixed_blocks += 1
            if played:
                self._lock.notify_all()
        if sounding == 0:
            out[:] = 0.0
        elif sounding > 1:
            np.clip(out, -1.0, 1.0, out=out)

    def _finished(self) -> None:  # PortAudio thread, stream became inactive
        with self._lock:
            if not self._closing and self._dead is None:
                self._dead = "the output stream stopped unexpectedly"   # the watcher handles it

    def _fail(self, reason: str, fault: Optional[AudioDeviceError] = None) -> None:
        with self._lock:
            if not self.ok:
                return
            self.ok, self.error = False, reason
            self._fault = fault or DeviceLostError(f"sound device {self.name!r} (looked for {self.query or 'the default'!r} "
                                                   f"in {self.setting}) failed: {reason}")
            self._last_open_attempt = time.monotonic()    # first re-open REOPEN_INTERVAL_S from now
            self._played.clear()
            listeners = self.lanes.clear()
            self._lock.notify_all()
        log.error("sound device %r failed: %s; requests go to WAV until it is back", self.name, reason)
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                stream.abort()
                stream.close()
            except Exception:
                pass
        for cb in listeners:
            try:
                cb(reason)
            except Exception:
                log.exception("device-failure listener")

    def _fire_played(self, force: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            due = [cb for t, cb in self._played if force or t <= now]
            self._played = [(t, cb) for t, cb in self._played if not (force or t <= now)]
        for cb in due:
            try:
                cb()
            except Exception:
                log.exception("played callback")

    def _watch(self) -> None:
        raise_thread_priority()
        stall_s = max(2.0, 10 * self.latency_s)
        while not self._stop_watcher.wait(ASLEEP_POLL_S if self.asleep else 0.02):
            self._fire_played()
            if (self.idle_close_s and not self.asleep and not self.lanes.voices and self.ok
                    and time.monotonic() - self._last_sound >= self.idle_close_s):
                self.sleep()
            if self.underruns != self._logged_underruns:
                log.warning("sound device %r: %d underrun(s) so far, %.0f ms of silence (synthesis slower than "
                            "playback; a stalled voice re-buffers %.0f ms)", self.name, self.underruns,
                            1000.0 * self.gap_frames / max(self.rate, 1), 1000 * REBUFFER_S)
                self._logged_underruns = self.underruns
            with self._lock:
                dead = self._dead if self.ok and not self._closing else None
                stalled = self.ok and not self._closing and not self.asleep and time.monotonic() - self._last_cb > stall_s
            if dead:
                self._fail(dead)
            elif stalled:
                self._fail(f"no audio callback for {stall_s:.1f} s")

