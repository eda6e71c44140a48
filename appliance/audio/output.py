"""Sound output routing: each request's audio goes to a sound device or to a WAV file.

Data path per request (all PCM float32 mono)::

    worker thread                      PortAudio callback thread        watcher thread
    pcm [n] @ 24000 Hz
      -> soxr.ResampleStream -> chunk @ device rate -> FIFO of chunks -> outdata
                                                        (per device)     fires "played"
                                                                         callbacks, logs
                                                                         underruns, detects
                                                                         a dead device

* :class:`AudioOutput` (here) decides where audio goes (``audio.output``: ``device``, ``wav`` or
  ``auto`` = device if PortAudio lists an output device, else WAV; the log says which and why),
  maps channels to devices (``channels[].device`` or ``audio.device``: an ALSA card id or name, or
  part of the PortAudio name, :mod:`appliance.audio.devices`) and hands out one
  :class:`~appliance.audio.request.RequestAudio` per request (resampling, WAV fallback, waiting
  for a device).
* :class:`~appliance.audio.device.DeviceOutput` owns ONE long-lived PortAudio stream per
  device; its requests are voices in lanes (:mod:`appliance.audio.mix`: ``audio.same_device``
  ``mix`` sums the channels, ``serialize`` plays whole requests one after another).
* An underrun (the FIFO runs dry while a request is still being synthesized) is counted and
  logged, never fatal.

Devices that come and go: a device that fails to open, stops calling back or stops with an error
is logged and shown (:attr:`AudioOutput.conditions`, :meth:`AudioOutput.status`). A watch thread
looks every :data:`RESCAN_S` (monotonic): while a device is down it lists the devices again
(:func:`~appliance.audio.devices.rescan`: when the ALSA cards or config changed, when a device is
busy, and at least every :data:`RELIST_S`; the streams of idle devices are closed and opened
again around it, a device with a sounding voice postpones it) and opens the device again, so a
speaker plugged back under another card index plays again within about a second or two, without a
restart. A request that starts while its device is busy retries :data:`BUSY_TRIES` times
:data:`BUSY_GAP_S` apart (the worker's heartbeat keeps beating). Then ``audio.on_device_error``
says what happens to a request whose device is down (when it starts, or when the device fails
under it):

* ``wav``: it completes into a WAV file holding its whole audio (``done`` names the file);
* ``wait``: it is held (status ``waiting_for_device``), at most ``audio.max_waiting`` per device
  (one more fails at once) and at most ``audio.max_wait_s`` each; it plays from its start when
  the device is back, else it ends ``device_lost`` (or ``device_busy``); at shutdown it completes
  to WAV;
* ``fail``: it ends at once with ``device_lost`` or ``device_busy``, naming what was looked for
  and what was found.

The route followed: ``audio.device: null`` (ALSA's ``default``) or a named ALSA / PipeWire route
may be re-pointed while the box runs (an ``.asoundrc`` rewritten, another default sink). The
watch thread lists the devices again when ALSA's configuration or card list changed
(:func:`~appliance.audio.devices.fingerprint`) and at a SIGHUP (:meth:`AudioOutput.reroute`),
as soon as no voice sounds: idle streams are closed and opened again on what the route names
now, and a stream closed while idle finds its device again when it wakes
(:mod:`appliance.audio.idle`); the log names where each stream plays
(:func:`~appliance.audio.alsa.describe`). A device whose sample formats PortAudio cannot write
gets an ALSA ``plug`` converter at such a listing (:mod:`appliance.audio.alsa`).

A request is never reported played unless it was: ``done.output`` is ``device:<name>`` only
after its last sample was played there.

The ``sounddevice`` import is lazy: without PortAudio, ``auto`` means WAV.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Hashable, Optional

from ..config import Config
from ..core import DEGRADED, UNHEALTHY, Condition
from ..errors import AudioDeviceError, DeviceBusyError, DeviceLostError
from .device import DeviceOutput
from .devices import LOCK, add_plugs, fingerprint, list_output_devices, rescan
from .request import ClientOnlyAudio, RequestAudio
from .sink import AudioSink, TeeAudio
from .volume import Volume
from .wav import MIB, WavRetention, remove_partials, wav_path
from .wavdir import WavDirHealth

log = logging.getLogger(__name__)

RESCAN_S = 1.0
"""Seconds (monotonic) between two looks at the devices that are down."""
RELIST_S = 5.0
"""While a device is down, PortAudio's list is rebuilt at least this often (s), changed or not."""
BUSY_TRIES = 3
BUSY_GAP_S = 0.5
"""A request whose device is busy tries it this many times, this many seconds apart."""


class AudioOutput:
    """Routes requests to sound devices or WAV files (see the module docstring).

    Args:
        cfg: the :class:`~appliance.config.Config` (``audio`` and ``service.channels``).
    """

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.volume = Volume.from_config(cfg)
        self.wav_dir = cfg.resolve(cfg.audio.wav_dir)
        self.retention = WavRetention(cfg.service.wav_keep_files, int(cfg.service.wav_max_mib * MIB))
        self.wav_health = WavDirHealth(self.wav_dir)
        self.mode = "wav"
        self.reason = ""
        self.devices: dict[Optional[str], DeviceOutput] = {}
        self._stop_watch = threading.Event()
        self._watch: Optional[threading.Thread] = None
        self._waiting: list[tuple[RequestAudio, float]] = []   # on_device_error: wait: (request, deadline)
        self._wlock = threading.Lock()
        self._listed: tuple = (None, 0.0)             # (fingerprint, time.monotonic()) of the last listing
        self._since: dict[Optional[str], float] = {}  # device query -> when it was first seen down
        self._told: dict[Optional[str], str] = {}     # device query -> the fault last logged
        self._postponed = False
        self._reroute = threading.Event()             # SIGHUP: find every route again

    def _device_query(self, channel: str) -> tuple[Optional[str], str]:
        """(query, the setting it came from) for ``channel``."""
        for ch in self.cfg.service.channels:
            if ch.name == channel and ch.device is not None:
                return ch.device, f"channels[{channel}].device"
        return self.cfg.audio.device, "audio.device"

    def start(self) -> None:
        """Remove the partial WAV files a crash left (and apply the WAV retention), pick the mode
        and open the devices of all channels (failures are logged, not raised)."""
        remove_partials(self.wav_dir)
        self.retention.prune(self.wav_dir)
        a = self.cfg.audio
        if a.output == "wav":
            self.mode, self.reason = "wav", "audio.output is wav"
        elif a.output == "device":
            self.mode, self.reason = "device", "audio.output is device"
        else:
            outs = list_output_devices()
            if outs:
                self.mode = "device"
                self.reason = f"audio.output is auto and PortAudio lists {len(outs)} output device(s): " + \
                    ", ".join(repr(d["name"]) for d in outs[:5])
            else:
                self.mode = "wav"
                self.reason = "audio.output is auto and PortAudio lists no output device"
        if self.mode == "wav":
            log.info("audio output: writing one WAV file per request to %s (%s)", self.wav_dir, self.reason)
            return
        log.info("audio output: playing on the sound device (%s)", self.reason)
        for ch in self.cfg.service.channels:
            q, setting = self._device_query(ch.name)
            if q in self.devices:
                continue
            mine = [c for c in self.cfg.service.channels if self._device_query(c.name)[0] == q]
            dev = DeviceOutput(q, a.sample_rate, a.latency_ms, mode=a.same_device, setting=setting,
                               gain=self._gain, idle_close_s=a.idle_close_s,
                               preroll_ms=max(a.preroll_ms if c.preroll_ms is None else c.preroll_ms for c in mine),
                               drain_ms=max(a.drain_ms if c.drain_ms is None else c.drain_ms for c in mine))
            self.devices[q] = dev
        if add_plugs(self.devices.values()):                 # before any stream is open
            try:
                rescan()
            except AudioDeviceError as e:
                log.error("sound devices: %s", e)
        self._listed = (fingerprint(), time.monotonic())
        for q, dev in self.devices.items():
            ch = next(c for c in self.cfg.service.channels if self._device_query(c.name)[0] == q)
            try:
                dev.open()
            except AudioDeviceError as e:
                log.error("audio output: channel %r: %s; its requests: %s until it is found", ch.name, e, self._fallback())
        self._watch = threading.Thread(target=self._watch_devices, name="sound-watch-devices", daemon=True)
        self._watch.start()

    def _fallback(self) -> str:
        return {"wav": f"WAV files in {self.wav_dir}", "wait": "held (audio.on_device_error: wait)"}.get(
            self.cfg.audio.on_device_error, "refused (audio.on_device_error: fail)")

    def _gain(self, channel: Optional[Hashable]) -> float:
        return self.volume.gain(channel)      # the volume in force (use_volume swaps it whole)

    def use_volume(self, volume: Volume) -> None:
        """Take new play-out gains (a reload, SIGHUP): the next block of every device plays at them,
        the audio already queued too (any thread: one reference swapped)."""
        self.volume = volume

    def open(self, request_id: str, channel: str, beat: Optional[Callable[[], None]] = None,
             play: bool = True, client: Optional[AudioSink] = None,
             on_sounding: Optional[Callable[[], None]] = None) -> AudioSink:
        """The :class:`~appliance.audio.sink.AudioSink` of one request on ``channel``: a
        :class:`RequestAudio`; ``beat()`` is called while a write waits for room in the device
        FIFO, or a busy device is tried again (keeps the worker's heartbeat going). ``play`` False
        (``Speak.play``): nothing is played or written here: ``client`` (a transport's sink for its
        client), else a :class:`ClientOnlyAudio`. ``play`` with ``client``: a :class:`TeeAudio` of both.
        ``on_sounding()``: once its first sample was written to the device (the watcher thread).

        Raises:
            DeviceLostError, DeviceBusyError: the device is down and ``audio.on_device_error`` is
                ``fail`` (or ``wait`` with ``audio.max_waiting`` requests already waiting).
            NoSpaceError, AudioDeviceError: the WAV file cannot be created.
        """
        if not play:
            return client if client is not None else ClientOnlyAudio()
        box = self._open_box(request_id, channel, beat, on_sounding)
        return box if client is None else TeeAudio(box, client)

    def _open_box(self, request_id: str, channel: str, beat: Optional[Callable[[], None]],
                  on_sounding: Optional[Callable[[], None]] = None) -> RequestAudio:
        """The request's :class:`RequestAudio` (module docstring: device, waiting, WAV or an error)."""
        wav = wav_path(self.wav_dir, request_id)
        policy = self.cfg.audio.on_device_error
        if self.mode == "device":
            dev = self.devices.get(self._device_query(channel)[0])
            if dev is not None:
                dev.wake()            # a stream closed while idle opens again (finding its route again)
            if dev is not None and (dev.ok or self._try(dev, beat)):
                return RequestAudio(request_id, wav, dev, beat, lane=channel, on_device_error=policy,
                                    on_wait=self._hold, retention=self.retention, on_sounding=on_sounding,
                                    wav_health=self.wav_health)
            fault = dev.fault if dev is not None and dev.fault is not None else DeviceLostError("no sound device")
            if policy == "fail":
                raise type(fault)(str(fault))
            if policy == "wait" and dev is not None:
                with self._wlock:
                    n = sum(1 for ra, _ in self._waiting if ra.device is dev)
                if n >= self.cfg.audio.max_waiting:
                    raise type(fault)(f"{fault}; {n} request(s) already wait for it (audio.max_waiting)")
                log.warning("request %s waits for the device (audio.on_device_error: wait): %s", request_id, fault)
                return RequestAudio(request_id, wav, dev, beat, lane=channel, on_device_error=policy,
                                    on_wait=self._hold, wait_from_start=True, retention=self.retention,
                                    on_sounding=on_sounding, wav_health=self.wav_health)
            log.warning("request %s: writing %s: %s", request_id, wav, fault)
        return RequestAudio(request_id, wav, None, retention=self.retention, on_sounding=on_sounding,
                            wav_health=self.wav_health)

    def _try(self, dev: DeviceOutput, beat: Optional[Callable[[], None]]) -> bool:
        """Open a device that is down now (a request needs it): lists the devices again when that
        could find it, and retries a busy one (module docstring); True when it is open."""
        for i in range(BUSY_TRIES):
            if i:
                waited = time.monotonic() + BUSY_GAP_S
                while time.monotonic() < waited and not self._stop_watch.wait(min(0.1, BUSY_GAP_S)):
                    if beat is not None:
                        beat()
            self._relist(force=i > 0)
            if dev.ensure_open(force=True):
                return True
            if not isinstance(dev.fault, DeviceBusyError):
                return False
        return False

    def conditions(self) -> tuple[Condition, ...]:
        """Health's view of the devices and the WAV directory (a :data:`~appliance.core.ConditionSource`):
        per device that is down, ``device_busy`` (degraded) or ``device_missing`` (unhealthy: the
        box is mute there), naming its channels, what was looked for and found, and where their
        requests go; ``wav_unwritable`` while WAV files cannot be written in ``audio.wav_dir``
        (:mod:`~appliance.audio.wavdir`) where they are the output (unhealthy: WAV requests fail)
        or a device's fallback (``audio.on_device_error: wav``, degraded); it clears when they can."""
        out = list(self._wav_condition())
        for q, dev in list(self.devices.items()):
            fault = dev.fault
            if fault is None:
                self._since.pop(q, None)
                continue
            chans = ", ".join(c.name for c in self.cfg.service.channels if self._device_query(c.name)[0] == q)
            busy = isinstance(fault, DeviceBusyError)
            out.append(Condition("device_busy" if busy else "device_missing",
                                 f"channel {chans}: {fault}; its requests: {self._fallback()}",
                                 self._since.setdefault(q, time.monotonic()), DEGRADED if busy else UNHEALTHY))
        return tuple(out)

    def _wav_condition(self) -> tuple[Condition, ...]:
        if self.mode == "wav":
            sev, then = UNHEALTHY, "requests end with no_space or audio_device instead of being written"
        elif self.cfg.audio.on_device_error == "wav":
            sev, then = DEGRADED, "a request whose sound device fails ends with an error (audio.on_device_error: wav)"
        else:
            return ()
        c = self.wav_health.condition(sev, then)
        return () if c is None else (c,)

    def status(self, channel: str) -> dict:
        """Output state of ``channel`` for StatusReply: ``output`` (device/wav, or where its requests
        go while the device is down), ``volume_db`` (its play-out gain on the device) + device fields."""
        if self.mode == "wav":
            return {"output": "wav", "wav_dir": str(self.wav_dir)}
        dev = self.devices.get(self._device_query(channel)[0])
        failed = {"wait": "waiting for the device", "fail": "refused (device down)"}.get(
            self.cfg.audio.on_device_error, "wav (device failed)")
        st = {"output": "device" if dev is not None and dev.ok else failed,
              "volume_db": round(self.volume.db(channel), 2)}
        with self._wlock:
            st["waiting_for_device"] = sum(1 for ra, _ in self._waiting if ra.lane == channel)
        if dev is not None:
            st.update(dev.status())
            fault = dev.fault
            st["fault"] = fault.code if fault is not None else None
        return st

    def _hold(self, ra: RequestAudio) -> None:
        with self._wlock:
            self._waiting.append((ra, time.monotonic() + self.cfg.audio.max_wait_s))

    def _relist(self, force: bool = False) -> bool:
        """Rebuild PortAudio's device list when it may have changed (module docstring); False when
        nothing was done (not due, or a device with a sounding voice postpones it)."""
        with LOCK:
            fp, at = self._listed
            now_fp = fingerprint()
            if not force and now_fp == fp and time.monotonic() - at < RELIST_S:
                return False
            up = [d for d in self.devices.values() if d.ok]
            paused = [d for d in up if d.pause()]
            if len(paused) < len(up):             # a device is sounding: not now
                for d in paused:
                    d.resume()
                if not self._postponed:
                    log.info("sound devices: listing them again waits until no channel is sounding")
                self._postponed = True
                return False
            self._postponed = False
            add_plugs(self.devices.values())
            try:
                rescan()
            except AudioDeviceError as e:
                log.error("sound devices: %s", e)
            self._listed = (now_fp, time.monotonic())
            for d in paused:
                d.resume()
            return True

    def _watch_devices(self) -> None:
        """Every RESCAN_S: open the devices that are down (listing them again first when due),
        replay the requests that wait for a device that is back, end those that waited too long."""
        while not self._stop_watch.wait(RESCAN_S):
            down = [d for d in self.devices.values() if not d.ok]
            if down:
                self._relist(force=any(isinstance(d.fault, DeviceBusyError) for d in down))
            elif self._reroute.is_set() or fingerprint() != self._listed[0]:   # the route may point elsewhere
                if self._relist(force=True):
                    self._reroute.clear()
            for q, dev in list(self.devices.items()):
                if not dev.ok and not dev.ensure_open(force=True) and self._told.get(q) != str(dev.fault):
                    log.warning("sound device still down: %s", dev.fault)
                self._told[q] = "" if dev.ok else str(dev.fault)
            now = time.monotonic()
            with self._wlock:
                ready = [ra for ra, _ in self._waiting if ra.device.ok]
                late = [(ra, t) for ra, t in self._waiting if not ra.device.ok and now >= t]
                self._waiting = [(ra, t) for ra, t in self._waiting if not ra.device.ok and now < t]
            for ra in ready:
                ra.replay()
            for ra, _ in late:
                fault = ra.device.fault or DeviceLostError("the sound device is down")
                ra.give_up(type(fault)(f"request {ra.request_id} waited {self.cfg.audio.max_wait_s:g} s "
                                       f"(audio.max_wait_s) for its sound device: {fault}"))

    def reroute(self) -> None:
        """Find every device's route again (SIGHUP; any thread, returns at once): the watch thread
        re-lists the devices and re-opens the idle streams as soon as no voice sounds."""
        if self.mode == "device":
            log.info("sound devices: finding their routes again (SIGHUP)")
            self._reroute.set()

    def close(self, drain_timeout_s: float = 30.0) -> None:
        """Drain and close every device stream; requests still waiting for a device complete to WAV."""
        self._stop_watch.set()
        if self._watch is not None:
            self._watch.join(timeout=5.0)
            self._watch = None
        with self._wlock:
            waiting, self._waiting = self._waiting, []
        for ra, _ in waiting:
            ra.to_wav()
        for dev in self.devices.values():
            dev.close(drain_timeout_s)
