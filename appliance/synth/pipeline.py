"""Text in, PCM chunks out: normalize -> split -> tokenize -> GPT -> Decoder -> Vocos -> ISTFT.

The one object the service layer talks to (no tensors cross it; numpy PCM only)::

    pipe = Pipeline.from_config(cfg)
    job = pipe.prepare(request)               # a SynthesisRequest; cheap; raises TextError / SpeakerError / RequestError
    run = pipe.run(job, cancel)
    for chunk in run:                         # PcmChunk: float32 samples [n], mono, chunk.rate Hz
        ...
    run.report.stats                          # JobStats once the run finished

Prompt format as upstream ``speaker.py`` ``decorate_code_prompts``:
``[Stts][spk_emb]{prompt}{sentence}[Ptts]``; the ``[spk_emb]`` position's embedding is replaced
by the L2-normalised speaker vector inside the runner's prefill. Long text is split into
sentences that fit ``model.max_prompt_tokens`` and spoken as one continuous stream (each
sentence is one GPT generation; their PCM is concatenated). Refine-text is off by default
(``synthesis.refine_text`` or a request's ``params.refine_text``): the GPT in text mode rewrites
each sentence just before it is spoken (torch CPU backend; up to 384 extra decode steps).

Differences from upstream on purpose: no mutable default parameters shared between calls (a
Job is immutable; each run writes its own Report), no "regenerate until non-empty" loop (an empty result raises
:class:`EmptyResultError`), no deletion of near-silent samples, and streaming is O(n) with exact
joins (:mod:`appliance.synth.vocoder`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from ..config import Config, SynthesisConfig, VoiceConfig
from ..core import DEGRADED, SAMPLE_RATE, Condition, PcmChunk, SamplingParams, SynthesisRequest, SynthParams
from ..engines.lookahead import LookaheadChoice
from ..engines.lookahead import choose as choose_lookahead
from ..engines.recover import Rebuild
from ..engines.runner import Runner, RunnerInfo
from ..errors import (
    ConfigError,
    EmptyResultError,
    RequestError,
    TextError,
)
from ..text.normalize import Normalizer
from ..text.speaker import resolve_voice
from ..text.budget import step_cap
from ..text.split import split_text
from ..text.tokenizer import Tokenizer
from ..text.voices import VoiceBook
from .batch import BatchEngine, Task, TaskState
from .checkpoint_dir import require_checkpoint
from .decode_loop import DecodeLoop
from .job import Job, Report, Sentence
from .schedule import ChunkSchedule
from .vocoder import WindowedVocoder

log = logging.getLogger(__name__)

#: Upstream ``RefineTextParams`` defaults (``ChatTTS/core.py``): temperature 0.7, top-P 0.7,
#: top-K 20, no repetition penalty, at most 384 tokens.
REFINE_PARAMS = SamplingParams(temperature=0.7, top_p=0.7, top_k=20, repetition_penalty=1.0, max_new_tokens=384)


class Pipeline:
    """ChatTTS synthesis over one :class:`~appliance.engines.runner.Runner`.

    Args:
        cfg: validated configuration.
        runner: an opened backend (see :func:`appliance.engines.select.open_runner`).
        tokenizer: the checkpoint's tokenizer.

    :meth:`run` (and everything touching the runner) belongs to one thread, the service's
    inference worker; :meth:`prepare` may run on another thread at the same time.
    """

    SAMPLE_RATE = SAMPLE_RATE

    def __init__(self, cfg: Config, runner: Runner, tokenizer: Tokenizer, engine_fallback: Optional[str] = None):
        if cfg.synthesis.refine_text and not runner.info.text_mode:
            raise ConfigError(f"synthesis.refine_text needs a backend with a text mode (torch on CPU); "
                              f"{runner.info.backend} has none: set it to false")
        self.cfg = cfg
        self.runner = runner
        self.tokenizer = tokenizer
        self.engine_fallback = engine_fallback
        self._loaded_at = time.monotonic()
        self.normalizer = Normalizer(tokenizer)
        self.voices = VoiceBook(cfg.voices)
        self.voices.check(runner.info.hidden_size, cfg.synthesis.voice)
        self._prepare_lock = threading.Lock()
        self.loop = DecodeLoop(runner)
        max_tokens = min(cfg.synthesis.max_new_tokens, runner.info.max_seq_len)
        self.vocoders = [WindowedVocoder(runner, max_tokens) for _ in range(self.loop.max_batch)]
        info = runner.info
        self.lookahead = choose_lookahead(cfg.stream.lookahead, cfg.resolve(cfg.model.engine_dir),
                                          cfg.resolve(cfg.model.path), info.backend, info.precision,
                                          cfg.stream.lookahead_threshold_db, info.engine_id)
        self.set_lookahead(self.lookahead.tokens)
        log.info("look-ahead: %s", self.lookahead.describe(self.vocoders[0].exact_lookahead))
        st = cfg.stream
        self.engine = BatchEngine(self.loop, self.vocoders, ChunkSchedule(st.first_chunk_tokens, st.chunk_tokens,
                                                                          st.chunk_growth, st.realtime_share,
                                                                          st.start_slack_ms / 1000.0,
                                                                          st.max_chunk_gap_ms / 1000.0),
                                  refiner=self._refine)

    @classmethod
    def from_config(cls, cfg: Config, rebuild: Optional[Rebuild] = None) -> "Pipeline":
        """Open the configured backend and the checkpoint's tokenizer; a bad built engine is
        rebuilt (``rebuild``) or replaced by the next backend that runs, which
        :meth:`conditions` then reports (:func:`~appliance.engines.recover.open_runner_recovering`).

        Raises:
            ConfigError, CheckpointError, EngineError: see :func:`~appliance.engines.recover.open_runner_recovering`.
        """
        from ..engines.recover import open_runner_recovering

        asset = require_checkpoint(cfg)
        marker = asset.parent / "RANDOM_WEIGHTS"          # written by `model random` beside asset/
        if marker.exists():
            log.warning("the checkpoint in %s has RANDOM weights: the voice is noise (see README: Getting "
                        "the real weights). %s", asset.parent, marker.read_text(encoding="utf-8", errors="replace").strip())
        tokenizer = Tokenizer.from_dir(asset / "tokenizer")
        opened = open_runner_recovering(cfg, rebuild)
        return cls(cfg, opened.runner, tokenizer, engine_fallback=opened.fallback)

    def conditions(self) -> tuple[Condition, ...]:
        """Health's view (a :data:`~appliance.core.ConditionSource`): ``engine_fallback``
        (degraded) while it runs another backend than the one it picked, naming why."""
        if self.engine_fallback is None:
            return ()
        return (Condition("engine_fallback", self.engine_fallback, self._loaded_at, DEGRADED),)

    @staticmethod
    def planned_sizes(cfg: Config):
        """What the configured backend will hold, before it loads
        (:func:`appliance.engines.sizes.plan_sizes`: weight bytes, KV bytes per position)."""
        from ..engines.sizes import plan_sizes

        return plan_sizes(cfg)

    def use_synthesis(self, synthesis: SynthesisConfig) -> None:
        """Take new ``synthesis`` defaults (a reload, SIGHUP): every later :meth:`prepare` reads
        them (any thread; one reference swapped, so a prepare sees the old or the new section whole).

        Raises:
            ConfigError: ``refine_text`` on a backend without a text mode.
        """
        if synthesis.refine_text and not self.runner.info.text_mode:
            raise ConfigError(f"synthesis.refine_text needs a backend with a text mode; {self.runner.info.backend} has none")
        self.cfg = dataclasses.replace(self.cfg, synthesis=synthesis)

    def use_voices(self, voices: Sequence[VoiceConfig]) -> None:
        """Take a new named-voice table (a reload, SIGHUP): every later :meth:`prepare` resolves
        its names (any thread; one reference swapped).

        Raises:
            ConfigError: a voice string of ``voices`` does not decode (the running table stays).
        """
        book = VoiceBook(voices)
        book.check(self.runner.info.hidden_size, self.cfg.synthesis.voice)
        self.voices = book

    @property
    def info(self) -> RunnerInfo:
        """The runner's description (backend, precision, memory)."""
        return self.runner.info

    def set_lookahead(self, tokens: Optional[int]) -> None:
        """Right context of every vocoder window, decode steps (None: exact). Worker thread only."""
        for v in self.vocoders:
            v.set_lookahead(tokens)

    def use_lookahead(self, choice: LookaheadChoice) -> None:
        """Stream with ``choice`` from now on (a calibration made on this pipeline). Worker thread only."""
        self.lookahead = choice
        self.set_lookahead(choice.tokens)

    def describe_lookahead(self) -> str:
        """One line for logs, STATUS and the health report, e.g. ``16 steps (calibrated ...)``."""
        return self.lookahead.describe(self.vocoders[0].exact_lookahead)

    def device_memory_bytes(self) -> int:
        """Accelerator memory the backend holds now (0 on a CPU: RSS counts it)."""
        return self.runner.device_memory_bytes()

    def close(self) -> None:
        """Release the backend."""
        self.runner.close()

    # ------------------------------------------------------------------ prepare

    def prepare(self, request: SynthesisRequest) -> Job:
        """Validate and pre-process a :class:`~appliance.core.SynthesisRequest` (no model run).

        Thread-safe with respect to :meth:`run`: it reads only the tokenizer, the normalizer
        (serialized by a lock) and immutable runner info, so the service may call it on its own
        thread while the worker synthesizes.

        Raises:
            TextError: empty, unspeakable or too long text.
            SpeakerError: malformed voice string, or an unknown voice name.
        """
        if not isinstance(request, SynthesisRequest):
            raise TypeError(f"Pipeline.prepare takes a SynthesisRequest, not {type(request).__name__}")
        with self._prepare_lock:
            return self._prepare(request)

    def _prepare(self, speak: SynthesisRequest) -> Job:
        cfg = self.cfg
        text = speak.text
        if len(text) > cfg.service.max_text_chars:
            raise TextError(f"text of {len(text)} characters is over the limit of {cfg.service.max_text_chars} (service.max_text_chars); split it")
        s = cfg.synthesis
        norm = self.normalizer(text, request_id=speak.id, emoji=s.emoji, list_numbers=s.list_numbers)
        p = speak.params
        params = SamplingParams.from_config(
            s, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
            repetition_penalty=p.repetition_penalty, min_new_tokens=p.min_new_tokens,
            # synthesis.max_new_tokens is the box's hard limit; the vocoder buffers were sized by the
            # value at start-up, which a reload (SIGHUP) may have raised since: the smaller one holds
            max_new_tokens=min(p.max_new_tokens if p.max_new_tokens is not None else s.max_new_tokens,
                               s.max_new_tokens, self.vocoders[0].max_tokens,
                               self.runner.info.max_seq_len - cfg.model.max_prompt_tokens - 1))
        prompt = p.prompt if p.prompt is not None else s.prompt
        voice = self.voices.lookup(speak.voice, s.voice)
        spk_emb = resolve_voice(voice.spec, self.runner.info.hidden_size)
        split = split_text(norm.text, self.tokenizer, cfg.model.max_prompt_tokens, prompt=prompt,
                           with_speaker=spk_emb is not None, max_steps=params.max_new_tokens)
        frame = self.tokenizer.code_prompt("", with_speaker=spk_emb is not None, prompt=prompt).size
        seed = speak.seed if speak.seed is not None else s.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
        refine = p.refine_text if p.refine_text is not None else s.refine_text
        if refine and not self.runner.info.text_mode:
            raise RequestError(f"refine_text needs a backend with a text mode; {self.runner.info.backend} has none")
        # upstream speaker.py decorate_text_prompts: [Sbreak]{text}[Pbreak]{prompt}
        sentences = tuple(Sentence(text=sent.text, ids=sent.ids,              # tokenized once, by split_text
                                   text_tokens=max(1, int(sent.ids.size) - int(frame)),   # expected length (start plan)
                                   refine_ids=self.tokenizer.encode(f"[Sbreak]{sent.text}[Pbreak]{s.refine_prompt}")
                                   if refine else None,
                                   max_steps=step_cap(sent.text, params.max_new_tokens, params.min_new_tokens))
                          for sent in split)
        return Job(id=speak.id, text=norm.text, sentences=sentences, unspeakable=tuple(norm.unspeakable),
                   seed=int(seed), params=params, spk_emb=spk_emb, prompt=prompt, voice=voice.label,
                   notes=norm.notes)

    def _refine(self, job: Job, sentence: Sentence, k: int) -> tuple[str, np.ndarray]:
        """Refine-text for sentence ``k`` of ``job`` (called by the engine on the worker thread
        just before the sentence joins): returns the refined text ("" when it gave none) and the
        code prompt to decode (int64 ``[T]``: the refined text's, or the sentence's own where the
        refined text is empty or no longer fits ``model.max_prompt_tokens``, logged). Upstream
        keeps only generated ids below ``[break_0]`` (``core.py`` ``_infer``)."""
        tok = self.tokenizer
        ids = self.loop.refine(sentence.refine_ids, eos_id=tok.id_of("[Ebreak]"), seed=job.seed + 1000 + k,
                               params=REFINE_PARAMS)
        ids = ids[ids < tok.id_of("[break_0]")]
        text = tok.decode(ids).strip()
        if not text:
            log.warning("request %s: refine-text gave no text for sentence %d; keeping it as is", job.id, k)
            return text, sentence.ids
        try:
            return text, tok.code_prompt(text, prompt=job.prompt, with_speaker=job.spk_emb is not None,
                                         max_tokens=self.cfg.model.max_prompt_tokens)
        except TextError as e:
            log.warning("request %s: refined sentence %d does not fit (%s); keeping it as is", job.id, k, e)
            return text, sentence.ids

    # ------------------------------------------------------------------ run

    def run(self, job: Job, cancel: Optional[threading.Event] = None, keep_codes: bool = False,
            on_step: Optional[Callable[[], None]] = None) -> Run:
        """Synthesize ``job`` alone: a :class:`Run`, whose iteration yields
        :class:`~appliance.core.PcmChunk` (float32 mono, 24 kHz) as they become final and whose
        ``report`` (:class:`~appliance.synth.job.Report`) holds what it said and its timings.

        The first chunk carries ``stream.first_chunk_tokens`` decode steps, later ones grow up to
        ``stream.chunk_tokens`` (:class:`~appliance.synth.schedule.ChunkSchedule`); a chunk's
        audio is committed once the look-ahead (exact or calibrated) exists to its right.
        This is the one-job use of :attr:`engine` (:class:`~appliance.synth.batch.BatchEngine`),
        the same code path the scheduler drives for several jobs at once. ``keep_codes``: the
        report keeps every code (the health check's reference). ``on_step``: called every decode
        step (the service's watchdog heartbeat while a health check runs on its thread).

        Iterating raises:
            CancelledError: ``cancel`` was set (checked every decode step).
            EmptyResultError: no sentence produced any audio code.
        """
        return Run(self.engine, job, cancel, keep_codes, on_step)

    def warmup(self) -> float:
        """Leave nothing cold for the first real request; returns the wall time in seconds.

        First calls allocate (ONNX Runtime's arena grows to the largest shape it has seen, torch's
        caching allocator, cuDNN picks algorithms) and prepack weights: the first prefill after a
        start measured 821 ms on the 2-core CPU instead of 175. So this runs prefills of the longest
        and of a typical prompt, one short sentence through the whole stream, and vocoder windows up
        to the chunk schedule's largest (every widened shape on a GPU; input values do not matter).
        Must run before the daemon serves (it uses KV slot 0).
        """
        from ..engines.runner import VocodeWindow

        t = time.perf_counter()
        ids = self.tokenizer.encode("你好" * self.info.max_prompt_tokens)
        for n in (self.info.max_prompt_tokens, 32):
            self.runner.prefill(0, ids[:max(1, min(n, len(ids)))], None)
        voc = self.vocoders[0]
        job = self.prepare(SynthesisRequest(text="你好。", id="warmup", seed=0, params=SynthParams(
            max_new_tokens=2 * (voc.lookahead_tokens + self.engine.schedule.first))))
        try:
            for _ in self.run(job):
                pass
        except EmptyResultError:
            pass
        sch = self.engine.schedule
        h = min(sch.cap + 2 * voc.exact_lookahead, voc.max_tokens)
        q = self.info.window_quantum
        # every window shape the stream can produce on a stateless GPU backend (windows are widened
        # to multiples of q tokens there; each new shape costs cuDNN / TensorRT set-up once)
        for n in (range(q, h + q, q) if q > 1 else (h,)):
            n = min(n, voc.max_tokens)
            self.runner.vocode(0, VocodeWindow(0, n, 0, 2 * n, 0, 2 * n, 0, 2 * n))
        # the stateful passes of each chunk size the schedule makes (first, growing, cap)
        voc.reset(0)
        n, plan = 0, sch.plan()
        for c in itertools.chain(plan, itertools.repeat(plan[-1])):     # the last size from then on
            if n + c > voc.max_tokens or n >= h:
                break
            n += c
            voc.push(n)
        voc.finish()
        return time.perf_counter() - t


class Run:
    """One job through the engine alone (:meth:`Pipeline.run`): an iterator of its PCM chunks
    (nothing runs before the first ``next``); :attr:`report` once it finished (or failed)."""

    def __init__(self, engine: BatchEngine, job: Job, cancel: Optional[threading.Event], keep_codes: bool,
                 on_step: Optional[Callable[[], None]]) -> None:
        self._engine, self._job, self._cancel, self._keep, self._on_step = engine, job, cancel, keep_codes, on_step
        self._task: Optional[Task] = None
        self._chunks = self._run()

    @property
    def report(self) -> Report:
        """What the run said and did (empty before it started)."""
        return self._task.report if self._task is not None else Report()

    def __iter__(self) -> Run:
        return self

    def __next__(self) -> PcmChunk:
        return next(self._chunks)

    def close(self) -> None:
        """Stop early: the task leaves the engine (its slot is free)."""
        self._chunks.close()

    def _run(self) -> Iterator[PcmChunk]:
        out: list[PcmChunk] = []
        eng = self._engine
        task = self._task = eng.add(self._job, out.append, self._cancel, keep_codes=self._keep)
        try:
            while not task.finished:
                eng.step(self._on_step)
                while out:
                    yield out.pop(0)
            while out:
                yield out.pop(0)
        finally:
            if not task.finished:
                eng.remove(task, TaskState.CANCELLED)
        if task.error is not None:
            raise task.error
