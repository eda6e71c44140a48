"""The table of our own text rules: every row says why, and its example reads as it says."""

import pytest

from appliance.text.normalize import Normalizer
from appliance.text.rules import RULES

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
