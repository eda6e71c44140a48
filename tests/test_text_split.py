"""Sentence splitting within the prompt-token limit; nothing lost or repeated."""

import re

import numpy as np
import pytest

from appliance.errors import TextError
from appliance.text.split import split_text
from appliance.text.tokenizer import Tokenizer
from tests.test_text_tokenizer import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    make_tiny_tokenizer(d)
    return Tokenizer.from_dir(d)


def squash(s: str) -> str:
    return re.sub(r"\s+", "", s)


def check(tok, text, limit, **kw):
    sentences = split_text(text, tok, limit, **kw)
    pieces = [s.text for s in sentences]
    assert squash("".join(pieces)) == squash(text)  # nothing lost, nothing repeated
    for p, ids in sentences:
        assert p == p.strip() and p
        want = tok.code_prompt(p, with_speaker=kw.get("with_speaker", True), prompt=kw.get("prompt", ""))
        assert want.size <= limit
        assert np.array_equal(ids, want) and ids.dtype == np.int64  # the ids counted are the prompt's
    return pieces


def test_sentence_ends(tok):
    text = "你好。今天天气很好！你呢？I am fine. Thanks!\n第二段"
    assert check(tok, text, 64) == ["你好。", "今天天气很好！", "你呢？", "I am fine.", "Thanks!", "第二段"]


def test_full_stops_of_initials_and_abbreviations_end_no_sentence(tok):
    """U.S., a.m., e.g., Mr., St. and initials inside mixed text stay inside their sentence (each
    of their dots was a cut before: 'I live in the U.' / 'S.' / 'now.'); real ends still cut."""
    text = ("I live in the U.S. now. Call me at nine a.m. tomorrow, e.g. at the office. "
            "Mr. and Mrs. Lee went to St. Louis. 美国U.S.A.的GDP很高。I.B.M. and N.A.S.A. Wait... what? Yes.")
    assert check(tok, text, 128) == ["I live in the U.S. now.", "Call me at nine a.m. tomorrow, e.g. at the office.",
                                     "Mr. and Mrs. Lee went to St. Louis.", "美国U.S.A.的GDP很高。",
                                     "I.B.M. and N.A.S.A. Wait...", "what?", "Yes."]


def test_clauses_then_hard(tok):
    text = "我们今天去公园，然后去商店，最后回家吃饭。" * 3
    pieces = check(tok, text, 20, prompt="[speed_5]")
    assert all(p.endswith(("，", "。")) for p in pieces)  # clause ends, no hard cuts needed
    long = "一" * 100 + "。"
    pieces = check(tok, long, 20)
    assert len(pieces) >= 6 and max(tok.code_prompt(p).size for p in pieces) == 20
    # English words are not cut inside when a word start is near
    en = " ".join(["hello world"] * 40)
    for p in check(tok, en, 24):
        assert all(w in ("hello", "world") for w in p.split())


def test_control_tokens_count_and_stay_whole(tok):
    text = "[laugh]" * 30 + "你好"
    pieces = check(tok, text, 16)
    for p in pieces:
        assert re.fullmatch(r"(\[laugh\])*(你好)?", p)


def test_silent_pieces_attached(tok):
    assert check(tok, "你好。[laugh]", 64) == ["你好。[laugh]"]
    assert check(tok, "。你好", 64) == ["。你好"]


def test_random_texts_roundtrip(tok):
    rng = np.random.default_rng(0)
    alphabet = list("你好世界天气很，。！？,.!? ab") + ["[uv_break]", "hello", "\n"]
    for _ in range(30):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(1, 200))))
        if not re.search(r"[a-z\u4e00-\u9fff]", text):
            continue
        check(tok, text, int(rng.integers(8, 40)), prompt="[speed_5]")


def test_prompt_too_long(tok):
    with pytest.raises(TextError, match="no room"):
        split_text("你好", tok, 4, prompt="[speed_5][oral_2]")


def test_text_path_on_random_checkpoint(tiny_ckpt):
    """normalize -> split -> code_prompt with the tokenizer `model random` writes: every prompt
    fits, no [UNK] reaches the model, and what was dropped is reported."""
    from appliance.text.normalize import Normalizer

    t = Tokenizer.from_dir(tiny_ckpt)
    norm = Normalizer(t)
    text = ("今天天气很好，我们去公园散步吧！" * 6 + "我有3个苹果😀。[uv_break]你是谁？\n" + "一二三四五六七八九十" * 8)
    r = norm(text)
    assert "😀" in r.unspeakable and "苹" in r.unspeakable  # not in the tiny vocabulary
    pieces = check(t, r.text, 24, prompt="[speed_5]")
    for p in pieces:
        ids = t.code_prompt(p, prompt="[speed_5]", max_tokens=24)
        assert t.unk_id not in ids
