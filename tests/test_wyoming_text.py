"""Sentences out of streamed text (``appliance.transports.text_stream``): pieces cut anywhere, even
inside words and numbers, give the same sentences as the whole text, each as soon as it is
known to be complete."""

from __future__ import annotations

import random

import pytest

from appliance.transports.text_stream import SentenceBuffer, speakable

TEXT = ("你好，今天天气很好。我们去公园散步吧！The time is 9.30 now. It is 21 degrees, isn't it? "
        "He said \"Really?!\" and left.\n新的一行。[uv_break]。。 最后一句")
SENTENCES = ["你好，今天天气很好。", "我们去公园散步吧！", "The time is 9.30 now.", "It is 21 degrees, isn't it?",
             "He said \"Really?!\"", "and left.", "新的一行。", "[uv_break]。。 最后一句"]


def _feed(pieces: list[str], max_chars: int = 300) -> tuple[list[list[str]], list[str]]:
    b = SentenceBuffer(max_chars)
    return [b.add(p) for p in pieces], b.finish()


def test_whole_text_and_any_cut_give_the_same_sentences():
    got, rest = _feed([TEXT])
    assert got[0] + rest == SENTENCES
    rng = random.Random(0)
    for _ in range(200):                                # cut anywhere, including inside words and numbers
        cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randint(1, 25)))
        pieces = [TEXT[a:b] for a, b in zip([0] + cuts, cuts + [len(TEXT)])]
        got, rest = _feed(pieces)
        assert [s for g in got for s in g] + rest == SENTENCES, pieces


def test_a_sentence_is_handed_out_once_the_next_character_shows_its_end():
    b = SentenceBuffer(300)
    assert b.add("It is 9.") == []                      # 9.30 or the end of a sentence? not yet known
    assert b.add("30 now.") == []                       # "now." might go on: "now.."
    assert b.add(" Next") == ["It is 9.30 now."]
    assert b.add("句子。") == []
    assert b.add("下") == ["Next句子。"]                 # a Chinese mark ends at once once anything follows
    assert b.add("一句!好") == ["下一句!"]                # ASCII mark before a Chinese character ends too
    assert b.add("v1.2 is out") == []
    assert b.finish() == ["好v1.2 is out"]


def test_nothing_to_say_stays_with_the_next_sentence_and_is_dropped_at_the_end():
    got, rest = _feed(["。。。", "！", "好的。", "然后"])
    assert [s for g in got for s in g] + rest == ["。。。！好的。", "然后"]
    assert _feed(["🙂. ", "[laugh]"]) == ([[], []], [])
    assert not speakable("[uv_break]。。") and speakable("a") and speakable("好")


@pytest.mark.parametrize("text", ["a" * 250, "很长的句子，" * 60, "word " * 70])
def test_long_text_without_an_end_is_cut_within_the_limit(text):
    got, rest = _feed([text[i:i + 7] for i in range(0, len(text), 7)], max_chars=100)
    pieces = [s for g in got for s in g] + rest
    assert all(0 < len(p) <= 100 for p in pieces)
    assert "".join(pieces).replace(" ", "") == text.replace(" ", "")
    if "，" in text:
        assert all(p.endswith("，") for p in pieces[:-1])      # cut after a clause mark


MARKDOWN = ("Here is the **plan**:\n| Day | High |\n|---|---|\n| Mon | 18 |\nThen run:\n```bash\nls -l\n\n"
            "foo. bar\n```\nDone. *This is one. And two.* End")
MARKDOWN_PIECES = ["Here is the **plan**:", "| Day | High |\n|---|---|\n| Mon | 18 |", "Then run:",
                   "```bash\nls -l\n\nfoo. bar\n```", "Done.", "*This is one.", "And two.* End"]


def test_a_table_and_a_code_fence_are_one_piece_however_they_arrive():
    """An LLM's Markdown cut anywhere: a table (its rows) and a fenced code block (to its closing
    fence, blank lines and sentence marks inside) each reach the markup stage whole."""
    rng = random.Random(1)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(MARKDOWN)), rng.randint(1, 30)))
        got, rest = _feed([MARKDOWN[a:b] for a, b in zip([0] + cuts, cuts + [len(MARKDOWN)])])
        assert [s for g in got for s in g] + rest == MARKDOWN_PIECES, cuts


def test_ssml_is_read_whole_at_the_end():
    b = SentenceBuffer(300, ssml=True)
    assert b.add('<speak>Turn left.<break time="') == [] and b.add('2s"/> Then right. Done.</speak>') == []
    assert b.finish() == ["Turn left.", "[lbreak] Then right.", "Done."]
