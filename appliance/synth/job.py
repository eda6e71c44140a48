"""A prepared request as the synthesis layer holds it: its sentences, their prompts, its report.

:meth:`~appliance.synth.pipeline.Pipeline.prepare` makes a :class:`Job`; the
:class:`~appliance.synth.batch.BatchEngine` runs it; :class:`JobStats` is its report once finished.
A leaf: numpy and the core types only, so the service reads a job's fields without the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..core import SamplingParams
from ..errors import RequestError


@dataclass
class JobStats:
    """Timings of one finished job.

    Attributes:
        ttfb_ms: from the start of :meth:`Pipeline.run` to the first PCM chunk, ms.
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
class Job:
    """A validated request, ready for :meth:`Pipeline.run`.

    Attributes:
        id: request id. text: normalized text. sentences: the pieces spoken one after another.
        unspeakable: characters of the input that cannot be spoken (skipped, reported).
        seed: sampling seed. params: effective sampling parameters. spk_emb: speaker vector.
        voice: how ``done`` names the voice (:class:`~appliance.text.voices.VoiceChoice` label).
        stats: filled when ``run`` finishes. meta: ``text_tokens`` (per sentence, its text's tokens
            without the prompt's frame: the expected length), ``refined`` (sentence -> refined
            text), ``silent`` (indices of sentences that produced no audio); a ``codes`` list set
            before :meth:`run` receives every kept code and ``max_rows`` the widest batch it ran in.
        open: more text may still come (:meth:`extend`; an utterance streamed in pieces): the
            engine waits after the last sentence instead of finishing, until :meth:`close`.
    """

    id: str
    text: str
    sentences: list
    prompts: list
    unspeakable: list
    seed: int
    params: SamplingParams
    spk_emb: Optional[np.ndarray]
    stats: Optional[JobStats] = None
    meta: dict = field(default_factory=dict)
    prompt: str = ""
    refine_prompts: Optional[list] = None
    voice: str = ""
    open: bool = False

    def extend(self, part: "Job") -> None:
        """Append the sentences of ``part`` (:meth:`Pipeline.prepare` of the next text of the same
        request: an utterance whose text still arrives) to this job, which must be :attr:`open`.
        Any thread while the engine runs the job: ``prompts`` grows last, so the engine (which
        reads ``prompts[k]`` only for ``k < len(prompts)``) never sees a half-added sentence.

        Raises:
            RequestError: the job is closed (its text is complete).
        """
        if not self.open:
            raise RequestError(f"request {self.id}: its text is complete; nothing can be added")
        if (self.refine_prompts is None) != (part.refine_prompts is None):
            raise RequestError(f"request {self.id}: refine_text must stay the same for all of its text")
        self.text = f"{self.text} {part.text}".strip()
        self.unspeakable.extend(u for u in part.unspeakable if u not in self.unspeakable)
        self.sentences.extend(part.sentences)
        if self.refine_prompts is not None:
            self.refine_prompts.extend(part.refine_prompts)
        self.meta.setdefault("text_tokens", []).extend(part.meta.get("text_tokens", []))
        self.prompts.extend(part.prompts)

    def close(self) -> None:
        """No more text: the engine ends the job after its last sentence (any thread)."""
        self.open = False
