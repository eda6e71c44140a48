"""Numbers read aloud in Chinese and English: cardinals, digit strings, decimals.

These are our own readings, used where ``wetext`` reads a number wrongly (see
:mod:`appliance.text.rules`) and as the fallback for any digit wetext leaves, so that no digit
ever reaches the tokenizer or is deleted. Conventions:

* Chinese cardinals follow the standard grouping by 万/亿 with 零 for skipped positions
  (``1012`` -> 一千零一十二, ``100000001`` -> 一亿零一); a leading 一十 is said 十.
  ``liang=True`` gives the measure-word form: 两 for a leading 2 before 百/千/万/亿 and for
  a bare 2 (两千五百元, 两公里), and 两千 inside a number (一万两千).
* English cardinals have no "and" (``1234`` -> one thousand two hundred thirty four); English
  ordinals change the last word (``1,000th`` -> one thousandth, ``21st`` -> twenty first).
* Decimals are read digit by digit after the point, as written (``1.50`` -> 一点五零).
"""

from __future__ import annotations

import re

_ZH_DIGITS = "零一二三四五六七八九"
_EN_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
            "fifteen sixteen seventeen eighteen nineteen").split()
_EN_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def zh_digits(s: str, yao: bool = False) -> str:
    """Digit by digit in Chinese (``110`` -> 一一零, or 幺幺零 with ``yao``); non-digits skipped."""
    d = _ZH_DIGITS.replace("一", "幺") if yao else _ZH_DIGITS
    return "".join(d[int(c)] for c in s if c.isdigit())


def en_digits(s: str) -> str:
    """Digit by digit in English (``110`` -> "one one zero"); non-digits skipped."""
    return " ".join(_EN_ONES[int(c)] for c in s if c.isdigit())


def zh_int(n: int, liang: bool = False) -> str:
    """Chinese cardinal of ``0 <= n < 10**16`` (larger: digit by digit).

    Args:
        liang: measure-word form (两 for a leading 2 before a unit, 两千 inside).
    """
    if n == 0:
        return "零"
    if n >= 10 ** 16:
        return zh_digits(str(n))
    units, big = ("", "十", "百", "千"), ("", "万", "亿", "万亿")
    groups = []
    m = n
    while m:
        groups.append(m % 10000)
        m //= 10000
    out, zero = [], False
    for gi in range(len(groups) - 1, -1, -1):
        g = groups[gi]
        if g == 0:
            zero = True
            continue
        if zero or (out and g < 1000):
            out.append("零")
        zero = False
        s, z = [], False
        for p in range(3, -1, -1):
            dgt = g // 10 ** p % 10
            if dgt == 0:
                z = bool(s)
                continue
            if z:
                s.append("零")
                z = False
            s.append(_ZH_DIGITS[dgt] + units[p])
        out.append("".join(s) + big[gi])
    r = "".join(out)
    if r.startswith("一十"):
        r = r[1:]
    if liang:
        if n == 2:
            return "两"
        if r[0] == "二" and len(r) > 1 and r[1] in "百千万亿":
            r = "两" + r[1:]
        r = r.replace("二千", "两千")
    return r


def en_int(n: int) -> str:
    """English cardinal of ``0 <= n < 10**15`` (larger: digit by digit)."""
    if n < 20:
        return _EN_ONES[n]
    if n >= 10 ** 15:
        return en_digits(str(n))
    if n < 100:
        return _EN_TENS[n // 10] + ("" if n % 10 == 0 else " " + _EN_ONES[n % 10])
    if n < 1000:
        return _EN_ONES[n // 100] + " hundred" + ("" if n % 100 == 0 else " " + en_int(n % 100))
    for p, w in ((12, "trillion"), (9, "billion"), (6, "million"), (3, "thousand")):
        if n >= 10 ** p:
            return en_int(n // 10 ** p) + " " + w + ("" if n % 10 ** p == 0 else " " + en_int(n % 10 ** p))
    raise AssertionError(n)  # unreachable


_EN_ORD = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
           "nine": "ninth", "twelve": "twelfth"}


def en_ordinal(n: int) -> str:
    """English ordinal of ``0 <= n < 10**15`` (``1000`` -> "one thousandth", ``21`` -> "twenty
    first", ``40`` -> "fortieth"): the last word of :func:`en_int` made ordinal."""
    head, _, last = en_int(n).rpartition(" ")
    if last in _EN_ORD:
        last = _EN_ORD[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return (head + " " if head else "") + last


def en_amount(text: str) -> str:
    """A written English number as it should reach wetext: unchanged below 1000, in words from
    four integer digits on (wetext reads ``1234`` like a year, twelve thirty four, and drops the
    "one" of ``1299.5``); ``text`` is a :data:`NUMBER`."""
    return en_number(text) if len(text.replace(",", "").split(".")[0].lstrip("+-−")) >= 4 else text


#: A written number: optional sign, digits with optional thousands commas, optional decimals.
NUMBER = r"[-−+]?\d+(?:,\d{3})*(?:\.\d+)?"


def zh_number(text: str, liang: bool = False) -> str:
    """Chinese reading of a written number (``NUMBER``: ``-1,299.50`` -> 负一千二百九十九点五零).

    Integer parts with a leading zero (``007``) are read digit by digit. ``liang`` applies to
    integers only (``2.5`` stays 二点五)."""
    sign, body = _sign(text)
    ip, _, frac = body.replace(",", "").partition(".")
    if len(ip) > 1 and ip.startswith("0"):
        s = zh_digits(ip)
    else:
        s = zh_int(int(ip), liang=liang and not frac)
    if frac:
        s += "点" + zh_digits(frac)
    return {"-": "负", "+": "正"}.get(sign, "") + s


def en_number(text: str) -> str:
    """English reading of a written number (``-1,299.50`` -> "minus one thousand two hundred
    ninety nine point five zero")."""
    sign, body = _sign(text)
    ip, _, frac = body.replace(",", "").partition(".")
    s = en_digits(ip) if len(ip) > 1 and ip.startswith("0") else en_int(int(ip))
    if frac:
        s += " point " + en_digits(frac)
    return {"-": "minus ", "+": "plus "}.get(sign, "") + s


def _sign(text: str) -> tuple[str, str]:
    text = text.strip()
    if text[:1] in "-−":
        return "-", text[1:]
    if text[:1] == "+":
        return "+", text[1:]
    return "", text


def read_number(text: str, lang: str, liang: bool = False) -> str:
    """:func:`zh_number` or :func:`en_number` by ``lang`` (``"zh"``/``"en"``)."""
    return zh_number(text, liang) if lang == "zh" else en_number(text)


_NUM_RE = re.compile(r"(?<![A-Za-z0-9_.])([-−+]?)(\d+(?:,\d{3})*|\d+)(?:\.(\d+))?(\s?%)?")


def verbalize_numbers(text: str, lang: str) -> str:
    """Our own plain reading of every number left in ``text`` (sign, decimals, percent).
    Digits that are not part of a number pattern are read one by one."""

    def one(m: re.Match) -> str:
        sign, ip, frac, pct = m.group(1), m.group(2), m.group(3), m.group(4)
        num = sign + ip + ("." + frac if frac else "")
        if lang == "zh":
            s = zh_number(num.lstrip("-−+"))
            if pct:
                s = "百分之" + s
            return {"-": "负", "−": "负", "+": "正"}.get(sign, "") + s
        s = en_number(num)
        return " " + s + (" percent" if pct else "") + " "

    text = _NUM_RE.sub(one, text)
    if lang == "zh":
        return re.sub(r"\d+", lambda m: zh_digits(m.group()), text)
    return re.sub(r"\d+", lambda m: " " + en_digits(m.group()) + " ", text)
