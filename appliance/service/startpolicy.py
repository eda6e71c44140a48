"""When a request starts to sound: slack for one hiccup, and a later start where the box cannot keep up.

A listener prefers a later start to stutter. At a request's first PCM chunk (the engine has then
measured its decode step and vocoder window times, this request's prefill and look-ahead steps
included) :class:`StartPolicy` decides how much audio its sound-device voice must hold before it
starts, beyond one device wake-up (:meth:`DeviceOutput.hold <appliance.audio.device.DeviceOutput.hold>`):

* always ``stream.start_slack_ms``: one scheduling hiccup of the synthesis thread (on a loaded
  2-core machine: pauses of 14-73 ms right after the first 30-35 ms of speech, in 7 of about
  250 requests, when the voice started on one wake-up of audio exactly);
* where the stream cannot keep up with this request (predicted real-time factor above
  ``stream.realtime_share``), the audio it must queue so that the rest is made before it is due:
  :func:`~appliance.synth.schedule.start_plan`, from the measured times, the rows decoding now,
  and the request's expected length.

The policy's input is typed: a :class:`StartInput` the worker builds at the first chunk, and at
the end the request's :class:`~appliance.synth.job.Report` (what it ran, to learn from).

Expected length: per sentence, its text tokens (``Sentence.text_tokens``) times the decode
steps per text token seen so far (:data:`STEPS_PER_TOKEN` until a request has finished: about
what trained ChatTTS speaks at ``[speed_5]``), clipped to the request's ``min_new_tokens`` and
``max_new_tokens``. A request that ends earlier than expected only started later than needed; one
that runs longer may still run dry (re-buffering, counted as an underrun).

The decision is reported in ``done`` (``predicted_rtf``, ``start_hold_ms``: the audio held beyond
the device wake-up, 0 for a WAV file or audio that only goes back to the client;
``start_delay_ms``: its first chunk to its first sample at the device) and,
per channel, in ``status`` (``start``: the channel's latest request). Thread-safe.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..synth.schedule import StartPlan, start_plan

if TYPE_CHECKING:
    from ..audio.sink import AudioSink
    from ..core import SamplingParams
    from ..synth.batch import BatchEngine
    from ..synth.job import Report

log = logging.getLogger(__name__)

KEPT = 256
"""Decisions remembered for ``done`` (those of requests that end with an error are dropped oldest first)."""
STEPS_PER_TOKEN = 10.0
"""Decode steps per text token before any request has finished (trained ChatTTS at
``[speed_5]``: about 4.5 Chinese characters, one token each, per second = 10 steps)."""


@dataclass(frozen=True)
class StartInput:
    """What the policy reads of a request at its first PCM chunk (the worker builds it).

    Attributes:
        id, channel: the request's.
        text_tokens: per sentence known now, its text's tokens without the prompt's frame.
        params: its sampling parameters (``min_new_tokens``, ``max_new_tokens`` per sentence).
        lookahead_tokens: its vocoder's look-ahead, decode steps. chunk_scale: its schedule's scale.
        audio: its :class:`~appliance.audio.sink.AudioSink` (``voice`` None: a WAV file or audio
            only for its client: nothing to hold; ``first_out_at``: when it first sounded).
        first_pcm_at: ``time.monotonic()`` of its first PCM chunk.
    """

    id: str
    channel: str
    text_tokens: tuple[int, ...]
    params: SamplingParams
    lookahead_tokens: int
    chunk_scale: int
    audio: AudioSink
    first_pcm_at: float


class StartPolicy:
    """Start decisions for the requests of one engine (module docstring).

    Args:
        engine: the :class:`~appliance.synth.batch.BatchEngine` (its measured ``step_s`` and
            ``window_s``, the rows in ``tasks``, its ``schedule``).
        slack_s: ``stream.start_slack_ms`` / 1000.
    """

    def __init__(self, engine: BatchEngine, slack_s: float) -> None:
        self.engine = engine
        self.slack_s = max(0.0, float(slack_s))
        self.per_token = STEPS_PER_TOKEN
        self._lock = threading.Lock()
        self._plans: collections.OrderedDict[str, tuple[StartInput, StartPlan, float]] = collections.OrderedDict()
        # ^ request id -> (input, plan, hold_s) until its done
        self._latest: dict[str, tuple[StartInput, StartPlan, float]] = {}    # channel -> the same

    def expected_steps(self, text_tokens: tuple[int, ...], params: SamplingParams) -> int:
        """Decode steps sentences of ``text_tokens`` are expected to run, all together (module docstring)."""
        lo, hi = int(params.min_new_tokens), int(params.max_new_tokens)
        with self._lock:
            per = self.per_token
        return sum(min(hi, max(lo, round(per * n))) for n in text_tokens)

    def apply(self, item: StartInput) -> None:
        """``item``'s first PCM chunk is about to be written: decide and hold its voice. Never raises."""
        try:
            eng = self.engine
            plan = start_plan(eng.schedule, eng.step_s, eng.window_s, self.expected_steps(item.text_tokens, item.params),
                              item.lookahead_tokens, rows=max(1, len(eng.tasks)), scale=item.chunk_scale)
            voice = item.audio.voice                            # None: a WAV file or the client's audio
            hold_s = self.slack_s + plan.hold_s if voice is not None else 0.0
            if voice is not None:
                voice.device.hold(voice, hold_s)
            with self._lock:
                self._plans[item.id] = (item, plan, hold_s)
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

    def fields(self, request_id: str, report: Report, params: SamplingParams) -> dict:
        """``done``'s start fields for ``request_id`` (forgets it, and learns the length from its
        ``report``, run with ``params``); {} if none."""
        with self._lock:
            got = self._plans.pop(request_id, None)
        self._learn(report, params)
        if got is None:
            return {}
        item, plan, hold_s = got
        out_at = item.audio.first_out_at
        delay = None if out_at is None else round(1000.0 * (out_at - item.first_pcm_at), 1)
        return {"predicted_rtf": None if plan.predicted_rtf is None else round(plan.predicted_rtf, 3),
                "start_hold_ms": round(1000.0 * hold_s, 1), "start_delay_ms": delay}

    def status(self, channel: str) -> dict:
        """``{"start": {...}}`` for ``status``: the channel's latest request's decision, or {}."""
        with self._lock:
            got = self._latest.get(channel)
        if got is None:
            return {}
        item, plan, hold_s = got
        return {"start": {"id": item.id, "predicted_rtf": None if plan.predicted_rtf is None else round(plan.predicted_rtf, 3),
                          "expected_audio_s": round(plan.expected_s, 2), "hold_ms": round(1000.0 * hold_s, 1),
                          "sounding": item.audio.first_out_at is not None}}

    def _learn(self, report: Report, params: SamplingParams) -> None:
        """Steps per text token from a finished run: a moving average; a run whose every sentence
        ran to ``max_new_tokens`` says only that the rate is at least what it saw."""
        st = report.stats
        tokens = sum(report.text_tokens)
        if st is None or tokens <= 0 or st.steps <= 0:
            return
        seen = st.steps / tokens
        clipped = st.steps >= st.sentences * int(params.max_new_tokens)
        with self._lock:
            self.per_token = max(self.per_token, seen) if clipped else 0.7 * self.per_token + 0.3 * seen

