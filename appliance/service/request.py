"""One accepted request, from ``accepted`` to its one terminal event: :class:`Request`.

Everything the service knows about a request lives here, keyed by the object itself (the
scheduler's queues, the worker, the journal number, the watchdog, the audio): the
:class:`~appliance.messages.protocol.Speak`, its prepared :class:`~appliance.synth.job.Job`
(the synthesis layer's view: sentences and prompts, no tensors), the client's
:data:`~appliance.messages.protocol.EventSink`, the cancel event, the engine's task handle, the
:class:`~appliance.audio.sink.AudioSink` its PCM goes to, and its timings.

Its life is one :class:`State`, changed only by :meth:`Request.move` (every caller holds the
worker's lock)::

                 admit                 synthesis done             played / written
      QUEUED ------------> RUNNING --------------------> PLAYING -----------------> ENDED
        ^                   |   |                           |                         ^
        |  alert, resume    |   |   cancel, failure, alert  |  cancel, alert, device  |
        +-------------------+   +---------------------------+-------------------------+
        (and from PLAYING)          (and QUEUED -> ENDED: cancelled while queued, daemon stops)

ENDED is entered exactly once (:meth:`Request.end` is idempotent): the worker sends the one
terminal event (``done`` or ``error``) only when :meth:`Request.end` returned True.

An *utterance* (a Wyoming stream, a long text sent in pieces) is ONE request whose text is
still arriving: :attr:`Request.more` is True while its job's
:class:`~appliance.synth.job.TextFeed` is open; :meth:`Request.add` hands the engine the next
prepared piece (it synthesizes the pieces in order, waiting in between), :meth:`Request.close`
ends the text. It takes one queue place on its channel, like any request.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from ..messages.protocol import PRIORITIES, Done, EventSink, Speak
from ..text.scripts import describe

if TYPE_CHECKING:
    from ..audio.sink import AudioSink, ClientAudio
    from ..synth.batch import Task
    from ..synth.job import Job

log = logging.getLogger(__name__)


class State(enum.Enum):
    """Where a request is in its life (module docstring)."""

    QUEUED = "queued"      # waits on its channel's queue
    RUNNING = "running"    # its job is in the batch engine (synthesizing, or waiting for text)
    PLAYING = "playing"    # synthesis over, its audio still plays (or is being written)
    ENDED = "ended"        # its terminal event was sent


_MOVES = {
    State.QUEUED: {State.RUNNING, State.ENDED},
    State.RUNNING: {State.PLAYING, State.QUEUED, State.ENDED},
    State.PLAYING: {State.QUEUED, State.ENDED},
    State.ENDED: set(),
}


@dataclass(eq=False)
class Request:
    """One accepted request (module docstring).

    Attributes:
        speak: the request. job: ``Pipeline.prepare(speak)``'s result. channel: resolved name.
        sink: where its events go. accepted_at / arrived_at: ``time.monotonic()`` at accept and
            when its first byte arrived.
        cancel: set to stop synthesis at the next decode step.
        state: a :class:`State` (change it with :meth:`move` or :meth:`end`).
        audio: its :class:`~appliance.audio.sink.AudioSink` once started.
        first_pcm_at: ``time.monotonic()`` of its first PCM chunk.
        task: its :class:`~appliance.synth.batch.Task` while synthesizing.
        preempted_by: id of the alert that interrupted it (until it is re-queued or dropped).
        restarts: times it was resumed after a preemption.
        begun: the scheduler's count of starts when it last started (the lowest of a channel's
            running or playing requests sounds now: a cancel with scope ``current``).
        resume_from: the sentence its next start begins with (the one an interruption cut; 0:
            from the start). The sentence ``k`` of a job always draws with ``seed + k``, so a
            resumed sentence sounds as it did.
        journal: its sequence number in the request journal (None: not journaled).
        not_crash_safe: why it is not journaled although the journal is on (the journal could
            not write it: ``accepted.not_crash_safe``), else None.
        progress_at: ``time.monotonic()`` of its last progress (start, decode step, PCM, new
            text); the per-request watchdog ends it after ``safety.stall_s`` without.
        client_audio: how its transport opens the sink of its client
            (:data:`~appliance.audio.sink.ClientAudio`, e.g. a Wyoming connection's), or None: the
            client gets the PCM through its events (``return_audio``).
    """

    speak: Speak
    job: Optional[Job]
    channel: str
    sink: EventSink
    accepted_at: float = field(default_factory=time.monotonic)
    arrived_at: Optional[float] = None
    cancel: threading.Event = field(default_factory=threading.Event)
    state: State = State.QUEUED
    audio: Optional[AudioSink] = None
    first_pcm_at: Optional[float] = None
    task: Optional[Task] = None
    preempted_by: Optional[str] = None
    restarts: int = 0
    resume_from: int = 0
    begun: int = 0
    journal: Optional[int] = None
    not_crash_safe: Optional[str] = None
    progress_at: float = 0.0
    client_audio: Optional[ClientAudio] = None

    @property
    def id(self) -> str:
        return self.speak.id

    @property
    def rank(self) -> int:
        """0 (alert) .. 2 (background)."""
        return PRIORITIES.index(self.speak.priority)

    @property
    def more(self) -> bool:
        """True while its text still arrives (an open utterance)."""
        return self.job is not None and self.job.feed is not None and self.job.feed.open

    def move(self, to: State) -> None:
        """The one place a request changes state (diagram in the module docstring).

        Raises:
            RuntimeError: a move the diagram does not have (a bug).
        """
        if to not in _MOVES[self.state]:
            raise RuntimeError(f"request {self.id}: no move from {self.state.value} to {to.value}")
        self.state = to

    def end(self) -> bool:
        """Enter ENDED; False when it had ended already (its terminal event went out)."""
        if self.state is State.ENDED:
            return False
        self.state = State.ENDED
        return True

    def restart(self) -> None:
        """Back to the queue after a preemption (``on_preempt: resume``): from sentence
        :attr:`resume_from` (set when it was interrupted)."""
        self.move(State.QUEUED)
        self.cancel = threading.Event()
        self.audio, self.task, self.first_pcm_at = None, None, None
        self.restarts += 1

    def add(self, part: Job) -> None:
        """Hand the engine the next piece of its text (:meth:`TextFeed.put
        <appliance.synth.job.TextFeed.put>`); counts as progress for the watchdog.

        Raises:
            RequestError: its text was complete already (or ``refine_text`` differs).
        """
        self.job.feed.put(part)
        self.progress_at = time.monotonic()

    def close(self) -> None:
        """Its text is complete: it ends after its last sentence."""
        self.job.feed.close()
        self.progress_at = time.monotonic()

    def ttfb_ms(self) -> float:
        """From its arrival to its first sample written out (device, WAV, client; until that is
        known, its first PCM chunk), ms."""
        out_at = (self.audio.first_out_at if self.audio is not None else None) or self.first_pcm_at or time.monotonic()
        return round(1000.0 * (out_at - (self.arrived_at or self.accepted_at)), 1)

    def done_event(self) -> Done:
        """Its :class:`~appliance.messages.protocol.Done` (``output`` filled in at play-out),
        with ``ttfb_ms`` from the request's arrival to its first sample written out (the device,
        the WAV file; until play-out is known, its first PCM chunk), from its task's
        :class:`~appliance.synth.job.Report` (synthesis done: set); the timings are logged."""
        rep = self.task.report
        st = rep.stats
        ttfb = self.ttfb_ms()
        rows = rep.max_rows
        log.info("synthesized %s on %s: %.2f s audio, TTFB %.0f ms (synthesis %.0f ms), RTF %.3f, %d steps, "
                 "%.1f steps/s, decode batch up to %d rows, %d sentence(s)",
                 self.id, self.channel, st.audio_s, ttfb, st.ttfb_ms, st.rtf, st.steps, st.steps_per_s, rows,
                 st.sentences,
                 extra={"request_id": self.id, "channel": self.channel, "ttfb_ms": ttfb, "rtf": st.rtf,
                        "batch_rows": rows})
        return Done(id=self.id, channel=self.channel, ttfb_ms=round(ttfb, 1), synthesis_ttfb_ms=round(float(st.ttfb_ms), 1),
                    rtf=round(float(st.rtf), 4),
                    audio_s=round(float(st.audio_s), 3), steps=int(st.steps),
                    steps_per_s=round(float(st.steps_per_s), 2), seed=self.job.seed,
                    spoken=list(rep.spoken), unspeakable=list(rep.unspeakable),
                    unspeakable_names=[describe(u) for u in rep.unspeakable],
                    voice=self.job.voice or None, silent_sentences=sorted(rep.silent),
                    truncated=[{"sentence": k, "text": rep.spoken[k], "steps": n} for k, n in rep.truncated])
