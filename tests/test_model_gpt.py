"""Static-KV-cache GPT: prefill + decode equal a full causal forward; per-row positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from appliance.errors import CapacityError
from appliance.model.checkpoint import load_model


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt)


def _seq(model, n_prompt: int, n_codes: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.shapes.num_text_tokens, (n_prompt,), generator=g)
    ids[1] = model.spk_emb_id
    spk = torch.randn(model.shapes.hidden, generator=g)
    codes = torch.randint(0, 625, (n_codes, 4), generator=g)
    return ids, spk, codes


@torch.inference_mode()
def test_prefill_decode_equals_full_forward(model):
    ids, spk, codes = _seq(model, 11, 20, 0)
    m = model
    m.gpt.setup_cache(2, 64, torch.float32, "cpu")
    emb_p = m.embed_prompt(ids, spk)  # [1, T, D]
    emb_c = m.embed_codes(codes).transpose(0, 1)  # [1, N, D]
    full = m.gpt.forward_full(torch.cat([emb_p, emb_c], 1))[0]  # [T+N, D]
    h = m.gpt.prefill(emb_p, 1)[0]
    torch.testing.assert_close(h, full[:11], rtol=1e-5, atol=1e-5)
    for i in range(20):
        p = torch.tensor([11 + i])
        hi = m.gpt.decode_step(emb_c[:, i:i + 1], torch.tensor([1]), p, 11 + i + 1)
        torch.testing.assert_close(hi[0], full[11 + i], rtol=1e-5, atol=1e-5)
    # kv_len=None (whole cache, fixed shape) gives the same as a bounded read
    h_all = m.gpt.decode_step(emb_c[:, :1], torch.tensor([1]), torch.tensor([11]), None)
    torch.testing.assert_close(h_all[0], full[11], rtol=1e-5, atol=1e-5)
    # logits are the heads of the hidden state
    lg = m.audio_logits(full[-1:])
    assert lg.shape == (1, 4, 626) and float(lg.std()) > 0.5


@torch.inference_mode()
def test_batched_rows_with_own_positions_equal_single_runs(model):
    m = model
    lens = [5, 9, 14]
    seqs = [_seq(m, n, 6, 10 + k) for k, n in enumerate(lens)]
    slots = [2, 0, 1]
    # reference: each sequence alone in slot 0
    ref = []
    for ids, spk, codes in seqs:
        m.gpt.setup_cache(1, 64, torch.float32, "cpu")
        m.gpt.prefill(m.embed_prompt(ids, spk), 0)
        ref.append([m.gpt.decode_step(m.embed_codes(codes[i:i + 1]), torch.tensor([0]), torch.tensor([len(ids) + i]))[0]
                    for i in range(6)])
    # batched: three slots, different positions in the same step
    m.gpt.setup_cache(3, 64, torch.float32, "cpu")
    for (ids, spk, _), s in zip(seqs, slots):
        m.gpt.prefill(m.embed_prompt(ids, spk), s)
    for i in range(6):
        codes = torch.stack([c[i] for _, _, c in seqs])  # [3, 4]
        pos = torch.tensor([n + i for n in lens])
        h = m.gpt.decode_step(m.embed_codes(codes), torch.tensor(slots), pos, int(pos.max()) + 1)
        for r in range(3):
            torch.testing.assert_close(h[r], ref[r][i], rtol=1e-5, atol=1e-5)


def test_runner_api_and_limits(tiny_config):
    from appliance.core import SamplingParams
    from appliance.engines.runner import VocodeWindow
    from appliance.engines.torch.cpu_runner import TorchRunner

    r = TorchRunner(tiny_config, reason="test")
    assert r.info.backend == "torch-cpu" and r.info.precision == "fp32" and r.info.max_batch == 3
    assert r.info.kv_bytes_per_token == 2 * 2 * 64 * 4 and r.info.text_mode and r.info.step_chunk == 1
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 400, 12)
    lg, h = r.forward_prefill(1, ids, rng.standard_normal(64).astype(np.float32))
    assert lg.shape == (4, 626) and h.shape == (64,) and lg.dtype == np.float32
    lg0, h0 = lg.copy(), h.copy()
    codes = lg.argmax(-1)[None]
    lg2, h2 = r.forward_decode(np.array([1]), codes, np.array([12]))
    assert lg2.shape == (1, 4, 626) and h2.shape == (1, 64)
    assert not np.allclose(lg2[0], lg0)
    mel = r.forward_decoder(np.stack([h0, h2[0]]))
    assert mel.shape == (100, 4)
    re, im = r.forward_vocos(mel)
    assert re.shape == im.shape == (4, 513) and np.all(np.hypot(re, im) <= 100.0 + 1e-3)
    # the contract: prefill, start, step keep the hidden states; vocode reads them
    r.prefill(1, ids, None)
    first = r.start(1, SamplingParams(greedy=True), 0)
    assert first.shape == (4,)
    out = r.step(np.array([1]), 1)
    assert out.shape == (1, 1, 4) and r.hidden(1, 0, 2).shape == (2, 64)
    re, im = r.vocode(1, VocodeWindow(0, 2, 0, 4, 0, 4, 0, 4))
    assert re.shape == im.shape == (4, 513)
    with pytest.raises(CapacityError, match="max_prompt_tokens"):
        r.prefill(0, np.zeros(129, np.int64), None)
    with pytest.raises(CapacityError, match="slot"):
        r.prefill(3, ids, None)
    with pytest.raises(CapacityError, match="distinct"):
        r.step(np.array([1, 1]), 1)
    r._pos[1] = 512
    with pytest.raises(CapacityError, match="max_seq_len"):
        r.step(np.array([1]), 1)
    r.close()
    r.close()
