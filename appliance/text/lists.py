"""List items: an ordered item's number said in its own item's language, attached to its text.

The markup stage (:mod:`.markup`) writes an ordered list item as a line ``N. text``. Read as it
stands, ``N.`` became a sentence of its own in the request's language ("one. Hello. ... 三。 Good
bye"). Here the number is said in the language of its item's words and joined to them by a pause
that ends no sentence: ``1. Hello`` -> "one, Hello", ``2. 你好世界`` -> "二、你好世界" (a line without
words takes the request's language). ``synthesis.list_numbers: drop`` leaves the numbers out.
"""

from __future__ import annotations

import re
from typing import Callable

from .numbers import en_int, zh_int
from .spans import detect_language

#: an ordered list item's number at the start of a line (as the markup stage writes it)
ITEM_RE = re.compile(r"(?m)^(\d{1,9})\. (?=\S)")
_LETTERS = re.compile(r"[A-Za-z\u3400-\u4dbf\u4e00-\u9fff]")


def list_numbers(text: str, mode: str, dominant: str, note: Callable[[str], None]) -> str:
    """``text`` with each list item's ``N.`` said in its line's language (``mode`` ``speak``) or
    left out (``drop``); each is noted once per request.

    Args:
        text: the markup stage's output. mode: ``synthesis.list_numbers``.
        dominant: the request's language, for an item without words.
    """
    said: list[str] = []

    def one(m: re.Match) -> str:
        line = m.string[m.end():].split("\n", 1)[0]
        n = int(m.group(1))
        if mode == "drop":
            said.append(f"{n}: dropped")
            return ""
        lang = detect_language(line) if _LETTERS.search(line) else dominant
        word = zh_int(n) + "、" if lang == "zh" else en_int(n) + ", "
        said.append(f"{n}: {word.strip(' ,、')}")
        return word

    out = ITEM_RE.sub(one, text)
    if said:
        note("list numbers " + ("dropped" if mode == "drop" else "said with their items") + ": " + "; ".join(said))
    return out
