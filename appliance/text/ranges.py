"""Ranges read with the language's "to": ``12点~13点半`` -> 十二点到十三点半, ``第1-3名`` -> 第一到三名,
``2:30–4 pm`` -> two thirty to four PM, ``10am-2pm``, ``9:00-17:00``, ``$10-$20``, ``1990–1995``,
``Mon–Fri``, ``March 5–7`` -> March fifth to seventh.

wetext and upstream read a range's dash or tilde as a pause (or a minus); the ``range-words`` row
of :data:`appliance.text.rules.RULES` runs :func:`read_ranges` on each span before wetext. A plain
``5-10`` and ``30%-40%`` are the ``range`` and ``percent-range`` rows; Chinese ``-`` after a
number with its unit (``10点-12点``) is the ``minus-sign`` row's; ``至`` stays 至 (it is the word).
"""

from __future__ import annotations

import re

from .numbers import en_ordinal

#: ranges: a dash or tilde after a number with up to 3 characters of unit (12点~13点半, 5元～8元)
_ZH_RANGE_WORD_RE = re.compile(r"(\d[^\d\s，。、,.;；:：!！?？()（）~～–—-]{1,3}?)\s*[~～–—]\s*(?=\d)|(第\d+)\s*[-~～–—]\s*(?=\d)")
_TIME = r"\d{1,2}(?::[0-5]\d)?"
_AMPM = r"\s?(?:[AaPp]\.?[Mm]\.?)(?![A-Za-z])"
#: 10am-2pm, 2:30–4 pm, 9:00-17:00: a dash between two times
_EN_TIME_RANGE_RE = re.compile(rf"(?<![\d:.])({_TIME}(?:{_AMPM})?)\s?[-–—~]\s?(?={_TIME}{_AMPM}|\d{{1,2}}:[0-5]\d(?!\d))")
#: 1990–1995, $10–$20, 5 ~ 10, $10-$20: an en/em dash or a tilde between numbers, a dash before an amount
_EN_DASH_RANGE_RE = re.compile(r"(?<=[\d%])\s?(?:[–—~～]\s?(?=[$€£¥]?\d)|-\s?(?=[$€£¥]\d))")
_DAYS = r"(?:Mon|Tues?|Wed|Thu(?:rs?)?|Fri|Sat|Sun)(?:day)?|Wednesday|Saturday|Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sept?|Oct|Nov|Dec"
#: March 5–7: the days of a month as ordinals
_EN_DAY_RANGE_RE = re.compile(r"\b((?:Jan|Febr)uary|March|April|May|June|July|August|(?:Sept|Nov|Dec)ember|October)\s+"
                              r"(\d{1,2})\s?[-–—~]\s?(\d{1,2})\b(?!:)")
_EN_NAME_RANGE_RE = re.compile(rf"\b({_DAYS})\.?\s?[-–—~]\s?(?=(?:{_DAYS})\b)")


def read_ranges(s: str, lang: str) -> str:
    """``s`` (one span of ``lang``) with the dash or tilde of each range as 到 / " to " (module
    docstring); the written numbers stay for the rules after this one."""
    if lang == "zh":
        return _ZH_RANGE_WORD_RE.sub(lambda m: (m.group(1) or m.group(2)) + "到", s)
    return _en_ranges(s, lang)


def _en_ranges(s: str, lang: str) -> str:
    s = _EN_DAY_RANGE_RE.sub(lambda m: f"{m.group(1)} {en_ordinal(int(m.group(2)))} to {en_ordinal(int(m.group(3)))}", s)
    s = _EN_TIME_RANGE_RE.sub(r"\1 to ", s)
    s = _EN_DASH_RANGE_RE.sub(" to ", s)
    return _EN_NAME_RANGE_RE.sub(r"\1 to ", s)
