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
  maps channels to devices (``channels[].device`` or ``audio.device``, matched as a
  case-insensitive substring of the PortAudio name) and hands out one
  :class:`~appliance.audio.request.RequestAudio` per request (resampling, WAV
  fallback, waiting for a device).
* :class:`~appliance.audio.device.DeviceOutput` owns ONE long-lived PortAudio stream per
  device; its requests are voices in lanes (:mod:`appliance.audio.mix`: ``audio.same_device``
  ``mix`` sums the channels, ``serialize`` plays whole requests one after another).
* An underrun (the FIFO runs dry while a request is still being synthesized) is counted and
  logged, never fatal. A device that fails to open, stops calling back, or stops with an
  error is logged and shown in :meth:`AudioOutput.status`; a request that was going to it
  completes into a WAV file (``audio.on_device_error: wav``) holding its whole audio. The
  device is re-opened (at most every :data:`~appliance.audio.device.REOPEN_INTERVAL_S`,
  the first time that long after the failure) by a background thread of :class:`AudioOutput`
  or when a later request begins; playback resumes on it from the next request. With
  ``audio.on_device_error: wait`` a request whose device fails (or is down when it begins) is
  held instead, status shows ``waiting_for_device``, and it plays on the device from its start
  when the device is back (completed to WAV at shutdown if it never is).

The ``sounddevice`` import is lazy: without PortAudio, ``auto`` means WAV.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from ..config import Config
from ..errors import AudioDeviceError
from .device import REOPEN_INTERVAL_S, DeviceOutput, list_output_devices
from .request import ClientOnlyAudio, RequestAudio
from .sink import AudioSink, TeeAudio
from .wav import MIB, WavRetention, remove_partials, wav_path

log = logging.getLogger(__name__)


class AudioOutput:
    """Routes requests to sound devices or WAV files (see the module docstring).

    Args:
        cfg: the :class:`~appliance.config.Config` (``audio`` and ``service.channels``).
    """

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.wav_dir = cfg.resolve(cfg.audio.wav_dir)
        self.retention = WavRetention(cfg.service.wav_keep_files, int(cfg.service.wav_max_mib * MIB))
        self.mode = "wav"
        self.reason = ""
        self.devices: dict[Optional[str], DeviceOutput] = {}
        self._stop_reopen = threading.Event()
        self._reopen: Optional[threading.Thread] = None
        self._waiting: list[RequestAudio] = []        # on_device_error: wait, until replayed
        self._wlock = threading.Lock()

    def _device_query(self, channel: str) -> Optional[str]:
        for ch in self.cfg.service.channels:
            if ch.name == channel:
                return ch.device if ch.device is not None else self.cfg.audio.device
        return self.cfg.audio.device

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
            q = self._device_query(ch.name)
            if q in self.devices:
                continue
            dev = DeviceOutput(q, a.sample_rate, a.latency_ms, mode=a.same_device)
            self.devices[q] = dev
            try:
                dev.open()
            except AudioDeviceError as e:
                log.error("audio output: channel %r: %s; its requests complete to WAV files in %s", ch.name, e, self.wav_dir)
        self._reopen = threading.Thread(target=self._reopen_failed, name="sound-reopen", daemon=True)
        self._reopen.start()

    def open(self, request_id: str, channel: str, beat: Optional[Callable[[], None]] = None,
             play: bool = True, client: Optional[AudioSink] = None,
             on_sounding: Optional[Callable[[], None]] = None) -> AudioSink:
        """The :class:`~appliance.audio.sink.AudioSink` of one request on ``channel``: a
        :class:`RequestAudio`; ``beat()`` is called while a write waits for room in the device
        FIFO (keeps the worker's heartbeat going). ``play`` False (``Speak.play``): nothing is
        played or written here: ``client`` (a transport's sink for its client), else a
        :class:`ClientOnlyAudio`. ``play`` with ``client``: a :class:`TeeAudio` of both.
        ``on_sounding()``: once its first sample was written to the device (the watcher thread).

        Raises:
            AudioDeviceError: the WAV file cannot be created either.
        """
        if not play:
            return client if client is not None else ClientOnlyAudio()
        box = self._open_box(request_id, channel, beat, on_sounding)
        return box if client is None else TeeAudio(box, client)

    def _open_box(self, request_id: str, channel: str, beat: Optional[Callable[[], None]],
                  on_sounding: Optional[Callable[[], None]] = None) -> RequestAudio:
        """The request's :class:`RequestAudio` (module docstring: device, waiting, or WAV)."""
        wav = wav_path(self.wav_dir, request_id)
        policy = self.cfg.audio.on_device_error
        if self.mode == "device":
            dev = self.devices.get(self._device_query(channel))
            if dev is not None and dev.ensure_open():
                return RequestAudio(request_id, wav, dev, beat, lane=channel, on_device_error=policy,
                                    on_wait=self._hold, retention=self.retention, on_sounding=on_sounding)
            if dev is not None and policy == "wait":
                log.warning("request %s: sound device %r unusable (%s); it waits for the device "
                            "(audio.on_device_error: wait)", request_id, dev.name, dev.error)
                return RequestAudio(request_id, wav, dev, beat, lane=channel, on_device_error=policy,
                                    on_wait=self._hold, wait_from_start=True, retention=self.retention,
                                    on_sounding=on_sounding)
            log.warning("request %s: sound device unusable (%s); writing %s",
                        request_id, dev.error if dev else "no device", wav)
        return RequestAudio(request_id, wav, None, retention=self.retention, on_sounding=on_sounding)

    def status(self, channel: str) -> dict:
        """Output state of ``channel`` for StatusReply: ``output`` (device/wav) + device fields."""
        if self.mode == "wav":
            return {"output": "wav", "wav_dir": str(self.wav_dir)}
        dev = self.devices.get(self._device_query(channel))
        failed = "waiting for the device" if self.cfg.audio.on_device_error == "wait" else "wav (device failed)"
        st = {"output": "device" if dev is not None and dev.ok else failed}
        with self._wlock:
            st["waiting_for_device"] = sum(1 for ra in self._waiting if ra.lane == channel)
        if dev is not None:
            st.update(dev.status())
        return st

    def _hold(self, ra: RequestAudio) -> None:
        with self._wlock:
            self._waiting.append(ra)

    def _reopen_failed(self) -> None:
        """Try failed devices again every REOPEN_INTERVAL_S, so that status shows a returned
        device (and it plays) without waiting for the next request; replay the requests that
        wait for a device that is back."""
        while not self._stop_reopen.wait(min(1.0, REOPEN_INTERVAL_S / 2)):
            for dev in list(self.devices.values()):
                if not dev.ok:
                    dev.ensure_open()
            with self._wlock:
                ready = [ra for ra in self._waiting if ra.device.ok]
                self._waiting = [ra for ra in self._waiting if not ra.device.ok]
            for ra in ready:
                ra.replay()

    def close(self, drain_timeout_s: float = 30.0) -> None:
        """Drain and close every device stream."""
        self._stop_reopen.set()
        if self._reopen is not None:
            self._reopen.join(timeout=5.0)
            self._reopen = None
        with self._wlock:
            waiting, self._waiting = self._waiting, []
        for ra in waiting:
            ra.to_wav()
        for dev in self.devices.values():
            dev.close(drain_timeout_s)
