"""DeviceSampler (the GPU sampler, run here on the CPU) against the host Sampler: same scores
after temperature / repetition penalty / top-P / top-K / EOS mask, same greedy codes, and the
counter-based random stream against its pure-Python reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from appliance.core import SamplingParams
from appliance.engines.rng import uniform_ref as splitmix_uniform_ref
from appliance.engines.torch.sampler import DeviceSampler, splitmix_uniform
from appliance.engines.sampling import Sampler

Q, V = 4, 626
PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=(0.7, 1.0, 0.3, 1.3), top_p=0.5, top_k=5, repetition_penalty=1.2, min_new_tokens=3),
    SamplingParams(temperature=1.0, top_p=None, top_k=None, repetition_penalty=1.0),
    SamplingParams(temperature=0.5, top_p=0.9, top_k=None, repetition_penalty=1.05, greedy=True),
]


def _pair(params, hist_len, rng):
    host = Sampler(len(params), exact=True)
    dev = DeviceSampler(len(params), Q, V, "cpu")
    for r, p in enumerate(params):
        host.start(r, p, seed=r)
        dev.configure(r, p, seed=r)
        for _ in range(hist_len):
            c = rng.integers(0, 40, Q)  # small range: repeats inside the window
            host.record(r, c)
            dev._record(torch.from_numpy(c)[None], slice(r, r + 1))
    return host, dev


@pytest.mark.parametrize("hist_len", [0, 7, 23])
def test_process_equals_host(hist_len):
    rng = np.random.default_rng(hist_len)
    host, dev = _pair(PARAMS, hist_len, rng)
    logits = (rng.standard_normal((len(PARAMS), Q, V)) * 3).astype(np.float32)
    logits[:, :, 625] = 12.0  # EOS on top: kept unless masked by min_new_tokens
    steps = np.full(len(PARAMS), hist_len)
    want = host.process(np.arange(len(PARAMS)), logits, steps).copy()
    got = dev.process(torch.from_numpy(logits), slice(0, len(PARAMS))).numpy()
    assert np.array_equal(np.isfinite(want), np.isfinite(got)), "different codes kept"
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-6, atol=1e-6)
    # EOS masked exactly where the host masks it (min_new_tokens 3 on row 1)
    assert np.isneginf(got[1, :, 625]).all() == (hist_len < 3)
    assert np.isfinite(got[0, :, 625]).all()


def test_greedy_codes_equal_host():
    rng = np.random.default_rng(5)
    params = [SamplingParams(greedy=True, repetition_penalty=1.3)] * 3
    host, dev = _pair(params, 0, rng)
    for step in range(40):
        logits = (rng.standard_normal((3, Q, V)) * 2).astype(np.float32)
        want = host.sample(np.arange(3), logits, np.full(3, step)).copy()
        for r in range(3):
            host.record(r, want[r])
        got = dev.sample(torch.from_numpy(logits), slice(0, 3)).numpy()
        assert np.array_equal(got, want), f"step {step}"


def test_draw_follows_the_processed_distribution():
    dev = DeviceSampler(1, Q, V, "cpu")
    logits = torch.full((1, Q, V), -30.0)
    logits[0, :, 10], logits[0, :, 11] = 0.0, np.log(3.0)  # p(11) = 3/4 at temperature 1
    hits = 0
    dev.configure(0, SamplingParams(temperature=1.0, top_p=None, top_k=None, repetition_penalty=1.0), seed=123)
    for _ in range(400):
        c = dev.sample(logits, slice(0, 1))[0].numpy()
        assert set(c.tolist()) <= {10, 11}
        hits += int((c == 11).sum())
    assert 0.70 < hits / 1600 < 0.80


def test_splitmix_matches_reference_and_differs_per_counter():
    seeds = torch.tensor([0, 1, 2**62 + 12345, -5], dtype=torch.int64)
    ctr = torch.arange(6, dtype=torch.int64)
    u = splitmix_uniform(seeds[:, None], ctr[None, :]).numpy()
    for i, s in enumerate(seeds.tolist()):
        for j in range(6):
            assert u[i, j] == pytest.approx(splitmix_uniform_ref(s & (2**64 - 1), j), abs=0)
    assert ((u >= 0) & (u < 1)).all() and len(np.unique(u)) == u.size
