"""Units, money and symbols as words, in Chinese and English.

Tables (one row per written form, so a reader of the code sees every unit we know):

* :data:`UNITS`: a unit symbol after a number (``35μg/m³``, ``120 km/h``, ``3‰``). Squares and
  cubes (``m²``, ``m2``, ``m^2``, ``cm³``) and quotients of two known units (``μg/m³``,
  ``kWh/100km`` is not one) are built from the rows. Chinese reads ``X/Y`` as wetext does,
  每Y + number + X (每立方米三十五微克, 每小时一百二十公里); English as "thirty five
  micrograms per cubic meter".
* :data:`CURRENCIES`: a currency sign before a number (``￥2,500``, ``$12.50``).
* :data:`SYMBOLS`: a symbol on its own (``&``, ``→``, ``©``), read as a word.

Ambiguous one-letter symbols that are usually something else after a number are left out on
purpose: ``A`` (seat 10A, gate 5A), ``B``, ``K``, ``G`` (5G), ``d``; ``m``/``s``/``h``/``t``/``g``
are in (SI meaning in announcements), and only when no letter or digit follows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .numbers import NUMBER, en_amount, zh_int, zh_number


@dataclass(frozen=True)
class Unit:
    """One unit: Chinese word, English singular and plural; ``liang``: a bare 2 before it is
    read 两 in Chinese (两公里, but 二摄氏度); ``prefix``: the Chinese word goes before the
    number (百分之五)."""

    zh: str
    en: str
    en_pl: str
    liang: bool = True
    prefix: bool = False
    area: bool = False   # a length: ² / ³ make it square / cubic


def _u(zh, en, en_pl=None, **kw) -> Unit:
    return Unit(zh, en, en_pl or en + "s", **kw)


#: Written unit -> words. Data sizes stay letters in Chinese (said "六十四G B" there).
UNITS: dict[str, Unit] = {
    # length (area/volume through ² ³)
    "km": _u("公里", "kilometer", area=True), "m": _u("米", "meter", area=True),
    "cm": _u("厘米", "centimeter", area=True), "mm": _u("毫米", "millimeter", area=True),
    "μm": _u("微米", "micrometer", area=True), "um": _u("微米", "micrometer", area=True),
    "nm": _u("纳米", "nanometer", area=True), "ft": _u("英尺", "foot", "feet", area=True),
    "mi": _u("英里", "mile"),
    # mass
    "t": _u("吨", "ton"), "kg": _u("千克", "kilogram"), "g": _u("克", "gram"),
    "mg": _u("毫克", "milligram"), "μg": _u("微克", "microgram"), "ug": _u("微克", "microgram"),
    "ng": _u("纳克", "nanogram"), "lb": _u("磅", "pound"), "lbs": _u("磅", "pound"),
    # volume
    "L": _u("升", "liter"), "l": _u("升", "liter"), "mL": _u("毫升", "milliliter"),
    "ml": _u("毫升", "milliliter"),
    # time
    "h": _u("小时", "hour"), "hr": _u("小时", "hour"), "hrs": _u("小时", "hour"),
    "min": _u("分钟", "minute"), "mins": _u("分钟", "minute"), "s": _u("秒", "second"),
    "sec": _u("秒", "second"), "ms": _u("毫秒", "millisecond"), "μs": _u("微秒", "microsecond"),
    # speed (km/h, m/s are quotients of the rows above)
    "kmh": _u("公里每小时", "kilometer per hour", "kilometers per hour"),
    "mph": _u("英里每小时", "mile per hour", "miles per hour"),
    # temperature and angle
    "°C": _u("摄氏度", "degree Celsius", "degrees Celsius", liang=False),
    "℃": _u("摄氏度", "degree Celsius", "degrees Celsius", liang=False),
    "°F": _u("华氏度", "degree Fahrenheit", "degrees Fahrenheit", liang=False),
    "℉": _u("华氏度", "degree Fahrenheit", "degrees Fahrenheit", liang=False),
    "°": _u("度", "degree", liang=False),
    # ratios
    "%": _u("百分之", "percent", "percent", liang=False, prefix=True),
    "‰": _u("千分之", "per mille", "per mille", liang=False, prefix=True),
    "‱": _u("万分之", "per ten thousand", "per ten thousand", liang=False, prefix=True),
    "ppm": _u("百万分之", "part per million", "parts per million", liang=False, prefix=True),
    # pressure
    "Pa": _u("帕", "pascal"), "hPa": _u("百帕", "hectopascal"), "kPa": _u("千帕", "kilopascal"),
    "MPa": _u("兆帕", "megapascal"), "bar": _u("巴", "bar"), "mmHg": _u("毫米汞柱", "millimeter of mercury", "millimeters of mercury"),
    # electricity, power, energy
    "V": _u("伏", "volt"), "kV": _u("千伏", "kilovolt"), "mA": _u("毫安", "milliampere"),
    "mAh": _u("毫安时", "milliampere hour"), "W": _u("瓦", "watt"), "kW": _u("千瓦", "kilowatt"),
    "MW": _u("兆瓦", "megawatt"), "kWh": _u("千瓦时", "kilowatt hour"),
    "kcal": _u("千卡", "kilocalorie"), "kJ": _u("千焦", "kilojoule"),
    # frequency, sound, rotation
    "Hz": _u("赫兹", "hertz", "hertz"), "kHz": _u("千赫兹", "kilohertz", "kilohertz"),
    "MHz": _u("兆赫兹", "megahertz", "megahertz"), "GHz": _u("吉赫兹", "gigahertz", "gigahertz"),
    "dB": _u("分贝", "decibel", liang=False), "rpm": _u("转每分钟", "revolution per minute",
                                                      "revolutions per minute"),
    # data
    "KB": _u("KB", "kilobyte"), "MB": _u("MB", "megabyte"), "GB": _u("GB", "gigabyte"),
    "TB": _u("TB", "terabyte"), "Mbps": _u("Mbps", "megabit per second", "megabits per second"),
    "Gbps": _u("Gbps", "gigabit per second", "gigabits per second"),
    # currency codes after a number
    "USD": _u("美元", "US dollar"), "CNY": _u("元", "yuan", "yuan"), "RMB": _u("元", "yuan", "yuan"),
    "EUR": _u("欧元", "euro"), "GBP": _u("英镑", "pound"), "JPY": _u("日元", "yen", "yen"),
    "HKD": _u("港元", "Hong Kong dollar"),
}

_POWER = {"²": 2, "2": 2, "^2": 2, "³": 3, "3": 3, "^3": 3}


def _alt(keys) -> str:
    return "(?:" + "|".join(sorted((re.escape(k) for k in keys), key=len, reverse=True)) + ")"


#: One unit term: a length with an optional power (``m²``, ``m2``, ``m^2``), or any unit.
_TERM = rf"(?:{_alt(k for k, u in UNITS.items() if u.area)}\^?[23²³]|{_alt(UNITS)})"
#: A unit expression: ``km``, ``m²``, ``μg/m³``, ``km/h``.
UNIT_EXPR = rf"(?:{_TERM}(?:/{_TERM})?)"
#: A number with its unit, or a range of two (``-3~5℃``, ``60-80 km/h``, ``30%``).
QUANTITY_RE = re.compile(
    rf"(?:(?<![A-Za-z0-9_.,])|(?<=\dh)|(?<=\dhr)|(?<=\dmin))(?P<a>{NUMBER})(?:\s?(?P<sep>[-~～–—]|to|至|到)\s?(?P<b>{NUMBER}))?"
    rf"\s?(?P<unit>{UNIT_EXPR})(?=$|[^A-Za-z0-9²³_-]|\d+(?:\.\d+)?{UNIT_EXPR}(?![A-Za-z]))")


def _one_unit(text: str) -> tuple[Unit, int]:
    """``m³`` -> (Unit of m, 3)."""
    if text in UNITS:
        return UNITS[text], 1
    for k in sorted(_POWER, key=len, reverse=True):
        if text.endswith(k) and text[: -len(k)] in UNITS:
            return UNITS[text[: -len(k)]], _POWER[k]
    raise AssertionError(f"not a unit: {text!r}")  # UNIT_EXPR only matches rows of UNITS


def _zh_unit(u: Unit, p: int) -> str:
    return {1: "", 2: "平方", 3: "立方"}[p] + u.zh


def _en_unit(u: Unit, p: int, many: bool) -> str:
    return {1: "", 2: "square ", 3: "cubic "}[p] + (u.en_pl if many else u.en)


def read_quantity(m: re.Match, lang: str) -> str:
    """Words for a :data:`QUANTITY_RE` match. Chinese: the numbers are read here; English: the
    unit becomes words and the numbers stay digits for wetext (which reads them in the style
    of the rest of the sentence)."""
    a, b, unit = m.group("a"), m.group("b"), m.group("unit")
    if unit in UNITS:
        num, per = (UNITS[unit], 1), None
    elif "/" in unit:
        x, y = unit.split("/", 1)
        num, per = _one_unit(x), _one_unit(y)
    else:
        num, per = _one_unit(unit), None
    u, p = num
    if lang == "zh":
        def zn(t: str) -> str:
            return zh_number(t, liang=u.liang)
        if u.prefix:
            words = _zh_unit(u, p) + zn(a) + ("到" + _zh_unit(u, p) + zn(b) if b else "")
        else:
            words = zn(a) + ("到" + zn(b) if b else "") + _zh_unit(u, p)
        if per:
            words = "每" + _zh_unit(*per) + words
        return words
    many = (b or a).lstrip("+") not in ("1", "1.0") or bool(b)

    words = en_amount(a) + (" to " + en_amount(b) if b else "") + " " + _en_unit(u, p, many)
    if per:
        words += " per " + _en_unit(*per, False)
    return " " + words + " "


@dataclass(frozen=True)
class Currency:
    """A currency sign: Chinese word (元 for ¥), English singular/plural, English minor unit
    (None: decimals are read "point ..." in English); ``fen``: Chinese reads decimals as 角/分."""

    zh: str
    en: str
    en_pl: str
    minor: tuple[str, str] | None
    fen: bool = False


#: Currency sign -> words. ¥ is read as yuan (the box speaks Chinese); yen is 円 or "JPY".
CURRENCIES: dict[str, Currency] = {
    "¥": Currency("元", "yuan", "yuan", None, fen=True),
    "￥": Currency("元", "yuan", "yuan", None, fen=True),
    "$": Currency("美元", "dollar", "dollars", ("cent", "cents")),
    "€": Currency("欧元", "euro", "euros", ("cent", "cents")),
    "£": Currency("英镑", "pound", "pounds", ("penny", "pence")),
}
_SCALES = {"万": ("万", None), "亿": ("亿", None), "k": (None, "thousand"), "K": (None, "thousand"),
           "m": (None, "million"), "M": (None, "million"), "bn": (None, "billion"), "B": (None, "billion"),
           "million": (None, "million"), "billion": (None, "billion")}
#: A currency sign, the amount, an optional scale and an optional repeated currency word.
MONEY_RE = re.compile(
    r"(?P<sign>[¥￥$€£])\s?(?P<num>\d+(?:,\d{3})*(?:\.\d+)?)"
    r"(?:\s?(?P<scale>万|亿|bn|million|billion|[kKmMB])(?![A-Za-z]))?(?P<word>元|美元|欧元|英镑)?(?![\d.,]\d)")


def read_money(m: re.Match, lang: str) -> str:
    """Words for a :data:`MONEY_RE` match (``￥1,299.50元`` -> 一千二百九十九元五角;
    ``$12.50`` -> 12 dollars and 50 cents, left to wetext for the numbers below 1000;
    ``¥1,299.50`` -> one thousand two hundred ninety nine point five yuan: ¥ has no English minor
    unit, its decimals are read as written without trailing zeros)."""
    cur = CURRENCIES[m.group("sign")]
    if m.group("word") and m.group("word") != cur.zh:   # $5元: not a repetition, keep both
        return read_money(MONEY_RE.match(m.group()[: -len(m.group("word"))]), lang) + m.group("word")
    num, scale = m.group("num").replace(",", ""), m.group("scale")
    ip, _, frac = num.partition(".")
    if lang == "zh":
        if scale and _SCALES[scale][0] is None:   # $5m in a Chinese sentence
            scale_zh = {"thousand": "千", "million": "百万", "billion": "十亿"}[_SCALES[scale][1]]
            return zh_number(num) + scale_zh + cur.zh
        if scale:
            return zh_number(num) + scale + cur.zh
        if cur.fen and frac and len(frac) <= 2:
            jiao, fen = int(frac[0]), int(frac[1]) if len(frac) == 2 else 0
            s = zh_int(int(ip), liang=True) + "元" if int(ip) or not (jiao or fen) else ""
            if jiao:
                s += zh_int(jiao) + "角"
            if fen:
                s += ("零" if s and not jiao else "") + zh_int(fen) + "分"
            return s
        frac = frac.rstrip("0")
        return zh_number(ip + ("." + frac if frac else ""), liang=True) + cur.zh
    if scale:
        word = _SCALES[scale][1] or {"万": "ten thousand", "亿": "hundred million"}[scale]
        return f" {en_amount(m.group('num'))} {word} {cur.en_pl} "
    many = cur.en_pl if num not in ("1", "1.0", "1.00") else cur.en
    whole_num = en_amount(m.group("num").split(".")[0])
    if frac and int(frac) and cur.minor and len(frac) <= 2:
        cents = int(frac) * (10 if len(frac) == 1 else 1)
        whole = cur.en if ip == "1" else cur.en_pl
        small = cur.minor[0] if cents == 1 else cur.minor[1]
        if int(ip) == 0:
            return f" {cents} {small} "
        return f" {whole_num} {whole} and {cents} {small} "
    if frac and int(frac):
        return f" {en_amount(ip + '.' + frac.rstrip('0'))} {cur.en_pl} "
    return f" {whole_num} {many} "


#: Symbols read as words when they stand alone: (Chinese, English).
SYMBOLS: dict[str, tuple[str, str]] = {
    "−": ("减", "minus"), "&": ("和", "and"), "@": ("艾特", "at"), "+": ("加", "plus"), "=": ("等于", "equals"),
    "#": ("井号", "number"), "×": ("乘", "times"), "÷": ("除以", "divided by"),
    "±": ("正负", "plus or minus"), "≈": ("约等于", "approximately"), "≠": ("不等于", "not equal to"),
    "≤": ("小于等于", "less than or equal to"), "≥": ("大于等于", "greater than or equal to"),
    "∞": ("无穷大", "infinity"), "©": ("版权", "copyright"), "®": ("注册商标", "registered"),
    "™": ("商标", "trademark"), "§": ("第节", "section"), "°": ("度", "degrees"),
    "★": ("星", "star"), "☆": ("星", "star"), "✓": ("对", "check"), "✔": ("对", "check"),
    "√": ("根号", "square root of"), "π": ("派", "pi"), "№": ("号", "number"),
    "$": ("美元", "dollars"), "¥": ("元", "yuan"), "￥": ("元", "yuan"), "€": ("欧元", "euros"),
    "£": ("英镑", "pounds"), "%": ("百分号", "percent"), "‰": ("千分号", "per mille"),
    "℃": ("摄氏度", "degrees Celsius"), "℉": ("华氏度", "degrees Fahrenheit"),
    "→": ("向右箭头", "right arrow"), "⟶": ("向右箭头", "right arrow"), "➡": ("向右箭头", "right arrow"),
    "⇒": ("推出", "implies"), "←": ("向左箭头", "left arrow"), "⬅": ("向左箭头", "left arrow"),
    "↑": ("向上箭头", "up arrow"), "⬆": ("向上箭头", "up arrow"), "↓": ("向下箭头", "down arrow"),
    "⬇": ("向下箭头", "down arrow"), "↔": ("双向箭头", "left right arrow"),
}
#: Right arrows between two words are read as a connection (北京→上海: 北京到上海).
RIGHT_ARROWS = "→⟶➡"
_SYMBOL_NOUN_RE = re.compile(r"(?:箭头|符号|图标|标志|标记|按键|键|arrow|symbol|sign|icon|key|button)[\s\"'“”‘’「」]*$",
                             re.IGNORECASE)


def read_symbols(s: str, lang: str) -> str:
    """Replace every :data:`SYMBOLS` character in ``s`` by its word (English words spaced).
    A right arrow between two words reads 到 / "to", unless the text names the symbol
    (``箭头→表示方向``: 箭头向右箭头表示方向)."""
    out: list[str] = []
    for i, c in enumerate(s):
        if c not in SYMBOLS:
            out.append(c)
            continue
        if c in RIGHT_ARROWS:
            before, after = s[:i].rstrip(), s[i + 1:].lstrip()
            if before and after and before[-1].isalnum() and after[0].isalnum() \
                    and not _SYMBOL_NOUN_RE.search(s[:i]):
                out.append("到" if lang == "zh" else " to ")
                continue
        w = SYMBOLS[c][0 if lang == "zh" else 1]
        out.append(w if lang == "zh" else f" {w} ")
    return "".join(out)
