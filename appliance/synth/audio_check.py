"""Degenerate audio: what a model with broken weights speaks while every request ends ``done``.

A flipped bit in a weight file does not always give NaN: an exponent bit that makes one weight
2^64 times larger saturates a layer, and the vocoder then speaks a periodic buzz, near-silence,
or the same noise whatever the seed. :func:`audio_problems` looks at one utterance (float32 PCM
``[n]`` at ``rate`` Hz), optionally beside the same request under another seed and beside a
reference rendering, and returns what is wrong with it (empty when nothing is):

* **non-finite**: any NaN/Inf sample.
* **silent**: RMS below ``silence_dbfs`` (-60 dBFS: ffmpeg ``silencedetect``'s default noise floor,
  a common "nothing audible" threshold; speech sits at -30 to -15 dBFS RMS).
* **constant**: no signal once the mean is removed (a DC offset only).
* **periodic**: the normalised autocorrelation of the whole clip (mean removed, each lag normalised
  by the energy of the overlapping parts) peaks above ``periodicity`` at a lag between its first
  zero crossing and ``max_lag_ms`` (50 ms: 20 Hz and up). The clip then repeats itself within
  10 % over its whole length. 0.9 is YIN's aperiodicity threshold (0.1, de Cheveigné & Kawahara
  2002, JASA 111(4)) taken over a whole utterance instead of one 25 ms frame: speech changes pitch
  and phone every few tens of ms and stays far below it over a sentence (our synthetic speech-like
  test signal: < 0.5), a buzz is close to 1 (test: > 0.95).
* **seed-independent**: the mean log-spectral distance (LSD, Gray & Markel 1976, IEEE TASSP 24(5);
  frames of ``n_fft`` 1024, hop 256, Hann, in dB) to the same text under another seed is below
  ``seed_lsd_db`` (1 dB, the classic "transparent" spectral distortion, Paliwal & Atal 1993,
  IEEE TSAP 1(1)) and the lengths agree within 5 %: the output ignores the sampling, as a
  saturated network does. Two seeds of a working model give different durations and spectra.
* **far from the reference**: the LSD to a reference rendering of the same request (same text,
  seed, backend and precision, recorded when the box was known good, e.g. by ``calibrate``) exceeds
  ``reference_lsd_db`` (6 dB), or the lengths differ by more than 5 %. The same request on the same
  backend is deterministic up to float rounding (LSD well below 1 dB); "unrelated audio" is tens
  of dB away.

Pure numpy; thresholds in :class:`Thresholds`. The health check calls it on its reference
sentence (see ``docs/integrity.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class Thresholds:
    """Limits of :func:`audio_problems` (sources in the module docstring)."""

    silence_dbfs: float = -60.0     #: RMS below this (dB re full scale 1.0) is silent
    periodicity: float = 0.9        #: normalised autocorrelation peak above this is a buzz
    max_lag_ms: float = 50.0        #: longest period searched, ms
    seed_lsd_db: float = 1.0        #: two seeds closer than this (dB) are seed-independent
    reference_lsd_db: float = 6.0   #: farther than this (dB) from the reference is wrong
    length_tol: float = 0.05        #: relative length difference that still counts as "same length"


DEFAULT = Thresholds()
N_FFT, HOP = 1024, 256


def rms_dbfs(x: np.ndarray) -> float:
    """RMS of ``x`` in dB re 1.0 (-inf for silence)."""
    r = math.sqrt(float(np.mean(np.square(x, dtype=np.float64)))) if x.size else 0.0
    return 20 * math.log10(r) if r > 0 else -math.inf


def periodicity(x: np.ndarray, rate: int, max_lag_ms: float = DEFAULT.max_lag_ms) -> tuple[float, float]:
    """(peak normalised autocorrelation, its lag in s) of ``x`` (module doc); (0, 0) when there is
    no lag to search (too short, or no zero crossing before ``max_lag_ms``)."""
    x = np.asarray(x, np.float64) - float(np.mean(x)) if x.size else np.zeros(0)
    n, lmax = x.size, int(rate * max_lag_ms / 1000)
    if n < 4 * max(lmax, 1) or not np.any(x):
        return 0.0, 0.0
    spec = np.fft.rfft(x, 1 << int(math.ceil(math.log2(2 * n))))
    ac = np.fft.irfft(spec * np.conj(spec))[:lmax + 1]
    c = np.concatenate(([0.0], np.cumsum(x * x)))
    lags = np.arange(lmax + 1)
    denom = np.sqrt((c[n - lags] - c[0]) * (c[n] - c[lags]))  # energy of x[:n-k] and of x[k:]
    r = np.where(denom > 0, ac / np.where(denom > 0, denom, 1.0), 0.0)
    neg = np.flatnonzero(r < 0)
    if neg.size == 0:
        return 0.0, 0.0
    k = int(neg[0] + np.flatnonzero(r[neg[0]:] >= r[neg[0]:].max() - 0.05)[0])
    while k < lmax and r[k + 1] > r[k]:  # the top of the first near-maximal peak: the fundamental
        k += 1
    return float(r[k]), k / rate


def log_spectra(x: np.ndarray) -> np.ndarray:
    """Power spectra in dB ``[frames, N_FFT/2+1]`` (Hann, hop 256; floor -120 dB)."""
    x = np.asarray(x, np.float64)
    if x.size < N_FFT:
        x = np.pad(x, (0, N_FFT - x.size))
    n = 1 + (x.size - N_FFT) // HOP
    frames = np.lib.stride_tricks.sliding_window_view(x, N_FFT)[::HOP][:n] * np.hanning(N_FFT)
    p = np.abs(np.fft.rfft(frames, axis=1)) ** 2
    return 10 * np.log10(np.maximum(p, 1e-12))


#: Dynamic range of the LSD (dB below the louder clip's loudest bin): quieter bins are clamped to it,
#: so that inaudible detail (dither, rounding noise in pauses) does not dominate the distance.
LSD_RANGE_DB = 60.0


def lsd_db(a: np.ndarray, b: np.ndarray) -> float:
    """Mean log-spectral distance (dB) between ``a`` and ``b`` over their common length: per frame
    the RMS over frequency of the difference of the dB spectra (each clamped to
    :data:`LSD_RANGE_DB` below the louder clip's peak), averaged over frames."""
    n = min(a.size, b.size)
    sa, sb = log_spectra(a[:n]), log_spectra(b[:n])
    floor = max(float(sa.max()), float(sb.max())) - LSD_RANGE_DB
    sa, sb = np.maximum(sa, floor), np.maximum(sb, floor)
    return float(np.mean(np.sqrt(np.mean((sa - sb) ** 2, axis=1))))


def _same_length(a: np.ndarray, b: np.ndarray, tol: float) -> bool:
    return abs(a.size - b.size) <= tol * max(a.size, b.size, 1)


def audio_problems(pcm: np.ndarray, rate: int, *, other_seed: Optional[np.ndarray] = None,
                   reference: Optional[np.ndarray] = None, t: Thresholds = DEFAULT) -> list[str]:
    """What is degenerate about ``pcm`` (module doc); each reason starts with ``audio:``.

    Args:
        pcm: float32 ``[n]`` samples in [-1, 1] at ``rate`` Hz (one utterance).
        other_seed: the same request under another seed, or None (check skipped).
        reference: a known-good rendering of the same request (text, seed, backend), or None.
        t: thresholds.

    Returns:
        reasons, empty when the audio passes every check.
    """
    x = np.asarray(pcm, np.float32).ravel()
    if not np.all(np.isfinite(x)):
        return [f"audio: {int(np.count_nonzero(~np.isfinite(x)))} of {x.size} samples are NaN/Inf"]
    db = rms_dbfs(x)
    if db < t.silence_dbfs:
        return [f"audio: silent (RMS {db:.1f} dBFS < {t.silence_dbfs:g} dBFS over {x.size} samples)"]
    if rms_dbfs(x - float(np.mean(x))) < t.silence_dbfs:
        return [f"audio: constant (a DC offset of {float(np.mean(x)):.3g}, no signal)"]
    out = []
    p, lag = periodicity(x, rate, t.max_lag_ms)
    if p > t.periodicity:
        out.append(f"audio: periodic buzz (autocorrelation {p:.3f} > {t.periodicity:g} at {lag * 1000:.2f} ms, "
                   f"{1 / lag:.0f} Hz, over the whole clip)")
    if other_seed is not None:
        o = np.asarray(other_seed, np.float32).ravel()
        d = lsd_db(x, o)
        if _same_length(x, o, t.length_tol) and d < t.seed_lsd_db:
            out.append(f"audio: seed-independent (another seed gives the same audio: log-spectral distance "
                       f"{d:.2f} dB < {t.seed_lsd_db:g} dB)")
    if reference is not None:
        r = np.asarray(reference, np.float32).ravel()
        if not _same_length(x, r, t.length_tol):
            out.append(f"audio: far from the reference ({x.size} samples, the reference {r.size})")
        elif (d := lsd_db(x, r)) > t.reference_lsd_db:
            out.append(f"audio: far from the reference (log-spectral distance {d:.1f} dB > {t.reference_lsd_db:g} dB)")
    return out
