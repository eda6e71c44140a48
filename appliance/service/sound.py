"""Sound output: one long-lived PortAudio stream per device, WAV files otherwise.

Data path per request (all PCM float32 mono)::

    worker thread                      PortAudio callback thread        watcher thread
    pcm [n] @ 24000 Hz
      -> soxr.ResampleStream -> chunk @ device rate -> FIFO of chunks -> outdata
                                                        (per device)     fires "played"
                                                                         callbacks, logs
                                                                         underruns, detects
                                                                         a dead device

* :class:`DeviceOutput` owns ONE ``sounddevice.OutputStream`` (callback mode) for one device,
  opened at start and kept running (silence when idle). Each request is a *voice* with its own
  FIFO of chunks, so a cancel drops exactly that request's unplayed audio. Voices belong to a
  *lane*: the voices of one lane play one after the other, in the order they began (requests
  of one channel never overlap). ``audio.same_device: mix`` makes each channel its own lane and
  the callback sums the lanes' current voices (hard-clipped to [-1, 1] when two or more sound
  at once; a lone voice is copied unchanged); ``serialize`` puts every channel of the device in
  one lane, so a second channel's request waits until the first one has played out. Samples of
  two requests are never interleaved.
* :class:`AudioOutput` decides where audio goes (``audio.output``: ``device``, ``wav`` or
  ``auto`` = device if PortAudio lists an output device, else WAV; the log says which and why),
  maps channels to devices (``channels[].device`` or ``audio.device``, matched as a
  case-insensitive substring of the PortAudio name) and hands out one :class:`RequestAudio`
  per request.
* Resampling 24000 Hz -> device rate (``audio.sample_rate`` or the device's default rate) uses
  ``soxr.ResampleStream`` (quality ``HQ``), one stream per request; its output does not depend
  on how the PCM is chunked, so a test can resample the whole utterance in one go and compare.
* An underrun (the FIFO runs dry while a request is still being synthesized) is counted and
  logged, never fatal. A device that fails to open, stops calling back, or stops with an
  error is logged and shown in :meth:`AudioOutput.status`; a request that was going to it
  completes into a WAV file (``audio.on_device_error: wav``) holding its whole audio. The
  device is re-opened (at most every :data:`REOPEN_INTERVAL_S`, the first time that long after
  the failure) by a background thread of :class:`AudioOutput` or when a later request begins;
  playback resumes on it from the next request. With ``audio.on_device_error: wait`` a request
  whose device fails (or is down when it begins) is held instead, status shows
  ``waiting_for_device``, and it plays on the device from its start when the device is back
  (completed to WAV at shutdown if it never is).

The ``sounddevice`` import is lazy: without PortAudio, ``auto`` means WAV.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..core import SAMPLE_RATE
from ..errors import AudioDeviceError
from .wavout import WavWriter, wav_path

log = logging.getLogger(__name__)

PIPELINE_RATE = SAMPLE_RATE
"""Rate of the PCM the pipeline produces, Hz."""

REOPEN_INTERVAL_S = 5.0
"""Seconds between attempts to re-open a failed device."""

MAX_BUFFER_S = 60.0
"""Audio (seconds) a device FIFO may hold before the writer waits (back-pressure)."""


def _sounddevice():
    """Import sounddevice; AudioDeviceError if PortAudio is missing."""
    try:
        import sounddevice
    except (OSError, ImportError) as e:
        raise AudioDeviceError(f"sounddevice/PortAudio is not usable ({e}); install libportaudio2 or set audio.output: wav") from e
    return sounddevice


def list_output_devices() -> list[dict]:
    """PortAudio output devices as dicts (``index``, ``name``, ``default_samplerate``), [] without PortAudio."""
    try:
        sd = _sounddevice()
        devs = sd.query_devices()
    except Exception as e:  # PortAudio init failure is an OSError/PortAudioError
        log.debug("cannot list sound devices: %s", e)
        return []
    return [dict(d, index=i) for i, d in enumerate(devs) if d.get("max_output_channels", 0) > 0]


def find_output_device(query: Optional[str]) -> dict:
    """The output device whose name contains ``query`` (case-insensitive); None = the default.

    Raises:
        AudioDeviceError: no PortAudio, no output device, or none matching (the message lists them).
    """
    sd = _sounddevice()
    outs = list_output_devices()
    if not outs:
        raise AudioDeviceError("PortAudio lists no output device; set audio.output: wav or connect one")
    if query is None:
        try:
            idx = sd.default.device[1]
        except Exception:
            idx = -1
        for d in outs:
            if d["index"] == idx:
                return d
        return outs[0]
    q = query.lower()
    for d in outs:
        if q in d["name"].lower():
            return d
    names = ", ".join(repr(d["name"]) for d in outs)
    raise AudioDeviceError(f"no output device matches {query!r}; output devices: {names}")


class _Chunk:
    __slots__ = ("data", "pos", "on_played")

    def __init__(self, data: np.ndarray, on_played: Optional[Callable[[], None]]):
        self.data, self.pos, self.on_played = data, 0, on_played


class _Voice:
    """One request on a device: its chunks, its lane, whether it is still being written."""

    __slots__ = ("lane", "chunks", "buffered", "writing", "on_failure")

    def __init__(self, lane: object, on_failure: Callable[[str], None]):
        self.lane = lane
        self.chunks: collections.deque[_Chunk] = collections.deque()
        self.buffered = 0                # samples not yet played
        self.writing: Optional[bool] = False   # False: no audio yet; True: streaming; None: ended
        self.on_failure = on_failure


class DeviceOutput:
    """One long-lived output stream on one sound device, fed from a FIFO of PCM chunks.

    Args:
        query: device name substring (None = PortAudio's default output).
        sample_rate: stream rate in Hz; None = the device's default rate.
        latency_ms: requested output latency (PortAudio buffer), ms.
        mode: ``mix`` (lanes sound at once, summed) or ``serialize`` (one lane for all), see
            the module docstring.

    Thread-safety: :meth:`enqueue`, :meth:`drop`, :meth:`wait_room` may be called from any
    thread; the PortAudio callback and a watcher thread run inside.
    """

    def __init__(self, query: Optional[str], sample_rate: Optional[int], latency_ms: float,
                 mode: str = "mix") -> None:
        self.query = query
        self.mode = mode
        self.want_rate = sample_rate
        self.latency_s = latency_ms / 1000.0
        self.name = query or "default"
        self.rate: int = sample_rate or 0
        self.ok = False
        self.error: Optional[str] = "not opened"
        self.underruns = 0          # a sounding voice ran dry while its request was mid-stream
        self.xruns = 0              # PortAudio reported output underflow
        self.mixed_blocks = 0       # callbacks that summed two or more voices
        self._logged_underruns = 0
        self._lock = threading.Condition()
        self._voices: dict[object, _Voice] = {}   # begin order
        self._buffered = 0          # samples queued over all voices
        self._mixbuf = np.zeros(0, np.float32)
        self._played: list[tuple[float, Callable[[], None]]] = []
        self._last_cb = 0.0
        self._stream = None
        self._closing = False
        self._dead: Optional[str] = None    # set by PortAudio's finished callback
        self._out_latency = self.latency_s  # what PortAudio granted, s
        self._last_open_attempt = 0.0
        self._open_lock = threading.Lock()
        self._watcher: Optional[threading.Thread] = None
        self._stop_watcher = threading.Event()

    # ------------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Find the device, open and start the stream.

        Raises:
            AudioDeviceError: no such device, rate refused, PortAudio error (message says which).
        """
        self._last_open_attempt = time.monotonic()
        try:
            sd = _sounddevice()
            dev = find_output_device(self.query)
            rate = self.want_rate or int(dev["default_samplerate"])
            try:
                sd.check_output_settings(device=dev["index"], samplerate=rate, channels=1, dtype="float32")
            except Exception as e:
                hint = "audio.sample_rate" if self.want_rate else "the device default rate"
                raise AudioDeviceError(f"device {dev['name']!r} refuses {rate} Hz float32 mono ({e}); change {hint}") from e
            stream = sd.OutputStream(
                device=dev["index"], samplerate=rate, channels=1, dtype="float32",
                latency=self.latency_s, callback=self._callback, finished_callback=self._finished,
            )
            with self._lock:
                self._last_cb = time.monotonic()
                self._closing = False
                self._dead = None
            stream.start()
        except AudioDeviceError as e:
            self.ok, self.error = False, str(e)
            raise
        except Exception as e:  # sounddevice.PortAudioError and friends
            self.ok, self.error = False, f"{e.__class__.__name__}: {e}"
            raise AudioDeviceError(f"cannot open sound device {self.query or 'default'!r}: {e}") from e
        self._stream, self.rate, self.name = stream, rate, dev["name"]
        self._out_latency = float(stream.latency)
        self.ok, self.error = True, None
        log.info("sound device %r open: %d Hz float32 mono, latency %.0f ms (asked %.0f ms)",
                 self.name, rate, 1000 * stream.latency, 1000 * self.latency_s)
        if self._watcher is None:
            self._stop_watcher.clear()
            self._watcher = threading.Thread(target=self._watch, name=f"sound-watch-{self.name}", daemon=True)
            self._watcher.start()

    def ensure_open(self) -> bool:
        """True if the device is usable; re-opens a failed one at most every REOPEN_INTERVAL_S."""
        with self._open_lock:      # the worker and AudioOutput's re-open thread may both ask
            if self.ok:
                return True
            if time.monotonic() - self._last_open_attempt < REOPEN_INTERVAL_S:
                return False
            try:
                self.open()
                log.info("sound device %r is back", self.name)
                return True
            except AudioDeviceError as e:
                log.warning("sound device still unusable: %s", e)
                return False

    def close(self, drain_timeout_s: float = 30.0) -> None:
        """Play what is queued (up to ``drain_timeout_s``), fire pending callbacks, close the stream."""
        deadline = time.monotonic() + drain_timeout_s
        with self._lock:
            while self.ok and self._buffered > 0 and time.monotonic() < deadline:
                self._lock.wait(0.05)
            self._closing = True
        time.sleep(self._out_latency if self.ok else 0)
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

    def begin(self, owner: object, on_failure: Callable[[str], None], lane: object = None) -> None:
        """Register a request as a voice of ``lane`` (a channel name; ignored in ``serialize``
        mode). Underruns count from its first :meth:`enqueue` until :meth:`end`;
        ``on_failure(reason)`` is called (watcher thread) if the device fails before :meth:`forget`."""
        with self._lock:
            self._voices[owner] = _Voice(None if self.mode == "serialize" else lane, on_failure)

    def end(self, owner: object) -> None:
        """The request wrote its last chunk (it stays registered for failures until played)."""
        with self._lock:
            v = self._voices.get(owner)
            if v is not None:
                v.writing = None

    def forget(self, owner: object) -> None:
        """The request was played or aborted: no more failure notifications for it."""
        with self._lock:
            v = self._voices.pop(owner, None)
            if v is not None:
                self._buffered -= v.buffered
                self._lock.notify_all()

    def enqueue(self, owner: object, data: np.ndarray, on_played: Optional[Callable[[], None]] = None) -> bool:
        """Append float32 ``[n]`` samples at :attr:`rate` to ``owner``'s voice; ``on_played``
        fires (watcher thread) about one latency after its last sample was played. False if the
        device has failed or ``owner`` is not registered."""
        with self._lock:
            v = self._voices.get(owner)
            if not self.ok or v is None:
                return False
            if v.writing is False and len(data):
                v.writing = True      # first audio: from now on a dry voice is an underrun
            v.chunks.append(_Chunk(np.ascontiguousarray(data, dtype=np.float32), on_played))
            v.buffered += len(data)
            self._buffered += len(data)
            return True

    def _sounding(self) -> list[_Voice]:
        """The voice that plays now in each lane: the first begun one that is not played out
        (ended and empty; such a voice stays registered for failures until :meth:`forget`);
        lock held."""
        seen: dict[object, _Voice] = {}
        for v in self._voices.values():
            if v.writing is None and not v.chunks:
                continue
            if v.lane not in seen:
                seen[v.lane] = v
        return list(seen.values())

    def wait_room(self, aborted: Callable[[], bool], beat: Optional[Callable[[], None]] = None,
                  owner: object = None) -> None:
        """Block while ``owner``'s voice is sounding and holds more than MAX_BUFFER_S of audio
        (returns early on abort/failure); ``beat()`` is called about every 0.1 s meanwhile.
        A voice that waits behind another in its lane is never held back (holding it would
        stall the synthesis the sounding voice needs)."""
        limit = int(MAX_BUFFER_S * max(self.rate, 1))
        while True:
            with self._lock:
                v = self._voices.get(owner) if owner is not None else None
                if v is None:
                    full = self._buffered > limit
                else:
                    full = v.buffered > limit and any(x is v for x in self._sounding())
                if not (self.ok and full and not aborted()):
                    return
                self._lock.wait(0.1)
            if beat is not None:
                beat()

    def drop(self, owner: object) -> int:
        """Remove ``owner``'s unplayed chunks (cancel); returns samples dropped."""
        with self._lock:
            v = self._voices.get(owner)
            if v is None:
                return 0
            dropped = v.buffered
            v.chunks.clear()
            v.buffered = 0
            self._buffered -= dropped
            self._lock.notify_all()
            return dropped

    def status(self) -> dict:
        """Device state for StatusReply: name, rate (Hz), ok, error, underruns, xruns, buffered_ms."""
        return {
            "device": self.name, "rate": self.rate, "ok": self.ok, "error": self.error,
            "underruns": self.underruns, "xruns": self.xruns, "mode": self.mode,
            "voices": len(self._voices),
            "buffered_ms": round(1000.0 * self._buffered / self.rate, 1) if self.rate else 0.0,
        }

    # ------------------------------------------------------------------ threads

    def _callback(self, outdata, frames, time_info, status) -> None:  # PortAudio thread
        out = outdata[:, 0]
        now = time.monotonic()
        sounding = 0
        dry = False
        with self._lock:
            self._last_cb = now
            if status.output_underflow:
                self.xruns += 1
            if len(self._mixbuf) < frames:
                self._mixbuf = np.zeros(frames, np.float32)
            played = 0
            for v in self._sounding():
                if not v.chunks:
                    dry = dry or v.writing is True
                    continue
                dst = out if sounding == 0 else self._mixbuf
                n = 0
                while n < frames and v.chunks:
                    c = v.chunks[0]
                    take = min(frames - n, len(c.data) - c.pos)
                    dst[n:n + take] = c.data[c.pos:c.pos + take]
                    c.pos += take
                    n += take
                    if c.pos == len(c.data):
                        v.chunks.popleft()
                        if c.on_played is not None:
                            self._played.append((now + self._out_latency, c.on_played))
                if n < frames:
                    dst[n:frames] = 0.0
                    dry = dry or v.writing is True
                if sounding > 0:
                    out[:frames] += self._mixbuf[:frames]
                sounding += 1
                v.buffered -= n
                played += n
            self._buffered -= played
            if dry:
                self.underruns += 1
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

    def _fail(self, reason: str) -> None:
        with self._lock:
            if not self.ok:
                return
            self.ok, self.error = False, reason
            self._last_open_attempt = time.monotonic()    # first re-open REOPEN_INTERVAL_S from now
            self._buffered = 0
            self._played.clear()
            listeners = [v.on_failure for v in self._voices.values()]
            self._voices.clear()
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
        stall_s = max(2.0, 10 * self.latency_s)
        while not self._stop_watcher.wait(0.02):
            self._fire_played()
            if self.underruns != self._logged_underruns:
                log.warning("sound device %r: %d underrun(s) so far (synthesis slower than playback)",
                            self.name, self.underruns)
                self._logged_underruns = self.underruns
            with self._lock:
                dead = self._dead if self.ok and not self._closing else None
                stalled = self.ok and not self._closing and time.monotonic() - self._last_cb > stall_s
            if dead:
                self._fail(dead)
            elif stalled:
                self._fail(f"no audio callback for {stall_s:.1f} s")


class RequestAudio:
    """Where one request's PCM goes: a device (with WAV fallback, or waiting for it) or a WAV file.

    :meth:`write` takes float32 ``[n]`` at 24000 Hz from the worker thread; :meth:`finish`
    calls ``on_done(output)`` once the audio has been played (``device:<name>``) or written
    (the WAV path), from another thread; :meth:`abort` drops what is unplayed (cancel).

    When the device fails: with ``on_device_error="wav"`` everything so far and the rest go to
    ``wav_file``; with ``"wait"`` the request keeps its PCM, ``on_wait(self)`` registers it with
    :class:`AudioOutput`, and :meth:`replay` plays it on the device again *from the start* once
    the device is back (``on_done`` fires after that; :meth:`to_wav` completes it to the file
    instead, e.g. at shutdown). ``wait_from_start=True`` creates it already waiting (the device
    was down when the request began).
    """

    def __init__(self, request_id: str, wav_file: Path, device: Optional[DeviceOutput],
                 beat: Optional[Callable[[], None]] = None, lane: object = None,
                 on_device_error: str = "wav", on_wait: Optional[Callable[["RequestAudio"], None]] = None,
                 wait_from_start: bool = False) -> None:
        self.request_id = request_id
        self.beat = beat
        self.wav_file = wav_file
        self.device = device
        self.lane = lane
        self.policy = on_device_error
        self.on_wait = on_wait
        self._lock = threading.Lock()
        self._pcm: list[np.ndarray] = []       # whole 24 kHz PCM, kept for the WAV fallback / replay
        self._wav: Optional[WavWriter] = None
        self._rs = None
        self._gen = 0                          # bumped by replay(): writes resampled before it are dropped
        self._aborted = False
        self._finished = False
        self.waiting = False                   # device failed, policy wait: held until replay()
        self._on_done: Optional[Callable[[str], None]] = None
        self.output = ""
        if device is not None:
            self.output = f"device:{device.name}"
            if wait_from_start:
                self.waiting = True
                if on_wait is not None:
                    on_wait(self)
            else:
                self._bind(device)
        else:
            self._wav = WavWriter(wav_file, PIPELINE_RATE)
            self.output = str(wav_file)

    def _bind(self, device: DeviceOutput) -> None:
        """New resampler and a voice on ``device`` (lock held or not yet shared)."""
        self._rs = None
        if device.rate != PIPELINE_RATE:
            import soxr
            self._rs = soxr.ResampleStream(PIPELINE_RATE, device.rate, 1, dtype="float32", quality="HQ")
        device.begin(self, self._device_failed, self.lane)

    def _resample(self, pcm: np.ndarray, last: bool = False) -> np.ndarray:
        if self._rs is None:
            return pcm
        return self._rs.resample_chunk(pcm, last=last)

    def write(self, pcm: np.ndarray) -> None:
        """Queue float32 ``[n]`` samples at 24000 Hz (blocks only under back-pressure)."""
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        with self._lock:
            if self._aborted:
                return
            if self._wav is not None:
                self._wav.write(pcm)
                return
            self._pcm.append(pcm)
            if self.waiting:
                return
            dev, gen = self.device, self._gen
            out = self._resample(pcm)
        if len(out):
            dev.wait_room(lambda: self._aborted, self.beat, owner=self)
            with self._lock:          # an abort() or replay() in between must not leave orphan audio queued
                if not self._aborted and not self.waiting and gen == self._gen:
                    dev.enqueue(self, out)

    def finish(self, on_done: Callable[[str], None]) -> None:
        """No more PCM; ``on_done(output)`` fires when it has been played or written."""
        with self._lock:
            if self._aborted:
                return
            self._finished = True
            if self._wav is not None:
                path = str(self._wav.close())
                self.output = path
                fire = True
            else:
                self._on_done = on_done
                fire = False
                if self.waiting:
                    return            # replay() or to_wav() completes it
                dev = self.device
                tail = self._resample(np.zeros(0, np.float32), last=True)
                played = dev.enqueue(self, tail, on_played=self._played)
        if fire:
            on_done(path)
            return
        dev.end(self)
        if not played:  # the device failed in between: the fallback fired or fires on_done
            self._device_failed(dev.error or "device failed")

    def abort(self) -> None:
        """Drop unplayed audio and any partial WAV; ``on_done`` will not fire."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            wav, self._wav = self._wav, None
        if self.device is not None:
            self.device.drop(self)
            self.device.forget(self)
        if wav is not None:
            wav.close()
            try:
                self.wav_file.unlink()
            except OSError:
                pass

    def replay(self) -> bool:
        """The device is back: play everything so far from the start (and the rest as it comes).
        Returns False if the request no longer waits (aborted, already completed)."""
        with self._lock:
            if self._aborted or not self.waiting:
                return False
            dev = self.device
            self.waiting = False
            self._gen += 1
            self._bind(dev)
            out = self._resample(np.concatenate(self._pcm) if self._pcm else np.zeros(0, np.float32))
            ok = dev.enqueue(self, out) if len(out) else True
            if self._finished and ok:
                tail = self._resample(np.zeros(0, np.float32), last=True)
                ok = dev.enqueue(self, tail, on_played=self._played)
            finished = self._finished
        log.info("request %s: sound device %r is back; playing it from the start", self.request_id, dev.name)
        if finished:
            dev.end(self)
        if not ok:
            self._device_failed(dev.error or "device failed")
        return True

    def to_wav(self) -> None:
        """Complete a waiting request into its WAV file now (shutdown)."""
        with self._lock:
            if self._aborted or not self.waiting:
                return
            self.waiting = False
        self._device_failed("the daemon stops while the device is unusable", force_wav=True)

    def _played(self) -> None:
        self.device.forget(self)
        with self._lock:
            cb, self._on_done = self._on_done, None
            aborted = self._aborted
        if cb is not None and not aborted:
            cb(self.output)

    def _device_failed(self, reason: str, force_wav: bool = False) -> None:
        """Wait for the device (policy ``wait``) or switch to WAV: everything so far goes into
        the file; on_done fires now if finished."""
        if self.policy == "wait" and not force_wav:
            with self._lock:
                if self._aborted or self.waiting or self._wav is not None:
                    return
                self.waiting = True
            log.warning("request %s: sound device failed (%s); it waits for the device (audio.on_device_error: wait)",
                        self.request_id, reason)
            if self.on_wait is not None:
                self.on_wait(self)
            return
        with self._lock:
            if self._aborted or self._wav is not None or (self.output and not self.output.startswith("device:")):
                return
            log.warning("request %s: sound device failed (%s); completing it to %s", self.request_id, reason, self.wav_file)
            try:
                self._wav = WavWriter(self.wav_file, PIPELINE_RATE)
                for p in self._pcm:
                    self._wav.write(p)
            except AudioDeviceError as e:
                log.error("request %s: WAV fallback failed too: %s", self.request_id, e)
            self._pcm = []
            self.output = str(self.wav_file)
            cb, self._on_done = self._on_done, None
            if cb is not None and self._wav is not None:
                self._wav.close()
        if cb is not None:
            cb(self.output)


class AudioOutput:
    """Routes requests to sound devices or WAV files (see the module docstring).

    Args:
        cfg: the :class:`~appliance.config.Config` (``audio`` and ``service.channels``).
    """

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.wav_dir = cfg.resolve(cfg.audio.wav_dir)
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
        """Pick the mode and open the devices of all channels (failures are logged, not raised)."""
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
            dev = DeviceOutput(q, a.sample_rate, a.latency_ms, mode=getattr(a, "same_device", "mix"))
            self.devices[q] = dev
            try:
                dev.open()
            except AudioDeviceError as e:
                log.error("audio output: channel %r: %s; its requests complete to WAV files in %s", ch.name, e, self.wav_dir)
        self._reopen = threading.Thread(target=self._reopen_failed, name="sound-reopen", daemon=True)
        self._reopen.start()

    def open(self, request_id: str, channel: str, beat: Optional[Callable[[], None]] = None) -> RequestAudio:
        """A :class:`RequestAudio` for one request on ``channel``; ``beat()`` is called while a
        write waits for room in the device FIFO (keeps the worker's heartbeat going).

        Raises:
            AudioDeviceError: the WAV file cannot be created either.
        """
        wav = wav_path(self.wav_dir, request_id)
        policy = self.cfg.audio.on_device_error
        if self.mode == "device":
            dev = self.devices.get(self._device_query(channel))
            if dev is not None and dev.ensure_open():
                return RequestAudio(request_id, wav, dev, beat, lane=channel, on_device_error=policy,
                                    on_wait=self._hold)
            if dev is not None and policy == "wait":
                log.warning("request %s: sound device %r unusable (%s); it waits for the device "
                            "(audio.on_device_error: wait)", request_id, dev.name, dev.error)
                return RequestAudio(request_id, wav, dev, beat, lane=channel, on_device_error=policy,
                                    on_wait=self._hold, wait_from_start=True)
            log.warning("request %s: sound device unusable (%s); writing %s",
                        request_id, dev.error if dev else "no device", wav)
        return RequestAudio(request_id, wav, None)

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
