"""Sampler: upstream's processing order and semantics, checked against a plain per-row reference."""

import numpy as np
import pytest

from appliance.core import SamplingParams
from appliance.engines.sampling import Sampler

V, Q, EOS = 626, 4, 625


def ref_process(logits, hist, p: SamplingParams, step: int):
    """Plain reference of upstream gpt.py + processors.py + HF warpers for one row [4, V]."""
    t = np.broadcast_to(np.asarray(p.temperature, np.float32), (Q,))
    x = (logits / t[:, None]).astype(np.float32)
    out = np.empty_like(x)
    for q in range(Q):
        s = x[q].copy()
        win = hist[q][-16:]
        freq = np.bincount(np.asarray(win, np.int64), minlength=V).astype(np.float32)
        if p.repetition_penalty != 1:
            alpha = np.power(np.float32(p.repetition_penalty), freq)
            s = np.where(s < 0, s * alpha, s / alpha).astype(np.float32)
        if p.top_p is not None:
            idx = np.argsort(s, kind="stable")
            srt = s[idx]
            e = np.exp(srt - srt.max())
            cum = np.cumsum(e / e.sum(), dtype=np.float32)
            rem = cum <= np.float32(1 - p.top_p)
            rem[-3:] = False
            s[idx[rem]] = -np.inf
        if p.top_k is not None:
            k = min(max(p.top_k, 3), V)
            kth = np.sort(s)[-k]
            s[s < kth] = -np.inf
        if step < p.min_new_tokens:
            s[EOS] = -np.inf
        out[q] = s
    return out


def make(params_list, seeds=None, max_batch=None):
    smp = Sampler(max_batch or len(params_list))
    for i, p in enumerate(params_list):
        smp.start(i, p, None if seeds is None else seeds[i])
    return smp


def run_with_history(params, hists, logits):
    smp = make(params)
    # feed histories through the real ring buffer
    for r, h in enumerate(hists):
        for i in range(len(h[0])):
            smp.record(r, np.array([h[q][i] for q in range(Q)]))
    n = len(hists)
    steps = np.array([len(h[0]) for h in hists])
    return smp.process(np.arange(n), logits.copy(), steps).copy()


def step(smp, logits, steps=None, slots=None):
    n = logits.shape[0]
    slots = np.arange(n) if slots is None else np.asarray(slots)
    steps = smp._recorded[slots].copy() if steps is None else np.asarray(steps)
    codes = smp.sample(slots, logits, steps).copy()
    fin = (codes == EOS).any(axis=1)
    for i in range(n):
        if not fin[i]:
            smp.record(slots[i], codes[i])
    return codes, fin


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=(0.3, 0.5, 0.7, 1.0), top_p=0.9, top_k=5, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, top_p=None, top_k=1, repetition_penalty=2.0, min_new_tokens=40),
    SamplingParams(temperature=0.7, top_p=0.05, top_k=None, repetition_penalty=1.0),
])
def test_process_matches_reference(params):
    rng = np.random.default_rng(1)
    b, n = 3, 23  # 23 steps of history > window 16
    logits = (rng.standard_normal((b, Q, V)) * 3).astype(np.float32)
    hists = [[list(rng.integers(0, 8, n)) for _ in range(Q)] for _ in range(b)]
    got = run_with_history([params] * b, hists, logits)
    for r in range(b):
        want = ref_process(logits[r], hists[r], params, step=n)
        np.testing.assert_array_equal(np.isinf(got[r]), np.isinf(want))
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[r][fin], want[fin], rtol=1e-6, atol=1e-6)


def one(p, **kw):
    return SamplingParams(**{"temperature": 1.0, "top_p": None, "top_k": None, "repetition_penalty": 1.0, **kw}) if p is None else p


def proc(smp, logits, steps=0):
    n = logits.shape[0]
    return smp.process(np.arange(n), logits, np.full(n, steps))


def test_keeps_at_least_three_and_top_p_before_top_k():
    logits = np.full((1, Q, V), -30.0, np.float32)
    logits[0, :, :5] = [10.0, 9.0, 8.0, 7.0, 6.0]
    x = proc(make([one(None, top_p=0.01, top_k=1)]), logits)
    assert (np.isfinite(x[0]).sum(axis=1) == 3).all()  # top_p tiny, top_k 1: still 3
    # top-P first: with top_p=0.5 only 3 survive, then top_k=20 cannot bring any back
    assert (np.isfinite(proc(make([one(None, top_p=0.5, top_k=20)]), logits)[0]).sum(axis=1) == 3).all()
    assert (np.isfinite(proc(make([one(None, top_k=4)]), logits)[0]).sum(axis=1) == 4).all()
    # ties at the k-th value are kept (HF: remove only scores < k-th largest)
    tied = np.zeros((1, Q, V), np.float32)
    assert np.isfinite(proc(make([one(None, top_k=5)]), tied)[0]).all()


def test_penalty_window_is_16_and_per_codebook():
    logits = np.ones((1, Q, V), np.float32)
    logits[0, :, 7] = -1.0
    smp = make([one(None, repetition_penalty=2.0)])
    for i in range(20):
        smp.record(0, np.array([7, 7, 3, 3]) if i < 4 else np.array([1, 2, 3, 3]))
    x = proc(smp, logits, 20)
    # codes 7 were recorded at steps 0..3, out of the 16-step window after 20 steps
    assert x[0, 0, 7] == -1.0
    assert x[0, 0, 1] == pytest.approx(1 / 2 ** 16)
    assert x[0, 1, 2] == pytest.approx(1 / 2 ** 16) and x[0, 1, 1] == 1.0
    assert x[0, 2, 3] == pytest.approx(1 / 2 ** 16)  # 16 times in the window, not 20


def test_negative_scores_multiplied():
    logits = np.full((1, Q, V), -2.0, np.float32)
    smp = make([one(None, repetition_penalty=1.5)])
    smp.record(0, np.array([5, 5, 5, 5]))
    assert proc(smp, logits)[0, 0, 5] == pytest.approx(-3.0)


def test_eos_masked_before_min_new_tokens_and_any_eos_stops():
    logits = np.full((2, Q, V), -5.0, np.float32)
    logits[:, :, EOS] = 20.0  # EOS overwhelmingly likely
    smp = make([SamplingParams(min_new_tokens=3), SamplingParams(min_new_tokens=0)], seeds=[1, 1])
    codes, fin = step(smp, logits)
    assert not fin[0] and (codes[0] != EOS).all()
    assert fin[1]
    for k in (1, 2):
        codes, fin = step(smp, logits[:1], steps=[k])
        assert not fin[0]
    codes, fin = step(smp, logits[:1], steps=[3])  # no longer masked
    assert fin[0]
    # one codebook alone emitting EOS finishes the row
    logits = np.full((1, Q, V), -5.0, np.float32)
    logits[0, 2, EOS] = 50.0
    logits[0, [0, 1, 3], 10] = 50.0
    codes, fin = step(make([SamplingParams()], seeds=[0]), logits)
    assert codes[0].tolist() == [10, 10, EOS, 10] and fin[0]


def test_seed_reproducible_slots_independent():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((8, 2, Q, V)).astype(np.float32)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)]

    def run(ps, seeds, slots=None, flip=False):
        s = make(ps, seeds, max_batch=3)
        if slots is not None:  # same requests started in other slots
            s = Sampler(3)
            for sl, p, sd in zip(slots, ps, seeds):
                s.start(sl, p, sd)
        return np.stack([step(s, (l[::-1] if flip else l)[: len(ps)], slots=slots)[0] for l in logits])

    a, b = run(params, [42, 7]), run(params, [42, 7])
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a[:, 0], run(params[:1], [42])[:, 0])  # row 0 unaffected by row 1
    np.testing.assert_array_equal(a[:, ::-1], run(params[::-1], [7, 42], slots=[2, 0], flip=True))
    assert not np.array_equal(a[:, 0], a[:, 1])
    s = Sampler(1)
    seed = s.start(0, SamplingParams(), None)
    assert isinstance(seed, int) and seed >= 0 and s.seeds[0] == seed


def test_distribution_matches_softmax():
    logits = np.full((1, Q, V), -np.inf, np.float32)
    logits[0, :, :4] = np.log(np.array([0.1, 0.2, 0.3, 0.4], np.float32))
    smp = make([one(None)], seeds=[3])
    n = 20000
    counts = np.zeros((Q, V))
    sl, st = np.array([0]), np.array([0])
    for _ in range(n):
        codes = smp.sample(sl, logits, st)
        counts[np.arange(Q), codes[0]] += 1
    freq = counts[:, :4] / n
    assert counts[:, 4:].sum() == 0  # zero-probability codes are never drawn
    np.testing.assert_allclose(freq, np.tile([0.1, 0.2, 0.3, 0.4], (Q, 1)), atol=0.015)


def test_greedy_is_argmax_after_penalty():
    logits = np.zeros((1, Q, V), np.float32)
    logits[0, :, 9] = 1.0
    logits[0, :, 8] = 0.9
    smp = make([SamplingParams(greedy=True, repetition_penalty=1.2)])
    codes, _ = step(smp, logits)
    assert codes[0].tolist() == [9, 9, 9, 9]
    codes, _ = step(smp, logits)  # 9 penalized once: 1/1.2 < 0.9
    assert codes[0].tolist() == [8, 8, 8, 8]


def test_start_resets_and_bad_params():
    smp = make([SamplingParams()], seeds=[1])
    smp.record(0, np.array([1, 2, 3, 4]))
    smp.start(0, SamplingParams(), 2)
    assert smp._counts.sum() == 0 and smp.seeds[0] == 2
    with pytest.raises(ValueError):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError):
        smp.process(np.arange(2), np.zeros((2, Q, V), np.float32), np.zeros(2))


def test_fast_path_equals_exact_path():
    rng = np.random.default_rng(11)
    for trial in range(40):
        b = int(rng.integers(1, 4))
        ps = [SamplingParams(temperature=float(rng.uniform(0.2, 1.5)), top_p=float(rng.uniform(0.05, 1.0)),
                             top_k=int(rng.integers(1, 60)), repetition_penalty=float(rng.uniform(1.0, 2.0)))
              for _ in range(b)]
        logits = (rng.standard_normal((b, Q, V)) * rng.uniform(0.5, 6)).astype(np.float32)
        if trial % 5 == 0:  # ties at the k-th value force the exact fallback
            logits[:, :, :40] = np.round(logits[:, :, :40])
        outs = []
        for exact in (False, True):
            smp = Sampler(b, exact=exact)
            for i, p in enumerate(ps):
                smp.start(i, p, 0)
            outs.append(smp)
        hists = [rng.integers(0, 30, (int(rng.integers(0, 25)), Q)) for _ in range(b)]
        res = []
        for smp in outs:
            for i, h in enumerate(hists):
                for c in h:
                    smp.record(i, c)
            res.append(smp.process(np.arange(b), logits.copy(), np.full(b, 5)).copy())
        np.testing.assert_array_equal(np.isneginf(res[0]), np.isneginf(res[1]))
        np.testing.assert_allclose(res[0][np.isfinite(res[1])], res[1][np.isfinite(res[1])], rtol=1e-6)
