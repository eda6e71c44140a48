"""The worker: the ONE inference thread that drives the pipeline's batch engine for all channels.

Transport-neutral: a request arrives as a :class:`~appliance.service.request.Request` (its life
and states are drawn there) holding a prepared pipeline job and an
:data:`~appliance.messages.protocol.EventSink` (a socket connection, the MQTT publisher, a
Wyoming connection). Events per request::

    submit() -> Accepted (before the item is queued, so it always precedes Started)
    worker   -> Started -> (PCM to its AudioSink: device, WAV, its client stream) -> (played / written) -> Done
                        or ErrorEvent (``cancelled``, ``preempted``, ...)
    an alert on its channel -> Preempted(action=resume) -> Started -> ... (from the start again)
                            or Preempted(action=drop) -> ErrorEvent(code=preempted)

Exactly one terminal event (``done`` or ``error``) per accepted request: how a request ends is
:class:`~appliance.service.ending.Endings` (its ``settle`` is idempotent), built here. An utterance whose text still arrives (``Request.more``) runs like any request;
:meth:`Worker.add_text` / :meth:`Worker.close_text` feed it, and the thread sleeps while every
running request waits for text.

What runs next is decided by the :class:`~appliance.service.scheduler.Scheduler` (queues,
throttle admission, preemption); this module is the thread around it, which owns
the pipeline's :class:`~appliance.synth.batch.BatchEngine`:

* up to ``max_running`` channels synthesize *together*: every running request is a row of the
  same batched decode step, a new one joins at the next step, a finished or cancelled one leaves
  without stalling the others. A channel's next request may start while the previous one still
  plays (its audio queues behind, in the same device lane). New requests stream with
  ``chunk_tokens * Limits.chunk_scale``.
* an ``alert`` preempts a lower-priority request running or playing on ITS channel (and a
  ``normal`` one a ``background`` one): synthesis stops at the next step and unplayed audio is
  dropped at once; then, by ``channels[].on_preempt``, the interrupted request is queued again
  right after the request that interrupted it, ahead of others of its priority (``resume``: it
  restarts from the sentence that was sounding, same seed so the same audio) or ends with an
  error ``preempted`` (``drop``).
* Cancel by id, by channel (its scope: :data:`~appliance.messages.protocol.CANCEL_SCOPES`) or by
  client (queued, running, playing): unplayed audio is dropped at once.

Hooks (worker thread; quick, never raising): ``on_heartbeat()`` at least every ``heartbeat_s``
while the worker is alive and making progress (a hung synthesis stops it: ``WATCHDOG=1``);
``on_finished(item, event)`` after each request's terminal event.

Known limit: the PCM sinks run on the worker thread, so a device FIFO holding more than
``appliance.audio.feed.MAX_BUFFER_S`` of a *sounding* request makes the whole batch wait for playback.
A client's sink (``Request.client_audio``, a transport's: Wyoming) never waits: when its client
does not keep up, its ``write`` raises and that request alone ends with the error.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..audio.cancel import abort_all
from ..core import PcmChunk
from ..errors import BusyError, CancelledError
from ..messages.protocol import (
    DEFAULT_CANCEL_SCOPE,
    Accepted,
    ErrorEvent,
    Event,
    EventSink,
    Started,
    error_event,
)
from .ending import Endings
from .journal import mark
from .request import Request, State
from .scheduler import Scheduler, ThrottlePolicy
from .stall import StallWatch
from .startpolicy import StartPolicy

if TYPE_CHECKING:
    from ..audio.output import AudioOutput
    from ..synth.job import Job
    from ..synth.pipeline import Pipeline
    from .journal import Journal

log = logging.getLogger(__name__)


class Worker:
    """Queues (:class:`~appliance.service.scheduler.Scheduler`) + one synthesis thread driving a
    batch engine (module docstring).

    Args:
        pipeline: the :class:`~appliance.synth.pipeline.Pipeline` (its ``engine`` and ``info``);
            None only for queue tests that never start the thread.
        audio: the :class:`~appliance.audio.output.AudioOutput` (None with ``pipeline``).
        queue_len: channel name -> most queued requests before :class:`BusyError`.
        heartbeat_s: heartbeat period, s.
        on_heartbeat, on_finished: hooks (see module docstring).
        on_preempt: channel name -> ``resume`` or ``drop`` (default ``resume``).
        throttle: a :class:`~appliance.ops.monitor.Monitor` (``limits()``,
            ``observe_rtf()``), or None.
        journal: the :class:`~appliance.service.journal.Journal` (its state records: started,
            synthesized, sounding, requeued; ``end`` before its terminal event is sent), or None.
        stall_s: per-request watchdog (``safety.stall_s``): a running request without progress
            for this long is ended with ``engine_error`` (:mod:`appliance.service.stall`); None = off.
        max_hold_s: longest a request waits held by the throttle (``service.max_hold_s``), then it
            ends ``throttled`` (:meth:`~appliance.service.scheduler.Scheduler.expired`); None = unbounded.
    """

    def __init__(self, pipeline: Optional[Pipeline], audio: Optional[AudioOutput], queue_len: dict[str, int],
                 heartbeat_s: float = 1.0, on_heartbeat: Optional[Callable[[], None]] = None,
                 on_finished: Optional[Callable[[Request, Event], None]] = None,
                 on_preempt: Optional[dict[str, str]] = None,
                 throttle: Optional[ThrottlePolicy] = None,
                 journal: Optional[Journal] = None, stall_s: Optional[float] = None,
                 max_hold_s: Optional[float] = None) -> None:
        self.pipeline = pipeline
        self.engine = pipeline.engine if pipeline is not None else None
        self.audio = audio
        self.heartbeat_s = heartbeat_s
        self.on_heartbeat = on_heartbeat
        self.on_finished = on_finished
        self.throttle = throttle
        self.journal = journal
        self._cv = threading.Condition()
        self._tasks: list[tuple[Callable[[], Any], EventSink]] = []   # run_task(), before queued speech
        self._stopping = False
        self._last_beat = 0.0
        self._thread: Optional[threading.Thread] = None
        self.sched = Scheduler(queue_len, self.engine.capacity if self.engine is not None else len(queue_len),
                               throttle, on_preempt, max_hold_s)
        self.starts = StartPolicy(self.engine, pipeline.cfg.stream.start_slack_ms / 1000.0) if pipeline else None
        self.ends = Endings(self.sched, self._cv, journal, throttle, self.starts, on_finished, lambda: self._stopping)
        self.stall = StallWatch(stall_s, self.sched.running_items, self.ends.settle, self._cv) if stall_s else None

    # ------------------------------------------------------------------ control side (any thread)

    def start(self) -> None:
        """Start the worker thread (and the per-request watchdog)."""
        self._thread = threading.Thread(target=self._loop, name="tts-worker", daemon=True)
        self._thread.start()
        if self.stall is not None:
            self.stall.start()

    def check(self, item: Request) -> None:
        """Would :meth:`submit` take ``item`` now? (Raises what it would raise, changes nothing:
        the dispatcher journals the request in between.)"""
        with self._cv:
            if self._stopping:
                raise BusyError("the daemon is stopping; send the request again after it restarts")
            self.sched.check(item)

    def poke(self) -> None:
        """Re-evaluate what may run (e.g. the throttle level changed)."""
        with self._cv:
            self._cv.notify_all()

    def submit(self, item: Request) -> int:
        """Queue ``item``, emitting ``accepted`` first; returns its queue position on its channel
        (0 = next). An ``alert`` preempts a lower-priority request on its channel.

        Raises:
            BusyError: the daemon is stopping or the channel's queue is full.
            RequestError: a request with the same id is still queued, running or playing.
        """
        with self._cv:
            if self._stopping:
                raise BusyError("the daemon is stopping; send the request again after it restarts")
            pos, waiting = self.sched.check(item)
            item.sink(Accepted(id=item.id, channel=item.channel, queue_position=pos, waiting=waiting,
                               not_crash_safe=item.not_crash_safe))
            victims = self.sched.enqueue(item)
            self._cv.notify_all()
        log.info("accepted %s (%s) on %s at queue position %d (%d chars)%s", item.id, item.speak.priority,
                 item.channel, pos, len(item.speak.text), f"; waits: {waiting}" if waiting else "")
        for v in victims:                   # where it resumes: the sentence sounding now
            voice = v.audio.voice if v.audio is not None else None
            v.resume_from = voice.sounding_sentence() if voice is not None else v.resume_from
        abort_all(v.audio for v in victims if v.audio is not None)    # the sounding one last
        for v in victims:
            log.info("%s %s preempts %s (%s, %s) on %s", item.speak.priority, item.id, v.id, v.speak.priority,
                     v.state.value, v.channel)
            with self._cv:
                playing = v.state is State.PLAYING
            if playing:                     # synthesis already over: decide now
                self.ends.after_preempt(v)
        return pos

    def add_text(self, request_id: str, part: Job) -> bool:
        """Append the sentences of ``part`` to the open utterance ``request_id`` (any thread);
        False when it has ended or takes no more text (nothing added)."""
        with self._cv:
            req = self.sched.find(request_id)
            if req is None or not req.more:
                return False
            req.add(part)
            self._cv.notify_all()
        return True

    def close_text(self, request_id: str) -> None:
        """The text of the utterance ``request_id`` is complete (a no-op once it has ended)."""
        with self._cv:
            req = self.sched.find(request_id)
            if req is not None and req.more:
                req.close()
                self._cv.notify_all()

    def run_task(self, fn: Callable[[], Any], sink: EventSink) -> None:
        """Run ``fn()`` on the worker thread (it owns the pipeline) when a synthesis slot is free,
        and send its return value (an event) to ``sink``; an exception becomes an ``error`` event.

        Raises:
            BusyError: the daemon is stopping.
        """
        with self._cv:
            if self._stopping:
                raise BusyError("the daemon is stopping; ask again after it restarts")
            self._tasks.append((fn, sink))
            self._cv.notify_all()

    def cancel(self, request_id: Optional[str] = None, channel: Optional[str] = None,
               sink: Optional[EventSink] = None, channels: Optional[set] = None,
               scope: str = DEFAULT_CANCEL_SCOPE) -> list[Request]:
        """Cancel a queued, running or still-playing request by id, those on ``channel`` within
        ``scope`` (:data:`~appliance.messages.protocol.CANCEL_SCOPES`), or all of one client
        (``sink``; only on ``channels`` when given). Each gets an ``error`` event with code
        ``cancelled`` on its own sink; returns the items."""
        with self._cv:
            targets = [it for it in self.sched.targets(request_id, channel, sink, scope)
                       if channels is None or it.channel in channels]
            states = {}
            for it in targets:
                states[it] = it.state
                it.cancel.set()
                it.preempted_by = None
                if it.state is State.QUEUED:
                    self.sched.queue.remove(it)
            self._cv.notify_all()       # a worker asleep (its requests wait for text) sees it
        abort_all(it.audio for it in targets if it.audio is not None)   # unplayed audio dropped now
        for it in targets:
            if states[it] in (State.QUEUED, State.PLAYING):
                self.ends.settle(it, ErrorEvent(code=CancelledError.code, message=f"request {it.id} was cancelled", id=it.id))
            # running: the worker sees the event at the next step and settles it
        if targets:
            log.info("cancelled %s", ", ".join(f"{it.id} ({states[it].value})" for it in targets))
        return targets

    def status(self) -> dict:
        """Per channel status (:meth:`~appliance.service.scheduler.Scheduler.status`)."""
        with self._cv:
            return self.sched.status()

    @property
    def busy(self) -> bool:
        """True while a request is queued, running or playing."""
        with self._cv:
            return bool(self.sched.active)

    def stop(self, timeout_s: Optional[float] = None) -> list[Request]:
        """Stop taking work: queued requests are removed and returned (not yet settled: the caller
        tells their clients); the running ones finish. Waits for the thread."""
        if self.stall is not None:
            self.stall.stop()
        with self._cv:
            self._stopping = True
            left = self.sched.drain_queue()
            tasks, self._tasks = self._tasks, []
            self._cv.notify_all()
        for _, sink in tasks:
            sink(error_event(BusyError("the daemon is stopping; ask again after it restarts")))
        if self._thread is not None:
            self._thread.join(timeout_s)
        return left

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is queued, running or playing; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self.sched.active:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.1))
        return True

    # ------------------------------------------------------------------ worker thread

    def beat(self) -> None:
        """A liveness beat from work the worker thread does outside the engine's decode steps
        (the health check's analysis, :func:`~appliance.ops.health.run_health_check`)."""
        self._beat()

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
        eng = self.engine
        while True:
            with self._cv:
                spent = self.ends.take_spent()
                if self._stopping and not self.sched.running and not self.sched.queue:
                    return
                task = self._tasks.pop(0) if self._tasks and not self._stopping and eng.free > 0 else None
                start = [] if self._stopping or task is not None else self.sched.admit()   # the task needs a slot
                expired = self.sched.expired()         # held by the throttle for service.max_hold_s
                # idle: nothing to start, to step (every task waits for text, or none) or to end
                if task is None and not start and not eng.runnable and not self.sched.over():
                    self._cv.wait(self.heartbeat_s)
                    idle = True
                else:
                    idle = False
            for ra in spent:      # freed on the thread that allocated it (sound_request: Memory)
                ra.release()
            for it, err in expired:
                self.ends.settle(it, error_event(err, it.id))
            self._beat()
            if idle:
                continue
            if task is not None:
                fn, sink = task
                try:
                    sink(fn())
                except Exception as e:
                    log.exception("worker task failed")
                    sink(error_event(e))
                self._beat(force=True)
            for it in start:
                self._start(it)
            if eng.runnable:
                eng.step(self._beat)
                if self.stall is not None:
                    self.stall.mark(list(self.sched.running.values()))
            with self._cv:
                ended = self.sched.ended()
            for it in ended:
                try:
                    self.ends.complete(it)
                except Exception as e:  # noqa: BLE001 - a bug here must not stop the other channels
                    log.exception("request %s: completion failed", it.id)
                    self.ends.fail(it, e)

    def _start(self, item: Request) -> None:
        item.progress_at = time.monotonic()
        mark(self.journal, item.journal, "started")
        item.sink(Started(id=item.id, channel=item.channel))
        log.info("started %s on %s (%d synthesizing)", item.id, item.channel, len(self.sched.running))
        try:
            client = item.client_audio() if item.client_audio is not None else None   # a transport's sink
            item.audio = self.audio.open(item.id, item.channel, beat=self._beat, play=item.speak.play, client=client,
                                         on_sounding=lambda: mark(self.journal, item.journal, "sounding"))
            lim = self.sched.limits()
            item.task = self.engine.add(item.job, lambda chunk, it=item: self._on_pcm(it, chunk), item.cancel,
                                        lim.chunk_scale if lim is not None else 1, first_sentence=item.resume_from)
        except Exception as e:  # noqa: BLE001
            item.task = None
            self.ends.fail(item, e)

    def _on_pcm(self, item: Request, chunk: PcmChunk) -> None:
        pcm = chunk.samples
        if not len(pcm) or item.cancel.is_set():
            return
        item.progress_at = time.monotonic()
        if item.first_pcm_at is None:
            item.first_pcm_at = item.progress_at
        voice = item.audio.voice
        if voice is not None:                 # where each sentence begins on the device (a resume point)
            voice.mark_sentence(chunk.sentence)
        self.starts.on_chunk(item, chunk)     # before the write: how much its player holds, sentence ends
        item.audio.write(pcm)
