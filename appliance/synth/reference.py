"""The health check's reference: its sentence rendered when the box was known good, and the test
that the audio still sounds like it.

``chattts-appliance calibrate`` (:mod:`appliance.build.calibrate`) renders ``health.sentence``
under :data:`HEALTH_SEED` through :func:`render` (``Pipeline.prepare`` / ``Pipeline.run``: the
production stream the health check itself uses) and :func:`record` stores a fingerprint of it in
the calibration entry (``"reference"`` in ``<engine_dir>/calibration.json``, :mod:`appliance.engines.lookahead`;
the entry is keyed by checkpoint sha256, backend, precision and engine id)::

    {"request": sha256 of the prepared job (prompt ids, speaker vector, seed, sampling settings),
     "sentence": ..., "seed": 1234, "steps": 212, "samples": 108544,
     "codes_sha256": sha256 of the codes int64 [steps, 4] (null: the backend did not repeat them),
     "spectrum": base64 of int16 [frames, 8] in 0.01 dB, "frames": 105, "range_db": 60.0,
     "tolerance_db": 0.31, "measured": {"repeat_db": ..., "bar_noise_db": ...},
     "lookahead_tokens": 16, "date": "2026-12-03T10:00:00+00:00"}

The fingerprint (:func:`fingerprint`) is the band log-spectrum of the PCM: Hann frames of 2048
samples, hop 1024 (43 ms at 24 kHz), power summed in the 8 octave-like bands of
:data:`BAND_EDGES_HZ`, in dB, rounded to 0.01 dB (2 bytes a value: ~1.5 KB for 4 s of audio).
The distance (:func:`band_lsd`) is the log-spectral distance of Gray & Markel (1976, IEEE TASSP
24(5)) over those bands: per frame the RMS over bands of the dB difference, averaged over frames,
each value clamped to ``range_db`` below the louder clip's loudest band.

Where the numbers come from (nothing here is a fixed dB): calibrate measured the error it accepts
from streaming, its *bar* (``max(stream.lookahead_threshold_db, streaming floor + 3 dB)``, e.g.
-60 dB re the peak). ``range_db`` is ``-bar``: what lies further below the loudest band than the
streaming error calibrate allows is not compared. The tolerance is the larger of (a) the distance
between two renders of the reference, the first with the calibrated look-ahead (what the daemon
uses), the second with the exact one (run-to-run variation and the look-ahead's own effect), and
(b) the distance that white noise as large as the bar (uniform, peak ``10^(bar/20)`` times the
clip's peak) makes when added to the whole clip.

The codes must be identical: the same seed on the same backend and precision draws the same codes
(docs/architecture.md, "One sampler, one random stream"), unless the health render shared its
decode steps with other requests (batched rounding may move a draw; then they are not judged).

:func:`check` finds the matching reference and compares: reasons start with ``audio: far from the
reference`` and name what differs; no matching reference is a note, not a failure.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from ..core import SAMPLE_RATE, SynthesisRequest
from ..engines import manifest as mf
from ..engines.lookahead import read as read_calibrations
from ..errors import EngineError
from .job import Job, Report

HEALTH_SEED = 1234
"""Sampling seed of the health sentence (fixed, so runs are comparable)."""
N_FFT, HOP = 2048, 1024
BAND_EDGES_HZ = (0, 150, 300, 600, 1200, 2400, 4800, 8000, 12000)
_CENTI = 100.0
REMEDY = ("a weight may have changed since (on disk or in memory): restart the daemon (its load hashes every "
          "weight file and names a changed one); if it starts clean, run 'chattts-appliance calibrate' again")


@dataclass(frozen=True)
class Take:
    """One render: the job (what was asked) and its report (what it drew: ``report.codes``, the
    kept codes, int64 ``[4]`` each, in order; ``report.max_rows``; ``report.stats``)."""

    job: Job
    report: Report


def render(pipeline: Any, text: str, seed: int, cancel=None,
           beat: Optional[Callable[[], None]] = None) -> tuple[np.ndarray, Take]:
    """``text`` under ``seed`` through ``pipeline.prepare`` / ``pipeline.run``, not played
    (``beat``: called every decode step, the watchdog's heartbeat on the worker thread).

    Returns:
        (float32 PCM ``[n]`` at 24 kHz, the :class:`Take`).

    Raises:
        whatever ``pipeline.run`` raises (CancelledError, EngineError, ...).
    """
    job = pipeline.prepare(SynthesisRequest(text=text, id=f"health-{seed}", seed=seed))
    run = pipeline.run(job, cancel, keep_codes=True, on_step=beat)
    parts = [c.samples for c in run if c.samples.size]
    pcm = np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, np.float32)
    return pcm, Take(job, run.report)


def request_digest(job: Any) -> str:
    """sha256 over what the decode depends on besides the weights: prompt ids, speaker vector,
    seed and sampling settings of a prepared job (text, voice, prompt and config all end up there)."""
    h = hashlib.sha256()
    for ids in job.prompts:
        h.update(np.asarray(ids, "<i8").tobytes() + b"|")
    h.update(b"spk:" + (b"none" if job.spk_emb is None else np.asarray(job.spk_emb, "<f4").tobytes()))
    h.update(json.dumps({"seed": int(job.seed), **dataclasses.asdict(job.params)}, sort_keys=True).encode())
    return h.hexdigest()


def codes_digest(codes: list) -> str:
    """sha256 of the kept codes as little-endian int64 ``[steps, 4]``."""
    a = np.stack(codes).astype("<i8") if codes else np.zeros((0, 4), "<i8")
    return hashlib.sha256(a.tobytes()).hexdigest()


def fingerprint(pcm: np.ndarray, rate: int = SAMPLE_RATE) -> np.ndarray:
    """Band log-spectrum of ``pcm`` (module doc): float64 ``[frames, 8]`` in dB, rounded to 0.01 dB."""
    x = np.asarray(pcm, np.float64).ravel()
    if x.size < N_FFT:
        x = np.pad(x, (0, N_FFT - x.size))
    n = 1 + (x.size - N_FFT) // HOP
    frames = np.lib.stride_tricks.sliding_window_view(x, N_FFT)[::HOP][:n] * np.hanning(N_FFT)
    p = np.abs(np.fft.rfft(frames, axis=1)) ** 2
    edges = np.searchsorted(np.fft.rfftfreq(N_FFT, 1.0 / rate), BAND_EDGES_HZ)
    bands = np.add.reduceat(p, edges[:-1], axis=1)
    db = 10 * np.log10(np.maximum(bands, 1e-12))
    return np.round(np.clip(db, -327.0, 327.0) * _CENTI) / _CENTI


def band_lsd(a: np.ndarray, b: np.ndarray, range_db: float) -> float:
    """Log-spectral distance (dB) of two fingerprints over their common frames (module doc)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0.0
    a, b = a[:n], b[:n]
    floor = max(float(a.max()), float(b.max())) - range_db
    a, b = np.maximum(a, floor), np.maximum(b, floor)
    return float(np.mean(np.sqrt(np.mean((a - b) ** 2, axis=1))))


def _encode(spec: np.ndarray) -> str:
    return base64.b64encode(np.round(spec * _CENTI).astype("<i2").tobytes()).decode("ascii")


def _decode(s: str, frames: int) -> np.ndarray:
    a = np.frombuffer(base64.b64decode(s), "<i2").astype(np.float64) / _CENTI
    return a.reshape(frames, len(BAND_EDGES_HZ) - 1)


def record(first: tuple[np.ndarray, Take], second: tuple[np.ndarray, Take], bar_db: float,
           lookahead_tokens: Optional[int], date: str, text: str) -> dict:
    """The ``"reference"`` of a calibration entry from two renders of the health sentence
    (:func:`render`: ``first`` with the calibrated look-ahead, ``second`` with the exact one) and
    calibrate's bar (dB re the peak, < 0). Tolerance and range as in the module doc."""
    (pa, ta), (pb, tb) = first, second
    fa, fb = fingerprint(pa), fingerprint(pb)
    range_db = -float(bar_db)
    codes_a, codes_b = codes_digest(ta.report.codes or []), codes_digest(tb.report.codes or [])
    repeat = band_lsd(fa, fb, range_db)
    peak = float(np.max(np.abs(pa))) if pa.size else 0.0
    noise = np.random.default_rng(0).uniform(-1.0, 1.0, pa.size) * peak * 10 ** (bar_db / 20)
    bar_noise = band_lsd(fa, fingerprint(pa + noise), range_db)
    return {"request": request_digest(ta.job), "sentence": text, "seed": int(ta.job.seed), "steps": len(ta.report.codes or []),
            "samples": int(pa.size), "codes_sha256": codes_a if codes_a == codes_b else None,
            "spectrum": _encode(fa), "frames": int(len(fa)), "range_db": round(range_db, 2),
            "tolerance_db": round(max(repeat, bar_noise), 3),
            "measured": {"repeat_db": round(repeat, 3), "bar_noise_db": round(bar_noise, 3), "bar_db": float(bar_db)},
            "lookahead_tokens": lookahead_tokens, "date": date}


@dataclass(frozen=True)
class Reference:
    """A matching reference (the ``"reference"`` dict of a calibration entry)."""

    data: dict

    @property
    def when(self) -> str:
        """``"calibrate on 2026-12-03"``."""
        return f"calibrate on {str(self.data.get('date', ''))[:10] or 'an unknown date'}"


_IDENTITY: dict = {}   # (checkpoint dir, files) -> sha256: hash a checkpoint whose mtimes moved once per process


def _checkpoint_sha(ckpt_dir: str, known: dict) -> str:
    files = mf.checkpoint_files(ckpt_dir)
    if known.get("files") == files and known.get("sha256"):
        return known["sha256"]
    key = (str(ckpt_dir), json.dumps(files, sort_keys=True))
    if key not in _IDENTITY:
        _IDENTITY[key] = mf.checkpoint_identity(ckpt_dir)["sha256"]
    return _IDENTITY[key]


def lookup(engine_dir: str | os.PathLike, ckpt_dir: str | os.PathLike, info: Any,
           job: Any) -> tuple[Optional[Reference], str]:
    """The reference recorded for this checkpoint, backend, precision, engines and request
    (``job``: the prepared health sentence); (None, why not) when there is none."""
    what = f"{info.backend}/{info.precision}"
    try:
        entries = [e for e in read_calibrations(engine_dir) if e.get("backend") == info.backend
                   and e.get("precision") == info.precision]
    except EngineError as e:
        return None, f"no reference: {e}"
    if not entries:
        return None, f"no reference: not calibrated for {what} (run 'chattts-appliance calibrate')"
    same = [e for e in entries if e.get("engine_id", "") == info.engine_id]
    if not same:
        return None, (f"no reference: the one recorded for {what} is for other engines (engine id "
                      f"{entries[0].get('engine_id', '')!r}, now {info.engine_id!r}): ignored; run 'chattts-appliance calibrate'")
    try:
        same = [e for e in same if _checkpoint_sha(str(ckpt_dir), e.get("checkpoint") or {}) == (e.get("checkpoint") or {}).get("sha256")]
    except (OSError, EngineError) as e:
        return None, f"no reference: cannot identify the checkpoint ({e})"
    if not same:
        return None, f"no reference: the one recorded for {what} is for another checkpoint: ignored; run 'chattts-appliance calibrate'"
    refs = [e["reference"] for e in same if isinstance(e.get("reference"), dict) and e["reference"]]
    if not refs:
        return None, f"no reference: the calibration of {what} holds none (made by an older version): run 'chattts-appliance calibrate'"
    want = request_digest(job)
    ref = next((r for r in refs if r.get("request") == want), None)
    if ref is None:
        return None, (f"no reference: the one recorded for {what} is for another health sentence, voice, sampling "
                      f"setting or length limit: ignored; run 'chattts-appliance calibrate'")
    return Reference(ref), ""


def compare(ref: Reference, take: Take, pcm: np.ndarray) -> tuple[list[str], str]:
    """(reasons, note) of the health render (``pcm``, ``take`` from :func:`render`) against ``ref``."""
    r = ref.data
    head = f"audio: far from the reference recorded by {ref.when}"
    codes = take.report.codes or []
    if r.get("codes_sha256"):
        got = codes_digest(codes)
        if got != r["codes_sha256"]:
            if take.report.max_rows > 1:
                return [], (f"not compared with the reference recorded by {ref.when}: its decode shared steps with other "
                            f"requests (batched rounding may move a draw)")
            return [f"{head}: the decode drew other codes for the same seed ({len(codes)} steps, sha256 {got[:12]}; "
                    f"recorded {r.get('steps')} steps, {r['codes_sha256'][:12]}): {REMEDY}"], f"differs from the reference recorded by {ref.when}"
    d = band_lsd(_decode(r["spectrum"], int(r["frames"])), fingerprint(pcm), float(r["range_db"]))
    tol = float(r["tolerance_db"])
    if d > tol:
        return [f"{head}: log-spectral distance {d:.2f} dB (allowed {tol:.2f}): {REMEDY}"], \
            f"differs from the reference recorded by {ref.when}"
    same = "codes identical, " if r.get("codes_sha256") else "codes not recorded (the backend did not repeat them), "
    return [], f"matches the reference recorded by {ref.when} ({same}log-spectral distance {d:.2f} dB, allowed {tol:.2f})"


def check(pipeline: Any, cfg: Any, take: Take, pcm: np.ndarray) -> tuple[list[str], str]:
    """Find the reference for ``pipeline`` (``cfg.model.engine_dir``, ``cfg.model.path``,
    ``pipeline.info``) and compare the health render with it: (reasons, note)."""
    try:
        info = pipeline.info
        engine_dir, ckpt = cfg.resolve(cfg.model.engine_dir), cfg.resolve(cfg.model.path)
    except AttributeError as e:   # a pipeline without engine information (a test double)
        return [], f"no reference: {e}"
    ref, why = lookup(engine_dir, ckpt, info, take.job)
    if ref is None:
        return [], why
    try:
        return compare(ref, take, pcm)
    except (KeyError, ValueError, TypeError) as e:   # binascii.Error is a ValueError
        return [], f"no reference: the one recorded by {ref.when} is unreadable ({e!r}): run 'chattts-appliance calibrate'"
