"""The request queue and the ONE inference worker thread.

Transport-neutral: a request arrives as an :class:`Item` holding a prepared pipeline job and
an :data:`EventSink` (the socket connection today, an MQTT publisher later). The worker emits
every event of the request through that sink:

    submit() -> Accepted (before the item is queued, so it always precedes Started)
    worker   -> Started -> [AudioChunk + PCM bytes]* -> (audio played / WAV written) -> Done
                                                     or ErrorEvent (code ``cancelled``, ...)

Exactly one terminal event (``done`` or ``error``) is emitted per accepted request
(:meth:`Worker._settle` is idempotent). ``done`` is sent once the audio has been *played*
(device) or the WAV file closed; the worker starts synthesizing the next request meanwhile,
and its audio queues behind on the device FIFO (never interleaved).

The queue orders by priority (``alert`` > ``normal`` > ``background``, FIFO within one);
preemption, batching across channels and admission control belong to the scheduler of the
channels issue, which replaces this class behind the same ``submit`` / ``cancel`` /
``status`` / ``stop`` methods.

Hooks (called from the worker thread; must be quick and must not raise):
``on_heartbeat()`` at least every ``heartbeat_s`` while the worker is alive and making progress
(idle wait, or each PCM chunk) – a hung synthesis stops it, so it can drive ``WATCHDOG=1``;
``on_finished(item, event)`` after each request's terminal event.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from ..errors import ApplianceError, BusyError, CancelledError, RequestError
from .protocol import PRIORITIES, Accepted, AudioChunk, Done, ErrorEvent, Speak, Started, error_event
from .wavout import to_int16

log = logging.getLogger(__name__)

EventSink = Callable[[Any, Optional[bytes]], None]
"""``sink(message, payload)``: deliver an event (protocol dataclass) and optional raw bytes
that follow it (``audio`` events). Thread-safe, never blocks on the network, never raises;
a gone client makes it a no-op."""


@dataclass(eq=False)
class Item:
    """One accepted request.

    Attributes:
        speak: the request. job: ``Pipeline.prepare(speak)``'s result. channel: resolved name.
        sink: where its events go. accepted_at: ``time.monotonic()`` at accept.
        cancel: set to stop synthesis at the next decode step.
        state: ``queued`` -> ``running`` -> ``playing`` -> ``settled``.
    """

    speak: Speak
    job: Any
    channel: str
    sink: EventSink
    accepted_at: float = field(default_factory=time.monotonic)
    cancel: threading.Event = field(default_factory=threading.Event)
    state: str = "queued"
    audio: Any = None
    first_pcm_at: Optional[float] = None

    @property
    def id(self) -> str:
        return self.speak.id


class Worker:
    """Queue + one synthesis thread.

    Args:
        pipeline: object with ``run(job, cancel)`` yielding float32 ``[n]`` PCM at 24000 Hz and
            setting ``job.stats`` (see ``appliance.tts.pipeline``).
        audio: :class:`~appliance.service.sound.AudioOutput`.
        queue_len: channel name -> most queued requests before :class:`BusyError`.
        heartbeat_s: heartbeat period, s.
        on_heartbeat, on_finished: hooks (see module docstring).
        audio_format: sample format of ``return_audio`` payloads, ``float32`` or ``int16``
            (``stream.sample_format``; little-endian, mono, 24000 Hz).
    """

    def __init__(self, pipeline: Any, audio: Any, queue_len: dict[str, int], heartbeat_s: float = 1.0,
                 on_heartbeat: Optional[Callable[[], None]] = None,
                 on_finished: Optional[Callable[[Item, Any], None]] = None,
                 audio_format: str = "float32") -> None:
        self.pipeline = pipeline
        self.audio_format = audio_format
        self.audio = audio
        self.queue_len = dict(queue_len)
        self.heartbeat_s = heartbeat_s
        self.on_heartbeat = on_heartbeat
        self.on_finished = on_finished
        self.last_rtf: Optional[float] = None
        self.last_ttfb_ms: Optional[float] = None
        self.completed = 0
        self.failed = 0
        self._cv = threading.Condition()
        self._queue: list[Item] = []
        self._tasks: list[tuple[Callable[[], Any], EventSink]] = []   # run_task(), before queued speech
        self._active: dict[str, Item] = {}     # queued, running or playing, by id
        self._current: Optional[Item] = None
        self._stopping = False
        self._last_beat = 0.0
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ control side (any thread)

    def start(self) -> None:
        """Start the worker thread."""
        self._thread = threading.Thread(target=self._loop, name="tts-worker", daemon=True)
        self._thread.start()

    def submit(self, item: Item) -> int:
        """Queue ``item``, emitting ``accepted`` first; returns its queue position (0 = next).

        Raises:
            BusyError: the daemon is stopping or the channel's queue is full.
            RequestError: a request with the same id is still queued, running or playing.
        """
        with self._cv:
            if self._stopping:
                raise BusyError("the daemon is stopping; send the request again after it restarts")
            if item.id in self._active:
                raise RequestError(f"request id {item.id!r} is already queued or running; use a new id")
            limit = self.queue_len.get(item.channel, 16)
            queued = sum(1 for q in self._queue if q.channel == item.channel)
            if queued >= limit:
                raise BusyError(f"channel {item.channel!r} has {queued} requests queued (limit {limit}, "
                                f"service.channels[].queue_len); retry later")
            rank = PRIORITIES.index(item.speak.priority)
            pos = len(self._queue)
            while pos > 0 and PRIORITIES.index(self._queue[pos - 1].speak.priority) > rank:
                pos -= 1
            item.sink(Accepted(id=item.id, channel=item.channel, queue_position=pos), None)
            self._queue.insert(pos, item)
            self._active[item.id] = item
            self._cv.notify_all()
        log.info("accepted %s on %s at queue position %d (%d chars)", item.id, item.channel, pos, len(item.speak.text))
        return pos

    def run_task(self, fn: Callable[[], Any], sink: EventSink) -> None:
        """Run ``fn()`` on the worker thread (it owns the pipeline) before the next queued request,
        and send its return value (an event) to ``sink``; an exception becomes an ``error`` event.

        Raises:
            BusyError: the daemon is stopping.
        """
        with self._cv:
            if self._stopping:
                raise BusyError("the daemon is stopping; ask again after it restarts")
            self._tasks.append((fn, sink))
            self._cv.notify_all()

    def cancel(self, request_id: Optional[str] = None, channel: Optional[str] = None) -> list[Item]:
        """Cancel a queued, running or still-playing request by id, or all on ``channel``.
        Each gets an ``error`` event with code ``cancelled`` on its own sink; returns the items."""
        with self._cv:
            targets = [it for it in self._active.values()
                       if (request_id and it.id == request_id) or (channel and it.channel == channel)]
            states = {}
            for it in targets:
                states[it] = it.state
                it.cancel.set()
                if it.state == "queued":
                    self._queue.remove(it)
        for it in targets:
            st = states[it]
            if st == "running":
                if it.audio is not None:
                    it.audio.abort()      # wakes a writer held by back-pressure; the worker settles it
            elif st in ("queued", "playing"):
                if it.audio is not None:
                    it.audio.abort()
                self._settle(it, ErrorEvent(code=CancelledError.code, message=f"request {it.id} was cancelled", id=it.id))
        if targets:
            log.info("cancelled %s", ", ".join(f"{it.id} ({states[it]})" for it in targets))
        return targets

    def status(self) -> dict:
        """Per channel: ``queued`` (count), ``active`` (running request id or None)."""
        with self._cv:
            chans = {name: {"queued": 0, "active": None} for name in self.queue_len}
            for it in self._queue:
                chans.setdefault(it.channel, {"queued": 0, "active": None})["queued"] += 1
            if self._current is not None:
                chans.setdefault(self._current.channel, {"queued": 0, "active": None})["active"] = self._current.id
        return chans

    @property
    def busy(self) -> bool:
        """True while a request is queued, running or playing."""
        with self._cv:
            return bool(self._active)

    def stop(self, timeout_s: Optional[float] = None) -> list[Item]:
        """Stop taking work: queued requests are removed and returned (not yet settled: the
        caller spools them or sends errors); the running one finishes. Waits for the thread."""
        with self._cv:
            self._stopping = True
            left = list(self._queue)
            self._queue.clear()
            tasks, self._tasks = self._tasks, []
            for it in left:
                self._active.pop(it.id, None)
                it.state = "settled"
            self._cv.notify_all()
        for _, sink in tasks:
            sink(error_event(BusyError("the daemon is stopping; ask again after it restarts")), None)
        if self._thread is not None:
            self._thread.join(timeout_s)
        return left

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is queued, running or playing; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._active:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.1))
        return True

    # ------------------------------------------------------------------ worker thread

    def _beat(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.on_heartbeat is not None and (force or now - self._last_beat >= self.heartbeat_s):
            self._last_beat = now
            try:
                self.on_heartbeat()
            except Exception:
                log.exception("heartbeat hook")

    def _loop(self) -> None:
        self._beat(force=True)
        while True:
            with self._cv:
                item = None
                task = self._tasks.pop(0) if self._tasks and not self._stopping else None
                if task is None and self._queue and not self._stopping:
                    item = self._queue.pop(0)
                    item.state = "running"
                    self._current = item
                elif task is None and self._stopping:
                    return
                elif task is None:
                    self._cv.wait(self.heartbeat_s)
            self._beat()
            if task is not None:
                fn, sink = task
                try:
                    sink(fn(), None)
                except Exception as e:
                    log.exception("worker task failed")
                    sink(error_event(e), None)
                self._beat(force=True)
            if item is not None:
                try:
                    self._process(item)
                finally:
                    with self._cv:
                        self._current = None
                self._beat(force=True)

    def _process(self, item: Item) -> None:
        item.sink(Started(id=item.id, channel=item.channel), None)
        log.info("started %s on %s", item.id, item.channel)
        try:
            item.audio = self.audio.open(item.id, item.channel, beat=self._beat)
            if item.cancel.is_set():
                raise CancelledError(f"request {item.id} was cancelled")
            for pcm in self.pipeline.run(item.job, cancel=item.cancel):
                pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
                if not len(pcm):
                    continue
                if item.first_pcm_at is None:
                    item.first_pcm_at = time.monotonic()
                item.audio.write(pcm)
                if item.speak.return_audio:
                    if self.audio_format == "int16":
                        data = to_int16(pcm).tobytes()
                    else:
                        data = pcm.astype("<f4").tobytes()
                    item.sink(AudioChunk(id=item.id, bytes=len(data), rate=24000, format=self.audio_format), data)
                self._beat()
            with self._cv:
                cancelled = item.cancel.is_set()
                if not cancelled:
                    item.state = "playing"
            if cancelled:
                raise CancelledError(f"request {item.id} was cancelled")
        except Exception as e:
            if item.audio is not None:
                item.audio.abort()
            if isinstance(e, CancelledError):
                ev = ErrorEvent(code=CancelledError.code, message=f"request {item.id} was cancelled", id=item.id)
            else:
                if not isinstance(e, ApplianceError):
                    log.exception("request %s failed", item.id)
                ev = error_event(e, item.id)
            self._settle(item, ev)
            return
        done = self._done_event(item)
        item.audio.finish(lambda output: self._settle(item, _with_output(done, output)))

    def _done_event(self, item: Item) -> Done:
        st = item.job.stats
        ttfb = 1000.0 * ((item.first_pcm_at or time.monotonic()) - item.accepted_at)
        self.last_rtf, self.last_ttfb_ms = float(st.rtf), ttfb
        log.info("synthesized %s: %.2f s audio, TTFB %.0f ms (synthesis %.0f ms), RTF %.3f, %d steps, %.1f steps/s",
                 item.id, st.audio_s, ttfb, st.ttfb_ms, st.rtf, st.steps, st.steps_per_s,
                 extra={"request_id": item.id, "channel": item.channel, "ttfb_ms": ttfb, "rtf": st.rtf})
        return Done(id=item.id, channel=item.channel, ttfb_ms=round(ttfb, 1), rtf=round(float(st.rtf), 4),
                    audio_s=round(float(st.audio_s), 3), steps=int(st.steps),
                    steps_per_s=round(float(st.steps_per_s), 2), seed=getattr(item.job, "seed", None),
                    unspeakable=list(getattr(item.job, "unspeakable", []) or []))

    def _settle(self, item: Item, event: Any) -> None:
        """Emit the request's one terminal event (idempotent)."""
        with self._cv:
            if item.state == "settled":
                return
            item.state = "settled"
            if self._active.get(item.id) is item:
                del self._active[item.id]
            if isinstance(event, Done):
                self.completed += 1
            else:
                self.failed += 1
            self._cv.notify_all()
        item.sink(event, None)
        if isinstance(event, Done):
            log.info("done %s -> %s", item.id, event.output)
        else:
            log.info("request %s ended with %s: %s", item.id, event.code, event.message)
        if self.on_finished is not None:
            try:
                self.on_finished(item, event)
            except Exception:
                log.exception("on_finished hook")


def _with_output(done: Done, output: str) -> Done:
    return dataclasses.replace(done, output=output)
