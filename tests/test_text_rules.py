"""The table of our own text rules: every row says why, and its example reads as it says."""

import re

import pytest

from appliance.text.normalize import Normalizer
from appliance.text.rules import RULES
from appliance.text.units import SYMBOLS, UNITS

STAGES = {"script", "before_spans", "spans", "before_wetext", "after_wetext", "filter"}


@pytest.fixture(scope="module")
def norm():
    return Normalizer()


def test_table_is_well_formed():
    names = [r.name for r in RULES]
    assert len(names) == len(set(names))
    for r in RULES:
        assert r.stage in STAGES, r.name
        assert set(r.langs.split()) <= {"zh", "en"} and r.langs, r.name
        assert len(r.reason) > 20, r.name
        assert (r.apply is not None) == (r.stage in ("before_spans", "before_wetext")), r.name


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_rule_example_reads_as_documented(norm, rule):
    text, spoken = rule.example
    assert norm(text).text == spoken


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_every_unit_is_read(norm, unit):
    u = UNITS[unit]
    zh = norm(f"数值为5{unit}。").text
    assert (u.zh in zh) and not re.search(r"\d", zh), zh
    en = norm(f"The value is 5 {unit}.").text
    assert u.en_pl in en and "five" in en, en


@pytest.mark.parametrize("sym", sorted(SYMBOLS))
def test_every_symbol_is_read(norm, sym):
    zh_word, en_word = SYMBOLS[sym]
    r = norm(f"甲{sym}乙")
    assert r.unspeakable == () and len(r.text) > 2, r.text
    r = norm(f"say {sym} now")
    assert r.unspeakable == () and r.text not in ("say now", "say, now"), r.text


def test_names_of_unspeakable(norm):
    r = norm("你好😀")
    assert r.unspeakable_names == ("😀 (U+1F600 GRINNING FACE)",)
