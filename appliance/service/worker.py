"""The scheduler: per-channel queues and the ONE inference thread that batches the channels.

Transport-neutral: a request arrives as an :class:`Item` holding a prepared pipeline job and
an :data:`EventSink` (the socket connection, or the MQTT publisher). Events per request::

    submit() -> Accepted (before the item is queued, so it always precedes Started)
    worker   -> Started -> [AudioChunk + PCM bytes]* -> (audio played / WAV written) -> Done
                        or ErrorEvent (``cancelled``, ``preempted``, ...)
    an alert on its channel -> Preempted(action=resume) -> Started -> ... (from the start again)
                            or Preempted(action=drop) -> ErrorEvent(code=preempted)

Exactly one terminal event (``done`` or ``error``) per accepted request (:meth:`Worker._settle`
is idempotent).

Scheduling (all on the worker thread, which owns the pipeline's
:class:`~appliance.synth.batch.BatchEngine`):

* Each channel has its own bounded queue (``service.channels[].queue_len``, then ``busy``),
  ordered ``alert > normal > background``, FIFO within a priority.
* At most ONE request per channel synthesizes at a time; up to ``max_running`` channels
  synthesize *together*: every running request is a row of the same batched decode step, a new
  one joins at the next step, a finished or cancelled one leaves without stalling the others.
  A channel's next request may start while the previous one still plays (its audio queues
  behind, in the same device lane).
* ``max_running = min(engine slots, memory budget, throttle)``. Memory: every synthesizing
  channel holds one KV cache (``kv_bytes_per_token * max_seq_len``) beside the weights
  (``weight_bytes``); a request that would take the total over ``service.memory_budget_mb``
  waits (its ``accepted`` event and the channel's status say why, and the log), and a budget
  too small for even one channel refuses every request (``over_capacity``). The throttle
  (:class:`~appliance.service.throttle.Monitor`) lowers ``max_running`` and holds back
  priorities outside ``Limits.run_priorities``; new requests stream with
  ``chunk_tokens * Limits.chunk_scale``.
* An ``alert`` preempts a lower-priority request running or playing on ITS channel: synthesis
  stops at the next step and unplayed audio is dropped at once; then, by
  ``channels[].on_preempt``, the interrupted request is queued again right after the alert
  (``resume``: it restarts from the beginning, same seed so same audio) or ends with an error
  ``preempted`` (``drop``).
* Cancel by id or by channel (queued, running, playing): unplayed audio is dropped at once.

Hooks (called from the worker thread; must be quick and must not raise):
``on_heartbeat()`` at least every ``heartbeat_s`` while the worker is alive and making progress
(idle wait, or each decode step) – a hung synthesis stops it, so it can drive ``WATCHDOG=1``;
``on_finished(item, event)`` after each request's terminal event.

Known limit: the PCM sinks run on the worker thread, so a device FIFO holding more than
``sound.MAX_BUFFER_S`` of a *sounding* request makes the whole batch wait for playback.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..core import PcmChunk
from ..errors import (
    ApplianceError,
    BusyError,
    CancelledError,
    CapacityError,
    PreemptedError,
    RequestError,
)
from .protocol import (
    PRIORITIES,
    Accepted,
    AudioChunk,
    Done,
    ErrorEvent,
    Preempted,
    Speak,
    Started,
    error_event,
)
from .wavout import to_int16

log = logging.getLogger(__name__)

EventSink = Callable[[Any, Optional[bytes]], None]
"""``sink(message, payload)``: deliver an event (protocol dataclass) and optional raw bytes
that follow it (``audio`` events). Thread-safe, never blocks on the network, never raises;
a gone client makes it a no-op."""

MIB = 1024 * 1024


@dataclass(eq=False)
class Item:
    """One accepted request.

    Attributes:
        speak: the request. job: ``Pipeline.prepare(speak)``'s result. channel: resolved name.
        sink: where its events go. accepted_at: ``time.monotonic()`` at accept.
        cancel: set to stop synthesis at the next decode step.
        state: ``queued`` -> ``running`` -> ``playing`` -> ``settled``.
        task: its :class:`~appliance.synth.batch.Task` while synthesizing.
        preempted_by: id of the alert that interrupted it (until it is re-queued or dropped).
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
    task: Any = None
    preempted_by: Optional[str] = None
    restarts: int = 0

    @property
    def id(self) -> str:
        return self.speak.id

    @property
    def rank(self) -> int:
        """0 (alert) .. 2 (background)."""
        return PRIORITIES.index(self.speak.priority)


class Worker:
    """The scheduler: queues + one synthesis thread driving a batch engine (module docstring).

    Args:
        pipeline: object with ``engine`` (a :class:`~appliance.synth.batch.BatchEngine`) and
            ``info`` (``weight_bytes``, ``kv_bytes_per_token``, ``max_seq_len``); None only for
            queue tests that never start the thread.
        audio: :class:`~appliance.service.sound.AudioOutput`.
        queue_len: channel name -> most queued requests before :class:`BusyError`.
        heartbeat_s: heartbeat period, s.
        on_heartbeat, on_finished: hooks (see module docstring).
        audio_format: sample format of ``return_audio`` payloads, ``float32`` or ``int16``.
        on_preempt: channel name -> ``resume`` or ``drop`` (default ``resume``).
        memory_budget_mb: ``service.memory_budget_mb``, MiB; None = no memory limit.
        throttle: a :class:`~appliance.service.throttle.Monitor` (``limits()``,
            ``observe_rtf()``), or None.
    """

    def __init__(self, pipeline: Any, audio: Any, queue_len: dict[str, int], heartbeat_s: float = 1.0,
                 on_heartbeat: Optional[Callable[[], None]] = None,
                 on_finished: Optional[Callable[[Item, Any], None]] = None,
                 audio_format: str = "float32", on_preempt: Optional[dict[str, str]] = None,
                 memory_budget_mb: Optional[float] = None, throttle: Any = None) -> None:
        self.pipeline = pipeline
        self.engine = getattr(pipeline, "engine", None)
        self.audio_format = audio_format
        self.audio = audio
        self.queue_len = dict(queue_len)
        self.on_preempt = dict(on_preempt or {})
        self.heartbeat_s = heartbeat_s
        self.on_heartbeat = on_heartbeat
        self.on_finished = on_finished
        self.throttle = throttle
        self.last_rtf: Optional[float] = None
        self.last_ttfb_ms: Optional[float] = None
        self.completed = 0
        self.failed = 0
        self._cv = threading.Condition()
        self._queue: list[Item] = []           # all channels, priority order, FIFO within one
        self._tasks: list[tuple[Callable[[], Any], EventSink]] = []   # run_task(), before queued speech
        self._active: dict[str, Item] = {}     # queued, running or playing, by id
        self._running: dict[str, Item] = {}    # channel -> the item synthesizing on it
        self._waiting: dict[str, str] = {}     # channel -> why its head request cannot start
        self._stopping = False
        self._last_beat = 0.0
        self._thread: Optional[threading.Thread] = None
        self.slots = self.engine.capacity if self.engine is not None else len(self.queue_len)
        if self.engine is not None:   # heartbeats also while a health check drives the engine
            self.engine.on_step = self._beat
        self.mem_channels, self.mem_text = self._memory_plan(memory_budget_mb)

    # ------------------------------------------------------------------ memory budget

    def _memory_plan(self, budget_mb: Optional[float]) -> tuple[int, str]:
        """How many channels may synthesize at once within the budget, and the sentence that says so."""
        info = getattr(self.pipeline, "info", None)
        if budget_mb is None or info is None:
            return 1 << 30, "no memory budget"
        weights = float(getattr(info, "weight_bytes", 0) or 0)
        kv = float(getattr(info, "kv_bytes_per_token", 0) or 0) * float(getattr(info, "max_seq_len", 0) or 0)
        budget = float(budget_mb) * MIB
        n = int((budget - weights) // kv) if kv > 0 else (1 << 30)
        n = max(0, n)
        text = (f"memory budget: weights {weights / MIB:.0f} MiB + {kv / MIB:.1f} MiB of KV cache per synthesizing "
                f"channel (model.max_seq_len {getattr(info, 'max_seq_len', '?')}) fit {n} channel(s) at once in "
                f"service.memory_budget_mb {budget_mb:g} MiB")
        log.info("%s", text)
        slots = int(getattr(info, "max_batch", 0) or 0)
        allocated = weights + slots * kv
        if allocated > budget:
            # the runners allocate every KV slot at load: the admission limit above bounds how many
            # channels synthesize at once, not the memory already held
            log.warning("memory budget: the backend holds %.0f MiB (weights + KV cache for all %d slots, "
                        "allocated at load), over service.memory_budget_mb %g MiB; lower model.max_batch or "
                        "model.max_seq_len, or use a smaller precision (int8 engines / fp16)",
                        allocated / MIB, slots, budget_mb)
        return n, text

    # ------------------------------------------------------------------ control side (any thread)

    def start(self) -> None:
        """Start the worker thread."""
        self._thread = threading.Thread(target=self._loop, name="tts-worker", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Re-evaluate what may run (e.g. the throttle level changed)."""
        with self._cv:
            self._cv.notify_all()

    def submit(self, item: Item) -> int:
        """Queue ``item``, emitting ``accepted`` first; returns its queue position on its channel
        (0 = next). An ``alert`` preempts a lower-priority request on its channel.

        Raises:
            BusyError: the daemon is stopping or the channel's queue is full.
            CapacityError: the memory budget does not hold even one channel.
            RequestError: a request with the same id is still queued, running or playing.
        """
        victims: list[Item] = []
        with self._cv:
            if self._stopping:
                raise BusyError("the daemon is stopping; send the request again after it restarts")
            if self.mem_channels < 1:
                raise CapacityError(f"request refused: {self.mem_text}; raise service.memory_budget_mb "
                                    f"or lower model.max_seq_len")
            if item.id in self._active:
                raise RequestError(f"request id {item.id!r} is already queued or running; use a new id")
            limit = self.queue_len.get(item.channel, 16)
            same = [q for q in self._queue if q.channel == item.channel]
            if len(same) >= limit:
                raise BusyError(f"channel {item.channel!r} has {len(same)} requests queued (limit {limit}, "
                                f"service.channels[].queue_len); retry later")
            pos = sum(1 for q in same if q.rank <= item.rank)
            waiting = None
            if item.channel not in self._running and pos == 0:
                ahead = set(self._running) | {q.channel for q in self._queue
                                              if q.channel != item.channel and q.rank <= item.rank}
                waiting = self._why_waiting(item, len(ahead), self._limits())
            item.sink(Accepted(id=item.id, channel=item.channel, queue_position=pos, waiting=waiting), None)
            self._insert(item)
            self._active[item.id] = item
            if item.speak.priority == "alert":
                for v in self._active.values():
                    if (v.channel == item.channel and v.state in ("running", "playing") and v.rank > item.rank
                            and v.preempted_by is None):
                        v.preempted_by = item.id
                        v.cancel.set()
                        victims.append(v)
            self._cv.notify_all()
        log.info("accepted %s (%s) on %s at queue position %d (%d chars)%s", item.id, item.speak.priority,
                 item.channel, pos, len(item.speak.text), f"; waits: {waiting}" if waiting else "")
        for v in victims:
            log.info("alert %s preempts %s (%s) on %s", item.id, v.id, v.state, v.channel)
            if v.audio is not None:
                v.audio.abort()
            with self._cv:
                playing = v.state == "playing"
            if playing:                     # synthesis already over: decide now
                self._after_preempt(v)
        return pos

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
                it.preempted_by = None
                if it.state == "queued":
                    self._queue.remove(it)
        for it in targets:
            st = states[it]
            if it.audio is not None:
                it.audio.abort()      # drops unplayed audio now; wakes a writer held by back-pressure
            if st in ("queued", "playing"):
                self._settle(it, ErrorEvent(code=CancelledError.code, message=f"request {it.id} was cancelled", id=it.id))
            # running: the worker sees the event at the next step and settles it
        if targets:
            log.info("cancelled %s", ", ".join(f"{it.id} ({states[it]})" for it in targets))
        return targets

    def status(self) -> dict:
        """Per channel: ``queued`` (count), ``active`` (synthesizing request id or None),
        ``playing`` (ids whose audio is still playing), ``waiting`` (why the head of its queue
        cannot start, or None), ``batch_rows`` (rows of the decode step its request is in)."""
        with self._cv:
            chans = {name: {"queued": 0, "active": None, "playing": [], "waiting": None, "batch_rows": 0}
                     for name in self.queue_len}
            blank = {"queued": 0, "active": None, "playing": [], "waiting": None, "batch_rows": 0}
            for it in self._queue:
                chans.setdefault(it.channel, dict(blank))["queued"] += 1
            for ch, it in self._running.items():
                c = chans.setdefault(ch, dict(blank))
                c["active"] = it.id
                c["batch_rows"] = it.task.max_rows if it.task is not None else 0
            for it in self._active.values():
                if it.state == "playing":
                    chans.setdefault(it.channel, dict(blank))["playing"].append(it.id)
            for ch, why in self._waiting.items():
                if ch in chans and chans[ch]["queued"]:
                    chans[ch]["waiting"] = why
        return chans

    @property
    def busy(self) -> bool:
        """True while a request is queued, running or playing."""
        with self._cv:
            return bool(self._active)

    def stop(self, timeout_s: Optional[float] = None) -> list[Item]:
        """Stop taking work: queued requests are removed and returned (not yet settled: the
        caller spools them or sends errors); the running ones finish. Waits for the thread."""
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

    # ------------------------------------------------------------------ scheduling (lock held)

    def _insert(self, item: Item) -> None:
        """Into the queue after every request of the same or higher priority."""
        pos = len(self._queue)
        while pos > 0 and self._queue[pos - 1].rank > item.rank:
            pos -= 1
        self._queue.insert(pos, item)

    def _limits(self) -> Any:
        if self.throttle is None:
            return None
        try:
            return self.throttle.limits()
        except Exception:  # noqa: BLE001 - a telemetry failure must not stop synthesis
            log.exception("throttle limits")
            return None

    def _max_running(self, lim: Any) -> tuple[int, str]:
        """Channels that may synthesize at once now, and the binding limit in words."""
        cands = [(self.slots, f"all {self.slots} synthesis slots are busy (model.max_batch)"),
                 (self.mem_channels, self.mem_text)]
        if lim is not None:
            cands.append((lim.max_channels, f"throttle level {lim.level.value if hasattr(lim.level, 'value') else lim.level} "
                                            f"allows {lim.max_channels} channel(s) at once"))
        return min(cands, key=lambda c: c[0])

    def _why_waiting(self, item: Item, running: int, lim: Any) -> Optional[str]:
        """Why ``item`` cannot start with ``running`` channels synthesizing under throttle
        limits ``lim`` (from :meth:`_limits`, fetched once per admission pass); None = it can."""
        if lim is not None and item.speak.priority not in lim.run_priorities:
            lvl = lim.level.value if hasattr(lim.level, "value") else lim.level
            return f"throttle level {lvl}: {item.speak.priority} requests wait"
        n, why = self._max_running(lim)
        return why if running >= n else None

    def _admit(self) -> list[Item]:
        """Move the queued items that may start now to running; remember why others wait."""
        lim = self._limits()
        start: list[Item] = []
        waiting: dict[str, str] = {}
        busy = set(self._running)
        for it in self._queue:
            if it.channel in busy or it.channel in waiting:
                continue
            why = self._why_waiting(it, len(self._running) + len(start), lim)
            if why is not None:
                waiting[it.channel] = why
                continue
            start.append(it)
            busy.add(it.channel)
        for it in start:
            self._queue.remove(it)
            it.state = "running"
            self._running[it.channel] = it
        for ch, why in waiting.items():
            if self._waiting.get(ch) != why:
                log.info("channel %s: %s waits: %s", ch, next(q.id for q in self._queue if q.channel == ch), why)
        self._waiting = waiting
        return start

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
        eng = self.engine
        while True:
            with self._cv:
                if self._stopping and not self._running and not self._queue:
                    return
                task = self._tasks.pop(0) if self._tasks and not self._stopping and eng.free > 0 else None
                start = [] if self._stopping or task is not None else self._admit()   # the task needs a slot
                if task is None and not start and not self._running:
                    self._cv.wait(self.heartbeat_s)
                    idle = True
                else:
                    idle = False
            self._beat()
            if idle:
                continue
            if task is not None:
                fn, sink = task
                try:
                    sink(fn(), None)
                except Exception as e:
                    log.exception("worker task failed")
                    sink(error_event(e), None)
                self._beat(force=True)
            for it in start:
                self._start(it)
            if eng.tasks:
                eng.step()
            with self._cv:
                ended = [it for it in self._running.values() if it.task is None or it.task.finished]
                for it in ended:
                    del self._running[it.channel]
            for it in ended:
                try:
                    self._complete(it)
                except Exception as e:  # noqa: BLE001 - a bug here must not stop the other channels
                    log.exception("request %s: completion failed", it.id)
                    self._fail(it, e)

    def _start(self, item: Item) -> None:
        item.sink(Started(id=item.id, channel=item.channel), None)
        log.info("started %s on %s (%d synthesizing)", item.id, item.channel, len(self._running))
        try:
            item.audio = self.audio.open(item.id, item.channel, beat=self._beat)
            lim = self._limits()
            item.task = self.engine.add(item.job, lambda chunk, it=item: self._on_pcm(it, chunk), item.cancel,
                                        lim.chunk_scale if lim is not None else 1)
        except Exception as e:  # noqa: BLE001
            item.task = None
            self._fail(item, e)

    def _on_pcm(self, item: Item, chunk: PcmChunk) -> None:
        pcm = chunk.samples
        if not len(pcm) or item.cancel.is_set():
            return
        if item.first_pcm_at is None:
            item.first_pcm_at = time.monotonic()
        item.audio.write(pcm)
        if item.speak.return_audio:
            data = to_int16(pcm).tobytes() if self.audio_format == "int16" else pcm.astype("<f4").tobytes()
            item.sink(AudioChunk(id=item.id, bytes=len(data), rate=chunk.rate, format=self.audio_format), data)
        self._beat()

    def _complete(self, item: Item) -> None:
        """A running item left the engine (or never entered it): play out, resume, or settle."""
        t = item.task
        if item.preempted_by is not None:
            if item.audio is not None:
                item.audio.abort()
            self._after_preempt(item)
            return
        if t is None:
            return                                    # _start failed and settled it
        if t.state == "done" and not item.cancel.is_set():
            with self._cv:
                item.state = "playing"
            done = self._done_event(item)
            item.audio.finish(lambda output: self._settle(item, _with_output(done, output)))
            return
        if t.state == "failed" and not item.cancel.is_set():
            self._fail(item, t.error)
            return
        if item.audio is not None:
            item.audio.abort()
        self._settle(item, ErrorEvent(code=CancelledError.code, message=f"request {item.id} was cancelled", id=item.id))

    def _after_preempt(self, item: Item) -> None:
        """Resume (re-queue from the start) or drop an item an alert interrupted."""
        policy = self.on_preempt.get(item.channel, "resume")
        with self._cv:
            by = item.preempted_by
            if by is None or item.state in ("settled", "queued"):
                return                      # already handled (worker and submit may both get here)
            item.preempted_by = None
            resume = policy == "resume" and not self._stopping
            if resume:
                item.state = "queued"
                item.cancel = threading.Event()
                item.audio, item.task, item.first_pcm_at = None, None, None
                item.restarts += 1
                self._insert(item)
                self._cv.notify_all()
        item.sink(Preempted(id=item.id, channel=item.channel, by=by, action="resume" if resume else "drop"), None)
        if resume:
            log.info("%s resumes on %s after alert %s (from the start)", item.id, item.channel, by)
            return
        err = PreemptedError(f"request {item.id} was dropped: alert {by} preempted it on channel {item.channel!r} "
                             f"(service.channels[].on_preempt: drop)" if policy == "drop" else
                             f"request {item.id} was preempted by alert {by} while the daemon stops")
        self._settle(item, error_event(err, item.id))

    def _fail(self, item: Item, e: BaseException) -> None:
        if item.audio is not None:
            item.audio.abort()
        if not isinstance(e, ApplianceError):
            log.error("request %s failed: %s", item.id, e, exc_info=e)
        self._settle(item, error_event(e, item.id))

    def _done_event(self, item: Item) -> Done:
        st = item.job.stats
        ttfb = 1000.0 * ((item.first_pcm_at or time.monotonic()) - item.accepted_at)
        self.last_rtf, self.last_ttfb_ms = float(st.rtf), ttfb
        if self.throttle is not None:
            try:
                self.throttle.observe_rtf(float(st.rtf))
            except Exception:  # noqa: BLE001
                log.exception("throttle observe_rtf")
        rows = item.task.max_rows if item.task is not None else 0
        log.info("synthesized %s on %s: %.2f s audio, TTFB %.0f ms (synthesis %.0f ms), RTF %.3f, %d steps, "
                 "%.1f steps/s, decode batch up to %d rows",
                 item.id, item.channel, st.audio_s, ttfb, st.ttfb_ms, st.rtf, st.steps, st.steps_per_s, rows,
                 extra={"request_id": item.id, "channel": item.channel, "ttfb_ms": ttfb, "rtf": st.rtf,
                        "batch_rows": rows})
        return Done(id=item.id, channel=item.channel, ttfb_ms=round(ttfb, 1), rtf=round(float(st.rtf), 4),
                    audio_s=round(float(st.audio_s), 3), steps=int(st.steps),
                    steps_per_s=round(float(st.steps_per_s), 2), seed=getattr(item.job, "seed", None),
                    unspeakable=list(getattr(item.job, "unspeakable", []) or []))

    def _settle(self, item: Item, event: Any) -> None:
        """Emit the request's one terminal event (idempotent)."""
        with self._cv:
            if item.state == "settled":
                return
            if item.state == "queued" and item in self._queue:
                self._queue.remove(item)
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
