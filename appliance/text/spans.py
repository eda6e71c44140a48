"""Language per span: which words of a mixed Chinese/English text are read in which language.

Letters decide: CJK characters are Chinese, Latin words English. Everything else is neutral and
joins the text around it: digits, punctuation, symbols, a number with its unit (``120km/h``,
``35μg/m³``), a number in E notation (``2.5e-3``), and codes that mix letters and digits
(``A12B34``, ``G1234``, ``PM2.5``, ``5G``), which are therefore read in the language of the
sentence they stand in (订单号A12B34 is Chinese, "Order A12B34" English). A neutral run between
two spans of different languages is cut after its last clause mark (``,.;:!?，。；：！？、`` and line
breaks, not a decimal point): what comes before the mark ends the clause on the left and is read
in its language, the rest starts the clause on the right (``Meeting starts at 10:45. 请准时参加``
reads 10:45 in English; ``Hello, 你好吗`` keeps its comma with ``Hello``). Without such a mark the
run goes to the side it is written against (no space between), else to the language that has more
words in the text around it; the request's dominant language decides only text that has no letters.
A web or e-mail address (:data:`~appliance.text.rules.WEB_RE`) is one span, in the language of the
words nearest to it on its left (else its right): ``请访问https://example.com/a?b=1了解`` says the
link in Chinese.
"""

from __future__ import annotations

import re

from .rules import CODE_RE, SCIENTIFIC_RE, WEB_RE
from .scripts import is_cjk, is_latin
from .units import QUANTITY_RE

_CLAUSE_MARKS = set(",.;:!?，。；：！？、…\n")
_CJK_RE = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]")
_EN_WORD_RE = re.compile(r"\b[A-Za-z]+\b")


def detect_language(text: str) -> str:
    """``"zh"`` if CJK characters outnumber English words, else ``"en"`` (upstream norm.py)."""
    return "zh" if len(_CJK_RE.findall(text)) > len(_EN_WORD_RE.findall(text)) else "en"


def _is_mark(seg: str, k: int) -> bool:
    c = seg[k]
    if c not in _CLAUSE_MARKS:
        return False
    if c in ".,:" and 0 < k < len(seg) - 1 and seg[k - 1].isdigit() and seg[k + 1].isdigit():
        return False   # 3.5, 1,000, 10:45
    return True


def split_spans(seg: str, dominant: str) -> list[tuple[str, str]]:
    """Cut ``seg`` into ``(lang, text)`` spans, ``lang`` ``"zh"`` or ``"en"`` (see module doc).

    Args:
        seg: text between control tokens, after the script pass.
        dominant: the request's language (:func:`detect_language`), for text with no letters.

    Returns:
        contiguous spans covering ``seg`` in order.
    """
    n = len(seg)
    neutral = [False] * n
    for rx in (QUANTITY_RE, CODE_RE, SCIENTIFIC_RE):
        for m in rx.finditer(seg):
            for i in range(m.start(), m.end()):
                neutral[i] = True
    kinds: list = []
    for i, c in enumerate(seg):
        if neutral[i]:
            kinds.append(None)
        elif is_cjk(c):
            kinds.append("zh")
        elif is_latin(c):
            kinds.append("en")
        else:
            kinds.append(None)
    for m in WEB_RE.finditer(seg):       # an address: one span, in its neighbours' language
        near = [k for k in kinds[m.start() - 1::-1] if k][:1] if m.start() else []
        near = near or [k for k in kinds[m.end():] if k][:1] or [dominant]
        for i in range(m.start(), m.end()):
            kinds[i] = near[0]
    i = 0
    while i < n:
        if kinds[i] is not None:
            i += 1
            continue
        j = i
        while j < n and kinds[j] is None:
            j += 1
        left = kinds[i - 1] if i > 0 else None
        right = kinds[j] if j < n else None
        if left == right or not (left and right):
            lang = left or right or dominant
            for k in range(i, j):
                kinds[k] = lang
        else:
            _resolve(seg, kinds, i, j, left, right)
        i = j
    spans: list[tuple[str, str]] = []
    start = 0
    for i in range(1, n + 1):
        if i == n or kinds[i] != kinds[start]:
            spans.append((kinds[start], seg[start:i]))
            start = i
    return spans


def _resolve(seg: str, kinds: list, i: int, j: int, left: str, right: str) -> None:
    """Give the neutral run ``seg[i:j]`` between ``left`` and ``right`` text its languages."""
    cut = next((k for k in range(j - 1, i - 1, -1) if _is_mark(seg, k)), None)
    if cut is not None:
        for k in range(i, j):
            kinds[k] = left if k <= cut else right
        return
    run = seg[i:j]
    if run[0].isspace() and not run[-1].isspace():
        lang = right
    elif run[-1].isspace() and not run[0].isspace():
        lang = left
    else:
        a = max((k for k in range(i) if _is_mark(seg, k)), default=-1) + 1
        b = next((k for k in range(j, len(seg)) if _is_mark(seg, k)), len(seg))
        lang = detect_language(seg[a:b])
    for k in range(i, j):
        kinds[k] = lang
