"""Chat text as people type it (the corpus rows are ``tests/text/chat.tsv``): pictures said by
meaning or dropped whole, list numbers dropped by config, every decision noted, the step budget
of a sentence proportional to its length and the splitter cutting a long text to fit it, and a
property over any string: no name of an ASCII punctuation mark is said, no unit repeats more than
``MAX_SPOKEN_REPEATS`` times."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.config import config_from_dict
from appliance.errors import TextError
from appliance.text import budget
from appliance.text.dryrun import dry_run, shown
from appliance.text.normalize import CTRL_RE, Normalizer
from appliance.text.scripts import describe
from appliance.text.shorten import MAX_REPEATS, MAX_SPOKEN_REPEATS
from appliance.text.split import split_text
from tests.test_text_corpus import make_full_tokenizer
from tests.test_text_fuzz import EXAMPLES


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_full_tokenizer(tmp_path_factory.mktemp("full_tok"))


@pytest.fixture(scope="module")
def norm(tok):
    return Normalizer(tok)


@pytest.mark.parametrize("text, said", [
    ("好的👍🏽明天见", "好的拇指向上明天见"),
    ("See you 👍🏽", "See you thumbs up"),
    ("我❤️你 I ❤️ you", "我红心你 I red heart you"),
    ("好的^_^", "好的微笑"),
    ("Thanks :) bye", "Thanks smile bye"),
    ("气死了(╯°□°)╯︵ ┻━┻", "气死了掀桌"),
    ("whatever ¯\\_(ツ)_/¯", "whatever shrug"),
    ("Our 👨‍👩‍👧‍👦 trip to 🇯🇵", "Our family man woman girl boy trip to Japan"),
])
def test_pictures_said_by_meaning_in_the_language_beside_them(norm, text, said):
    r = norm(text, emoji="name")
    assert (r.text, r.unspeakable) == (said, ())
    assert any("said as" in n for n in r.notes), r.notes


def test_dropped_pictures_are_reported_as_whole_clusters(norm):
    r = norm("Our 👨‍👩‍👧‍👦 trip 🇯🇵 ^_^ (╯°□°)╯︵ ┻━┻ and 👍🏽")
    assert r.text == "Our trip and"
    assert r.unspeakable == ("(╯°□°)╯︵ ┻━┻", "^_^", "👨‍👩‍👧‍👦", "🇯🇵", "👍🏽")
    names = [describe(u) for u in r.unspeakable]
    assert names[1] == "^_^ (emoticon)" and names[0].endswith("(kaomoji)")
    assert names[2].startswith("👨‍👩‍👧‍👦 (emoji family man woman girl boy: U+1F468 U+200D")
    assert names[4] == "👍🏽 (emoji thumbs up: U+1F44D U+1F3FD)"
    with pytest.raises(TextError, match="emoji thumbs up"):
        norm("👍🏽")


def test_list_numbers_dropped_by_config(norm):
    r = norm("1. Hello\n2. 你好世界\n3. Good bye", list_numbers="drop")
    assert r.text == "Hello. 你好世界。Good bye"
    assert r.notes == ("list numbers dropped: 1: dropped; 2: dropped; 3: dropped",)


def test_each_decision_is_noted(norm):
    r = norm("第Ⅻ届 Henry VIII hahahahaha commit e9d436c0a1b2c3d4e5f6 see https://example.com/a?b=1\n1. 你好")
    text = "\n".join(r.notes)
    for part in ("list numbers said with their items: 1: 一", "Roman numeral XII after 第 read as 12",
                 "Roman numeral VIII after Henry read as 'the eighth'", "run 'hahahahaha' said as 'hahaha'",
                 "code 'e9d436c0a1b2c3d4e5f6' said as 'a code'", "link 'https://example.com/a?b=1': its path"):
        assert part in text, (part, r.notes)


def test_step_cap_is_proportional_with_a_floor_and_the_ceiling():
    short, zh, en = "你好。", "你" * 45, " ".join(["word"] * 50)
    assert budget.step_cap(short, 2048) == round(budget.STEPS_PER_S * budget.MIN_CAP_S)   # the floor
    assert budget.expected_s(zh) == pytest.approx(45 / budget.ZH_CHARS_PER_S)
    assert budget.expected_s(en) == pytest.approx(50 / budget.EN_WORDS_PER_S)
    assert budget.step_cap(zh, 2048) == int(-(-budget.STEPS_PER_S * 2 * 10 // 1))       # 10 s x 2
    assert budget.step_cap(en, 2048) == int(budget.STEPS_PER_S * 2 * 20)                 # 20 s x 2
    assert budget.step_cap(en, 1000) == 1000 and budget.step_cap(short, 100) == 100      # the ceiling
    assert budget.step_cap(short, 2048, min_steps=400) == 400                             # min_new_tokens
    assert budget.step_cap(short, 300, min_steps=400) == 300


def test_a_long_unpunctuated_text_is_cut_to_fit_the_budget(tok):
    text = "".join("今天天气很好我们一起去公园散步然后吃午饭" for _ in range(20))   # 400 characters, no mark
    pieces = split_text(text, tok, 1024, max_steps=2048)
    assert "".join(p.text for p in pieces) == text
    assert len(pieces) > 1 and all(budget.fits(p.text, 2048) for p in pieces)
    assert all(budget.step_cap(p.text, 2048) <= 2048 for p in pieces)
    # without a budget the prompt limit alone cuts: the 400 characters fit 1024 tokens whole
    assert [p.text for p in split_text(text, tok, 1024)] == [text]
    # a small ceiling never cuts below MIN_CUT_S of expected speech
    short = "今天天气很好我们一起去公园散步"
    assert [p.text for p in split_text(short, tok, 1024, max_steps=50)] == [short]


def test_normalize_shows_caps_and_decisions(tok, tmp_path):
    cfg = config_from_dict({"synthesis": {"max_new_tokens": 600}})
    reply = dry_run("哈哈哈哈哈哈，第Ⅻ届。" + "今天天气很好我们一起去公园散步然后吃午饭" * 4, cfg, tok)
    assert reply["steps"] == [budget.step_cap(s, 600) for s in reply["spoken"]]
    assert reply["steps"][0] == 188 and max(reply["steps"]) == 600     # the floor, the ceiling
    lines = shown(reply, "x")
    assert any(re.search(r"\[\d+ tokens, at most 188 steps = 4\.0 s\]", line) for line in lines), lines
    assert "decided: run '哈哈哈哈哈哈' said as '哈哈哈' (6 times -> 3)" in lines


# -- the property over any string ------------------------------------------------------------------

#: names of ASCII punctuation marks, English and Chinese (an e-mail address may say dash and
#: underscore: inputs with @ are left out of those two)
PUNCT_NAMES = ("underscore", "circumflex", "caret", "tilde", "asterisk", "backslash", "slash", "colon",
               "semicolon", "hyphen", "apostrophe", "quotation", "parenthesis", "bracket", "brace", "backtick",
               "grave", "vertical bar", "exclamation", "question mark", "full stop",
               "下划线", "星号", "斜杠", "冒号", "分号", "括号", "引号", "波浪号", "感叹号", "问号", "竖线")
CHAT = ["^_^", "T_T", "<3", ":)", ":-(", ";)", "XD", "-_-", "(╯°□°)╯︵ ┻━┻", "¯\\_(ツ)_/¯", "ヽ(•‿•)ノ", "👍🏽",
        "👨‍👩‍👧‍👦", "🇨🇳", "1️⃣", "❤️", "ha", "哈", "a", "no ", "Ⅻ", "第", "XII", "Henry ", "VIII", "Chapter ", "IV",
        "I", "MIX", "12点", "~", "–", "-", "13点半", "2:30", "4 pm", "$10", "e9d436c0a1b2c3d4e5f6", "A12B34C56D78",
        "https://example.com/a?b=1", "www.x.org/p", "1. ", "\n2. ", "0000", "v2.1.3", "你好", "hello", " ", "，", "."]
STRINGS = st.one_of(st.text(alphabet=st.characters(codec="ascii"), max_size=40),
                    st.lists(st.one_of(st.sampled_from(CHAT), st.text(max_size=3)), max_size=14).map("".join),
                    st.tuples(st.sampled_from(["ha", "哈", "a", "ab", "0", "xo "]), st.integers(4, 60)).map(
                        lambda t: t[0] * t[1]))


def _longest_repeat(letters: str) -> int:
    """Most consecutive copies of any unit of 1-4 characters in ``letters``."""
    best = 1
    for n in range(1, 5):
        for m in re.finditer(rf"(.{{{n}}})\1+", letters):
            best = max(best, len(m.group()) // n)
    return best


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=STRINGS)
def test_no_punctuation_names_and_bounded_repeats(norm, text):
    for mode in ("drop", "name"):
        try:
            out = norm(text, emoji=mode).text
        except TextError:
            return
        said = CTRL_RE.sub(" ", out).lower()
        for name in PUNCT_NAMES:
            if "@" in text and name in ("underscore", "hyphen"):
                continue
            assert not re.search(rf"(?<!百){name}", said), (name, text, out)   # 百分号 is %'s word
        letters = "".join(c for c in said if c.isalpha())
        assert _longest_repeat(letters) <= MAX_SPOKEN_REPEATS, (text, out)
        if re.fullmatch(r"(?:ha|哈|a)+", text):
            assert _longest_repeat(letters) <= MAX_REPEATS, (text, out)
