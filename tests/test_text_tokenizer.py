"""Tokenizer wrapper: loading, ids, [UNK] detection, upstream's code prompt, length limit."""

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from appliance.errors import CheckpointError, TextError
from appliance.text.tokenizer import TOKENIZER_JSON, Tokenizer
from appliance.text.tokens import BERT_SPECIALS, CONTROL_TOKENS

_WORDS = ("the", "have", "apples", "apple", "call", "hello", "world", "iphone", "one", "two", "three",
          "hundred", "and", "ten", "zero", "i", "a", "minus", "point", "five", "degrees", "celsius")


def make_tiny_tokenizer(ckpt_dir: Path) -> Path:
    """A tokenizer in the official layout built the way the real one is: BERT WordPiece over a
    bert-base-chinese-like vocabulary (specials, ASCII, CJK U+4E00..U+9FA5, ## pieces) plus the
    50 ChatTTS control tokens as added special tokens."""
    vocab = list(BERT_SPECIALS)
    vocab += [chr(c) for c in range(33, 127) if not chr(c).isalnum()]
    vocab += list("，。、！？：；（）“”‘’《》…—")
    vocab += [str(d) for d in range(10)] + [chr(c) for c in range(97, 123)]
    vocab += ["##" + chr(c) for c in range(97, 123)] + ["##" + str(d) for d in range(10)]
    vocab += list(_WORDS)
    vocab += [chr(c) for c in range(0x4E00, 0x9FA6)]
    vocab = list(dict.fromkeys(vocab))
    tok = HFTokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]",
                                       max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                strip_accents=None, lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(list(CONTROL_TOKENS))
    out = ckpt_dir / TOKENIZER_JSON
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    make_tiny_tokenizer(d)
    return Tokenizer.from_dir(d)


def test_load_and_ids(tok, tmp_path):
    assert tok.unk_id == tok.id_of("[UNK]")
    assert tok.spk_emb_id == tok.id_of("[spk_emb]")
    assert tok.vocab_size > 20000
    ids = [tok.id_of(t) for t in CONTROL_TOKENS]
    assert ids == list(range(ids[0], ids[0] + 50))  # appended in order, like the real vocabulary
    with pytest.raises(TextError):
        tok.id_of("[nope]")
    with pytest.raises(CheckpointError, match="asset/tokenizer"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not a tokenizers JSON"):
        Tokenizer.from_dir(tmp_path)


def test_encode_control_tokens_single_ids(tok):
    ids = tok.encode("你好[uv_break]hello[laugh][speed_5]")
    assert ids.dtype == np.int64
    assert tok.id_of("[uv_break]") in ids and tok.id_of("[laugh]") in ids and tok.id_of("[speed_5]") in ids
    assert ids.size == 2 + 1 + 1 + 1 + 1
    assert tok.id_of("[CLS]") not in ids  # add_special_tokens=False
    assert tok.decode(ids).replace(" ", "") == "你好[uv_break]hello[laugh][speed_5]"


def test_unknown_chars(tok):
    assert tok.unknown_chars("你好😀世界") == ["😀"]
    # an unknown char inside a word turns the whole word into one [UNK]; only it is reported
    assert tok.unknown_chars("ab☃cd ☃ 𠀀") == ["☃", "𠀀"]
    assert tok.unknown_chars("hello 你好[laugh]") == []


def test_code_prompt_as_upstream(tok):
    assert Tokenizer.prompt_text(" 你好 ", prompt="[speed_5]") == "[Stts][spk_emb][speed_5]你好[Ptts]"
    assert Tokenizer.prompt_text("[Stts]你好[spk_emb]", with_speaker=False) == "[Stts][empty_spk]你好[Ptts]"
    assert Tokenizer.prompt_text("hi", txt_smp="ref", prompt="[oral_2]") == "[Stts][spk_emb]ref[oral_2]hi[Ptts]"
    ids = tok.code_prompt("你好", prompt="[speed_5]")
    assert ids.tolist() == [tok.id_of("[Stts]"), tok.spk_emb_id, tok.id_of("[speed_5]"),
                            tok.id_of("你"), tok.id_of("好"), tok.id_of("[Ptts]")]


def test_length_limit(tok):
    tok.code_prompt("你" * 10, max_tokens=13)
    with pytest.raises(TextError, match="14 tokens.*limit of 13"):
        tok.code_prompt("你" * 11, max_tokens=13)


def test_random_checkpoint_tokenizer(tiny_ckpt):
    """The tokenizer `chattts-appliance model random` writes loads and builds upstream's prompt."""
    t = Tokenizer.from_dir(tiny_ckpt)
    ids = [t.id_of(c) for c in CONTROL_TOKENS]
    assert ids == list(range(t.vocab_size - 50, t.vocab_size))
    p = t.code_prompt("你好[uv_break]", prompt="[speed_5]")
    assert p[:3].tolist() == [t.id_of("[Stts]"), t.spk_emb_id, t.id_of("[speed_5]")]
    assert p[-2:].tolist() == [t.id_of("[uv_break]"), t.id_of("[Ptts]")]
    assert t.unk_id not in p
    assert t.unknown_chars("你好😀") == ["😀"]


def test_prompt_ids_equal_upstream_tokenizer(golden, golden_ckpt):
    """Our prompt + tokenizers-library encoding gives the ids upstream's BertTokenizerFast gave
    for the golden's prompt (tests/golden/upstream_tiny.npz, made with chattts 0.2.5)."""
    prompt_text = bytes(golden["text"]).decode("utf-8")
    t = Tokenizer.from_dir(golden_ckpt)
    body = prompt_text.removeprefix("[Stts][spk_emb][speed_5]").removesuffix("[Ptts]")
    assert Tokenizer.prompt_text(body, prompt="[speed_5]") == prompt_text
    np.testing.assert_array_equal(t.code_prompt(body, prompt="[speed_5]"), golden["input_ids"])
