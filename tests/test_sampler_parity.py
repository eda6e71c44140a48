"""Sampler parity with upstream ChatTTS 0.2.5 (goldens made by tests/golden/make_goldens.py on
the device machine with upstream's CustomRepetitionPenaltyLogitsProcessorRepeat and HF
transformers' TopPLogitsWarper / TopKLogitsWarper): same -inf pattern, values within 1e-6."""

from pathlib import Path

import numpy as np
import pytest

from appliance.core import SamplingParams
from appliance.engines.sampling import Sampler

GOLDEN = Path(__file__).parent / "golden" / "upstream_tiny.npz"
Q, V = 4, 626


@pytest.fixture(scope="module")
def golden():
    if not GOLDEN.exists():
        pytest.skip(f"{GOLDEN.name} not generated yet (tests/golden/make_goldens.py on the device)")
    g = np.load(GOLDEN)
    if "sampler_logits" not in g.files:
        pytest.skip(f"{GOLDEN.name} has no sampler section")
    return g


def ours(logits8, hist8, hist_len, exact=False, **params):
    """Run our Sampler on upstream's flattened rows: row r = slot r // 4, codebook r % 4."""
    n_slots = logits8.shape[0] // Q
    smp = Sampler(n_slots, exact=exact)
    p = SamplingParams(**params)
    for s in range(n_slots):
        smp.start(s, p, 0)
        for t in range(hist8.shape[1] - hist_len, hist8.shape[1]):
            smp.record(s, hist8[s * Q:(s + 1) * Q, t])
    x = smp.process(np.arange(n_slots), logits8.reshape(n_slots, Q, V).copy(), np.full(n_slots, hist_len))
    return x.reshape(-1, V).copy()


def same(got, want):
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    assert np.isfinite(got[fin]).all()
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-6, atol=1e-6)


def test_penalty_and_warpers_match_upstream(golden):
    logits, hist, params = golden["sampler_logits"], golden["sampler_hist"], golden["sampler_params"]
    assert len(params) >= 1
    for k, (temp, rp, tp, tk, hl) in enumerate(params.tolist()):
        base = dict(temperature=float(np.float32(temp)), repetition_penalty=float(np.float32(rp)))
        pen = ours(logits, hist, int(hl), top_p=None, top_k=None, **base)
        same(pen, golden[f"sampler_pen_{k}"])
        for exact in (True, False):  # full sort, and the partial-sort fast path
            out = ours(logits, hist, int(hl), exact=exact, top_p=float(np.float32(tp)), top_k=int(tk), **base)
            same(out, golden[f"sampler_out_{k}"])
            assert np.isneginf(out).any()  # the warpers did remove codes


def test_greedy_steps_match_upstream_generate(golden):
    """Upstream's own GPT.generate (temperature 1, repetition penalty 1.05 over the last 16
    codes, EOS masked, argmax): at the logged steps our greedy Sampler, fed the same raw logits
    and the same code history, picks the same 4 codes."""
    codes, steps, raw = golden["codes"], golden["logit_steps"], golden["step_logits"]
    n = codes.shape[0]
    p = SamplingParams(temperature=1.0, repetition_penalty=1.05, top_p=0.7, top_k=20,
                       min_new_tokens=n, greedy=True)
    checked = 0
    for s, logits in zip(steps.tolist(), raw):
        smp = Sampler(1)
        smp.start(0, p, 0)
        for t in range(s):
            smp.record(0, codes[t])
        got = smp.sample(np.array([0]), logits[None].astype(np.float32), np.array([s]))[0]
        np.testing.assert_array_equal(got, codes[s], err_msg=f"step {s}")
        checked += 1
    assert checked == len(steps) >= 10
