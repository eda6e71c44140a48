"""Degenerate-audio checks (appliance.synth.audio_check) on synthetic signals: a speech-like
signal (gliding pitch, syllable envelope, noise bursts) passes; a buzz, silence, DC, NaN, a
seed-independent pair and audio unrelated to its reference are each named."""

from __future__ import annotations

import numpy as np
import pytest

from appliance.synth.audio_check import (
    DEFAULT,
    audio_problems,
    lsd_db,
    periodicity,
    rms_dbfs,
)

RATE = 24000
T = np.arange(3 * RATE) / RATE


def speech_like(seed: int) -> np.ndarray:
    """3 s of a voiced harmonic source whose pitch glides 60-180 Hz, four syllables a second,
    fricative-like noise bursts: aperiodic over the clip, as speech is."""
    r = np.random.default_rng(seed)
    f0 = 120 + 60 * np.sin(2 * np.pi * r.uniform(0.3, 0.8) * T + r.uniform(0, 6)) + r.normal(0, 1, T.size).cumsum() / 400
    ph = 2 * np.pi * np.cumsum(f0) / RATE
    voiced = sum(np.sin(k * ph) / k for k in range(1, 12))
    env = np.clip(np.sin(2 * np.pi * 4 * T + r.uniform(0, 6)), 0, None) ** 2
    noise = r.normal(0, 1, T.size) * (np.sin(2 * np.pi * 3 * T) > 0.7)
    return (0.1 * env * voiced + 0.02 * noise).astype(np.float32)


def buzz(hz: float = 150.0) -> np.ndarray:
    saw = 0.2 * ((T * hz) % 1 - 0.5)
    return (saw + 0.001 * np.random.default_rng(0).normal(size=T.size)).astype(np.float32)


def test_speech_like_audio_and_noise_pass():
    s = speech_like(1)
    assert audio_problems(s, RATE) == []
    assert periodicity(s, RATE)[0] < 0.5
    noise = (0.1 * np.random.default_rng(3).normal(size=T.size)).astype(np.float32)
    lowpassed = np.convolve(noise, np.ones(100) / 100, "same").astype(np.float32)   # strong short-lag correlation
    assert audio_problems(noise, RATE) == [] and audio_problems(lowpassed, RATE) == []
    assert audio_problems(s, RATE, other_seed=speech_like(2), reference=s + 1e-5) == []


@pytest.mark.parametrize("hz", [93.75, 150.0, 440.0])
def test_a_periodic_buzz_is_named_with_its_period(hz):
    p, lag = periodicity(buzz(hz), RATE)
    assert p > 0.95 and abs(1 / lag - hz) < 0.02 * hz                        # the fundamental, not a multiple
    (reason,) = audio_problems(buzz(hz), RATE)
    assert reason.startswith("audio: periodic buzz") and f"{1 / lag:.0f} Hz" in reason


def test_silence_dc_and_nan_are_named():
    assert audio_problems(np.zeros(RATE, np.float32), RATE)[0].startswith("audio: silent")
    quiet = (1e-4 * np.random.default_rng(0).normal(size=RATE)).astype(np.float32)    # -80 dBFS
    assert rms_dbfs(quiet) < DEFAULT.silence_dbfs and audio_problems(quiet, RATE)[0].startswith("audio: silent")
    assert audio_problems(np.full(RATE, 0.3, np.float32), RATE)[0].startswith("audio: constant")
    x = speech_like(1)
    x[100] = np.nan
    assert audio_problems(x, RATE) == [f"audio: 1 of {x.size} samples are NaN/Inf"]


def test_seed_independent_output_is_named():
    a = speech_like(1)
    same = a + (1e-4 * np.random.default_rng(9).normal(size=a.size)).astype(np.float32)
    assert lsd_db(a, same) < 0.2 and lsd_db(a, speech_like(2)) > 5
    (reason,) = audio_problems(a, RATE, other_seed=same)
    assert reason.startswith("audio: seed-independent")
    assert audio_problems(a, RATE, other_seed=same[: a.size // 2]) == []      # a different length is not


def test_audio_far_from_its_reference_is_named():
    ref = speech_like(1)
    assert audio_problems(ref * 1.01, RATE, reference=ref) == []              # rounding-level differences pass
    (reason,) = audio_problems(speech_like(2), RATE, reference=ref)           # unrelated audio, same length
    assert reason.startswith("audio: far from the reference (log-spectral distance")
    assert audio_problems(ref[: RATE], RATE, reference=ref)[0].startswith("audio: far from the reference (24000 samples")
