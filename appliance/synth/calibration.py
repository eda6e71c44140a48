"""Measuring how much look-ahead the vocoder windows really need (``chattts-appliance calibrate``,
and the daemon at a start that finds no calibration for its engines).

The Decoder and Vocos are convolution stacks with a theoretical receptive field of ±75 and ±27
mel frames at full size: exact streaming waits 53 decode steps (1.1 s of audio) before a token's
audio is final. How far the *trained* weights really look is a property of the checkpoint, so it
is measured here, on the installed checkpoint, backend and precision:

1. A fixed set of sentences (Chinese, English, mixed) is synthesized with several voices and
   seeds through the pipeline's own decode loop (the runner keeps each sentence's hidden states).
2. The exact stream of each sentence is :class:`~appliance.synth.vocoder.WindowedVocoder` with the
   exact look-ahead, in chunks of 2 decode steps (the most joins, and every frame committed with
   the least context: the worst case of any chunk schedule).
3. For increasing look-ahead ``r`` the sentence is streamed the same way with ``r`` steps of right
   context, and also with the pipeline's own chunk schedule (``stream.first_chunk_tokens`` growing
   by ``stream.chunk_growth`` up to ``stream.chunk_tokens``); the error is the larger of the two
   ``20 log10(max |streamed - exact stream| / max |exact stream|)``. Both are the stream that runs:
   with ``r`` steps the Decoder also freezes its frames once ``2r`` mel frames exist to their right
   (``WindowedVocoder.reach``), so the error covers the frozen provisional frames too.
4. The smallest ``r`` whose worst error over all sentences is at or below
   ``stream.lookahead_threshold_db`` (default -60 dB) is the result; with none, the exact field.

The record also keeps each backend's *streaming floor*: the exact stream against one vocoder
window over the whole sentence. With an FP32 vocoder (every backend's default, the ONNX ``int8``
export included) it is FP32 rounding (below -100 dB); an INT8 vocoder (older ONNX exports) rounds
matrices of at most 64 rows another way than larger ones, so small passes differ from a one-shot
pass by its activation rounding (measured: -36 dB at full size); that is a property of INT8
compute, not of the look-ahead, and is reported, not calibrated away.

The entry also keeps the health check's reference (:func:`reference`): ``health.sentence`` under
the health seed, rendered by the production stream with the chosen look-ahead and again with the
exact one, fingerprinted (codes digest, band log-spectrum) with the tolerance derived from this
calibration's bar (:mod:`appliance.synth.reference`); the health check compares its own render
with it.

The result and the whole curve go to ``<model.engine_dir>/calibration.json``
(:mod:`appliance.engines.lookahead`), keyed by the checkpoint's sha256, backend and precision;
``engines export`` / ``engines build`` and ``scripts/install_jetson.sh`` run this after building,
and the daemon runs it before it serves when it finds no calibration for its engines
(:func:`calibrate_pipeline`, ``stream.calibrate_at_start``); the command and its report are
:mod:`appliance.build.calibrate`.
Random weights prove nothing about real ones: on a box, calibrate with the weights it speaks with.
"""

from __future__ import annotations

import datetime
import logging
import math
import time
from dataclasses import asdict
from typing import Callable, Optional

import numpy as np

from ..core import SynthesisRequest, SynthParams
from ..engines import manifest as mf
from ..engines.lookahead import Calibration, LookaheadChoice, save
from ..engines.runner import VocodeWindow
from . import reference as rf
from .decode_loop import Sequence
from .istft import istft
from .vocoder import WindowedVocoder

log = logging.getLogger(__name__)

#: (language, text): what a car or home box says; each is spoken with every voice of VOICES.
SENTENCES = (
    ("zh", "今天天气很好，我们一起去公园散步吧。"),
    ("en", "The next train to the airport leaves from platform two in five minutes."),
    ("mixed", "请在十点四十五分之前到达 Terminal B 的登机口。"),
)
VOICES = (("seed:2", 11), ("seed:7", 23))
CANDIDATES = (4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48)
CHUNK = 2
TOKENS = (60, 120)   # min / max decode steps per sentence


IDENTICAL_DB = -200.0


def error_db(streamed: np.ndarray, exact: np.ndarray) -> float:
    """``20 log10(max |streamed - exact| / max |exact|)``; :data:`IDENTICAL_DB` (-200) when identical."""
    peak = float(np.abs(exact).max())
    err = float(np.abs(streamed - exact).max()) if streamed.shape == exact.shape else peak
    return IDENTICAL_DB if err == 0.0 else max(IDENTICAL_DB, 20.0 * math.log10(err / max(peak, 1e-12)))


def _stream(voc: WindowedVocoder, slot: int, n: int, r: Optional[int], chunk: int | list[int]) -> np.ndarray:
    """The PCM of ``n`` hidden states of ``slot`` streamed with look-ahead ``r`` in chunks of ``chunk``
    steps (an int, or the sizes in turn, the last one repeated)."""
    sizes = [chunk] if isinstance(chunk, int) else list(chunk)
    voc.set_lookahead(r)
    voc.reset(slot)
    parts, k, i = [], 0, 0
    while True:
        k += sizes[min(i, len(sizes) - 1)]
        i += 1
        if k >= n:
            break
        parts.append(voc.push(k))
    parts.append(voc.push(n))
    parts.append(voc.finish())
    return np.concatenate(parts)


def calibrate(pipe, threshold_db: float, candidates=CANDIDATES, chunk: int = CHUNK, sentences=SENTENCES,
              voices=VOICES, tokens=TOKENS) -> Calibration:
    """Measure the look-ahead curve on ``pipe`` (a :class:`~appliance.synth.pipeline.Pipeline`) and
    return the calibration (not saved). Uses the pipeline's decode loop and runner slots; run it
    while nothing else synthesizes."""
    loop, runner = pipe.loop, pipe.runner
    sch = pipe.engine.schedule
    plan = sch.plan()
    voc = WindowedVocoder(runner, runner.info.max_seq_len)
    exact_r = voc.exact_lookahead
    cands = [r for r in candidates if r < exact_r]
    jobs = [(lang, text, voice, seed) for lang, text in sentences for voice, seed in voices]
    worst = {r: -math.inf for r in cands}
    per: list[dict] = []
    for i in range(0, len(jobs), loop.max_batch):
        batch = jobs[i:i + loop.max_batch]
        seqs = []
        for lang, text, voice, seed in batch:
            job = pipe.prepare(SynthesisRequest(id=f"calibrate-{lang}", text=text, voice=voice, seed=seed,
                                                params=SynthParams(min_new_tokens=tokens[0], max_new_tokens=tokens[1])))
            seq = Sequence(ids=job.prompts[0], spk_emb=job.spk_emb, params=job.params, seed=job.seed)
            loop.join(seq)
            seqs.append(seq)
        while loop.active:
            loop.step()
        try:
            for (lang, text, voice, seed), seq in zip(batch, seqs):
                n = seq.steps
                exact = _stream(voc, seq.slot, n, None, chunk)
                re, im = runner.vocode(seq.slot, VocodeWindow(0, n, 0, 2 * n, 0, 2 * n, 0, 2 * n))
                floor = error_db(exact, istft(re.copy(), im.copy()))
                curve = {}
                bar_s = max(threshold_db, floor + 3.0)   # this sentence's bar; the final one is no stricter
                for r in cands:
                    curve[r] = max(error_db(_stream(voc, seq.slot, n, r, chunk), exact),
                                   error_db(_stream(voc, seq.slot, n, r, plan), exact))
                    worst[r] = max(worst[r], curve[r])
                    if curve[r] <= bar_s:
                        break   # passes here; the error only falls with more context (measured)
                per.append({"lang": lang, "voice": voice, "seed": seed, "tokens": n,
                            "streaming_floor_db": round(floor, 1),
                            "error_db": {str(r): round(v, 1) for r, v in curve.items()}})
                log.info("calibrate %s %s: %s", lang, voice, {r: round(v, 1) for r, v in curve.items()})
        finally:
            for seq in seqs:
                loop.release(seq)
    # a look-ahead whose error is within the backend's own streaming rounding (FP16 windows round
    # differently by position) cannot be told from the exact stream: the bar is the threshold or,
    # where that floor is higher, 3 dB above it
    floor = max((s["streaming_floor_db"] for s in per), default=IDENTICAL_DB)
    bar = max(threshold_db, floor + 3.0)
    chosen = next((r for r in cands if worst[r] <= bar), exact_r)
    return Calibration(
        backend=runner.info.backend, precision=runner.info.precision, lookahead_tokens=int(chosen),
        exact_lookahead=exact_r, threshold_db=float(threshold_db), chunk_tokens=chunk, floor_db=round(floor, 1),
        engine_id=runner.info.engine_id, threads=runner.info.threads, threads_source=runner.info.threads_source,
        curve=[{"tokens": r, "worst_db": round(worst[r], 1)} for r in cands if worst[r] > -math.inf],  # measured ones
        sentences=per, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def reference(pipe, cal: Calibration, sentence: str) -> dict:
    """The health check's reference for ``cal`` (:func:`appliance.synth.reference.record`):
    ``sentence`` under the health seed through ``pipe.run``, first with the look-ahead ``cal``
    chose (what the daemon streams with), then exactly; the bar is this calibration's,
    ``max(threshold, floor + 3 dB)``. Leaves the pipeline at the chosen look-ahead."""
    chosen = cal.lookahead_tokens if cal.lookahead_tokens < cal.exact_lookahead else None
    takes = []
    for tokens in (None, chosen):
        pipe.set_lookahead(tokens)
        takes.append(rf.render(pipe, sentence, rf.HEALTH_SEED))
    return rf.record(takes[1], takes[0], max(cal.threshold_db, cal.floor_db + 3.0), chosen, cal.date, sentence)


def calibrate_pipeline(cfg, pipe, threshold_db: Optional[float] = None,
                       measure: Optional[Callable] = None) -> tuple[Calibration, str]:
    """Calibrate the loaded pipeline ``pipe`` (nothing else synthesizing), record the health check's
    reference, save it beside the engines and stream with it from now on; returns (calibration,
    path). What the daemon does at a start that finds no calibration for its engines, before it
    serves (``stream.calibrate_at_start``). ``measure``: the curve's measurement (default
    :func:`calibrate`)."""
    thr = cfg.stream.lookahead_threshold_db if threshold_db is None else threshold_db
    t = time.perf_counter()
    cal = (measure or calibrate)(pipe, thr)
    ref = reference(pipe, cal, cfg.health.sentence)
    ident = mf.checkpoint_identity(cfg.resolve(cfg.model.path))
    cal = Calibration(**{**asdict(cal), "checkpoint": ident, "reference": ref})
    path = save(cfg.resolve(cfg.model.engine_dir), cal)
    s = time.perf_counter() - t
    exact = cal.lookahead_tokens >= cal.exact_lookahead
    pipe.use_lookahead(LookaheadChoice(None if exact else cal.lookahead_tokens,
                                       f"calibrated {cal.date[:10]} for {cal.backend}/{cal.precision} in {s:.1f} s, "
                                       f"worst error <= {cal.threshold_db} dB"))
    log.info("calibration took %.1f s: look-ahead %s", s, pipe.describe_lookahead())
    return cal, str(path)
