"""Normalization: numbers/dates/units become words in the right language, nothing is lost,
control tokens pass, unspeakable characters are reported, bad text is a TextError."""

import logging
import re
import unicodedata

import pytest

from appliance.errors import TextError
from appliance.text.normalize import Normalizer, clean_controls
from appliance.text.numbers import en_int, verbalize_numbers, zh_int
from appliance.text.tokenizer import Tokenizer
from tests.test_text_tokenizer import make_tiny_tokenizer


@pytest.fixture(scope="module")
def norm():
    n = Normalizer()
    assert n.wetext, "wetext must be installed (pyproject dependency)"
    return n


@pytest.fixture(scope="module")
def own():
    return Normalizer(use_wetext=False)


@pytest.mark.parametrize("text, want, lang", [
    ("I have 3 apples", "I have three apples", "en"),
    ("2024年3月5日 14:30", "二零二四年三月五日 十四点三十分", "zh"),
    ("温度是-5.5°C", "温度是负五点五摄氏度", "zh"),
    ("打99折", "打九十九折", "zh"),
    ("call 110", "call one one zero", "en"),
    ("我买了3个iPhone", "我买了三个iPhone", "zh"),
    ("增长了25%", "增长了百分之二十五", "zh"),
    ("It grew 25%.", "It grew twenty five percent.", "en"),
    ("速度120km/h", "速度每小时一百二十公里", "zh"),
    ("Drive 120 km/h", "Drive one hundred and twenty kilometers per hour", "en"),
    ("It costs $12.50.", "It costs twelve dollars and fifty cents.", "en"),
    ("phone 555-1234", "phone five five five, one two three four", "en"),
    ("我的电话是13812345678", "我的电话是幺三八幺二三四五六七八", "zh"),
    ("2024年03月05日", "二零二四年三月五日", "zh"),
    ("一共1,000", "一共一千", "zh"),
    ("GPT-4很强", "GPT 四很强", "zh"),
    ("100 m/s", "one hundred meters per second", "en"),
    ("It is -5.5°C outside", "It is minus five point five degrees Celsius outside", "en"),
    ("version 3.11.2", "version three point eleven point two", "en"),
    ("we sold 1,234 items", "we sold one thousand two hundred thirty four items", "en"),  # wetext drops "one"
    ("It costs $1,234 or $1.", "It costs one thousand two hundred thirty four dollars or one dollar.", "en"),
    ("1000 people", "one thousand people", "en"),
    ("a $5m deal, $1.5bn and $2.5", "a five million dollars deal, one point five billion dollars and two dollars and fifty cents", "en"),
    ("growth of 30%-40%", "growth of thirty to forty percent", "en"),
    ("涨幅30%-40%", "涨幅百分之三十到百分之四十", "zh"),
    ("the 100m race", "the one hundred meters race", "en"),
    ("会议在2024.3.5举行", "会议在二零二四年三月五日举行", "zh"),
    ("in the 1990s and 80s", "in the nineteen nineties and eighties", "en"),  # wetext: "ninety seconds"
    ("共1,234,567人", "共一百二十三万四千五百六十七人", "zh"),
])
def test_cases(norm, text, want, lang):
    r = norm(text)
    assert r.text == want
    assert r.lang == lang and r.unspeakable == ()


def test_mixed_text_decides_per_span(norm):
    r = norm("call 110 please 请拨打110")
    assert r.text == "call one one zero please 请拨打幺幺零"
    assert not re.search(r"\d", norm("我有3个苹果 and 4 pears").text)
    assert "four" in norm("我有3个苹果 and 4 pears").text


def test_control_tokens_untouched(norm):
    r = norm("我有3个苹果[uv_break]然后[laugh]笑了[speed_5][break_3]")
    assert r.text == "我有三个苹果[uv_break]然后[laugh]笑了[speed_5][break_3]"
    # structural tokens of the prompt are removed and reported, like upstream strips them
    r = norm("[Stts]你好[spk_emb]")
    assert r.text == "你好" and r.unspeakable == ("[Stts]", "[spk_emb]")


def test_emoji_and_other_scripts_reported(norm):
    r = norm("你好😀世界")
    assert r.text == "你好 世界" and r.unspeakable == ("😀",)
    r = norm("Hello 😀 world, Привет!")
    assert "😀" in r.unspeakable and "П" in r.unspeakable
    assert r.text.startswith("Hello world")


def test_invisible_characters_silent(norm):
    r = norm("你\u200b好❤\ufe0f")
    assert r.text == "你好" and r.unspeakable == ("❤\ufe0f",)   # the emoji cluster, whole


def test_control_characters_become_spaces():
    cc = [chr(c) for c in (*range(0x20), *range(0x7F, 0xA0))]
    assert len(cc) == 65 and all(unicodedata.category(c) == "Cc" for c in cc)
    out = clean_controls("a" + "a".join(cc) + "a")
    assert out == "a" + "a".join("\t" if c == "\t" else "\n" if c in "\n\r" else " " for c in cc) + "a"
    assert clean_controls("one\r\ntwo\rthree") == "one\ntwo\nthree"


def test_control_characters_separate_words_and_reach_neither_tokenizer_nor_log(tmp_path, caplog):
    tok = Tokenizer.from_dir(make_tiny_tokenizer(tmp_path).parent)
    n = Normalizer(tok, use_wetext=False)
    with caplog.at_level(logging.DEBUG, logger="appliance.text"):
        r = n("hello\x00world\x1b\x07and\x85you\tthere\x7f😀", request_id="r1")
    assert r.text == "hello world and you there"          # a NUL between words is a space, not a join
    assert r.unspeakable == ("😀",)
    assert tok.unknown_chars(r.text) == []
    msgs = [rec.getMessage() for rec in caplog.records]
    assert any("speaks" in m for m in msgs)
    assert not [m for m in msgs if any(unicodedata.category(c) == "Cc" for c in m)], msgs
    with pytest.raises(TextError, match="empty"):
        n("\x00\x01\x9f \x1b")


def test_unknown_to_tokenizer_reported(tmp_path):
    tok = Tokenizer.from_dir(make_tiny_tokenizer(tmp_path).parent)
    n = Normalizer(tok, use_wetext=False)
    r = n("你好\u9fa6世界")  # U+9FA6 is CJK but not in the (tiny, like bert-base-chinese) vocabulary
    assert r.unspeakable == ("\u9fa6",) and r.text == "你好世界"
    assert tok.unknown_chars(r.text) == []


def test_punctuation_as_upstream(norm):
    assert norm("他说：“好的”！").text == "他说，好的。"
    assert norm("你好,世界!").text == "你好，世界。"   # zh: half-width -> full-width, simplified
    assert norm("Wow!!! Really???").text == "Wow. Really."
    assert norm("第一行\n第二行").text == "第一行。第二行"


def test_nothing_lost(norm, own):
    # every digit becomes words; nothing numeric is dropped, with or without wetext
    for n in (norm, own):
        for text in ("I have 3 apples", "打99折", "温度是-5.5°C", "+1 555 123 4567", "0.5%", "12345678901234567890",
                     "1990s", "x=3", "第2024届"):
            out = n(text).text
            assert not re.search(r"\d", out), (text, out)
            assert len(out) >= 2


def test_own_rules_without_wetext(own):
    assert own("I have 3 apples").text == "I have three apples"
    assert own("打99折").text == "打九十九折"
    assert own("温度是-5.5度").text == "温度是负五点五度"
    assert own("call 110").text == "call one one zero"
    assert own("增长了25%").text == "增长了百分之二十五"


@pytest.mark.parametrize("bad, words", [
    ("", "empty"), ("   \n", "empty"), ("。。。！！", "only punctuation"), ("[laugh][uv_break]", "only punctuation"),
    ("😀😀", "nothing speakable.*😀"),
])
def test_text_errors(norm, bad, words):
    with pytest.raises(TextError, match=words):
        norm(bad)
    with pytest.raises(TextError):
        norm(123)  # type: ignore[arg-type]


def test_numbers_readings():
    assert [zh_int(v) for v in (0, 10, 15, 101, 110, 1001, 10001, 100000001, 20000)] == \
        ["零", "十", "十五", "一百零一", "一百一十", "一千零一", "一万零一", "一亿零一", "二万"]
    assert en_int(1234567) == "one million two hundred thirty four thousand five hundred sixty seven"
    assert verbalize_numbers("-3.25%", "zh") == "负百分之三点二五"
    assert verbalize_numbers("007", "en").split() == ["zero", "zero", "seven"]


def test_apostrophes_kept_where_the_tokenizer_knows_them(tmp_path):
    """bert-base-chinese (which the checkpoint's tokenizer extends) holds ``'``: an apostrophe
    is kept, ``’`` becomes ``'``, and a quotation mark is not spoken."""
    tok = Tokenizer.from_dir(make_tiny_tokenizer(tmp_path).parent)
    assert tok.unknown_chars("don't") == []
    n = Normalizer(tok)
    r = n("I don’t know, it's John's car. The drivers' seats, 'yes' or o'clock.")
    assert r.text == "I don't know, it's John's car. The drivers' seats, yes or o'clock." and r.unspeakable == ()


def test_apostrophe_reported_when_the_tokenizer_lacks_it(tmp_path):
    from appliance.build.random_ckpt import build_vocab, write_tokenizer

    write_tokenizer(tmp_path, [t for t in build_vocab("tiny") if t != "'"])
    r = Normalizer(Tokenizer.from_dir(tmp_path), use_wetext=False)("I don't know.")
    assert r.unspeakable == ("'",) and r.text == "I dont know."   # dropped, but never silently
