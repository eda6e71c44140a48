"""Sampler: upstream's processing order and semantics, checked against a plain per-row reference."""

import numpy as np
import pytest

from appliance.tts.sampler import Sampler, SamplingParams

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


def run_with_history(params, hists, logits):
    smp = Sampler(params)
    steps = max(len(h[0]) for h in hists)
    # feed histories through the real ring buffer: replay each row's codes as forced draws
    for i in range(steps):
        codes = np.array([[h[q][i] for q in range(Q)] for h in hists], np.int64)
        smp._push(codes)
    return smp.process(logits.copy()).copy()


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


def test_keeps_at_least_three_and_top_p_before_top_k():
    logits = np.full((1, Q, V), -30.0, np.float32)
    logits[0, :, :5] = [10.0, 9.0, 8.0, 7.0, 6.0]
    smp = Sampler([SamplingParams(temperature=1.0, top_p=0.01, top_k=1, repetition_penalty=1.0)])
    x = smp.process(logits)
    assert (np.isfinite(x[0]).sum(axis=1) == 3).all()  # top_p tiny, top_k 1: still 3
    # top-P first: with top_p=0.5 only the top few survive, then top_k=20 keeps them all (3 min)
    smp = Sampler([SamplingParams(temperature=1.0, top_p=0.5, top_k=20, repetition_penalty=1.0)])
    assert (np.isfinite(smp.process(logits)[0]).sum(axis=1) == 3).all()
    # top-K alone
    smp = Sampler([SamplingParams(temperature=1.0, top_p=None, top_k=4, repetition_penalty=1.0)])
    assert (np.isfinite(smp.process(logits)[0]).sum(axis=1) == 4).all()


def test_penalty_window_is_16_and_per_codebook():
    logits = np.ones((1, Q, V), np.float32)
    logits[0, :, 7] = -1.0
    p = SamplingParams(temperature=1.0, top_p=None, top_k=None, repetition_penalty=2.0)
    smp = Sampler([p])
    for i in range(20):
        smp._push(np.array([[7, 7, 3, 3]]) if i < 4 else np.array([[1, 2, 3, 3]]))
    x = smp.process(logits)
    # codes 7 were pushed at steps 0..3, out of the 16-step window after 20 steps
    assert x[0, 0, 7] == -1.0
    assert x[0, 0, 1] == pytest.approx(1 / 2 ** 16)
    assert x[0, 1, 2] == pytest.approx(1 / 2 ** 16) and x[0, 1, 1] == 1.0
    assert x[0, 2, 3] == pytest.approx(1 / 2 ** 16)  # 16 times in the window, not 20


def test_negative_scores_multiplied():
    logits = np.full((1, Q, V), -2.0, np.float32)
    smp = Sampler([SamplingParams(temperature=1.0, top_p=None, top_k=None, repetition_penalty=1.5)])
    smp._push(np.array([[5, 5, 5, 5]]))
    assert smp.process(logits)[0, 0, 5] == pytest.approx(-3.0)


def test_eos_masked_before_min_new_tokens_and_any_eos_stops():
    logits = np.full((2, Q, V), -5.0, np.float32)
    logits[:, :, EOS] = 20.0  # EOS overwhelmingly likely
    smp = Sampler([SamplingParams(min_new_tokens=3, seed=1), SamplingParams(min_new_tokens=0, seed=1)])
    codes, fin = smp.step(logits)
    assert not fin[0] and (codes[0] != EOS).all()
    assert fin[1]
    smp.step(logits)
    smp.step(logits)
    codes, fin = smp.step(logits)  # step 3: no longer masked
    assert fin[0]
    # one codebook alone emitting EOS finishes the row
    logits = np.full((1, Q, V), -5.0, np.float32)
    logits[0, 2, EOS] = 50.0
    logits[0, [0, 1, 3], 10] = 50.0
    codes, fin = Sampler([SamplingParams(seed=0)]).step(logits)
    assert codes[0].tolist() == [10, 10, EOS, 10] and fin[0]


def test_seed_reproducible_and_rows_independent():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((8, 2, Q, V)).astype(np.float32)
    params = [SamplingParams(temperature=1.0, seed=42), SamplingParams(temperature=1.0, seed=7)]

    def run(ps):
        s = Sampler(ps)
        return np.stack([s.step(l[: len(ps)])[0].copy() for l in logits])

    a, b = run(params), run(params)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a[:, 0], run(params[:1])[:, 0])  # row 0 unaffected by row 1
    assert not np.array_equal(a[:, 0], a[:, 1])
    s = Sampler([SamplingParams(seed=None)])
    assert isinstance(s.seeds[0], int) and s.seeds[0] >= 0


def test_distribution_matches_softmax():
    logits = np.full((1, Q, V), -np.inf, np.float32)
    logits[0, :, :4] = np.log(np.array([0.1, 0.2, 0.3, 0.4], np.float32))
    smp = Sampler([SamplingParams(temperature=1.0, top_p=None, top_k=None, repetition_penalty=1.0, seed=3)])
    n = 20000
    counts = np.zeros((Q, V))
    for _ in range(n):
        smp.steps[0] = 0  # no penalty history matters (penalty 1); keep the loop simple
        codes, _ = smp.step(logits)
        counts[np.arange(Q), codes[0]] += 1
    freq = counts[:, :4] / n
    assert counts[:, 4:].sum() == 0  # zero-probability codes are never drawn
    np.testing.assert_allclose(freq, np.tile([0.1, 0.2, 0.3, 0.4], (Q, 1)), atol=0.015)


def test_greedy_is_argmax_after_penalty():
    logits = np.zeros((1, Q, V), np.float32)
    logits[0, :, 9] = 1.0
    logits[0, :, 8] = 0.9
    smp = Sampler([SamplingParams(greedy=True, repetition_penalty=1.2)])
    codes, _ = smp.step(logits)
    assert codes[0].tolist() == [9, 9, 9, 9]
    codes, _ = smp.step(logits)  # 9 penalized once: 1/1.2 < 0.9
    assert codes[0].tolist() == [8, 8, 8, 8]


def test_reset_row_and_bad_params():
    smp = Sampler([SamplingParams(seed=1)])
    smp._push(np.array([[1, 2, 3, 4]]))
    smp.reset_row(0, SamplingParams(seed=2))
    assert smp.steps[0] == 0 and smp._counts.sum() == 0 and smp.seeds[0] == 2
    with pytest.raises(ValueError):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError):
        smp.process(np.zeros((2, Q, V), np.float32))
