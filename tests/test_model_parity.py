"""Parity with upstream ChatTTS 0.2.5 on a random tiny checkpoint (goldens: tests/golden/upstream_tiny.npz,
made by tests/golden/make_goldens.py; see its docstring for every array).

The checkpoint is rebuilt from the npz in the official layout and loaded with OUR loader; GPT hidden
states and audio logits, greedy codes (>= 200 steps, free-running), Decoder mel and Vocos waveform
(through the torch reference ISTFT) must equal upstream's within FP32 rounding.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.fixtures_model import GOLDEN

EOS = 625
RTOL = 1e-4  # relative to the largest magnitude of the reference array

pytestmark = pytest.mark.skipif(not GOLDEN.is_file(), reason="golden file missing")


def _close(name: str, ours: np.ndarray, ref: np.ndarray, rtol: float = RTOL) -> tuple[float, float]:
    """Assert |ours - ref| <= rtol * max|ref| everywhere; return (max abs err, max abs err / max|ref|)."""
    assert ours.shape == ref.shape, f"{name}: shape {ours.shape} != {ref.shape}"
    scale = float(np.abs(ref).max())
    err = float(np.abs(ours.astype(np.float64) - ref).max())
    assert err <= rtol * scale, f"{name}: max abs error {err:.3g} > {rtol} x max|ref| {scale:.3g}"
    return err, err / scale


def _penalize(logits: np.ndarray, hist: np.ndarray, penalty: float = 1.05, window: int = 16) -> np.ndarray:
    """Upstream CustomRepetitionPenaltyLogitsProcessorRepeat for one row per codebook.
    ``logits [Q, V]``, ``hist [n, Q]`` generated codes so far."""
    out = logits.astype(np.float32).copy()
    w = hist[-window:]
    for q in range(out.shape[0]):
        freq = np.bincount(w[:, q], minlength=out.shape[1])[: out.shape[1]] if len(w) else np.zeros(out.shape[1], np.int64)
        alpha = np.power(np.float32(penalty), freq.astype(np.float32))
        out[q] = np.where(out[q] < 0, out[q] * alpha, out[q] / alpha)
    return out


def test_golden_meta(golden):
    meta = json.loads(golden["meta_json"].tobytes().decode("utf-8"))
    assert meta["chattts"] == "0.2.5" and meta["vocos"] == "0.1.0" and meta["dtype"] == "float32"
    assert golden["codes"].shape[0] >= 200
    assert GOLDEN.stat().st_size < 4_000_000


def test_tokenizer_matches_upstream_ids(golden, golden_ckpt):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(golden_ckpt / "asset" / "tokenizer" / "tokenizer.json"))
    text = golden["text"].tobytes().decode("utf-8")
    assert tok.encode(text, add_special_tokens=False).ids == golden["input_ids"].tolist()


@torch.inference_mode()
def test_prefill_hidden_and_logits(golden, golden_model):
    ids = torch.from_numpy(golden["input_ids"])
    emb = golden_model.embed_prompt(ids, torch.from_numpy(golden["spk_emb"]))
    golden_model.gpt.setup_cache(1, 512, torch.float32, "cpu")
    h = golden_model.gpt.prefill(emb, 0)[0]
    _close("prefill hidden", h.numpy(), golden["prefill_hidden"])
    _close("prefill logits", golden_model.audio_logits(h[-1:])[0].numpy(), golden["prefill_logits"])


def run_greedy(golden, ckpt, device: str = "cpu", dtype: str = "float32", rtol: float = RTOL) -> dict:
    """Free-running greedy decode through a TorchRunner, compared step by step with the goldens.

    Fails at the first differing code, showing both top-1/top-2 gaps. Returns error statistics.
    """
    from appliance.config import config_from_dict
    from appliance.engines.torch.cpu_runner import TorchRunner

    cfg = config_from_dict({"model": {"path": str(ckpt), "backend": "torch", "device": device, "dtype": dtype,
                                      "threads": 1, "max_batch": 1, "max_seq_len": 512, "max_prompt_tokens": 128}})
    r = TorchRunner(cfg)
    ref_codes, ref_hid = golden["codes"], golden["hiddens"]
    steps = {int(s): i for i, s in enumerate(golden["logit_steps"])}
    n, t = ref_codes.shape[0], golden["input_ids"].shape[0]
    logits, hidden = r.forward_prefill(0, golden["input_ids"], golden["spk_emb"])
    codes = np.zeros_like(ref_codes)
    errs_h, errs_l = [], []
    for i in range(n):
        errs_h.append(_close(f"hidden step {i}", hidden.reshape(-1), ref_hid[i], rtol)[1])
        if i in steps:
            errs_l.append(_close(f"logits step {i}", logits.reshape(4, -1), golden["step_logits"][steps[i]], rtol)[1])
        pen = _penalize(logits.reshape(4, -1), codes[:i])
        pen[:, EOS] = -np.inf
        codes[i] = pen.argmax(-1)
        if not np.array_equal(codes[i], ref_codes[i]):
            top2 = np.sort(pen, -1)[:, -2:]
            pytest.fail(f"greedy code differs at step {i} (identical for {i} steps): ours {codes[i].tolist()} "
                        f"upstream {ref_codes[i].tolist()}; our top-1 minus top-2 gap per codebook "
                        f"{(top2[:, 1] - top2[:, 0]).tolist()}, upstream gap {golden['gap'][i].tolist()}")
        if i + 1 < n:
            logits, hidden = r.forward_decode(np.array([0]), codes[i:i + 1], np.array([t + i]))
    r.close()
    return {"steps": n, "hidden_rel": max(errs_h), "logits_rel": max(errs_l)}


def test_greedy_codes_hidden_logits(golden, golden_ckpt):
    """Free-running greedy decode through the TorchRunner: identical codes for every step."""
    st = run_greedy(golden, golden_ckpt)
    assert st["steps"] >= 200
    print(f"greedy: {st['steps']} identical steps; hidden max rel err {st['hidden_rel']:.2e}, "
          f"logits max rel err {st['logits_rel']:.2e}")


def test_decoder_mel(golden, golden_model):
    with torch.inference_mode():
        mel = golden_model.decoder(torch.from_numpy(golden["hiddens"]).T.unsqueeze(0).contiguous())[0].numpy()
    err = _close("decoder mel", mel, golden["mel"])
    print(f"mel: max abs err {err[0]:.2e}, rel {err[1]:.2e}")


def test_vocos_waveform(golden, golden_model):
    from appliance.model.vocos import reference_istft

    with torch.inference_mode():
        re, im = golden_model.vocos(torch.from_numpy(golden["mel"]).unsqueeze(0))
        win = torch.from_numpy(golden["w|Vocos.safetensors|head.istft.window"].astype(np.float32))
        wav = reference_istft(re, im, window=win)[0].numpy()  # vocos inverts with its checkpoint window
    assert wav.shape == golden["wav"].shape == (512 * golden["codes"].shape[0] - 256,)
    err = _close("vocos waveform", wav, golden["wav"])
    print(f"wav: max abs err {err[0]:.2e}, rel {err[1]:.2e}")
