"""When a request sounds: slack for one hiccup, a later start where the box cannot keep up, and a
pause at a sentence boundary where it falls behind mid-request.

A listener prefers a later start to stutter, and a pause between two sentences to gaps inside
words. :class:`StartPolicy` sees every PCM chunk of a request before it is written
(:meth:`StartPolicy.on_chunk`; the engine has then measured its decode step and vocoder window
times, all channels together) and decides how much audio its sound-device voice must hold:

* at the request's first chunk, before it starts, beyond one device wake-up
  (:meth:`DeviceOutput.hold <appliance.audio.device.DeviceOutput.hold>`):

  * always ``stream.start_slack_ms``: one scheduling hiccup of the synthesis thread (on a loaded
    2-core machine: pauses of 14-73 ms right after the first 30-35 ms of speech, in 7 of about
    250 requests, when the voice started on one wake-up of audio exactly);
  * where the stream cannot keep up with this request (predicted real-time factor above
    ``stream.realtime_share``), the audio it must queue so that the rest is made before it is due:
    :func:`~appliance.synth.schedule.start_plan`, from the measured times, the rows decoding now,
    and the request's expected length;

* at the first chunk of each later sentence, the same for that sentence alone: the voice plays
  on from the previous sentence's end only if it holds that much of the next one, else it holds
  there (:mod:`appliance.audio.mix`, "Sentences"). The start plan assumed the rates it measured
  at the start; when synthesis falls below real time later (a busy neighbour, a lower clock, a
  channel joining), this re-hold turns the shortfall into a pause at the next sentence boundary;
* at every chunk, what the voice must re-buffer should it run dry mid-sentence anyway (a
  slowdown inside a sentence): the rest of that sentence at the rate measured now
  (:meth:`RequestAudio.rebuffer <appliance.audio.request.RequestAudio.rebuffer>`), so it pauses
  once, not at every chunk.

When the CPU is really gone (``cpu_busy``: decode steps over :data:`BUSY` times this box's best
at the same rows, e.g. a neighbour that takes the cores), a rate measured now says little about
the rate a second later, and a plan made from it may still run dry inside a sentence. Then the
policy pauses at sentence boundaries only: a later sentence's boundary hold is the *whole*
sentence (the voice plays on once its last chunk is queued, :mod:`appliance.audio.mix`), a
sentence already playing re-buffers its whole rest should it run dry (one pause), and a request
that starts then plans its start for its first sentence alone (its later sentences hold at their
boundaries), so that its first audio is not held for the rest. ``done.pauses`` marks such a
pause ``"whole_sentence": true``.

The policy reads typed objects only: the :class:`~appliance.service.request.Request`, its
:class:`~appliance.synth.batch.Task` (the sentences known now, its ``chunk_scale``, the steps its
decoding sentence has run: ``Task.decoded``) and, at the end, the task's :class:`~appliance.synth.job.Report`.

Expected length: per sentence, its text tokens (``Sentence.text_tokens``) times the decode steps
per text token seen so far
(:data:`STEPS_PER_TOKEN` until a request has finished: about what trained ChatTTS speaks at
``[speed_5]``), clipped to the request's ``min_new_tokens`` and ``max_new_tokens``. A request
that ends earlier than expected only started later than needed; one that runs longer may still
run dry (re-buffering, counted as an underrun).

The decisions are reported in ``done`` (``predicted_rtf``, ``start_hold_ms``: the audio held
beyond the device wake-up, 0 for a WAV file or audio that only goes back to the client;
``start_delay_ms``: its first chunk to its first sample at the device; ``pauses``: every silence
inside it at the device, where (a sentence boundary or mid-sentence), how long, and its cause,
:data:`CAUSES`; ``pause_ms``: their sum) and, per channel, in ``status`` (``start``: the
channel's latest request). Thread-safe.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from ..synth.schedule import StartPlan, start_plan

if TYPE_CHECKING:
    from ..audio.sink import AudioSink
    from ..core import PcmChunk, SamplingParams
    from ..synth.batch import BatchEngine, Task
    from ..synth.job import Report
    from .request import Request

log = logging.getLogger(__name__)

KEPT = 256
"""Decisions remembered for ``done`` (those of requests that end with an error are dropped oldest first)."""
STEPS_PER_TOKEN = 10.0
"""Decode steps per text token before any request has finished (trained ChatTTS at
``[speed_5]``: about 4.5 Chinese characters, one token each, per second = 10 steps)."""
BUSY = 1.25
"""A decode step this many times slower than the fastest one seen at the same rows: the CPU is
busy with something else (another process, a lower clock)."""
WHOLE_S = 3600.0
"""A hold (s) no sentence reaches: the voice plays on once the sentence is queued whole."""
CAUSES = {
    "cpu_busy": "decode steps slower than this box's best at this many channels: another process, or a lower clock",
    "channels": "several channels decode together and their batch is slower than real time",
    "slow": "one channel at this box's best speed is slower than real time",
    "late_sentence": "the next sentence's first audio (its prompt and look-ahead) came after the queued audio ran out",
}
"""Why a request paused (``done.pauses[].cause``)."""


@dataclass
class _Track:
    """One request's audio as the policy follows it (worker thread)."""

    audio: AudioSink
    sentence: int = 0
    causes: dict = field(default_factory=dict)      # sentence -> cause at its first chunk (its boundary hold)
    latest: dict = field(default_factory=dict)      # sentence -> cause at its latest chunk (a dry-out in it)
    whole: set = field(default_factory=set)         # sentences held (or re-buffered) until queued whole


class StartPolicy:
    """Start decisions for the requests of one engine (module docstring).

    Args:
        engine: the :class:`~appliance.synth.batch.BatchEngine` (its measured ``step_s`` and
            ``window_s``, the rows in ``tasks``, its ``schedule``, ``lookahead_of(task)``).
        slack_s: ``stream.start_slack_ms`` / 1000.
    """

    def __init__(self, engine: BatchEngine, slack_s: float) -> None:
        self.engine = engine
        self.slack_s = max(0.0, float(slack_s))
        self.per_token = STEPS_PER_TOKEN
        self._lock = threading.Lock()
        self._plans: collections.OrderedDict[Request, tuple[StartPlan, float]] = collections.OrderedDict()
        # ^ item -> (plan, hold_s) until its done
        self._latest: dict[str, tuple[Request, StartPlan, float]] = {}    # channel -> (item, plan, hold_s)
        self._track: collections.OrderedDict[Request, _Track] = collections.OrderedDict()   # item -> until its done
        self._best: dict[int, float] = {}        # rows -> the fastest decode step seen, s

    def _sentence_steps(self, task: Task, params: SamplingParams) -> list[int]:
        """Decode steps each sentence of ``task`` known now is expected to run (module docstring)."""
        lo, hi = int(params.min_new_tokens), int(params.max_new_tokens)
        with self._lock:
            per = self.per_token
        return [min(hi, max(lo, round(per * s.text_tokens))) for s in task.sentences]

    def on_chunk(self, item: Request, chunk: PcmChunk) -> None:
        """``item``'s :class:`~appliance.core.PcmChunk` ``chunk`` is about to be written (worker
        thread): its first chunk decides the start (:meth:`apply`), a later sentence's first chunk
        its hold at the boundary before it, every chunk the re-buffering amount; a chunk that ends
        a sentence is marked as such on the voice. Never raises."""
        try:
            with self._lock:
                tr = self._track.get(item)
            if tr is None or tr.audio is not item.audio:        # its first chunk (again after a resume)
                tr = _Track(item.audio, chunk.sentence)
                with self._lock:
                    self._track[item] = tr
                    while len(self._track) > KEPT:
                        self._track.popitem(last=False)
                self.apply(item)
            elif chunk.sentence != tr.sentence:
                tr.sentence = chunk.sentence
                self._rehold(item, tr)
            self._rebuffer(item, tr)
            voice = item.audio.voice
            if chunk.ends_sentence and voice is not None:
                voice.end_sentence_next()
        except Exception:  # noqa: BLE001 - a policy bug must not fail the request
            log.exception("request %s: sentence plan", item.id)

    def _plan(self, item: Request, steps: int) -> tuple[StartPlan, str]:
        """The start plan for ``steps`` more decode steps of ``item`` at the rates measured now, and
        what would make it fall behind (:data:`CAUSES`: ``cpu_busy``, ``channels`` or ``slow``)."""
        eng, task = self.engine, item.task
        rows = max(1, len(eng.tasks))
        plan = start_plan(eng.schedule, eng.step_s, eng.window_s, steps, eng.lookahead_of(task),
                          rows=rows, scale=task.chunk_scale)
        with self._lock:
            best = self._best[rows] = min(self._best.get(rows, eng.step_s), eng.step_s)
        if eng.step_s > BUSY * best:
            return plan, "cpu_busy"
        return plan, "channels" if rows > 1 else "slow"

    def _rehold(self, item: Request, tr: _Track) -> None:
        """The first chunk of sentence ``tr.sentence`` (> 0): the voice holds that much of it at the
        boundary before it (module docstring)."""
        k = tr.sentence
        steps = self._sentence_steps(item.task, item.job.params)
        plan, cause = self._plan(item, steps[k] if k < len(steps) else max(steps, default=1))
        tr.causes[k] = cause if plan.hold_s > 0 else "late_sentence"
        voice = item.audio.voice
        if voice is None:
            return
        if cause == "cpu_busy" and plan.hold_s > 0:    # the CPU is gone: the whole sentence, no gap inside it
            tr.whole.add(k)
            voice.device.hold(voice, WHOLE_S)
            log.info("request %s: sentence %d: predicted RTF %.2f (cpu_busy): it plays on once it is queued whole "
                     "(a pause between sentences, none inside)", item.id, k, plan.predicted_rtf,
                     extra={"request_id": item.id, "predicted_rtf": plan.predicted_rtf, "sentence": k})
            return
        voice.device.hold(voice, self.slack_s + plan.hold_s)
        if plan.hold_s > 0:
            log.info("request %s: sentence %d: predicted RTF %.2f (%s): it plays on once %.2f s of it are queued "
                     "(a pause between sentences instead of gaps)", item.id, k, plan.predicted_rtf, cause,
                     self.slack_s + plan.hold_s, extra={"request_id": item.id, "predicted_rtf": plan.predicted_rtf,
                                                        "sentence": k, "hold_s": self.slack_s + plan.hold_s})

    def _rebuffer(self, item: Request, tr: _Track) -> None:
        """What the voice re-buffers should it run dry in this sentence: the rest of it at the rate now."""
        task, k = item.task, tr.sentence
        steps = self._sentence_steps(item.task, item.job.params)
        done = task.decoded(k)
        plan, cause = self._plan(item, max(1, (steps[k] if k < len(steps) else 1) - done))
        tr.latest[k] = cause
        voice = item.audio.voice
        if voice is not None:
            gone = cause == "cpu_busy" and plan.hold_s > 0
            voice.rebuffer(WHOLE_S if gone else plan.hold_s)    # gone: one pause until the rest is queued

    def apply(self, item: Request) -> None:
        """``item``'s first PCM chunk is about to be written: decide and hold its voice. Never raises."""
        try:
            eng, task = self.engine, item.task
            steps = self._sentence_steps(task, item.job.params)[item.resume_from:]   # a resumed one: the rest
            plan, cause = self._plan(item, sum(steps))
            if cause == "cpu_busy" and plan.hold_s > 0 and len(steps) > 1:   # later sentences hold at their boundaries
                plan, _ = self._plan(item, steps[0])
            voice = item.audio.voice                            # None: a WAV file or the client's audio
            hold_s = self.slack_s + plan.hold_s if voice is not None else 0.0
            if voice is not None:
                voice.device.hold(voice, hold_s)
            with self._lock:
                self._plans[item] = (plan, hold_s)
                while len(self._plans) > KEPT:
                    self._plans.popitem(last=False)
                self._latest[item.channel] = (item, plan, hold_s)
        except Exception:  # noqa: BLE001 - a policy bug must not fail the request
            log.exception("request %s: start plan", item.id)
            return
        if plan.hold_s > 0:
            log.info("request %s: predicted RTF %.2f over %.1f s of audio: it starts once %.2f s are queued "
                     "(a later start instead of gaps)", item.id, plan.predicted_rtf, plan.expected_s, hold_s,
                     extra={"request_id": item.id, "predicted_rtf": plan.predicted_rtf, "start_hold_s": hold_s})

    def fields(self, item: Request) -> dict:
        """``done``'s start and pause fields for ``item`` (forgets it and learns its length); {} if
        none."""
        with self._lock:
            got = self._plans.pop(item, None)
            tr = self._track.pop(item, None)
        if item.task is not None:
            self._learn(item.task.report, item.job.params)
        if got is None:
            return {}
        plan, hold_s = got
        out_at = item.audio.first_out_at if item.audio is not None else None
        delay = None if out_at is None or item.first_pcm_at is None else round(1000.0 * (out_at - item.first_pcm_at), 1)
        pauses = self._pauses(item, tr)
        return {"predicted_rtf": None if plan.predicted_rtf is None else round(plan.predicted_rtf, 3),
                "start_hold_ms": round(1000.0 * hold_s, 1), "start_delay_ms": delay, "pauses": pauses,
                "pause_ms": round(sum(p["ms"] for p in pauses), 1)}

    @staticmethod
    def _pauses(item: Request, tr: Optional[_Track]) -> list[dict]:
        """``done.pauses``: the voice's silences at the device with their causes (module docstring)."""
        voice = item.audio.voice if item.audio is not None else None
        if voice is None or tr is None:
            return []
        rate = max(1, voice.device.rate)
        out = []
        for p in list(voice.pauses):
            causes = tr.causes if p.at_boundary else tr.latest
            out.append({"sentence": p.sentence, "at_s": round(p.at / rate, 3), "ms": round(1000.0 * p.samples / rate, 1),
                        "where": "sentence_boundary" if p.at_boundary else "mid_sentence",
                        "cause": causes.get(p.sentence, "late_sentence" if p.at_boundary else "slow"),
                        **({"whole_sentence": True} if p.at_boundary and p.sentence in tr.whole else {})})
        return out

    def status(self, channel: str) -> dict:
        """``{"start": {...}}`` for ``status``: the channel's latest request's decision, or {}."""
        with self._lock:
            got = self._latest.get(channel)
        if got is None:
            return {}
        item, plan, hold_s = got
        return {"start": {"id": item.id, "predicted_rtf": None if plan.predicted_rtf is None else round(plan.predicted_rtf, 3),
                          "expected_audio_s": round(plan.expected_s, 2), "hold_ms": round(1000.0 * hold_s, 1),
                          "sounding": item.audio is not None and item.audio.first_out_at is not None}}

    def _learn(self, report: Report, params: SamplingParams) -> None:
        """Steps per text token from a finished run (its ``report``, run with ``params``): a moving
        average; a run whose every sentence ran to ``max_new_tokens`` says only that the rate is at
        least what it saw."""
        st = report.stats
        tokens = sum(report.text_tokens)
        if st is None or tokens <= 0 or st.steps <= 0:
            return
        seen = st.steps / tokens
        clipped = st.steps >= st.sentences * int(params.max_new_tokens)
        with self._lock:
            self.per_token = max(self.per_token, seen) if clipped else 0.7 * self.per_token + 0.3 * seen

