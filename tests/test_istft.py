"""Streaming numpy ISTFT == torch.istft(center=True), for any push sizes and across resets."""

import numpy as np
import torch

from appliance.synth.istft import StreamingISTFT, istft


def _ref(re, im):
    spec = torch.complex(torch.from_numpy(re.T.copy()), torch.from_numpy(im.T.copy()))
    return torch.istft(spec, 1024, 256, 1024, torch.hann_window(1024), center=True).numpy()


def test_streaming_equals_torch_istft_for_random_push_sizes_and_resets():
    rng = np.random.default_rng(0)
    s = StreamingISTFT(max_frames_per_push=64)
    for _ in range(4):   # one object, several signals: reset() must leave nothing behind
        f = int(rng.integers(3, 150))
        re = rng.standard_normal((f, 513)).astype(np.float32)
        im = rng.standard_normal((f, 513)).astype(np.float32)
        s.reset()
        parts, i = [], 0
        while i < f:
            n = int(rng.integers(1, 50))
            parts.append(s.push(re[i:i + n], im[i:i + n]))
            i += n
        parts.append(s.finish())
        out = np.concatenate(parts)
        ref = _ref(re, im)
        assert out.shape == ref.shape == (256 * (f - 1),)
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-6)


def test_whole_signal_helper():
    rng = np.random.default_rng(1)
    re = rng.standard_normal((20, 513)).astype(np.float32)
    im = rng.standard_normal((20, 513)).astype(np.float32)
    np.testing.assert_allclose(istft(re, im), _ref(re, im), rtol=0, atol=1e-6)
