"""One request's audio: where its PCM goes, and what happens when its device fails.

The PCM (float32 mono at the pipeline's 24000 Hz) is resampled to the device rate with
``soxr.ResampleStream`` (quality ``HQ``), one stream per request; its output does not depend on
how the PCM is chunked, so a test can resample the whole utterance in one go and compare.

A :class:`RequestAudio` is on one :class:`Route` at a time::

    DEVICE  --device fails, on_device_error: wav-->  WAV      (everything so far, then the rest)
    DEVICE  --device fails, on_device_error: wait--> WAITING  --replay()--> DEVICE (from the start)
                                                              --to_wav()--> WAV    (shutdown)
                                                              --give_up()-> LOST   (waited too long)
    DEVICE  --device fails, on_device_error: fail--> LOST     (ends with the device's error)
    WAV     (no device: from the start)

and, across routes, it may be *finished* (no more PCM) and *aborted* (cancel: nothing more is
played or written, ``on_done`` never fires).

Memory: the per-request native state (the soxr resampler) and the PCM kept for the WAV fallback
are allocated on the worker thread and must be freed there too: dropped by the last reference
on the sound watcher thread (after play-out), they left glibc's per-thread heap of the worker
fragmented and the process grew by ~60 kB per request played on a device (measured: 58-96 kB
per request over 120-200 requests; WAV output flat). So the resampler is dropped in
:meth:`RequestAudio.finish` and the worker calls :meth:`RequestAudio.release` once the request
has ended (see ``Worker._settle``); after that its RSS stays flat (bench/HISTORY.md).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Hashable, Optional

import numpy as np

from ..core import SAMPLE_RATE
from ..errors import ApplianceError, DeviceLostError
from .device import REBUFFER_S, DeviceOutput
from .sink import ClientOnlyAudio, Outcome  # noqa: F401 - ClientOnlyAudio: imported from here too
from .wav import WavRetention, WavWriter
from .wavdir import WavDirHealth

log = logging.getLogger(__name__)

PIPELINE_RATE = SAMPLE_RATE
"""Rate of the PCM the pipeline produces, Hz."""


class Route(enum.Enum):
    """Where a request's audio goes now."""

    DEVICE = "device"     # queued on the sound device
    WAITING = "waiting"   # device failed or down, on_device_error: wait: PCM kept for replay()
    WAV = "wav"           # written to the request's WAV file
    LOST = "lost"         # its device is gone and nothing else takes it: it ends with that error


class RequestAudio:
    """Where one request's PCM goes: a device (with WAV fallback, or waiting for it) or a WAV file.

    :meth:`write` takes float32 ``[n]`` at 24000 Hz from the worker thread; :meth:`finish`
    calls ``on_done(output)`` once the audio has been played (``device:<name>``) or written
    (the WAV path), from another thread; :meth:`abort` drops what is unplayed (cancel).

    When the device fails: with ``on_device_error="wav"`` everything so far and the rest go to
    ``wav_file``; with ``"fail"`` it ends with the device's error (``device_lost``/``device_busy``:
    never reported played); with ``"wait"`` the request keeps its PCM, ``on_wait(self)`` registers it with
    :class:`~appliance.audio.output.AudioOutput`, and :meth:`replay` plays it on the device
    again *from the start* once the device is back (``on_done`` fires after that; :meth:`to_wav`
    completes it to the file instead, e.g. at shutdown). ``wait_from_start=True`` creates it
    already waiting (the device was down when the request began).

    A WAV file appears under ``wav_file`` only once complete (:class:`~appliance.audio.wav.WavWriter`),
    before ``on_done`` fires; ``retention`` is applied to its directory then, and ``wav_health``
    told whether it could be written. ``on_sounding()``
    is called once its first sample was written to the device (the watcher thread).

    Raises:
        NoSpaceError, AudioDeviceError: (constructor, no device) the WAV file cannot be created;
            (:meth:`write`) it cannot be written (no partial file is left under its name).
    """

    def __init__(self, request_id: str, wav_file: Path, device: Optional[DeviceOutput],
                 beat: Optional[Callable[[], None]] = None, lane: Optional[Hashable] = None,
                 on_device_error: str = "wav", on_wait: Optional[Callable[[RequestAudio], None]] = None,
                 wait_from_start: bool = False, retention: Optional[WavRetention] = None,
                 on_sounding: Optional[Callable[[], None]] = None, wav_health: Optional[WavDirHealth] = None) -> None:
        self.request_id = request_id
        self.retention = retention
        self.wav_health = wav_health
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
        self._on_done: Optional[Callable[[Outcome], None]] = None
        self._failure: Optional[ApplianceError] = None   # why its WAV fallback could not be written
        #: ``time.monotonic()`` when its first sample was written to the device or the WAV file
        self.first_out_at: Optional[float] = None
        self.on_sounding = on_sounding   # once its first sample was written to the device (watcher thread)
        self._marks: list[tuple[int, int]] = []   # (device samples queued before it, sentence): sentence starts
        self._queued = 0                       # device samples queued on its voice (this route's start)
        #: its silences on the device (:class:`~appliance.audio.mix.Pause`, samples at the device's
        #: rate): held at a sentence boundary or ran dry mid-sentence; appended by the device
        self.pauses: list = []
        if device is not None:
            self.output = f"device:{device.name}"
            if wait_from_start:
                self.route = Route.WAITING
                if on_wait is not None:
                    on_wait(self)
            else:
                self.route = Route.DEVICE
                self._bind(device)
        else:
            self.route = Route.WAV
            self._wav = WavWriter(wav_file, PIPELINE_RATE, retention, wav_health)
            self.output = str(wav_file)

    @property
    def voice(self) -> Optional[RequestAudio]:
        """Itself where it has a sound device (:class:`~appliance.audio.sink.AudioSink`), else None."""
        return self if self.device is not None else None

    def rebuffer(self, seconds: float) -> None:
        """Audio its voice must hold to resume should it run dry mid-sentence (at least the device's
        :data:`~appliance.audio.device.REBUFFER_S`): :meth:`Lanes.rebuffer <appliance.audio.mix.Lanes.rebuffer>`."""
        dev = self.device
        n = round(max(REBUFFER_S, seconds) * dev.rate)
        dev.voice_do(lambda lanes: lanes.rebuffer(self, n))

    def mark_sentence(self, k: int) -> None:
        """The PCM :meth:`write` queues next belongs to sentence ``k`` of its job (worker thread):
        where each sentence begins on the device, for :meth:`sounding_sentence`."""
        with self._lock:
            if not self._marks or self._marks[-1][1] != k:
                self._marks.append((self._queued, k))

    def sounding_sentence(self) -> int:
        """The sentence its voice plays now (the one an interruption cuts: a request resumed after
        a preemption starts again there), from the samples its voice has handed to the device;
        its first marked sentence before it sounds (0 without marks)."""
        got: list = []
        self.device.voice_do(lambda lanes: got.append(getattr(lanes.voices.get(self), "played", None)))
        played = got[0]
        with self._lock:
            marks = list(self._marks)
        if not marks:
            return 0
        if played is None:                    # played out (or never registered): its last sentence
            return marks[-1][1]
        return max((k for start, k in marks if start <= played), default=marks[0][1])

    def end_sentence_next(self) -> None:
        """The next PCM :meth:`write` queues ends a sentence: its voice may hold after it for the
        next one (:meth:`Lanes.end_sentence_next <appliance.audio.mix.Lanes.end_sentence_next>`)."""
        self.device.voice_do(lambda lanes: lanes.end_sentence_next(self))

    def _bind(self, device: DeviceOutput) -> None:
        """New resampler and a voice on ``device`` (lock held or not yet shared)."""
        self._rs = None
        if device.rate != PIPELINE_RATE:
            import soxr
            self._rs = soxr.ResampleStream(PIPELINE_RATE, device.rate, 1, dtype="float32", quality="HQ")
        device.begin(self, self._device_failed, self.lane, on_first=self._first_out, pauses=self.pauses)

    def _first_out(self, t: float) -> None:
        if self.first_out_at is None:
            self.first_out_at = t
            if self.on_sounding is not None:
                self.on_sounding()

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
            if self.route is Route.LOST:
                return
            if self.route is Route.WAV:
                if self._wav is not None:
                    self._wav.write(pcm)
                    if self.first_out_at is None and len(pcm):
                        self.first_out_at = time.monotonic()
                return
            self._pcm.append(pcm)
            if self.route is Route.WAITING:
                return
            dev, gen = self.device, self._gen
            out = self._resample(pcm)
        if len(out):
            dev.wait_room(lambda: self._aborted, self.beat, owner=self)
            with self._lock:          # an abort() or replay() in between must not leave orphan audio queued
                if not self._aborted and self.route is Route.DEVICE and gen == self._gen and dev.enqueue(self, out):
                    self._queued += len(out)

    def finish(self, on_done: Callable[[Outcome], None]) -> None:
        """No more PCM; ``on_done(outcome)`` fires when it has been played or written, or with
        the error that kept it from either (:data:`~appliance.audio.sink.Outcome`)."""
        with self._lock:
            if self._aborted:
                return
            self._finished = True
            written = self.route in (Route.WAV, Route.LOST)
            if written:
                path = self._close_wav() if self.route is Route.WAV else self._failure
            else:
                self._on_done = on_done
                if self.route is Route.WAITING:
                    return            # replay() or to_wav() completes it
                dev = self.device
                tail = self._resample(np.zeros(0, np.float32), last=True)
                self._rs = None       # freed here, on the worker thread (module docstring: Memory)
                played = dev.enqueue(self, tail, on_played=self._played)
        if written:
            on_done(path)
            return
        dev.end(self)
        if not played:  # the device failed in between: the fallback fired or fires on_done
            self._device_failed(dev.error or "device failed")

    def release(self) -> None:
        """Free the kept PCM and the resampler now (call on the worker thread, once the request
        has ended: played, written, aborted or failed; a later replay() has nothing to play)."""
        with self._lock:
            self._pcm, self._rs = [], None

    def abort(self) -> None:
        """Drop unplayed audio and any partial WAV (its ``.part`` file); ``on_done`` will not fire."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            wav, self._wav = self._wav, None
        if self.device is not None:
            self.device.drop(self)
            self.device.forget(self)
        if wav is not None:
            wav.discard()             # an unfinished file never appears under wav_file

    def replay(self) -> bool:
        """The device is back: play everything so far from the start (and the rest as it comes).
        Returns False if the request no longer waits (aborted, already completed)."""
        with self._lock:
            if self._aborted or self.route is not Route.WAITING:
                return False
            dev = self.device
            self.route = Route.DEVICE
            self._gen += 1
            self._bind(dev)
            self._marks, self._queued = [], 0          # played again from its start
            self.output = f"device:{dev.name}"         # the device as it was found again (another card index)
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

    def _close_wav(self) -> Outcome:
        """Complete the WAV file (lock held): its path, or the error that kept it from being written."""
        if self._wav is not None:
            try:
                self.output = str(self._wav.close())
            except ApplianceError as e:
                self._failure = e
            self._wav = None
        return self._failure if self._failure is not None else self.output

    def give_up(self, error: ApplianceError) -> None:
        """End a waiting request with ``error`` (it waited too long for its device): nothing is
        played or written; ``on_done(error)`` fires (now, or at :meth:`finish`)."""
        with self._lock:
            if self._aborted or self.route is not Route.WAITING:
                return
            fire = self._lose(error)
        if fire is not None:
            fire()

    def _lose(self, error: ApplianceError) -> Optional[Callable[[], None]]:
        """Route to LOST with ``error`` (lock held); returns what fires a pending ``on_done``."""
        log.warning("request %s: %s", self.request_id, error)
        self.route, self._failure, self._pcm = Route.LOST, error, []
        cb, self._on_done = self._on_done, None
        return None if cb is None else (lambda: cb(error))

    def to_wav(self) -> None:
        """Complete a waiting request into its WAV file now (shutdown)."""
        with self._lock:
            if self._aborted or self.route is not Route.WAITING:
                return
            fire = self._switch_to_wav("the daemon stops while the device is unusable")
        if fire is not None:
            fire()

    def _played(self) -> None:
        self.device.forget(self)
        with self._lock:
            cb, self._on_done = self._on_done, None
            aborted = self._aborted
            if self.route is Route.DEVICE:
                self.output = f"device:{self.device.name}"   # where it played (a re-found device may be renamed)
        if cb is not None and not aborted:
            cb(self.output)

    def _device_failed(self, reason: str) -> None:
        """The device failed while this request was on it: wait for the device (policy
        ``wait``), end with the device's error (``fail``) or switch to WAV (everything so far goes
        into the file; on_done fires now if finished)."""
        if self.policy == "fail":
            with self._lock:
                if self._aborted or self.route is not Route.DEVICE:
                    return
                fault = self.device.fault or DeviceLostError(f"sound device {self.device.name!r} failed: {reason}")
                fire = self._lose(type(fault)(f"request {self.request_id} was not played to its end: {fault}"))
            self.device.forget(self)
            if fire is not None:
                fire()
            return
        if self.policy == "wait":
            with self._lock:
                if self._aborted or self.route is not Route.DEVICE:
                    return
                self.route = Route.WAITING
            log.warning("request %s: sound device failed (%s); it waits for the device (audio.on_device_error: wait)",
                        self.request_id, reason)
            if self.on_wait is not None:
                self.on_wait(self)
            return
        with self._lock:
            if self._aborted or self.route is not Route.DEVICE:
                return
            fire = self._switch_to_wav(reason)
        if fire is not None:
            fire()

    def _switch_to_wav(self, reason: str) -> Optional[Callable[[], None]]:
        """Route to the WAV file and write the PCM so far (lock held); returns what fires the
        ``on_done`` of a finished request (its path, or the error that kept the file from being
        written: never reported as played) once the lock is released."""
        log.warning("request %s: sound device failed (%s); completing it to %s", self.request_id, reason, self.wav_file)
        self.route = Route.WAV
        try:
            self._wav = WavWriter(self.wav_file, PIPELINE_RATE, self.retention, self.wav_health)
            for p in self._pcm:
                self._wav.write(p)
        except ApplianceError as e:
            log.error("request %s: WAV fallback failed too: %s", self.request_id, e)
            self._wav, self._failure = None, e
        self._pcm = []
        self.output = str(self.wav_file)
        cb, self._on_done = self._on_done, None
        if cb is None:
            return None
        outcome = self._close_wav()
        return lambda: cb(outcome)
