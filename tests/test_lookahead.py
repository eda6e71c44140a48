"""A calibrated look-ahead: streaming with less right context than the theoretical receptive field,
the chunk schedule, and the calibration record the daemon reads (tiny checkpoint, torch CPU).

What holds per backend is in docs/latency.md: with the exact look-ahead the streamed PCM equals the
one-shot PCM to FP32 rounding; with a calibrated one it stays within the calibrated bound."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from appliance.build.calibrate import calibrate
from appliance.synth.calibration import _stream, error_db
from appliance.config import config_from_dict
from appliance.core import SynthesisRequest, SynthParams
from appliance.engines.runner import VocodeWindow
from appliance.model.integrity import write_sums
from appliance.synth.decode_loop import Sequence
from appliance.synth.istft import istft
from appliance.synth.pipeline import Pipeline
from appliance.synth.schedule import ChunkSchedule
from appliance.synth.vocoder import WindowedVocoder


def _cfg(tiny_ckpt, engine_dir, **stream):
    return config_from_dict({
        "model": {"path": str(tiny_ckpt), "backend": "torch", "device": "cpu", "threads": 1, "max_batch": 3,
                  "max_seq_len": 512, "max_prompt_tokens": 128, "engine_dir": str(engine_dir)},
        "synthesis": {"max_new_tokens": 120}, "stream": stream}, base_dir=str(tiny_ckpt))


@pytest.fixture(scope="module")
def pipe(tiny_ckpt, tmp_path_factory):
    p = Pipeline.from_config(_cfg(tiny_ckpt, tmp_path_factory.mktemp("eng")))
    yield p
    p.close()


@pytest.fixture(scope="module")
def sentence(pipe):
    """A decoded sentence held in slot 0: (slot, tokens, exact PCM)."""
    job = pipe.prepare(SynthesisRequest(id="la", text="你好，今天天气很好。", seed=4,
                                        params=SynthParams(min_new_tokens=90, max_new_tokens=90)))
    seq = Sequence(ids=job.prompts[0], spk_emb=job.spk_emb, params=job.params, seed=job.seed)
    pipe.loop.join(seq)
    while pipe.loop.active:
        pipe.loop.step()
    n = seq.steps
    re, im = pipe.runner.vocode(seq.slot, VocodeWindow(0, n, 0, 2 * n, 0, 2 * n, 0, 2 * n))
    yield seq.slot, n, istft(re.copy(), im.copy())
    pipe.loop.release(seq)


def test_exact_lookahead_is_exact_for_every_chunk_size(pipe, sentence):
    slot, n, exact = sentence
    voc = WindowedVocoder(pipe.runner, 512)
    for chunk in (1, 2, 5, 24):
        got = _stream(voc, slot, n, None, chunk)
        assert got.shape == exact.shape == (512 * n - 256,)
        np.testing.assert_allclose(got, exact, rtol=0, atol=1e-5 * np.abs(exact).max())
    assert voc.lookahead_tokens == voc.exact_lookahead == 14
    voc.set_lookahead(99)
    assert voc.exact


def test_same_request_same_samples_whatever_the_load(pipe, monkeypatch):
    """Load changes the chunk schedule (the measured step and window times, the throttle's
    chunk_scale), so the vocoder windows differ; with the exact look-ahead the samples may differ
    only by FP32 rounding (the daemon tests compare played audio at 1e-6). A clock that advances
    0.1 ms (a fast box) to 60 ms (a loaded one, RTF > 1: chunks at the cap) per reading drives the
    real schedule into other chunk sizes. (A calibrated look-ahead commits each frame with the
    right context its chunk had: there the samples move within the calibrated bound.)"""
    import types

    from appliance.synth import batch

    def run(tick_s: float, scale: int = 1) -> tuple[np.ndarray, list[int]]:
        now = [0.0]

        def clock() -> float:
            now[0] += tick_s
            return now[0]

        monkeypatch.setattr(batch, "time", types.SimpleNamespace(perf_counter=clock))
        job = pipe.prepare(SynthesisRequest(id="load", text="Cancel me soon.", seed=70,
                                            params=SynthParams(min_new_tokens=190, max_new_tokens=190)))
        chunks: list[np.ndarray] = []
        eng = pipe.engine
        eng.step_s = eng.window_s = 0.0
        eng.add(job, lambda c: chunks.append(c.samples), None, scale)
        while eng.tasks:
            eng.step()
        return np.concatenate(chunks), [len(c) for c in chunks]

    fast, fast_sizes = run(1e-4)
    for tick, scale in ((0.01, 2), (0.06, 1), (0.004, 1)):
        got, sizes = run(tick, scale)
        assert sizes != fast_sizes                            # another schedule ...
        assert got.shape == fast.shape and np.abs(got - fast).max() <= 1e-6, (tick, scale)   # ... same samples


def test_shorter_lookahead_error_shrinks_and_joins_stay_within_it(pipe, sentence):
    """Less right context -> a larger error; the error is the whole story (no click at the joins:
    a discontinuity would show as a sample error far above the bound)."""
    slot, n, exact = sentence
    voc = WindowedVocoder(pipe.runner, 512)
    errs = {r: error_db(_stream(voc, slot, n, r, 2), exact) for r in (4, 8, 10, 12)}
    assert errs[4] > errs[8] > errs[10] > errs[12], errs
    assert errs[4] < -6.0  # even 4 steps of context is far from noise
    got = _stream(voc, slot, n, 10, 2)
    err = np.abs(got - exact)
    joins = np.arange(2, n, 2) * 512                          # chunk joins in samples (within the sentence)
    assert err[joins].max() <= err.max() and err.max() <= 10 ** (errs[10] / 20) * np.abs(exact).max() * 1.0001
    # larger chunks commit every frame with more context: never worse than 2-step chunks (the calibrated case)
    assert error_db(_stream(voc, slot, n, 10, 8), exact) <= errs[10] + 0.5


def test_calibration_picks_the_smallest_lookahead_under_the_threshold(pipe):
    free = pipe.loop.free_slots
    cal = calibrate(pipe, -60.0, candidates=(4, 8, 10, 12), sentences=(("zh", "你好，今天天气很好。"),),
                    voices=(("seed:2", 1),), tokens=(60, 80))
    worst = {c["tokens"]: c["worst_db"] for c in cal.curve}
    assert cal.lookahead_tokens == min(r for r, db in worst.items() if db <= -60.0)
    assert cal.exact_lookahead == 14 and cal.backend == "torch-cpu" and cal.precision == "fp32"
    assert pipe.loop.free_slots == free   # slots given back


def test_the_streams_that_run_stay_within_the_calibrated_bound(pipe):
    """Calibration measures the stream that runs: with the chosen look-ahead the Decoder freezes its
    frames after 2r mel frames (fewer recomputed frames), and the streamed PCM of the calibrated
    sentence stays within the threshold for the pipeline's own chunk schedule and for other chunk
    plans, not only the 2-step chunks."""
    text, voice, seed, steps = "你好，今天天气很好。", "seed:2", 1, 80
    # a loose threshold, so that the look-ahead is short enough to freeze Decoder frames (2r < 15
    # mel frames, the tiny Decoder's receptive field)
    cal = calibrate(pipe, -20.0, candidates=(4, 5, 6, 7), sentences=(("zh", text),), voices=((voice, seed),),
                    tokens=(steps, steps))
    r = cal.lookahead_tokens
    assert r < cal.exact_lookahead, cal.curve
    job = pipe.prepare(SynthesisRequest(id="calibrate-zh", text=text, voice=voice, seed=seed,
                                        params=SynthParams(min_new_tokens=steps, max_new_tokens=steps)))
    seq = Sequence(ids=job.prompts[0], spk_emb=job.spk_emb, params=job.params, seed=job.seed)
    pipe.loop.join(seq)
    while pipe.loop.active:
        pipe.loop.step()
    try:
        voc = WindowedVocoder(pipe.runner, 512)
        n = seq.steps
        exact = _stream(voc, seq.slot, n, None, 2)
        sch = pipe.engine.schedule
        plans = {"2": 2, "schedule": sch.plan(), "3": 3, "8": 8, "5-11": [5, 11]}
        errs = {k: error_db(_stream(voc, seq.slot, n, r, p), exact) for k, p in plans.items()}
        assert voc.reach == 2 * r < pipe.runner.info.decoder_rf
        assert max(errs["2"], errs["schedule"]) == pytest.approx(cal.sentences[0]["error_db"][str(r)], abs=0.05)
        assert max(errs.values()) <= cal.threshold_db, errs
    finally:
        pipe.loop.release(seq)


def test_daemon_uses_the_record_for_its_checkpoint_only(tiny_ckpt, tmp_path):
    from appliance.build.calibrate import run

    cfg = _cfg(tiny_ckpt, tmp_path / "eng")
    p = Pipeline.from_config(cfg)
    assert p.lookahead.tokens is None and "not calibrated" in p.describe_lookahead()
    p.close()
    import appliance.build.calibrate as c

    small = dict(candidates=(6, 10, 12), sentences=(("zh", "你好。"),), voices=(("seed:2", 1),), tokens=(40, 50))
    orig = c.calibrate
    c.calibrate = lambda pipe, thr: orig(pipe, thr, **small)
    try:
        cal, path = run(cfg)
    finally:
        c.calibrate = orig
    p = Pipeline.from_config(cfg)
    assert p.lookahead.tokens == cal.lookahead_tokens and p.vocoders[0].lookahead_tokens == cal.lookahead_tokens
    assert "calibrated" in p.describe_lookahead()
    p.close()
    # a stricter threshold than the calibration's, an explicit setting, exact
    for stream, want in (({"lookahead_threshold_db": -100.0}, None), ({"lookahead": "7"}, 7), ({"lookahead": "exact"}, None)):
        p = Pipeline.from_config(_cfg(tiny_ckpt, tmp_path / "eng", **stream))
        assert p.lookahead.tokens == want, (stream, p.describe_lookahead())
        p.close()
    # another checkpoint (same sizes, other bytes): not this calibration
    other = tmp_path / "other"
    import shutil

    shutil.copytree(tiny_ckpt, other)
    blob = other / "asset" / "Decoder.safetensors"
    data = bytearray(blob.read_bytes())
    data[-1] ^= 1
    blob.write_bytes(bytes(data))
    write_sums(other)       # a deliberate change: its own sums (appliance.model.integrity)
    p = Pipeline.from_config(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(other))))
    assert p.lookahead.tokens is None and "another checkpoint" in p.describe_lookahead()
    p.close()


def test_chunk_schedule_small_first_chunk_growth_and_keeping_up():
    a = 512 / 24000
    s = ChunkSchedule(first=4, cap=48, growth=2.0, safety=0.8)
    # a fast GPU (0.8 ms per step, 3 ms per window): a 4-step first chunk, then doubling
    assert s.first_chunk(0.0008, 0.003) == 4
    assert s.next(4, buffered_s=0.08, step_s=0.0008, window_s=0.003) == 8
    assert s.next(32, buffered_s=10.0, step_s=0.0008, window_s=0.003) == 48            # capped
    assert s.next(32, buffered_s=10.0, step_s=0.0008, window_s=0.003, scale=2) == 64  # throttle
    # a 2-core CPU (13 ms per step, 250 ms per window): windows that small never keep up
    sus = s.sustainable(0.013, 0.25)
    assert sus == 48 and 0.8 * a - 0.013 > 0                       # 250 ms / (17 - 13 ms) > cap
    first = s.first_chunk(0.013, 0.25)
    assert first == 48 and first * 0.8 * a >= sus * 0.013 + 0.25 - 1e-9 or first == s.cap
    assert s.next(4, buffered_s=0.05, step_s=0.013, window_s=0.25) == sus   # short of audio: keep up
    # a middle case: the first chunk grows just enough to cover the second one's making
    c1 = s.sustainable(0.005, 0.05)
    f = s.first_chunk(0.005, 0.05)
    assert f * 0.8 * a >= c1 * 0.005 + 0.05 and (f - 1) * 0.8 * a < c1 * 0.005 + 0.05
    assert s.first_chunk(0.0, 0.0) == 4 and s.next(4, 0.0, 0.0) == 8   # nothing measured yet


def test_first_chunk_leaves_slack_for_one_hiccup():
    """The first chunk's audio covers the making of the second one plus one scheduling hiccup
    (``stream.start_slack_ms``): on a box where 4 steps cover the second chunk with nothing to
    spare, the slack makes it larger."""
    a = 512 / 24000
    bare, slack = ChunkSchedule(4, 48, 2.0, 0.8), ChunkSchedule(4, 48, 2.0, 0.8, slack_s=0.08)
    assert bare.first_chunk(0.003, 0.04) == 4
    f = slack.first_chunk(0.003, 0.04)
    c1 = slack.sustainable(0.003, 0.04)
    assert f > 4 and f * 0.8 * a >= c1 * 0.003 + 0.04 + 0.08 > (f - 1) * 0.8 * a
    assert slack.first_chunk(0.0008, 0.003) == 5              # a fast GPU: one step more (0.8 ms)


def test_one_growth_rule_for_the_stream_its_plan_and_the_start_policy():
    """The chunks by growth alone (the warm-up's and calibration's plan), the stream's next chunk
    with nothing measured, and the start policy's window count follow one rule (ceil, up to cap)."""
    from appliance.synth.schedule import chunks_for

    s = ChunkSchedule(4, 48, 1.5, 0.9)
    assert s.plan() == [4, 6, 9, 14, 21, 32, 48]
    assert all(s.next(a, 0.0, 0.0) == b for a, b in zip(s.plan(), s.plan()[1:]))
    assert chunks_for(s, sum(s.plan()), 48) == len(s.plan())
    assert chunks_for(s, sum(s.plan()) + 1, 48) == len(s.plan()) + 1
    assert ChunkSchedule(4, 48, 1.0).plan() == [4]                          # no growth: first on


def test_start_plan_holds_what_a_box_that_cannot_keep_up_needs():
    """Where the stream keeps up nothing is held; where it cannot, the player holds the audio that
    lets the rest be made before it is due, and a simulation of the chunk arrivals at the cap
    confirms that playback started then never runs dry, while starting a chunk earlier would."""
    from appliance.synth.schedule import chunks_for, start_plan

    a = 512 / 24000
    s = ChunkSchedule(4, 48, 2.0, 0.9)
    fast = start_plan(s, 0.005, 0.05, 300, 14)
    assert fast.hold_s == 0.0 and fast.predicted_rtf < 0.9 and abs(fast.expected_s - 300 * a) < 1e-9
    assert start_plan(s, 0.0, 0.0, 300, 14).predicted_rtf is None          # nothing measured yet
    for step_s, steps, rows in ((0.03, 300, 1), (0.022, 600, 1), (0.012, 400, 3)):
        plan = start_plan(s, step_s, 0.2, steps, 14, rows=rows)
        assert plan.predicted_rtf * 1.0 > 0.9 and 0 < plan.hold_s <= plan.expected_s
        n = chunks_for(s, steps, 48)                                        # windows of the growing chunks
        assert n > -(-steps // 48)
        per = (step_s + rows * 0.2 * n / steps) / 0.9                      # wall s per step, at the share
        arrive = [(14 + 48 * (i + 1)) * per for i in range(-(-steps // 48))]
        sizes = [min(48, steps - 48 * i) * a for i in range(len(arrive))]

        def dry(start_audio: float) -> bool:
            k = next(i for i in range(len(sizes)) if sum(sizes[:i + 1]) >= start_audio - 1e-9)
            t0 = arrive[k]                                                 # the player starts here
            return any(arrive[i] > t0 + sum(sizes[:i]) + 1e-9 for i in range(k + 1, len(arrive)))

        assert not dry(plan.hold_s), (step_s, steps, rows, plan)
        assert dry(plan.hold_s - 48 * a) or plan.hold_s < 48 * a, (step_s, steps, rows, plan)


def test_a_rebuild_of_the_engines_invalidates_the_calibration(tiny_ckpt, tmp_path):
    from appliance.engines import manifest as mf
    from appliance.engines.lookahead import Calibration, choose, save

    ident = mf.checkpoint_identity(tiny_ckpt)
    save(tmp_path, Calibration(backend="onnxruntime", precision="int8", lookahead_tokens=9, exact_lookahead=14,
                               threshold_db=-60.0, chunk_tokens=2, engine_id="manifest-A", checkpoint=ident))
    got = choose("auto", tmp_path, tiny_ckpt, "onnxruntime", "int8", -60.0, "manifest-A")
    assert got.tokens == 9
    got = choose("auto", tmp_path, tiny_ckpt, "onnxruntime", "int8", -60.0, "manifest-B")
    assert got.tokens is None and "rebuilt" in got.source
    assert choose("auto", tmp_path, tiny_ckpt, "onnxruntime", "fp32", -60.0, "manifest-A").tokens is None


def test_calibrate_says_when_the_daemon_uses_the_result():
    from appliance.build.calibrate import report
    from appliance.engines.lookahead import Calibration

    cal = Calibration(backend="torch-cpu", precision="fp32", lookahead_tokens=10, exact_lookahead=14,
                      threshold_db=-60.0, chunk_tokens=2, curve=[{"tokens": 10, "worst_db": -61.0}])
    last = report(cal, "/e/calibration.json").splitlines()[-1]
    assert last.startswith("the daemon uses 10 steps (exact: 14) from its next start")
    assert "restarted (systemctl restart chattts-appliance)" in last and "reload" in last and "does not read" in last
    last = report(cal, "/e/calibration.json", "7").splitlines()[-1]
    assert last.startswith("the daemon does not use it: stream.lookahead is '7'") and "set it to auto" in last
