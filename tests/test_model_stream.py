"""The stateful vocoder passes (appliance.model.stream) and the host runners that use them: equal to
the one-shot pass for any split of the sentence, each hidden state through the Decoder once, the
ONNX graphs equal to the torch functions, and an export without them refused (tiny checkpoint)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.synth.calibration import _stream
from appliance.config import config_from_dict
from appliance.engines.runner import VocodeWindow
from appliance.errors import EngineMismatchError
from appliance.model.checkpoint import load_model
from appliance.model.stream import (
    decoder_cache_shapes,
    decoder_stream,
    vocos_cache_shapes,
    vocos_stream,
    zero_caches,
)
from appliance.synth.istft import istft
from appliance.synth.vocoder import WindowedVocoder
from tests.fixtures_model import ONNX_LIMITS


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt, dtype=torch.float32).eval()


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / max(float(np.abs(np.asarray(b)).max()), 1e-12))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(1, 23), min_size=1, max_size=6))
def test_decoder_passes_equal_the_one_shot_pass_for_any_split(model, cuts):
    dec = model.decoder
    rf = sum(f // 2 for _, f in decoder_cache_shapes(dec))
    hid = torch.randn(1, model.shapes.hidden, sum(cuts), generator=torch.Generator().manual_seed(len(cuts)))
    cache, n = zero_caches(decoder_cache_shapes(dec), torch.float32), 0
    with torch.no_grad():
        for t in cuts:
            mel, cache = decoder_stream(dec, hid[..., n:n + t], torch.tensor(2 * n), cache)
            a, n = 2 * n - rf, n + t
            assert mel.shape[-1] == rf + 2 * t
            ref = dec(hid[..., :n])  # one-shot over what exists: final and provisional frames alike
            assert _rel(mel[..., max(0, a) - a:], ref[..., max(0, a):]) < 1e-5


def _frozen_reference(dec, hid, cuts, reach):
    """An independent statement of the stream with a reach: per layer, the one-shot layer over its
    input, where input frames ``p < end - min(H_l, reach)`` keep the value they had when they were
    frozen (``H_l``: the half-widths of the layers before). Returns the final layer's output
    ``[1, 100, 2n]`` after each pass."""
    st = dec.decoder
    layers = [(1, lambda x: F.gelu(st.conv_in[0](x))), (1, st.conv_in[2])]
    layers += [(b.dwconv.dilation[0] * (b.dwconv.kernel_size[0] // 2), b) for b in st.decoder_block]
    layers += [(1, lambda x: dec.out_conv(st.conv_out(x)))]   # conv_out is 1x1: frozen with out_conv's input
    frozen: list[torch.Tensor | None] = [None] * len(layers)
    x_all = hid.reshape(1, 2, hid.shape[1] // 2, -1).permute(0, 2, 3, 1).flatten(2)
    outs, n = [], 0
    for t in cuts:
        n += t
        end, x, depth = 2 * n, x_all[..., :2 * n], 0
        for i, (h, f) in enumerate(layers):
            if frozen[i] is not None:   # frozen input frames keep their values
                x = torch.cat([frozen[i], x[..., frozen[i].shape[-1]:]], -1)
            frozen[i] = x[..., :max(0, end - min(depth, reach))]
            x, depth = f(x), depth + h
        outs.append(x * dec.coef)
    return outs


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(1, 23), min_size=1, max_size=6), reach=st.integers(1, 15))
def test_decoder_passes_with_a_reach_freeze_each_layer_at_that_depth(model, cuts, reach):
    """A reach below the receptive field: each pass's mel equals the frozen-frames reference (the
    one-shot pass only where reach >= rf), covering ``[pos0 - R, end)`` with ``R = min(rf, reach)``."""
    dec = model.decoder
    rf = sum(f // 2 for _, f in decoder_cache_shapes(dec))
    R = min(rf, reach)
    hid = torch.randn(1, model.shapes.hidden, sum(cuts), generator=torch.Generator().manual_seed(reach))
    cache, n = None, 0
    with torch.no_grad():
        refs = _frozen_reference(dec, hid, cuts, reach)
        for t, ref in zip(cuts, refs):
            mel, cache = decoder_stream(dec, hid[..., n:n + t], torch.tensor(2 * n), cache, reach)
            a, n = 2 * n - R, n + t
            assert mel.shape[-1] == R + 2 * t
            assert _rel(mel[..., max(0, a) - a:], ref[..., max(0, a):]) < 1e-5
        if reach >= rf:
            assert _rel(refs[-1], dec(hid)) < 1e-5


def test_vocos_final_frames_ignore_provisional_input(model):
    """Provisional mel frames change the provisional spectrum only: the cache keeps final inputs."""
    voc = model.vocos
    rf = sum(f // 2 for _, f in vocos_cache_shapes(voc))
    g = torch.Generator().manual_seed(3)
    mel = torch.randn(1, model.shapes.n_mels, 70, generator=g)
    cache, p = zero_caches(vocos_cache_shapes(voc), torch.float32), 0
    with torch.no_grad():
        for f, nf in ((12, 5), (30, 30), (7, 2), (21, 21)):
            x = mel[..., p:p + f].clone()
            x[..., nf:] += torch.randn(x[..., nf:].shape, generator=g)  # provisional: not the final values
            re, im, cache = vocos_stream(voc, x, torch.tensor(p), torch.tensor(nf), cache)
            ref_re, ref_im = voc(torch.cat([mel[..., :p], x], -1))
            a = p - rf
            assert _rel(re[:, max(0, a) - a:], ref_re[:, max(0, a):]) < 1e-5
            assert _rel(im[:, max(0, a) - a:], ref_im[:, max(0, a):]) < 1e-5
            p += nf
        re, _, _ = vocos_stream(voc, mel[..., p:], torch.tensor(p), torch.tensor(70 - p), cache)
        assert _rel(re[:, rf:], voc(mel)[0][:, p:]) < 1e-5


def _cfg(tiny_ckpt, engine_dir, backend):
    return config_from_dict({"model": {"path": str(tiny_ckpt), "backend": backend, "device": "cpu", "threads": 1,
                                       **ONNX_LIMITS, "engine_dir": str(engine_dir)}}, base_dir=str(tiny_ckpt))


@pytest.fixture(scope="module")
def runners(tiny_ckpt, onnx_dir):
    from appliance.engines.onnx.runner import OnnxRunner
    from appliance.engines.torch.cpu_runner import TorchRunner

    o, t = OnnxRunner(_cfg(tiny_ckpt, onnx_dir, "onnxruntime")), TorchRunner(_cfg(tiny_ckpt, onnx_dir, "torch"))
    yield o, t
    o.close()
    t.close()


class _Counting:
    """Wraps a host runner's passes to count the hidden states and mel frames they receive."""

    def __init__(self, r):
        self.r, self.hidden, self.mel = r, 0, 0
        self.dec, self.voc = r.forward_decoder_stream, r.forward_vocos_stream
        r.forward_decoder_stream, r.forward_vocos_stream = self._dec, self._voc

    def _dec(self, h, *a):
        self.hidden += h.shape[0]
        return self.dec(h, *a)

    def _voc(self, m, *a):
        self.mel += m.shape[1]
        return self.voc(m, *a)

    def close(self):
        del self.r.forward_decoder_stream, self.r.forward_vocos_stream


@pytest.mark.parametrize("which", [0, 1], ids=["onnxruntime", "torch"])
def test_streamed_pcm_is_the_one_shot_pcm_and_each_hidden_state_is_decoded_once(runners, which):
    r = runners[which]
    n, slot = 70, 1
    r.prefill(slot, np.arange(1, 9, dtype=np.int64), None)
    r._hid[slot, :n] = np.random.default_rng(5).standard_normal((n, r.info.hidden_size)).astype(np.float32)
    re, im = r.vocode(slot, VocodeWindow(0, n, 0, 2 * n, 0, 2 * n, 0, 2 * n))
    exact = istft(re.copy(), im.copy())
    voc = WindowedVocoder(r, 512)
    for chunk in (1, 4, 13):
        count = _Counting(r)
        try:
            got = _stream(voc, slot, n, None, chunk)
        finally:
            count.close()
        assert _rel(got, exact) < 1e-5
        assert count.hidden == n            # no left context recomputed: each hidden state once
        assert count.mel <= 2 * n + (-(-n // chunk) + 1) * r.info.decoder_rf  # final mel once + a provisional tail per pass
    # a look-ahead of 4 steps: the Decoder freezes its frames after 8 mel frames of right context,
    # so Vocos reads at most rf_voc provisional mel frames per pass (not up to rf_dec)
    count = _Counting(r)
    try:
        _stream(voc, slot, n, 4, 13)
    finally:
        count.close()
    assert voc.reach == 8 < r.info.decoder_rf
    assert count.mel <= 2 * n + (-(-n // 13) + 1) * r.info.vocos_rf


def test_onnx_passes_equal_torch_passes_across_calls(runners):
    o, t = runners
    rng = np.random.default_rng(7)
    hid = rng.standard_normal((40, o.info.hidden_size)).astype(np.float32)
    for reach in (None, 5):   # exact, and frozen after 5 frames of right context
        co = ct = None
        n = 0
        for k in (3, 1, 16, 20):
            mo, co = o.forward_decoder_stream(hid[n:n + k], 2 * n, co, reach)
            mt, ct = t.forward_decoder_stream(hid[n:n + k], 2 * n, ct, reach)
            assert mo.shape == mt.shape == (100, (reach or o.info.decoder_rf) + 2 * k)
            assert _rel(mo, mt) < 1e-4
            n += k
    mel = rng.standard_normal((100, 50)).astype(np.float32)
    vo = vt = None
    for p, f, nf in ((0, 20, 12), (12, 38, 38)):
        ro, io, vo = o.forward_vocos_stream(mel[:, p:p + f], p, nf, vo)
        rt, it, vt = t.forward_vocos_stream(mel[:, p:p + f], p, nf, vt)
        assert _rel(ro, rt) < 1e-4 and _rel(io, it) < 1e-4


def test_onnx_and_torch_streams_agree_with_a_short_lookahead(runners):
    """The same look-ahead (4 steps: the Decoder's frames frozen after 8 mel frames) gives the same
    PCM through the ONNX graphs and the torch functions, and it is not the exact PCM."""
    n, slot = 60, 2
    h = np.random.default_rng(9).standard_normal((n, runners[0].info.hidden_size)).astype(np.float32)
    out = []
    for r in runners:
        r.prefill(slot, np.arange(1, 9, dtype=np.int64), None)
        r._hid[slot, :n] = h
        voc = WindowedVocoder(r, 512)
        out.append((_stream(voc, slot, n, 4, 2), _stream(voc, slot, n, 4, [4, 8, 16]), _stream(voc, slot, n, None, 5)))
    for a, b in zip(*out):
        assert _rel(a, b) < 1e-4
    assert _rel(out[1][0], out[1][2]) > 1e-3


def test_an_export_with_stateless_vocoder_graphs_is_refused_with_the_command(tiny_ckpt, onnx_dir, tmp_path):
    from appliance.engines.onnx.runner import OnnxRunner

    old = tmp_path / "old"
    shutil.copytree(onnx_dir, old)
    mpath = old / "onnx" / "fp32" / "manifest.json"
    m = json.loads(mpath.read_text())
    m["build"]["vocoder"] = "stream-merged"   # the export before the Decoder's reach input
    mpath.write_text(json.dumps(m))
    with pytest.raises(EngineMismatchError, match="vocoder graphs from an older export.*export again with: chattts-appliance engines export"):
        OnnxRunner(dataclasses.replace(_cfg(tiny_ckpt, old, "onnxruntime")))
