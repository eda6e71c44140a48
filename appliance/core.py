"""Leaf types shared by every layer: audio constants, sampling parameters, the synthesis request,
the PCM chunk the pipeline yields, and the health :class:`Condition` any part may report (with
:class:`ConditionFlag`, a condition a part raises and clears). Imports nothing of the package but
errors.

The layers (imports only point down; ``tests/test_layering.py`` keeps it so)::

    errors, config, core  <-  model  <-  engines  <-  synth  <-  service, build  <-  cli
                                          text  <--'

``text`` (normalize, split, tokenizer, speaker) sits beside ``synth`` and below it; ``build``
(export, engine plans, calibration, random checkpoints) is a tool layer beside ``service``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import Callable, Iterable, Optional, Union

import numpy as np

#: Audio vocabulary: 625 FSQ codes + end-of-sequence, per codebook; 4 codebooks.
NUM_AUDIO_TOKENS = 626
AUDIO_EOS = 625
NUM_VQ = 4

#: Output sample rate of Vocos (Hz) and its hop in samples (two per GPT decode step: 512 samples).
SAMPLE_RATE = 24000
HOP_LENGTH = 256

#: FFT size of the Vocos head (its mel bins come from the checkpoint: ``ModelShapes.n_mels``).
N_FFT = 1024


def version() -> str:
    """This package's version: the installed distribution's, else (a checkout that was not
    installed) the one ``pyproject.toml`` held when this was written."""
    try:
        return metadata.version("chattts-appliance")
    except metadata.PackageNotFoundError:
        return "0.1.0"


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request (upstream ``InferCodeParams`` defaults). The seed is
    not here: it is given to :meth:`Sampler.start` (one per request, reported back).

    Attributes:
        temperature: one value, or one per codebook (4 values); > 0.
        top_p: nucleus mass kept, in (0, 1]; None = off.
        top_k: codes kept (at least 3 always are); None = off.
        repetition_penalty: > 0 (>= 1 in practice); 1 = off.
        min_new_tokens: EOS is masked for the first this many steps.
        max_new_tokens: hard stop in decode steps (enforced by the decode loop, not here).
        greedy: argmax instead of drawing (the seed is then unused).
    """

    temperature: Union[float, tuple[float, ...]] = 0.3
    top_p: Optional[float] = 0.7
    top_k: Optional[int] = 20
    repetition_penalty: float = 1.05
    min_new_tokens: int = 0
    max_new_tokens: int = 2048
    greedy: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.temperature, list):
            object.__setattr__(self, "temperature", tuple(self.temperature))
        t = self.temperature if isinstance(self.temperature, tuple) else (self.temperature,)
        if len(t) not in (1, NUM_VQ) or not all(x > 0 for x in t):
            raise ValueError(f"temperature {self.temperature!r} must be > 0, one value or {NUM_VQ}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p} must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k {self.top_k} must be >= 1")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty {self.repetition_penalty} must be > 0")
        if self.min_new_tokens < 0 or self.max_new_tokens < 1:
            raise ValueError(f"min_new_tokens {self.min_new_tokens} must be >= 0 and "
                             f"max_new_tokens {self.max_new_tokens} >= 1")

    @classmethod
    def from_config(cls, syn, **overrides) -> "SamplingParams":
        """Build from ``appliance.config.SynthesisConfig`` (``cfg.synthesis``), then overrides
        (keys whose value is None are ignored)."""
        base = dict(temperature=syn.temperature, top_p=syn.top_p, top_k=syn.top_k,
                    repetition_penalty=syn.repetition_penalty,
                    min_new_tokens=syn.min_new_tokens, max_new_tokens=syn.max_new_tokens)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


@dataclass(frozen=True)
class SynthParams:
    """Per-request overrides of the sampling defaults (``synthesis`` in config). None = default.

    Attributes:
        temperature: sampling temperature (> 0).
        top_p: nucleus mass in (0, 1].
        top_k: codes kept, 1..626.
        repetition_penalty: >= 1.
        min_new_tokens: EOS masked before this many decode steps.
        max_new_tokens: hard stop in decode steps for EACH SENTENCE (46.875 per second of audio).
        prompt: control tokens put before the text, e.g. ``[speed_5][oral_2]``.
        refine_text: run the refine-text pass for this request (default: ``synthesis.refine_text``).
    """

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    repetition_penalty: Optional[float] = None
    min_new_tokens: Optional[int] = None
    max_new_tokens: Optional[int] = None
    prompt: Optional[str] = None
    refine_text: Optional[bool] = None


@dataclass(frozen=True)
class SynthesisRequest:
    """What the pipeline needs to speak one text. The service's ``speak`` message
    (:class:`~appliance.messages.protocol.Speak`) is one, with its routing added: the pipeline
    takes it as it is.

    Attributes:
        text: what to say (UTF-8; control tokens such as ``[uv_break]`` allowed).
        id: request id (logs, statistics).
        voice: ``seed:N`` or an upstream speaker string; None = ``synthesis.voice``.
        seed: sampling seed; None = ``synthesis.seed`` or a fresh random one.
        params: per-request overrides of the sampling defaults.
    """

    text: str
    id: str = ""
    voice: Optional[str] = None
    seed: Optional[int] = None
    params: SynthParams = field(default_factory=SynthParams)


@dataclass(frozen=True)
class PcmChunk:
    """A piece of synthesized audio, in order.

    Attributes:
        samples: float32 ``[n]`` mono PCM in [-1, 1] (not clipped).
        rate: sample rate, Hz (24000 for ChatTTS).
        sentence: which sentence of its request it belongs to (0 = the first).
        ends_sentence: it is that sentence's last chunk (a player may pause after it).
    """

    samples: np.ndarray
    rate: int = SAMPLE_RATE
    sentence: int = 0
    ends_sentence: bool = False

    @property
    def seconds(self) -> float:
        """Duration, s."""
        return self.samples.shape[0] / self.rate


#: How bad a :class:`Condition` is: the box still speaks, worse than it should (``degraded``), or
#: it does not do its job (``unhealthy``: mute, garbled, or about to fail at the next start).
DEGRADED, UNHEALTHY = "degraded", "unhealthy"


@dataclass(frozen=True)
class Condition:
    """One thing wrong with the box now, as health reports it (:mod:`appliance.ops.verdict`).

    Attributes:
        name: what it is, a stable key for machines (``throttled``, ``device_missing``,
            ``storage_degraded``, ``wav_unwritable``, ``reload_failed``, ``integrity``,
            ``audio_reference``, ``engine_fallback``, ...).
        reason: one line for a person, readable alone (what was seen and what the box does).
        since: when it began, ``time.monotonic()`` s (the wire form shows its age, ``for_s``).
        severity: :data:`DEGRADED` or :data:`UNHEALTHY`.
    """

    name: str
    reason: str
    since: float
    severity: str = DEGRADED

    def __post_init__(self) -> None:
        if self.severity not in (DEGRADED, UNHEALTHY):
            raise ValueError(f"Condition.severity must be {DEGRADED!r} or {UNHEALTHY!r}, not {self.severity!r}")


ConditionSource = Callable[[], Iterable[Condition]]
"""What the health verdict reads: ``() -> the conditions that hold now`` (empty when all is well).
Called from any thread, often (each ``status``); must be quick and must not block."""


class ConditionFlag:
    """One condition a part raises and clears (thread-safe); the flag itself is a
    :data:`ConditionSource`. ``since`` is kept while it stays raised, whatever the reason becomes.

    Args:
        name: :attr:`Condition.name`. severity: :attr:`Condition.severity`.
        clock: monotonic clock, s (tests).
    """

    def __init__(self, name: str, severity: str = DEGRADED, clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.severity, self._clock = name, severity, clock
        self._lock = threading.Lock()
        self._cond: Optional[Condition] = None

    def set(self, reason: str) -> None:
        """Raise it (or change its reason)."""
        with self._lock:
            since = self._cond.since if self._cond is not None else self._clock()
            self._cond = Condition(self.name, reason, since, self.severity)

    def clear(self) -> None:
        """Its cause is gone."""
        with self._lock:
            self._cond = None

    def update(self, reason: Optional[str]) -> None:
        """:meth:`set` with a reason, :meth:`clear` with None."""
        if reason is None:
            self.clear()
        else:
            self.set(reason)

    def __call__(self) -> tuple:
        cond = self._cond
        return () if cond is None else (cond,)
