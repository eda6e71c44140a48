"""Property-based fuzzing of the normalizer over arbitrary Unicode (hypothesis).

Invariants, for any input:

1. it returns, or raises the documented :class:`TextError` only when nothing in the input is
   speakable (no letter, digit or known CJK character survives the script pass);
2. the output holds only what the tokenizer knows: CJK characters of the vocabulary, ASCII
   letters, ``，。、,.``, spaces, apostrophes after a letter (``don't``, ``drivers'``) and user
   control tokens; no digit of any script;
3. user control tokens survive byte for byte, in order;
4. no letter or digit is dropped silently: every CJK character is spoken or reported; every
   Latin word that is not glued to a number (where it may be a unit, expanded into words) is
   spoken; changing the digits of a number changes what is said; every symbol we have no word
   for is reported.

The vocabulary is the full 21,178-entry layout of the official tokenizer (as ``model random
--size full`` writes it), not the tiny test one. Example counts are bounded so the file runs in
seconds; raise ``FUZZ_EXAMPLES`` in the environment for a longer hunt.
"""

import os
import re
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.errors import TextError
from appliance.text.normalize import CTRL_RE, Normalizer
from appliance.text.scripts import ScriptConverter, is_cjk, is_latin
from appliance.text.tokenizer import Tokenizer
from appliance.text.tokens import USER_CONTROL_TOKENS
from appliance.text.units import SYMBOLS, UNITS
from tests.test_text_corpus import make_full_tokenizer

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "250"))

#: Pieces real announcements are made of, so the fuzzer reaches the rules, not only noise.
FRAGMENTS = [
    "0", "1", "2", "7", "12", "2,500", "1,299.50", "3.5", "-5", "10:45", "2024-03-05", "2024.3.5", "13812345678",
    "555-1234", "¥", "￥", "$", "€", "£", "%", "‰", "°C", "℃", "km/h", "μg/m³", "m²", "kg", "h", "s", "m", "元",
    "美元", "年", "月", "日", "号", "第", "室", "单元", "点", "折", "个", "→", "←", "&", "@", "+", "=", "#", "×", "©",
    "A12B34", "PM2.5", "G1234", "iPhone 5s", "GPT-4", "No.", "Straße", "Müller", "café", "ß", "臺灣", "電話", "你好",
    "今天", "温度", "Hello", "world", "meeting", "at", "call", "the", "don't",
    "John's", "drivers'", "'yes'", "’", "1e5", "2.5e-3", "1,000th", ",", ".", "，", "。", "！", "？", "、",
    "：", "；", "(", ")", "“", "”", "-", "~", "/", " ", "\n", "😀", "Привет", "α", "①", "½", "１２", "٣", "10²",
    "[uv_break]", "[laugh]", "[speed_5]", "[break_3]", "[Stts]", "[spk_emb]", "\u200b", "\ufe0f",
]
TEXTS = st.one_of(
    st.text(max_size=30),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=2)), max_size=10).map("".join),
)
#: Symbols that read as a pause or nothing, like punctuation (upstream norm.py treats them so).
SEPARATORS = set("|~～^`<>/\\_*")
#: Characters glued to a number that make a Latin word a unit or code of it.
_NUMERIC_NEIGHBOURS = set("0123456789μ°%‰²³^./:-")


@pytest.fixture(scope="module")
def full_tok(tmp_path_factory):
    tok = make_full_tokenizer(tmp_path_factory.mktemp("full_tok"))
    assert tok.vocab_size == 21178
    return tok


@pytest.fixture(scope="module")
def norm(full_tok):
    return Normalizer(full_tok)


@pytest.fixture(scope="module")
def scripts():
    return ScriptConverter()


def _speakable_input(conv: str, tok: Tokenizer) -> bool:
    body = CTRL_RE.sub(" ", conv)
    return any(c.isascii() and c.isalnum() for c in body) or \
        any(is_cjk(c) and not tok.unknown_chars(c) for c in body)


def _latin_words(conv: str) -> list[str]:
    """Latin words of ``conv`` (outside control tokens) not glued to a number."""
    body = CTRL_RE.sub("\0", conv)
    out = []
    for m in re.finditer(r"[A-Za-z]+", body):
        before = body[: m.start()].rstrip()[-1:]
        after = body[m.end():].lstrip()[:1]
        if before in _NUMERIC_NEIGHBOURS or after in _NUMERIC_NEIGHBOURS:
            continue
        out.append(m.group())
    return out


def _bump_digits(conv: str, k: int) -> str:
    """``conv`` with the ``k``-th run of digits changed (each digit + 1 mod 10)."""
    runs = list(re.finditer(r"\d+", CTRL_RE.sub(lambda m: "\0" * len(m.group()), conv)))
    m = runs[k]
    new = "".join(str((int(c) + 1) % 10) for c in m.group())
    return conv[: m.start()] + new + conv[m.end():]


def check(norm: Normalizer, tok: Tokenizer, scripts: ScriptConverter, text: str) -> None:
    conv = scripts.convert(text)
    try:
        r = norm(text)
    except TextError:
        assert not _speakable_input(conv, tok), f"TextError although {conv!r} has something to say"
        return
    out = r.text
    body = CTRL_RE.sub(" ", out)
    # 2. only what the tokenizer knows
    assert not any(unicodedata.category(c) == "Nd" for c in body), out
    assert all(is_cjk(c) or is_latin(c) or c in "，。、,. '" for c in body), out
    assert all(i > 0 and is_latin(body[i - 1]) for i, c in enumerate(body) if c == "'"), out
    assert tok.unknown_chars(body) == [], out
    # 3. control tokens byte for byte
    assert [t for t in CTRL_RE.findall(text) if t in USER_CONTROL_TOKENS] == CTRL_RE.findall(out)
    # 4. letters: CJK spoken or reported, free Latin words spoken
    squashed = body.replace(" ", "").lower()
    for c in CTRL_RE.sub(" ", conv):
        if is_cjk(c):
            assert c in out or c in r.unspeakable, (c, out)
        elif unicodedata.category(c)[0] == "S" and c not in SYMBOLS and c not in SEPARATORS \
                and not any(c in u for u in UNITS):
            assert c in r.unspeakable, (c, out, r.unspeakable)
    for w in _latin_words(conv):
        assert w.lower() in squashed, (w, out)
    # digits: a different number is said differently
    n_runs = len(re.findall(r"\d+", CTRL_RE.sub(" ", conv)))
    for k in range(min(n_runs, 2)):
        assert norm(_bump_digits(conv, k)).text != norm(conv).text, (conv, k)


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXTS)
def test_fuzz_invariants(norm, full_tok, scripts, text):
    check(norm, full_tok, scripts, text)


@pytest.mark.parametrize("text", [
    "花了￥2,500元", "Meeting starts at 10:45. 请准时参加。", "订单号A12B34", "今天空气中PM2.5为35μg/m³。",
    "箭头→表示方向", "Straße und Müller", "臺灣", "[uv_break]3‰[laugh]", "①②③", "x" * 120, "٣ cats",
])
def test_invariants_on_known_cases(norm, full_tok, scripts, text):
    check(norm, full_tok, scripts, text)


def test_control_tokens_byte_for_byte(norm):
    text = "[uv_break]价格￥5[laugh]，Price $5[speed_5][break_7][oral_2]"
    assert CTRL_RE.findall(norm(text).text) == ["[uv_break]", "[laugh]", "[speed_5]", "[break_7]", "[oral_2]"]
