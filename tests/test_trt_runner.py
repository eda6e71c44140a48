"""The TensorRT runner end to end without TensorRT (which cannot be installed here): engines from
``tests/fake_trt.py`` that compute simple numpy functions over the buffers the runner bound,
through the runner's own CUDA memory, on the host-memory CUDA fake everywhere and on the real
CUDA runtime where cuda-python and a GPU are present. The codes, hidden states, KV cache and
spectrum must equal an independent numpy computation of the same functions with the one sampler."""

from __future__ import annotations

import json

import numpy as np
import pytest

from appliance.config import config_from_dict
from appliance.core import SamplingParams
from appliance.engines.runner import VocodeWindow
from appliance.engines.sampling import Sampler
from tests import fake_cudart, fake_trt
from tests.test_trt_cuda_io import _cuda_here

L, D, H, Q, V, M, S, T, WIN, N_TEXT = 2, 32, 2, 4, 626, 3, 64, 16, 16, 50
SHAPES = {"n_layers": L, "hidden": D, "n_heads": H, "num_vq": Q, "num_audio_tokens": V, "n_mels": 100, "n_fft": 1024,
          "num_text_tokens": N_TEXT, "dec_layers": 1, "voc_layers": 1}


def _t(name, shape, dtype):
    return {"name": name, "shape": list(shape), "dtype": dtype}


def _manifest() -> dict:
    gpt_in = [_t("emb", (-1, -1, D), "float"), _t("pos", (-1,), "int64"), _t("slots", (-1,), "int64"),
              _t("past", (-1,), "int64")] + [_t(f"{k}_cache.{i}", (S, M, H, D // H), "half") for k in "kv" for i in range(L)]
    gpt_out = [_t("logits", (-1, Q, V), "float"), _t("hidden", (-1, D), "float"),
               _t("k_new", (L, -1, -1, H, D // H), "half"), _t("v_new", (L, -1, -1, H, D // H), "half")]
    prof = lambda b, t: {"emb": [[1, 1, D], [b, t, D], [b, t, D]], "pos": [[1], [b], [b]],   # noqa: E731
                         "slots": [[1], [b], [b]], "past": [[1], [S - 1], [S - 1]]}
    return {
        "precision": "fp16", "runtime": {"name": "tensorrt", "version": "10.3.0"}, "kv": {"dtype": "float16"},
        "shapes": SHAPES, "limits": {"max_batch": M, "max_seq_len": S, "max_prompt_tokens": T, "window_tokens": WIN},
        "graphs": {"gpt": {"file": "gpt.plan", "inputs": gpt_in, "outputs": gpt_out, "profiles": [prof(M, 1), prof(1, T)]},
                   "decoder": {"file": "decoder.plan", "inputs": [_t("hidden", (-1, D), "float")],
                               "outputs": [_t("mel", (100, -1), "float")],
                               "profiles": [{"hidden": [[1, D], [WIN, D], [WIN, D]]}]},
                   "vocos": {"file": "vocos.plan", "inputs": [_t("mel", (100, -1), "float")],
                             "outputs": [_t("real", (-1, 513), "float"), _t("imag", (-1, 513), "float")],
                             "profiles": [{"mel": [[100, 1], [100, 2 * WIN], [100, 2 * WIN]]}]}},
    }


@pytest.fixture(params=["fake", pytest.param("cuda", marks=pytest.mark.skipif(
    not _cuda_here(), reason="needs cuda-python and an NVIDIA GPU"))])
def trt_runner(request, tmp_path, monkeypatch):
    from appliance.engines.onnx import runner as onnx_runner
    from appliance.engines.tensorrt import runner as trt_runner_mod, trt as trtshim
    from appliance.engines.tensorrt.cuda import Cuda

    m = _manifest()
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    for g in ("gpt", "decoder", "vocos"):
        (tmp_path / f"{g}.plan").write_bytes(g.encode())
    rng = np.random.default_rng(3)
    et, ec = rng.standard_normal((N_TEXT, D)).astype(np.float32), 0.3 * rng.standard_normal((Q, V, D)).astype(np.float32)
    monkeypatch.setattr(onnx_runner, "load_embeddings", lambda d, m, hint, verify: (et, ec, None))
    monkeypatch.setattr(trt_runner_mod, "load_manifest", lambda cfg, d: m)
    monkeypatch.setattr(trtshim, "module", lambda: fake_trt)
    monkeypatch.setattr(trtshim, "capture_logger", lambda: fake_trt.Logger())
    cu = Cuda(runtime=fake_cudart) if request.param == "fake" else Cuda()
    monkeypatch.setattr(fake_trt, "CU", cu)
    monkeypatch.setattr(fake_trt, "W", rng.standard_normal((D, Q * V)).astype(np.float32))
    monkeypatch.setattr(fake_trt, "SHAPES", SHAPES)
    fake_trt.LOG.clear()
    cfg = config_from_dict({"model": {"backend": "tensorrt", "max_batch": M, "max_seq_len": S, "max_prompt_tokens": T},
                            "safety": {"verify_checkpoint": False}})
    r = trt_runner_mod.TensorRTRunner(cfg, reason="test", plan_dir=tmp_path, cuda=cu)
    yield r, et, ec
    r.close()
    r.close()


def _ref_gpt(emb_last: np.ndarray, past: int) -> tuple[np.ndarray, np.ndarray]:
    h = np.tanh(emb_last + 0.01 * past).astype(np.float32)
    return (h @ fake_trt.W).reshape(Q, V), h


def test_prompt_steps_kv_and_spectrum_match_numpy(trt_runner):
    r, et, ec = trt_runner
    ids = np.array([3, 7, 1, 9, 4], np.int64)
    params = SamplingParams()
    r.prefill(1, ids, None)
    first = r.start(1, params, 21)
    codes = r.step(np.array([1]), 3)[:, 0].copy()

    ref = Sampler(M, num_vq=Q, num_tokens=V)                     # the same functions, in numpy
    ref.start(1, params, 21)
    logits, h = _ref_gpt(et[ids][-1], 1)
    hid = [h]
    c = ref.sample(np.array([1]), logits[None], np.zeros(1, np.int64))[0].copy()
    ref.record(1, c)
    want, embs = [c], [et[ids]]
    for j in range(3):
        e = sum(ec[q][c[q]] for q in range(Q))
        embs.append(e[None])
        logits, h = _ref_gpt(e, len(ids) + j)
        hid.append(h)
        c = ref.sample(np.array([1]), logits[None], np.array([j + 1]))[0].copy()
        ref.record(1, c)
        want.append(c)
    assert np.array_equal(first, want[0]) and np.array_equal(codes, np.stack(want[1:]))
    np.testing.assert_allclose(r.hidden(1, 0, 4), np.stack(hid), rtol=1e-6, atol=1e-6)

    k, v = r._io.read_kv()
    allpos = np.concatenate(embs)                                # positions 0..7 of slot 1
    for layer in range(L):
        want_k = (allpos + layer).astype(np.float16).reshape(-1, H, D // H)
        assert np.array_equal(k[layer, :8, 1], want_k) and np.array_equal(v[layer, :8, 1], -want_k)
    assert not k[:, 8:].any() and not k[:, :, [0, 2]].any()      # nothing else written
    runs = [e for e in fake_trt.LOG if e[0] == "gpt"]
    assert runs[0][1] == 1 and runs[0][2]["emb"] == (1, 5, D)    # the prompt on the prefill profile
    assert [e[2]["past"] for e in runs[1:]] == [(5,), (6,), (7,)]

    re, im = r.vocode(1, VocodeWindow(h0=0, h1=4, m0=0, m1=8, v0=0, v1=8, s0=0, s1=8, reach=0))
    mel = np.repeat(np.stack([np.resize(x, 100) for x in np.stack(hid)], 1), 2, axis=1)
    want_re = np.stack([np.resize(mel[:, i], 513) for i in range(8)])
    np.testing.assert_allclose(re, want_re, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(im, -want_re, rtol=1e-6, atol=1e-6)
    info = r.info.network_fields()
    assert set(info["networks"]) == {"gpt", "decoder", "vocos"} and "no torch" in info["networks"]["gpt"]
    assert r.device_memory_bytes() >= 2 * L * S * M * D * 2


def test_three_rows_step_together_and_long_windows_are_exact(trt_runner):
    r, et, ec = trt_runner
    for s in range(M):
        r.prefill(s, np.array([s + 1, 2, 3], np.int64), None)
        r.start(s, SamplingParams(), 5 + s)
    out = np.concatenate([r.step(np.arange(M), 12).copy(), r.step(np.arange(M), 12).copy()])
    assert out.shape == (24, M, Q)
    gpt = [e for e in fake_trt.LOG if e[0] == "gpt" and e[1] == 0]
    assert gpt[-1][2]["emb"] == (M, 1, D) and gpt[-1][2]["past"] == (3 + 23,)
    h = r.hidden(2, 0, 25)                 # 25 hidden states > one decoder window (16), 50 mel frames > 32
    re, _ = r.vocode(2, VocodeWindow(h0=0, h1=25, m0=0, m1=50, v0=0, v1=50, s0=2, s1=47, reach=0))
    mel = np.repeat(np.stack([np.resize(x, 100) for x in h], 1), 2, axis=1)
    want = np.stack([np.resize(mel[:, i], 513) for i in range(50)])[2:47]
    np.testing.assert_allclose(re, want, rtol=1e-6, atol=1e-6)
    assert sum(1 for e in fake_trt.LOG if e[0] == "decoder") > 1 and sum(1 for e in fake_trt.LOG if e[0] == "vocos") > 1
