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
   for is reported. "Every" counts the text after the markup stage (tags and Markdown signs are
   not words), which the fragments feed too; likewise after the chat-text stages (pictures
   dropped, Roman numerals read, runs collapsed, codes said as "a code": :func:`_front`);
5. markup (:func:`test_fuzz_markup`: Markdown, HTML and SSML built around words): every word in a
   spoken place is spoken, no word of the markup is (no asterisk, hash, slash, tag name, address
   path, an agent's ``<think>``), and the control tokens between them survive in order; also
   when the words sit in quotes and lists nested deeper than markdown-it parses
   (:func:`test_fuzz_deep_nesting_loses_no_word`).

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
from appliance.text.emoticons import pictures
from appliance.text.lists import list_numbers
from appliance.text.markup import Markup
from appliance.text.normalize import CTRL_RE, Normalizer, clean_controls
from appliance.text.roman import read_roman
from appliance.text.rules import WEB_RE
from appliance.text.scripts import ScriptConverter, is_cjk, is_latin
from appliance.text.shorten import MAX_REPEATS, collapse_runs, shorten_codes
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
    "## ", "\n- ", "\n1. ", "*", "**", "`", "[", "](https://example.com/x)", "<b>", "</b>", "<br>", "<speak>",
    "<break time=\"300ms\"/>", "</speak>", "|", "\n|---|---|\n", "&amp;", "<", ">", "https://www.example.com/a?b=1",
]
TEXTS = st.one_of(
    st.text(max_size=30),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=2)), max_size=10).map("".join),
)
#: Symbols that read as a pause or nothing, like punctuation (upstream norm.py treats them so).
SEPARATORS = set("|~～^`<>/\\_*")
#: Characters glued to a number that make a Latin word a unit or code of it.
_NUMERIC_NEIGHBOURS = set("0123456789μ°%‰²³^./:-")


MARKUP = Markup()


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


def _masked(conv: str) -> str:
    """``conv`` with control tokens and web addresses (read short: their path is not said)
    replaced by NULs of the same length."""
    return WEB_RE.sub(lambda m: "\0" * len(m.group()), CTRL_RE.sub(lambda m: "\0" * len(m.group()), conv))


def _latin_words(conv: str) -> list[str]:
    """Latin words of ``conv`` (outside control tokens and web addresses) not glued to a number."""
    body = _masked(conv)
    out = []
    for m in re.finditer(r"[A-Za-z]+", body):
        before = body[: m.start()].rstrip()[-1:]
        after = body[m.end():].lstrip()[:1]
        if before in _NUMERIC_NEIGHBOURS or after in _NUMERIC_NEIGHBOURS:
            continue
        out.append(m.group())
    return out


def _bump_digits(text: str, k: int) -> str:
    """``text`` with the ``k``-th run of digits outside control tokens changed (each digit + 1 mod 10)."""
    m = list(re.finditer(r"\d+", CTRL_RE.sub(lambda m: "\0" * len(m.group()), text)))[k]
    new = "".join(str((int(c) + 1) % 10) for c in m.group())
    return text[: m.start()] + new + text[m.end():]


def _front(scripts: ScriptConverter, raw: str) -> str:
    """``raw`` through the stages before the rules, as the normalizer runs them: markup, list
    numbers, pictures (dropped), Roman numerals, the script pass, runs, codes."""
    def quiet(_):
        return None
    text = read_roman(pictures(list_numbers(MARKUP(raw), "speak", "en", quiet), "drop", "en", quiet, quiet), quiet)
    return shorten_codes(collapse_runs(scripts.convert(text), quiet), WEB_RE, quiet)


def check(norm: Normalizer, tok: Tokenizer, scripts: ScriptConverter, text: str) -> None:
    raw = clean_controls(text)
    conv = _front(scripts, raw)
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
    assert [t for t in CTRL_RE.findall(conv) if t in USER_CONTROL_TOKENS] == CTRL_RE.findall(out)
    # 4. letters: CJK spoken or reported, free Latin words spoken
    squashed = body.replace(" ", "").lower()
    for c in CTRL_RE.sub(" ", conv):
        if is_cjk(c):
            assert c in out or c in r.unspeakable, (c, out)
        elif unicodedata.category(c)[0] == "S" and c not in SYMBOLS and c not in SEPARATORS \
                and not any(c in u for u in UNITS):
            assert any(c in u for u in r.unspeakable), (c, out, r.unspeakable)   # alone or in its cluster
    for w in _latin_words(conv):
        assert w.lower() in squashed, (w, out)
    # digits: a different number is said differently (a digit that is markup, such as a tag's
    # attribute or the number of a list's second item, or in an address's path, is not said)
    checked = 0
    for k in range(len(re.findall(r"\d+", CTRL_RE.sub(" ", raw)))):
        bumped = _bump_digits(raw, k)
        if _masked(_front(scripts, bumped)) == _masked(conv):
            continue
        assert norm(bumped).text != out, (raw, k)
        checked += 1
        if checked == 2:
            break


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


# -- 5. markup built around words ----------------------------------------------------------------

WORDS = ["hello", "world", "kitchen", "lights", "garage", "dinner", "你好", "今天", "温度", "欢迎"]
TOKENS = ["[uv_break]", "[laugh]", "[lbreak]", "[speed_5]"]
#: what markup would say if it leaked: sign names, tag names, an address's scheme and path, think
LEAKS = ["asterisk", "hash", "slash", "http", "png", "speak", "break", "strong", "alias", "secret", "underscore",
         "井号", "星号", "斜杠"]
#: (template, spoken): ``{}`` is the word; a template that is not spoken drops its word on purpose.
#: An SSML break of 1 s is said as [lbreak].
FORMS = [("{}", True), ("*{}*", True), ("**{}**", True), ("_{}_", True), ("`{}`", True), ("~~{}~~", True),
         ("\n## {}\n", True), ("\n- {}\n", True), ("\n3. {}\n", True), ("\n> {}\n", True),
         ("[{}](https://example.com/path/png)", True), ("![{}](pic.png)", True), ("<b>{}</b>", True),
         ("<p>{}</p>", True), ("{}<br>", True), ("<speak>{}<break time=\"1s\"/></speak>", True),
         ("<emphasis level=\"strong\">{}</emphasis>", True), ("<sub alias=\"{}\">speak</sub>", True),
         ("\n| {} | kitchen |\n|---|---|\n| a | b |\n", True), ("\n```\n{}\n```\n", True),
         ("<think>secret {}</think>", False), ("<script>secret {}</script>", False)]
PARTS = st.lists(st.tuples(st.sampled_from(WORDS), st.sampled_from(FORMS), st.sampled_from(TOKENS + [""] * 4)),
                 min_size=1, max_size=6)


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=PARTS)
def test_fuzz_markup(norm, parts):
    _check_markup(norm, [" ".join(form.format(word) + tok for word, (form, _), tok in parts)], parts)


def _check_markup(norm, lines: list[str], parts) -> None:
    """``lines`` (each built from ``parts``), joined, are said with every spoken word of each line,
    no markup, and the control tokens of each line in order."""
    text = "\n".join(lines)
    spoken = [w for w, (_, said), _ in parts if said]
    try:
        out = norm(text).text
    except TextError:
        assert not spoken, text
        return
    squashed = CTRL_RE.sub("", out).replace(" ", "").lower()
    for w in spoken:
        # a word said over and over is a run: said MAX_REPEATS times (shorten.collapse_runs)
        assert squashed.count(w) >= min(len(lines) * spoken.count(w), MAX_REPEATS), (w, text, out)
    for leak in LEAKS:
        assert leak not in squashed, (leak, text, out)
    want = [t for _, (form, _), tok in parts for t in (["[lbreak]"] if "<break" in form else []) + [tok] if t]
    assert CTRL_RE.findall(out) == want * len(lines), (text, out)


#: quote and list markers; 34 of them nest past markdown-it's block limit (three levels for ``> - ``)
NESTS = st.lists(st.sampled_from(["> ", "- ", "* ", "1. ", "3) ", ">"]), min_size=1, max_size=120).map("".join)
INLINE_FORMS = [f for f in FORMS if "\n" not in f[0]]


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(nests=st.lists(NESTS, min_size=1, max_size=3),
       parts=st.lists(st.tuples(st.sampled_from(WORDS), st.sampled_from(INLINE_FORMS), st.sampled_from(TOKENS + [""] * 4)),
                      min_size=1, max_size=4))
def test_fuzz_deep_nesting_loses_no_word(norm, nests, parts):
    """Words inside quotes and lists nested however deep (each line its own nesting) are all
    spoken, the markup not, the control tokens in order."""
    _check_markup(norm, [nest + " ".join(form.format(word) + tok for word, (form, _), tok in parts) for nest in nests],
                  parts)


@pytest.mark.parametrize("text, said", [
    ("> " * 2000 + "two thousand quotes", "two thousand quotes"),
    ("> - " * 40 + "**last** words[uv_break]", "last words[uv_break]"),
    ("".join("  " * i + "- item\n" for i in range(50)) + "  " * 50 + "- deep words", "deep words"),
    ("".join("   " * i + "1. step\n" for i in range(40)) + "   " * 40 + "2. deep words", "deep words"),

    # an ordered item numbered other than 1 after a line of text (CommonMark: paragraph text)
    ("> hello[uv_break]\n> 3) * hello[uv_break]", "hello[uv_break]\n3. hello[uv_break]"),
    ("Steps:\n4) *dry* the dishes", "Steps:\n4. dry the dishes"),
])
def test_markup_nested_deeper_than_the_parser_reads(text, said):
    """markdown-it drops what is nested past its limit (``MAX_NESTING`` levels); the markup stage
    flattens such a text instead, so the last words are there."""
    out = MARKUP(text)
    assert out.endswith(said), out[-80:]
