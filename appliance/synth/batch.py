"""Several jobs synthesizing at once over ONE decode loop (continuous batching).

:class:`BatchEngine` is the only synthesis code path: :meth:`Pipeline.run
<appliance.synth.pipeline.Pipeline.run>` drives it for one job, the service's scheduler for up to
``len(channels)`` jobs. Each call of :meth:`BatchEngine.step`:

1. drops every task whose ``cancel`` event is set (its KV slot is freed at once);
2. joins every task waiting for a slot: the prefill of its next sentence runs *between* decode
   steps, so a job that arrives mid-way decodes with the others from the next step on;
3. runs ONE batched decode step (:meth:`DecodeLoop.step`) over all active sequences (the runner
   keeps each row's hidden states in its slot);
4. per task, advances its own :class:`~appliance.synth.vocoder.WindowedVocoder` (one per task
   slot, allocated once by the pipeline) when the next chunk of the task's
   :class:`~appliance.synth.schedule.ChunkSchedule` is decoded (a small first chunk, then growing
   ones that the audio already queued can cover) and hands the PCM that became final to the
   task's sink;
   a sentence that ended is flushed and the task's next sentence joins at the next step (same
   vocoder slot, so multi-sentence jobs stay in order and continuous); a finished task leaves
   without stalling the others. A job whose text still arrives (``job.feed``: later pieces
   handed over through its :class:`~appliance.synth.job.TextFeed`) waits after its last sentence
   (:attr:`TaskState.WAITING`: no KV slot, no decode row) until more sentences come or the feed
   is closed.

Each task's :class:`~appliance.synth.job.Report` (what it spoke, silent sentences, codes kept,
widest batch, timings) is written here, on the engine's thread, and read once the task ended.

Same seed => same PCM alone or batched: every row has its own KV slot, its own sampler state and
counter-based random stream (:mod:`appliance.engines.rng`), its own vocoder; the runner's decode
is row-wise (per-row attention over that row's own positions), so batch
composition only changes floating-point rounding inside the batched matmuls (see
``tests/test_channels_batch.py`` for the measured tolerance). Upstream ChatTTS batches only
requests that start together (``GPT.generate`` over a padded batch); joining mid-way is ours
(continuous batching as in Orca, Yu et al., OSDI 2022).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from ..core import SAMPLE_RATE, PcmChunk
from ..errors import BusyError, CancelledError, EmptyResultError
from .decode_loop import DecodeLoop, Sequence
from .guard import check_pcm
from .job import Job, JobStats, Report, Sentence
from .schedule import ChunkSchedule
from .vocoder import WindowedVocoder

log = logging.getLogger(__name__)

PcmSink = Callable[[PcmChunk], None]
"""``sink(chunk)``: receives one task's :class:`~appliance.core.PcmChunk` (float32 mono), in order."""


class TaskState(enum.Enum):
    """Where a task is in the engine."""

    JOINING = "joining"        # waits for its next sentence's prefill (at the next step)
    DECODING = "decoding"      # a row of the batched decode step
    WAITING = "waiting"        # an open job between sentences: its vocoder slot, no KV slot, no row
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        """Done, failed or cancelled."""
        return self in (TaskState.DONE, TaskState.FAILED, TaskState.CANCELLED)


@dataclass(eq=False)
class Task:
    """One job inside the engine; every field is the engine thread's.

    Attributes:
        job: the :class:`~appliance.synth.job.Job`. sink: where its PCM goes.
        cancel: set (any thread) to remove the task at the next step.
        chunk_scale: the schedule's largest chunk is multiplied by this (throttle: fewer, larger chunks).
        state: a :class:`TaskState`.
        error: the exception of a failed/cancelled task.
        sentences: the job's sentences, then those of each later piece taken from its feed
            (``fed``: the pieces taken so far).
        report: what this run said and did (:class:`~appliance.synth.job.Report`).
        joined_at_step: the engine's step counter when its first sentence joined.
    """

    job: Job
    sink: PcmSink
    cancel: Optional[threading.Event] = None
    chunk_scale: int = 1
    state: TaskState = TaskState.JOINING
    error: Optional[BaseException] = None
    sentences: list[Sentence] = field(default_factory=list)
    fed: int = 0
    report: Report = field(default_factory=Report)
    voc: int = -1
    k: int = 0
    seq: Optional[Sequence] = None
    emitted: int = 0
    last_chunk: int = 0
    samples: int = 0
    steps: int = 0
    t0: float = field(default_factory=time.perf_counter)
    ttfb: Optional[float] = None
    first_at: float = 0.0
    joined_at_step: int = -1

    @property
    def finished(self) -> bool:
        """True once done, failed or cancelled."""
        return self.state.ended

    @property
    def progress(self) -> int:
        """A count that grows with every decode step or PCM sample it made (the service's
        watchdog compares two readings; engine thread, or under the service's lock)."""
        return self.steps + self.samples + (self.seq.steps if self.seq is not None else 0)

    def decoded(self, k: int) -> int:
        """Decode steps sentence ``k`` has run so far: 0 unless it is the one decoding now."""
        return self.seq.steps if self.seq is not None and self.k == k else 0


class BatchEngine:
    """Continuous batching of whole jobs over one :class:`DecodeLoop` (see module docstring).

    Args:
        loop: the decode loop (owns the runner's KV slots and the per-slot samplers).
        vocoders: one :class:`WindowedVocoder` per task slot (allocated once).
        schedule: streamed chunk sizes (:class:`~appliance.synth.schedule.ChunkSchedule`).
        refiner: ``(job, sentence, k) -> (text, ids)`` runs refine-text for sentence ``k`` of a job
            whose sentences carry ``refine_ids``, just before it joins (the pipeline's): the refined
            text ("" when it gave none) and the code prompt to decode.

    Not thread-safe: one thread calls :meth:`add`, :meth:`step`, :meth:`remove`; only the tasks'
    ``cancel`` events may be set from other threads.
    """

    def __init__(self, loop: DecodeLoop, vocoders: list[WindowedVocoder], schedule: ChunkSchedule,
                 refiner: Optional[Callable[[Job, Sentence, int], tuple[str, np.ndarray]]] = None) -> None:
        self.loop = loop
        self.refiner = refiner
        self.vocoders = vocoders
        self.schedule = schedule
        #: wall seconds per engine decode step and per vocoder window (moving averages)
        self.step_s = 0.0
        self.window_s = 0.0
        self.capacity = min(loop.max_batch, len(vocoders))
        self.tasks: list[Task] = []
        self._free_voc = list(range(self.capacity - 1, -1, -1))
        self._by_seq: dict[Sequence, Task] = {}
        self.steps_run = 0
        self.rows_hist: collections.Counter = collections.Counter()   # batch rows -> decode steps

    @property
    def runnable(self) -> bool:
        """True when :meth:`step` has work: a task that is not waiting for text (or whose text
        came, ended or was cancelled)."""
        return any(t.state is not TaskState.WAITING or t.job.feed is None or t.job.feed.ready(t.fed)
                   or (t.cancel is not None and t.cancel.is_set()) for t in self.tasks)

    def lookahead_of(self, task: Task) -> int:
        """The look-ahead of ``task``'s vocoder, decode steps."""
        return self.vocoders[task.voc].lookahead_tokens

    @property
    def free(self) -> int:
        """Tasks that may still be added."""
        return len(self._free_voc)

    def add(self, job: Job, sink: PcmSink, cancel: Optional[threading.Event] = None, chunk_scale: int = 1,
            keep_codes: bool = False, first_sentence: int = 0) -> Task:
        """Register ``job``; its first sentence joins the batch at the next :meth:`step`.
        ``keep_codes``: its report keeps every code drawn (the health check's reference).
        ``first_sentence``: start at this sentence of the job (a request resumed after a
        preemption; clipped to its sentences known now); it draws with ``seed + k`` as always, and
        its report lists the sentences before it as spoken (they were, before the interruption), so
        that ``report.spoken[k]`` stays sentence ``k``.

        Raises:
            BusyError: all ``capacity`` task slots are taken.
        """
        if not self._free_voc:
            raise BusyError(f"all {self.capacity} synthesis slots are busy")
        t = Task(job=job, sink=sink, cancel=cancel, chunk_scale=max(1, int(chunk_scale)),
                 sentences=list(job.sentences),
                 report=Report(unspeakable=list(job.unspeakable), codes=[] if keep_codes else None),
                 k=max(0, min(int(first_sentence), len(job.sentences) - 1)))
        t.report.spoken.extend(s.text for s in job.sentences[:t.k])
        t.voc = self._free_voc.pop()
        self.tasks.append(t)
        return t

    def remove(self, task: Task, reason: TaskState = TaskState.CANCELLED, error: Optional[BaseException] = None) -> None:
        """Take ``task`` out now (its KV slot and vocoder are free for the next join)."""
        if task.finished and task not in self.tasks:
            return
        self._end(task, reason, error)

    def step(self, on_step: Optional[Callable[[], None]] = None) -> list[Task]:
        """Cancel, join, one batched decode step, stream out (see module docstring). ``on_step``
        is called first (the service's watchdog heartbeat).

        Returns:
            the tasks that finished (done, failed or cancelled) during this call. Errors of one
            task (bad prompt, empty result) fail that task only; a runner error in the batched
            decode fails every task that was decoding.
        """
        ended: list[Task] = []
        if on_step is not None:
            on_step()
        for t in list(self.tasks):
            if t.cancel is not None and t.cancel.is_set():
                self._end(t, TaskState.CANCELLED, CancelledError(f"request {t.job.id} cancelled"))
                ended.append(t)
        for t in list(self.tasks):
            if t.state is TaskState.WAITING:
                self._next(t)
                if t.finished:
                    ended.append(t)
            if t.state is TaskState.JOINING:
                try:
                    self._join(t)
                except Exception as e:  # noqa: BLE001 - one task's failure must not stop the others
                    self._end(t, TaskState.FAILED, e)
                if t.finished:
                    ended.append(t)
        if not self.loop.active:
            return ended
        b = len(self.loop.active)
        self.rows_hist[b] += 1
        self.steps_run += 1
        decoding = [self._by_seq[s] for s in self.loop.active]
        for t in decoding:
            t.report.max_rows = max(t.report.max_rows, b)
        t_step = time.perf_counter()
        try:
            self.loop.step(self._due(decoding))
        except Exception as e:  # noqa: BLE001
            log.error("batched decode step failed for %s: %s", ", ".join(t.job.id for t in decoding), e)
            for t in decoding:
                self._end(t, TaskState.FAILED, e)
            return ended + decoding
        dt = time.perf_counter() - t_step
        self.step_s = dt if self.step_s == 0.0 else 0.9 * self.step_s + 0.1 * dt
        for t in decoding:
            try:
                self._advance(t)
            except Exception as e:  # noqa: BLE001
                self._end(t, TaskState.FAILED, e)
            if t.finished:
                ended.append(t)
        return ended

    # ------------------------------------------------------------------ internals

    def _join(self, t: Task) -> None:
        job, s = t.job, t.sentences[t.k]
        voc = self.vocoders[t.voc]
        ids, spoken = s.ids, s.text
        if s.refine_ids is not None and self.refiner is not None:
            text, ids = self.refiner(job, s, t.k)   # refine-text (engine thread, a free slot)
            t.report.refined[t.k] = text
            spoken = text or s.text
        t.report.spoken.append(spoken)
        t.report.text_tokens.append(s.text_tokens)
        params = job.params
        if 0 < s.max_steps < params.max_new_tokens:    # its own cap, proportional to its length
            params = dataclasses.replace(params, max_new_tokens=s.max_steps,
                                         min_new_tokens=min(params.min_new_tokens, s.max_steps))   # cap >= min: budget
        seq = Sequence(ids=ids, spk_emb=job.spk_emb, params=params, seed=job.seed + t.k, trace=t.report.codes)
        t.seq, t.emitted = seq, 0
        self.loop.join(seq)
        voc.reset(seq.slot)
        if t.joined_at_step < 0:
            t.joined_at_step = self.steps_run
        self._by_seq[seq] = t
        t.state = TaskState.DECODING
        if seq.finished:
            self._sentence_end(t)

    def _target(self, t: Task) -> int:
        """Decode steps in the task's next chunk (the schedule, from what is queued now)."""
        if t.last_chunk == 0:
            return self.schedule.first_chunk(self.step_s, self.window_s)
        buffered = t.samples / SAMPLE_RATE - (time.perf_counter() - t.first_at)
        return self.schedule.next(t.last_chunk, buffered, self.step_s, self.window_s, t.chunk_scale)

    def _due(self, decoding: list[Task]) -> int:
        """Steps until the first of ``decoding`` has its next chunk (>= 1)."""
        due = [self.vocoders[t.voc].lookahead_tokens + t.emitted + self._target(t) - t.seq.steps
               for t in decoding if t.seq is not None]
        return max(1, min(due, default=1))

    def _advance(self, t: Task) -> None:
        seq = t.seq
        voc = self.vocoders[t.voc]
        if seq.steps - voc.lookahead_tokens - t.emitted >= self._target(t):
            tw = time.perf_counter()
            pcm = voc.push(seq.steps)
            dw = time.perf_counter() - tw
            self.window_s = dw if self.window_s == 0.0 else 0.8 * self.window_s + 0.2 * dw
            new = max(0, seq.steps - voc.lookahead_tokens)
            t.last_chunk, t.emitted = new - t.emitted, new
            self._out(t, pcm)
        if seq.finished:
            self._sentence_end(t)

    def _sentence_end(self, t: Task) -> None:
        seq, voc = t.seq, self.vocoders[t.voc]
        tail = np.concatenate([voc.push(seq.steps), voc.finish()]) if seq.steps else np.zeros(0, np.float32)
        self.loop.release(seq)
        t.steps += seq.steps
        if seq.steps == 0:
            log.warning("request %s: sentence %d produced no audio (EOS at the first step)", t.job.id, t.k)
            t.report.silent.append(t.k)                          # reported in done.silent_sentences
        elif seq.reason == "max_tokens":                         # reported in done.truncated
            t.report.truncated.append((t.k, seq.steps))
            log.warning("request %s: sentence %d reached its cap of %d decode steps (%.1f s) and was cut there: %r",
                        t.job.id, t.k, seq.steps, seq.steps * 512 / SAMPLE_RATE, t.report.spoken[t.k][:80],
                        extra={"request_id": t.job.id})
        self._by_seq.pop(seq, None)
        t.seq = None
        self._out(t, tail, ends_sentence=True)
        t.k += 1
        self._next(t)

    def _next(self, t: Task) -> None:
        """After sentence ``k - 1``: join the next one, wait for its text, or end the task."""
        more = False
        if t.job.feed is not None:
            parts, more = t.job.feed.take(t.fed)
            t.fed += len(parts)
            for p in parts:
                t.sentences.extend(p.sentences)
                t.report.unspeakable.extend(u for u in p.unspeakable if u not in t.report.unspeakable)
        if t.k < len(t.sentences):
            t.state = TaskState.JOINING
            return
        if more:
            t.state = TaskState.WAITING
            return
        wall = time.perf_counter() - t.t0
        if t.samples == 0:
            self._end(t, TaskState.FAILED, EmptyResultError(
                f"request {t.job.id}: the model produced no audio (end of sequence at the first step); try another seed or voice"))
            return
        t.report.stats = _stats(t, wall)
        self._end(t, TaskState.DONE, None)

    def _out(self, t: Task, pcm: np.ndarray, ends_sentence: bool = False) -> None:
        if pcm.size:
            check_pcm(pcm, t.job.id, self.loop.runner, t.seq)   # NaN/Inf fails the task, never reaches a sink
            if t.ttfb is None:
                t.first_at = time.perf_counter()
                t.ttfb = t.first_at - t.t0
            t.samples += pcm.size
            t.sink(PcmChunk(pcm, SAMPLE_RATE, t.k, ends_sentence))

    def _end(self, t: Task, state: TaskState, error: Optional[BaseException]) -> None:
        if t.seq is not None:
            self.loop.leave(t.seq, "left")
            self._by_seq.pop(t.seq, None)
            t.seq = None
        t.state, t.error = state, error
        if t in self.tasks:
            self.tasks.remove(t)
            self._free_voc.append(t.voc)


def _stats(t: Task, wall_s: float) -> JobStats:
    """The timings of a finished task (logged)."""
    audio_s = t.samples / SAMPLE_RATE
    ttfb_s = t.ttfb if t.ttfb is not None else wall_s
    st = JobStats(ttfb_ms=1000.0 * ttfb_s, rtf=wall_s / audio_s, audio_s=audio_s, steps=t.steps,
                  steps_per_s=t.steps / wall_s if wall_s > 0 else 0.0, sentences=len(t.sentences))
    log.info("request %s done: %.2f s audio, TTFB %.0f ms, RTF %.3f, %d steps (%.1f/s)",
             t.job.id, audio_s, st.ttfb_ms, st.rtf, t.steps, st.steps_per_s,
             extra={"request_id": t.job.id, "ttfb_ms": st.ttfb_ms, "rtf": st.rtf})
    return st
