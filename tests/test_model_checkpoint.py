"""Checkpoint layout, loader checks and the random checkpoint's tokenizer."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from appliance.errors import CheckpointError
from appliance.model import layout
from appliance.model.checkpoint import load_model, read_checkpoint
from appliance.model.shapes import TINY
from appliance.text.tokens import BERT_SPECIALS, CONTROL_TOKENS


def _copy(tiny_ckpt, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, dst)
    return dst / "asset"


def test_random_tiny_layout_and_shapes(tiny_ckpt):
    a = tiny_ckpt / "asset"
    for f in (layout.GPT_CONFIG, layout.GPT_FILE, layout.EMBED_FILE, layout.DECODER_FILE, layout.DVAE_FILE,
              layout.VOCOS_FILE, *(f"tokenizer/{n}" for n in layout.TOKENIZER_FILES)):
        assert (a / f).is_file(), f
    gpt = load_file(a / layout.GPT_FILE)
    assert gpt["embed_tokens.weight"].shape[1] == TINY.hidden
    assert set(gpt) - {"embed_tokens.weight"} == set(layout.gpt_keys(TINY))
    assert set(load_file(a / layout.DVAE_FILE)) == set(layout.dvae_keys(TINY))
    ck = read_checkpoint(tiny_ckpt)
    dvae = {k: getattr(TINY, k) for k in ("dvae_dim", "dvae_hidden", "dvae_layers", "dvae_bn", "vq_dim")}
    assert replace(ck.shapes, **dvae) == TINY  # DVAE shapes are not read back (never loaded)
    cfg = json.loads((a / layout.GPT_CONFIG).read_text())
    assert cfg["model_type"] == "llama" and cfg["num_vq"] == 4 and cfg["num_text_tokens"] == TINY.num_text_tokens
    total = sum(f.stat().st_size for f in a.rglob("*") if f.is_file() and f.name != layout.DVAE_FILE)
    assert total < 4_000_000


def test_random_checkpoint_is_deterministic(tmp_path):
    from appliance.build.random_ckpt import write_random_checkpoint

    a1 = write_random_checkpoint(tmp_path / "a", "tiny", seed=7)
    a2 = write_random_checkpoint(tmp_path / "b", "tiny", seed=7)
    a3 = write_random_checkpoint(tmp_path / "c", "tiny", seed=8)
    e1, e2, e3 = (load_file(a / layout.EMBED_FILE) for a in (a1, a2, a3))
    assert all(np.array_equal(e1[k], e2[k]) for k in e1)
    assert not np.array_equal(e1["emb_text.weight"], e3["emb_text.weight"])


def test_missing_unexpected_misshaped_keys_are_all_named(tiny_ckpt, tmp_path):
    a = _copy(tiny_ckpt, tmp_path)
    emb = load_file(a / layout.EMBED_FILE)
    del emb["emb_code.2.weight"]
    emb["bogus.weight"] = np.zeros((3,), np.float32)
    save_file(emb, str(a / layout.EMBED_FILE))
    voc = load_file(a / layout.VOCOS_FILE)
    voc["backbone.norm.bias"] = np.zeros((TINY.voc_dim + 1,), np.float32)
    save_file(voc, str(a / layout.VOCOS_FILE))
    with pytest.raises(CheckpointError) as ei:
        read_checkpoint(a.parent)
    msg = str(ei.value)
    assert "Embed.safetensors: missing key 'emb_code.2.weight'" in msg
    assert "Embed.safetensors: unexpected key 'bogus.weight'" in msg
    assert "Vocos.safetensors: key 'backbone.norm.bias' has shape [65], expected [64]" in msg


def test_gpt_missing_layer_key_and_ignored_embed_tokens(tiny_ckpt, tmp_path):
    a = _copy(tiny_ckpt, tmp_path)
    gpt = load_file(a / layout.GPT_FILE)
    del gpt["layers.1.mlp.up_proj.weight"]
    save_file(gpt, str(a / layout.GPT_FILE))
    with pytest.raises(CheckpointError, match=r"gpt/model.safetensors: missing key 'layers.1.mlp.up_proj.weight'"):
        read_checkpoint(a)


def test_not_a_checkpoint_and_missing_files(tmp_path, tiny_ckpt):
    with pytest.raises(CheckpointError, match="not a ChatTTS checkpoint"):
        read_checkpoint(tmp_path)
    a = _copy(tiny_ckpt, tmp_path)
    (a / layout.DECODER_FILE).unlink()
    with pytest.raises(CheckpointError, match="Decoder.safetensors"):
        read_checkpoint(a)


def test_weight_norm_is_folded(tiny_ckpt):
    import torch

    m = load_model(tiny_ckpt)
    emb = load_file(tiny_ckpt / "asset" / layout.EMBED_FILE)
    g = emb["head_code.1.parametrizations.weight.original0"]
    v = emb["head_code.1.parametrizations.weight.original1"]
    w = g * v / np.linalg.norm(v, axis=1, keepdims=True)
    np.testing.assert_allclose(m.embed.head_code.weight[626:2 * 626].detach().numpy(), w, rtol=1e-5, atol=1e-7)
    # same as torch's own weight_norm parametrization (dim=0)
    lin = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(TINY.hidden, 626, bias=False))
    lin.parametrizations.weight.original0.data = torch.from_numpy(g)
    lin.parametrizations.weight.original1.data = torch.from_numpy(v)
    torch.testing.assert_close(m.embed.head_code.weight[626:2 * 626].detach(), lin.weight.detach(), rtol=1e-5, atol=1e-7)


def test_tokenizer_round_trip(tiny_ckpt):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_ckpt / "asset" / "tokenizer" / "tokenizer.json"))
    assert tok.get_vocab_size() == TINY.num_text_tokens
    base = TINY.num_text_tokens - len(CONTROL_TOKENS)
    for i, t in enumerate(CONTROL_TOKENS):
        assert tok.token_to_id(t) == base + i
    for t in BERT_SPECIALS:
        assert tok.token_to_id(t) is not None
    enc = tok.encode("[Stts][spk_emb][speed_5]今天天气很好, hello 42![uv_break][Ptts]", add_special_tokens=False)
    assert enc.tokens[:3] == ["[Stts]", "[spk_emb]", "[speed_5]"]
    assert enc.tokens[-2:] == ["[uv_break]", "[Ptts]"]
    assert "今" in enc.tokens and "##e" in enc.tokens and "[UNK]" not in enc.tokens
    assert tok.decode(enc.ids, skip_special_tokens=True).replace(" ", "") == "今天天气很好,hello42!"
    cfg = json.loads((tiny_ckpt / "asset" / "tokenizer" / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "BertTokenizerFast" and cfg["do_lower_case"] is True


def test_full_vocab_layout():
    from appliance.build.random_ckpt import FULL_BASE_VOCAB, build_vocab

    v = build_vocab("full")
    assert len(v) == FULL_BASE_VOCAB == 21128
    assert v[0] == "[PAD]" and v[100] == "[UNK]" and v[101] == "[CLS]" and v[103] == "[MASK]"
    assert "一" in v and "##a" in v
