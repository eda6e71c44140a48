"""Chinese dates, clock times and the choice between 二 and 两.

The rows of :data:`appliance.text.rules.RULES` that read Chinese dates and times call these
functions (``(text, lang) -> text``, on one Chinese span, before ``wetext``). The convention is
the usual Mandarin one (the 二/两 entries of the 现代汉语词典 and every Mandarin grammar):

* **二 where the number names something** -- a date, a position, a label: 二月二日, 十二月二日,
  二号, 第二, 二楼, 二年级, 星期二; a year digit by digit (二零二二年); the minutes and seconds of a
  clock time (两点零二分, 十点二十二分, 十点零分零二秒); a number inside a larger number
  (十二, 二十二, 一万二千).
* **两 where the number counts** -- before a measure word: 两个, 两天, 两年, 两次, 两倍, 两成,
  两公里; and the hour of a clock time, 2 o'clock is 两点 (两点半, 下午两点). wetext reads 2日 as
  两日 even after a month (十二月两日), 2季度 as 两季度 and 2年/2次/2倍 as 二年/二次/二倍; the rows
  here correct these. A bare 2日 with no month stays 两日 (休息2日: two days).

Dates wetext misses are made into the 年/月/日 form first (2024.3.5, 2024年03月05日); the
month and day are then read here, the year is left to wetext (digit by digit).
"""

from __future__ import annotations

import re
from typing import Optional

from .numbers import zh_int

_DOTTED_DATE_RE = re.compile(r"(?<![\d.])(\d{4})[./](\d{1,2})[./](\d{1,2})(?![\d.])")
_PADDED_DATE_RE = re.compile(r"(\d{2,4})\s*年\s*0?(\d{1,2})\s*月(?:\s*0?(\d{1,2})\s*[日号])?")
#: ``[12]月2日``, ``每月2号``, ``12月2日至5日``, ``12月2到5日``, ``12月30日-1月2日``
_MONTH_DAY_RE = re.compile(r"(?:(?<![\d.])(\d{1,2})\s*)?月\s*0?(\d{1,2})(?:\s*([日号]))?"
                           r"(?:\s*([到至~～-])\s*(?:0?(\d{1,2})\s*月\s*)?0?(\d{1,2})\s*([日号]))?")
_TIME = r"([01]?\d|2[0-4]):([0-5]\d)(?::([0-5]\d))?"
_CLOCK_RE = re.compile(rf"(?<![\d:.]){_TIME}(?:\s?[-~～至到]\s?{_TIME})?(?![\d:])")
#: ``2点``, ``2点钟``, ``2点半``, ``2点2分``, ``10点05分30秒`` (not ``2点5``, a decimal)
_CLOCK_WORDS_RE = re.compile(r"(?<![\d.第])([01]?\d|2[0-4])点(?=$|[^\d]|\d{1,2}分)"
                             r"(?:([0-5]?\d)分(?!钟)(?:([0-5]?\d)秒(?!钟))?)?")
_AMPM_RE = re.compile(r"(?<![\d:])(\d{1,2})(?::([0-5]\d))?\s?([AaPp])\.?[Mm]\.?(?![A-Za-z])")
#: a bare 2 before a measure word that wetext reads with 二 (not 2次方, 2年级, 2年代)
_MEASURE_TWO_RE = re.compile(r"(?<![\d.,:：第])2(?![\d.,:])(?=\s?(?:次(?!方|元)|遍|年(?!级|代)|台|份|种|倍|成(?!员)))")
#: a bare 2 before a noun that names a position (a quarter, a century), which wetext reads 两
_NAMED_TWO_RE = re.compile(r"(?<![\d.,:：])2(?![\d.,:])(?=季度|世纪)")


def _hour(h: int) -> str:
    return "两" if h == 2 else zh_int(h)


def _part(text: Optional[str], unit: str) -> str:
    """Minutes or seconds of a clock time: 二 (never 两), 零 for a written leading zero or a
    value below ten (零二分)."""
    if text is None:
        return ""
    return ("零" if len(text) == 2 and text[0] == "0" else "") + zh_int(int(text)) + unit


def dotted_date(s: str, lang: str) -> str:
    """``2024.3.5`` / ``2024/3/5`` -> ``2024年3月5日`` (read further by :func:`month_day`)."""
    return _DOTTED_DATE_RE.sub(lambda m: f"{m.group(1)}年{int(m.group(2))}月{int(m.group(3))}日", s)


def padded_date(s: str, lang: str) -> str:
    """``2024年03月05日`` -> ``2024年3月5日`` (wetext reads 03月 as 零三月)."""
    return _PADDED_DATE_RE.sub(lambda m: f"{m.group(1)}年{int(m.group(2))}月"
                               + (f"{int(m.group(3))}日" if m.group(3) else ""), s)


def month_day(s: str, lang: str) -> str:
    """Month and day in words with 二: ``12月2日`` -> 十二月二日, ``每月2号`` -> 每月二号,
    ``12月2日至5日`` -> 十二月二日至五日. A day needs its 日/号 (or a range that ends in one);
    a month outside 1..12 or a day outside 1..31 is left to the other rules."""
    def one(m: re.Match) -> str:
        mo, d, d_unit, sep, mo2, d2, d2_unit = m.groups()
        valid = all(1 <= int(x) <= 31 for x in (d, d2) if x) and all(1 <= int(x) <= 12 for x in (mo, mo2) if x)
        if not (d_unit or sep) or not valid:
            return m.group()
        out = (zh_int(int(mo)) if mo else "") + "月" + zh_int(int(d)) + (d_unit or "")
        if sep:
            out += {"至": "至"}.get(sep, "到") + (zh_int(int(mo2)) + "月" if mo2 else "") + zh_int(int(d2)) + d2_unit
        return out
    return _MONTH_DAY_RE.sub(one, s)


def clock(s: str, lang: str) -> str:
    """``14:30`` -> 十四点三十分, ``2:02`` -> 两点零二分, ``0:30`` -> 零点三十分 (wetext reads 0:30
    as a score), ``10:00-22:00`` -> 十点到二十二点."""
    def read(h: str, mi: str, sec: Optional[str]) -> str:
        out = _hour(int(h)) + "点"
        if int(mi) or (sec and int(sec)):
            out += ("零" if 0 < int(mi) < 10 else "") + zh_int(int(mi)) + "分"
        if sec and int(sec):
            out += ("零" if int(sec) < 10 else "") + zh_int(int(sec)) + "秒"
        return out

    def one(m: re.Match) -> str:
        g = m.groups()
        return read(*g[:3]) + ("到" + read(*g[3:]) if g[3] else "")
    return _CLOCK_RE.sub(one, s)


def clock_words(s: str, lang: str) -> str:
    """A clock time written with 点/分/秒: the hour 2 is 两 (``2点半`` -> 两点半), minutes and
    seconds are read with 二 (``2点2分`` -> 两点二分, ``3点02分`` -> 三点零二分); wetext reads
    2点 as 二点 and 2分 as 两分."""
    return _CLOCK_WORDS_RE.sub(lambda m: _hour(int(m.group(1))) + "点" + _part(m.group(2), "分")
                               + _part(m.group(3), "秒"), s)


def am_pm(s: str, lang: str) -> str:
    """``3pm`` -> 下午三点, ``2:05 AM`` -> 上午两点零五分 (wetext leaves 三pm)."""
    def one(m: re.Match) -> str:
        h, mi, ap = int(m.group(1)), m.group(2), m.group(3).lower()
        out = ("上午" if ap == "a" else "下午") + _hour(h) + "点"
        if mi and int(mi):
            out += ("零" if int(mi) < 10 else "") + zh_int(int(mi)) + "分"
        return out
    return _AMPM_RE.sub(one, s)


def two_or_liang(s: str, lang: str) -> str:
    """A bare 2 before 次, 遍, 年, 台, 份, 种, 倍, 成 counts: 两 (两次, 两年, 两倍; wetext reads 二);
    before 季度, 世纪 it names one: 二 (二季度, 公元二世纪; wetext reads 两)."""
    return _NAMED_TWO_RE.sub("二", _MEASURE_TWO_RE.sub("两", s))
