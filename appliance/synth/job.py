"""A prepared request as the synthesis layer holds it: its sentences, their prompts, its report.

:meth:`~appliance.synth.pipeline.Pipeline.prepare` makes a :class:`Job` (immutable: any thread may
read it); the :class:`~appliance.synth.batch.BatchEngine` runs it and writes its :class:`Report`
(on the engine's thread only; read once the task has ended). An utterance whose text still
arrives carries a :class:`TextFeed`: the thread that prepares each next piece hands the engine
whole :class:`Job` parts through it (any thread puts, the engine's thread reads; the pieces are
kept, so a request resumed after an alert reads them again from the first). A leaf: numpy
and the core types only, so the service reads a job's fields without importing the pipeline.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from ..core import SamplingParams
from ..errors import RequestError


@dataclass(frozen=True)
class Sentence:
    """One sentence: one GPT generation.

    Attributes:
        text: the normalized text spoken.
        ids: int64 ``[T]`` its code prompt (``[Stts][spk_emb]{prompt}{text}[Ptts]``), tokenized once.
        text_tokens: its text's tokens without the prompt's frame (>= 1): the expected length's basis.
        refine_ids: int64 ``[T']`` its text-mode prompt when refine-text is on, else None.
        max_steps: its decode-step cap (:func:`appliance.text.budget.step_cap`: proportional to
            its length, at most the job's ``params.max_new_tokens``); 0 = the job's.
    """

    text: str
    ids: np.ndarray
    text_tokens: int
    refine_ids: Optional[np.ndarray] = None
    max_steps: int = 0


@dataclass(frozen=True)
class Job:
    """A validated request, ready for :meth:`Pipeline.run <appliance.synth.pipeline.Pipeline.run>`.

    Attributes:
        id: request id. text: normalized text. sentences: the pieces spoken one after another.
        unspeakable: characters of the input that cannot be spoken (skipped, reported).
        seed: sampling seed (sentence ``k`` draws with ``seed + k``). params: effective sampling
            parameters. spk_emb: float32 ``[D]`` speaker vector, or None.
        prompt: the prompt tokens' text (``[speed_5]``). voice: how ``done`` names the voice
            (:class:`~appliance.text.voices.VoiceChoice` label).
        feed: the rest of its text still arrives through it (an utterance streamed in pieces): the
            engine waits after the last sentence it has, until :meth:`TextFeed.close`; None: the
            text is complete.
        notes: what the normalizer decided for its text (:attr:`~appliance.text.normalize.NormalizedText.notes`).
    """

    id: str
    text: str
    sentences: tuple[Sentence, ...]
    unspeakable: tuple[str, ...]
    seed: int
    params: SamplingParams
    spk_emb: Optional[np.ndarray]
    prompt: str = ""
    voice: str = ""
    feed: Optional[TextFeed] = None
    notes: tuple[str, ...] = ()

    @property
    def prompts(self) -> tuple[np.ndarray, ...]:
        """Each sentence's code prompt ids (int64 ``[T]``), in order."""
        return tuple(s.ids for s in self.sentences)

    @property
    def refine(self) -> bool:
        """Refine-text runs before each sentence (its sentences carry ``refine_ids``)."""
        return bool(self.sentences) and self.sentences[0].refine_ids is not None

    def opened(self) -> Job:
        """This job with a :class:`TextFeed`: more of its text will come."""
        return replace(self, feed=TextFeed(self.id, self.refine))


class TextFeed:
    """The later pieces of an utterance's text, handed to the engine (module docstring).

    :meth:`put` and :meth:`close` from any thread; :meth:`take` on the engine's thread. An
    append-only log: each task reads from its own position (a resumed request from 0 again).
    """

    def __init__(self, request_id: str, refine: bool) -> None:
        self.request_id = request_id
        self.refine = refine
        self._lock = threading.Lock()
        self._parts: list[Job] = []
        self._open = True

    @property
    def open(self) -> bool:
        """More text may still come."""
        with self._lock:
            return self._open

    def put(self, part: Job) -> None:
        """Hand over the next piece (:meth:`Pipeline.prepare` of the next text of the same request).

        Raises:
            RequestError: the text was complete already, or ``refine_text`` differs from the first piece's.
        """
        if part.refine != self.refine and part.sentences:
            raise RequestError(f"request {self.request_id}: refine_text must stay the same for all of its text")
        with self._lock:
            if not self._open:
                raise RequestError(f"request {self.request_id}: its text is complete; nothing can be added")
            self._parts.append(part)

    def close(self) -> None:
        """No more text: the engine ends the job after its last sentence."""
        with self._lock:
            self._open = False

    def take(self, since: int) -> tuple[list[Job], bool]:
        """The pieces after the first ``since`` and whether more may come (one atomic read: a
        piece put before :meth:`close` is always taken with or before the closed flag)."""
        with self._lock:
            return self._parts[since:], self._open

    def ready(self, since: int) -> bool:
        """A piece after the first ``since`` waits, or the text is complete (the engine has work)."""
        with self._lock:
            return len(self._parts) > since or not self._open


@dataclass(frozen=True)
class JobStats:
    """Timings of one finished job.

    Attributes:
        ttfb_ms: from the job's start in the engine to its first PCM chunk, ms.
        rtf: wall seconds of synthesis per second of audio produced.
        audio_s: seconds of audio (24 kHz samples / 24000).
        steps: decode steps (codes) produced, all sentences together.
        steps_per_s: decode steps per wall second.
        sentences: GPT generations run.
    """

    ttfb_ms: float
    rtf: float
    audio_s: float
    steps: int
    steps_per_s: float
    sentences: int


@dataclass
class Report:
    """What one run of a job said and did; written by the engine's thread only, read once its
    task has ended (the service's ``done``, the health check).

    Attributes:
        spoken: per sentence, in order, the text spoken (refine-text's when it ran and gave one).
        refined: sentence index -> the text refine-text gave it ("" for none), where it ran.
        text_tokens: per sentence, in order, its text's tokens (what the start policy learns from).
        unspeakable: the characters of all its text that could not be spoken.
        silent: indices of sentences that produced no audio (end of sequence at the first step).
        truncated: ``(index, steps)`` of each sentence that reached its step cap (cut there).
        codes: every kept code (int64 ``[4]`` each, in order) when the run was asked to keep them
            (the health check's reference), else None.
        max_rows: most rows any decode step of the job had (> 1: it ran batched).
        stats: its timings once it finished (None: it failed or was cancelled).
    """

    spoken: list[str] = field(default_factory=list)
    refined: dict[int, str] = field(default_factory=dict)
    text_tokens: list[int] = field(default_factory=list)
    unspeakable: list[str] = field(default_factory=list)
    silent: list[int] = field(default_factory=list)
    truncated: list[tuple[int, int]] = field(default_factory=list)
    codes: Optional[list[np.ndarray]] = None
    max_rows: int = 0
    stats: Optional[JobStats] = None
