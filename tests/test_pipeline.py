"""Pipeline on the random tiny checkpoint: streaming equals one-shot decoding, limits, errors."""

import threading

import numpy as np
import pytest

from appliance.config import config_from_dict
from appliance.core import SynthesisRequest, SynthParams
from appliance.errors import CancelledError, SpeakerError, TextError
from appliance.synth.pipeline import Pipeline


@pytest.fixture(scope="module")
def pipe(tiny_ckpt):
    cfg = config_from_dict({
        "model": {"path": str(tiny_ckpt), "backend": "torch", "device": "cpu", "threads": 1,
                  "max_seq_len": 512, "max_prompt_tokens": 128},
        "synthesis": {"max_new_tokens": 120},
        "stream": {"chunk_tokens": 8, "first_chunk_tokens": 4},
    })
    p = Pipeline.from_config(cfg)
    yield p
    p.close()


def _full_decode(pipe, slot, n):
    """Reference: Decoder + Vocos over the whole utterance of ``slot`` (one window), then the inverse STFT."""
    from appliance.engines.runner import VocodeWindow
    from appliance.synth.istft import istft

    re, im = pipe.runner.vocode(slot, VocodeWindow(0, n, 0, 2 * n, 0, 2 * n, 0, 2 * n))
    return istft(re, im)


def test_streamed_chunks_equal_one_shot_decoding(pipe):
    """Windowed streaming (many small chunks) must give the same samples as decoding the whole
    utterance at once: a wrong window, a dropped or duplicated frame would break this."""
    from appliance.synth.decode_loop import Sequence

    job = pipe.prepare(SynthesisRequest(text="你好，今天天气很好。", id="a", seed=3,
                             params=SynthParams(min_new_tokens=100, max_new_tokens=100)))
    run = pipe.run(job)
    chunks = list(run)
    assert len(chunks) > 5, "expected several streamed chunks"
    assert all(c.rate == 24000 for c in chunks)
    streamed = np.concatenate([c.samples for c in chunks])
    assert run.report.stats.steps == 100
    assert streamed.size == 512 * 100 - 256

    # replay the same decode (same seed) and collect the hidden states
    seq = Sequence(ids=job.prompts[0], spk_emb=job.spk_emb, params=job.params, seed=job.seed)
    pipe.loop.join(seq)
    while not seq.finished:
        pipe.loop.step()
    ref = _full_decode(pipe, seq.slot, seq.steps)
    pipe.loop.release(seq)
    np.testing.assert_allclose(streamed, ref, rtol=0, atol=1e-5 * max(1.0, np.abs(ref).max()))


def test_same_seed_same_audio_and_fresh_seed_reported(pipe):
    a = np.concatenate([c.samples for c in pipe.run(pipe.prepare(SynthesisRequest(text="你好。", id="1", seed=5)))])
    b = np.concatenate([c.samples for c in pipe.run(pipe.prepare(SynthesisRequest(text="你好。", id="2", seed=5)))])
    np.testing.assert_array_equal(a, b)
    j = pipe.prepare(SynthesisRequest(text="你好。", id="3"))
    assert isinstance(j.seed, int)


def test_request_cannot_exceed_the_configured_max_new_tokens(pipe):
    job = pipe.prepare(SynthesisRequest(text="你好。", id="x", seed=1, params=SynthParams(max_new_tokens=4000, min_new_tokens=4000)))
    assert job.params.max_new_tokens == 120
    run = pipe.run(job)
    pcm = np.concatenate([c.samples for c in run])
    assert run.report.stats.steps == 120 and pcm.size == 512 * 120 - 256


def test_cancel_stops_the_run_and_frees_the_slot(pipe):
    ev = threading.Event()
    job = pipe.prepare(SynthesisRequest(text="你好。", id="c", seed=1, params=SynthParams(min_new_tokens=100)))
    it = pipe.run(job, cancel=ev)
    next(it)
    ev.set()
    with pytest.raises(CancelledError):
        for _ in it:
            pass
    assert pipe.loop.free_slots == pipe.loop.max_batch


@pytest.mark.parametrize("text, exc", [("", TextError), ("。，！", TextError), ("x" * 5000, TextError)])
def test_bad_text(pipe, text, exc):
    with pytest.raises(exc):
        pipe.prepare(SynthesisRequest(text=text, id="b"))


def test_malformed_speaker_string(pipe):
    with pytest.raises(SpeakerError):
        pipe.prepare(SynthesisRequest(text="你好", id="s", voice="not a speaker string"))


def test_long_text_is_split_and_spoken_as_one_stream(pipe):
    text = "今天天气很好。" * 40
    job = pipe.prepare(SynthesisRequest(text=text, id="long", seed=2, params=SynthParams(max_new_tokens=20, min_new_tokens=20)))
    assert len(job.prompts) > 1
    assert all(len(p) <= 128 for p in job.prompts)
    run = pipe.run(job)
    pcm = np.concatenate([c.samples for c in run])
    assert run.report.stats.sentences == len(job.prompts)
    assert pcm.size == len(job.prompts) * (512 * 20 - 256)


def test_a_failing_join_gives_its_slot_back(pipe):
    """A sequence whose sampler cannot start (here: a negative seed, refused by numpy) must not
    keep its KV slot: three such failures used to leave no slot for anyone."""
    from appliance.synth.decode_loop import Sequence

    job = pipe.prepare(SynthesisRequest(text="你好。", id="neg", seed=1))
    for _ in range(pipe.loop.max_batch + 1):
        with pytest.raises(ValueError):
            pipe.loop.join(Sequence(ids=job.prompts[0], spk_emb=job.spk_emb, params=job.params, seed=-5))
        assert pipe.loop.free_slots == pipe.loop.max_batch
    assert np.concatenate([c.samples for c in pipe.run(job)]).size > 0


@pytest.mark.parametrize("obj", [{"text": "hi", "seed": -5}, {"text": "hi", "seed": 2**64},
                                 {"text": "hi", "voice": "seed:" + "9" * 5000}])
def test_out_of_range_seeds_are_bad_requests(pipe, obj):
    from appliance.errors import RequestError
    from appliance.messages.protocol import parse_request

    with pytest.raises(RequestError):
        pipe.prepare(parse_request(obj))


def test_missing_checkpoint_names_model_path_and_the_config_file(tmp_path):
    from appliance.config import load_config
    from appliance.errors import CheckpointError

    (tmp_path / "c.yaml").write_text("model: {path: nothing-here, backend: torch}\n")
    with pytest.raises(CheckpointError) as e:
        Pipeline.from_config(load_config(tmp_path / "c.yaml"))
    msg = str(e.value)
    assert "model.path" in msg and str(tmp_path / "c.yaml") in msg and "model random" in msg
    assert "asset/tokenizer/asset" not in msg


def test_model_path_may_point_at_asset_and_random_weights_are_flagged(tiny_ckpt, caplog):
    assert (tiny_ckpt / "RANDOM_WEIGHTS").is_file()
    cfg = config_from_dict({"model": {"path": str(tiny_ckpt / "asset"), "backend": "torch", "device": "cpu",
                                      "threads": 1, "max_seq_len": 256, "max_prompt_tokens": 64}})
    with caplog.at_level("WARNING"):
        p = Pipeline.from_config(cfg)
    p.close()
    assert "RANDOM weights" in caplog.text
