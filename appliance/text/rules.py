"""Our own text rules, in one table: where we do not take ``wetext``'s (or upstream's) reading,
and why.

``wetext`` (PyPI, Apache-2.0; the pynini-free runtime of WeTextProcessing, the normalizer
upstream ChatTTS recommends) reads most Chinese and English dates, times, cardinals, fractions,
percentages and measure words right (2024年3月5日, 10:45 -> ten forty five, 2个 -> 两个,
1/3 -> 三分之一) and is kept for those. Every row of :data:`RULES` is a case it (or the
upstream normalizer) gets wrong, with the reason and an example of what the box says instead;
``tests/test_text_rules.py`` speaks every example. Rows with ``stage == "before_wetext"`` are
applied here (:func:`apply_rules`), in table order, to each span of one language; the other
stages name the module that implements them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

from . import dates
from .ranges import read_ranges
from .numbers import (
    en_digits,
    en_int,
    en_number,
    en_ordinal,
    read_number,
    zh_digits,
    zh_int,
    zh_number,
)
from .units import MONEY_RE, QUANTITY_RE, read_money, read_quantity


@dataclass(frozen=True)
class Rule:
    """One of our rules.

    Attributes:
        name: short id. langs: ``"zh"``, ``"en"`` or ``"zh en"``.
        stage: ``script`` (whole text, :mod:`.scripts`), ``before_spans`` (whole text, here),
            ``spans`` (:mod:`.spans`), ``before_wetext`` (each span, here), ``after_wetext`` /
            ``filter`` (:mod:`.normalize`).
        reason: what wetext or upstream does, and why we differ.
        example: ``(input, spoken)``, checked by the test suite.
        apply: ``(text, lang) -> text`` for ``before_wetext`` rows.
    """

    name: str
    langs: str
    stage: str
    reason: str
    example: tuple[str, str]
    apply: Optional[Callable[[str, str], str]] = None


def _sub(rx: re.Pattern, fn: Callable[[re.Match, str], str]) -> Callable[[str, str], str]:
    return lambda s, lang: rx.sub(lambda m: fn(m, lang), s)


# -- patterns and readings ---------------------------------------------------------------------

#: phone numbers: never a part of a decimal or a separated number (13000000000.5 is an amount)
_ZH_PHONE_RES = (
    re.compile(r"(?<![\d.,])(?:\+?86[\s-]?)?1[3-9]\d[\s-]?\d{4}[\s-]?\d{4}(?!\d|[.,]\d)"),
    re.compile(r"(?<![\d.,])0\d{2,3}-\d{7,8}(?!\d|[.,]\d)"),
    re.compile(r"(?<![\d.,])[48]00[\s-]?\d{3}[\s-]?\d{4}(?!\d|[.,]\d)"),
    re.compile(r"(?<![A-Za-z0-9+])\+\d{1,3}(?:[\s-]?\d{2,4}){2,5}(?!\d|[.,]\d)"),
)
_EN_PHONE_RES = (
    re.compile(r"(?<!\w)(?:\+\d{1,3}[\s.-]?)?\(?\d{3}\)?[\s.-]\d{3}[\s.-]\d{4}(?!\w|[.,]\d)"),
    re.compile(r"(?<![\w.,])\d{3}-\d{4}(?!\w|[.,]\d)"),
)
_EN_CALL_RE = re.compile(r"\b((?:call|dial|phone|tel|fax|ring|text)\b\s*:?\s*)(\+?\d[\d\s-]*\d|\d)(?![\d.,]\d)",
                         re.IGNORECASE)
#: after "number": a phone-like number (5 digits or more, or with + or -) is read digit by digit,
#: a short one as a number (number 10 is ten)
_EN_NUMBER_RE = re.compile(r"\b(number\s*:?\s*)(\+?\d[\d\s-]*\d)(?![\d.,]\d)", re.IGNORECASE)
_VERSION_RE = re.compile(r"(?<![\d.])(?:(?<![A-Za-z])[vV])?\d+(?:\.\d+){2,}(?![\d.]*\d)|(?<![A-Za-z])[vV]\d+\.\d+(?![\d.]*\d)")
_PCT_RANGE_RE = re.compile(r"(\d+(?:\.\d+)?)\s?%\s?[-~～]\s?(?=\d+(?:\.\d+)?\s?%)")
_ZH_ORDINAL_RE = re.compile(r"第\s?(\d+)(?![\d.])")
_ROOMS = ("室", "房", "会议室", "教室", "病房", "房间", "号房")
_ZH_LABEL_RE = re.compile(r"(?<![\d.,])(\d+)(?=号楼|栋|幢|单元|楼|层|号线|路|号|室|房|会议室|教室|病房|座|区|期|排|站台|"
                          r"车厢|门|出口|入口|车道)")
_EN_EQUALS_RE = re.compile(r"(?<=[A-Za-z0-9)])\s?=\s?(?=[A-Za-z0-9(+-])")
#: an e-mail address, or a web address with its scheme or ``www.`` (host, port, then an ASCII path,
#: query or fragment that does not end in punctuation: ``(see https://x.com/a).`` ends at ``a``)
WEB_RE = re.compile(r"(?P<mail>(?:https?://)?[\w.+-]+@[\w-]+(?:\.[\w-]+)+)"
                     r"|(?:(?:https?|ftps?|wss?|rtsp|mqtts?)://|(?=www\.))(?P<host>[\w-]+(?:\.[\w-]+)*)(?::\d+)?"
                     r"(?:[/?#][!-~]*[\w/#=&%~+-])?", re.ASCII | re.IGNORECASE)
_SERVICE_RE = re.compile(r"(?<![\d.,])(11[0249]|12[02]|1[02]\d{3})(?![\d.,])")
_DIAL_RE = re.compile(r"(?:拨打|拨|打|电话|热线|号码|呼叫|报警|急救|求助|求救|致电)[^\d，。！？]{0,3}$")
_DIGIT_CODE_RE = re.compile(r"((?:码|号码|编号|单号|尾号|账号|卡号|工号|密码)(?:是|为|：|:)?\s?)(\d{3,})(?![\d.,])")
#: Letters and digits mixed in one token (a code, or a number with a suffix); not ``1.8bar``'s 8bar.
CODE_RE = re.compile(r"(?<![A-Za-z0-9])(?<!\d\.)(?=[A-Za-z0-9]*[A-Za-z])(?=[A-Za-z0-9]*\d)[A-Za-z0-9]+(?:\.\d+)?"
                     r"(?![A-Za-z0-9])")
_EN_NOT_CODE_RE = re.compile(r"\d+(?:st|nd|rd|th|s|am|pm|AM|PM)|[a-z0-9.]+")
_RANGE_RE = re.compile(r"(?<![\d.,:-])(\d+(?:\.\d+)?)\s?[-~～–—]\s?(?=\d+(?:\.\d+)?(?![\d.,:]|-\d|\s?=))")
_TIMES_RE = re.compile(r"(?<=\d)\s?[xX×*]\s?(?=\d)")
_POWER_RE = re.compile(r"(\d+(?:\.\d+)?)\^(\d+)")
#: No. 5, no.5, NO.5, #5 (not C#5, &#5 or ##)
_NO_RE = re.compile(r"(?:\b[Nn][Oo]\.|(?<![A-Za-z0-9_#&])#)\s?(\d+)(?![\d,]\d|\.\d)")
_ZH_DECIMAL_RE = re.compile(r"(?<![\d.])[-−]?\d+\.\d+(?![\d.])")
_THOUSANDS_RE = re.compile(r"(?<![\d,])\d{1,3}(?:,\d{3})+(?![\d,])")
#: 1,234 / 1,234.5 / 1000 / 1234.5 / 1,000th / 1000th (not 1234 alone: wetext reads it as a year would be)
_EN_THOUSANDS_RE = re.compile(r"(?<![\d,.])(\d{1,3}(?:,\d{3})+|[1-9]000|\d{4,}(?=\.\d|st|nd|rd|th))"
                              r"(?:\.(\d+)|(st|nd|rd|th)\b)?(?![\d,])")
#: a minus sign: not after a letter, digit or closing mark (5-10, GPT-4, 30%-40% are not)
_MINUS_RE = re.compile(r"(?<![A-Za-z0-9_.,)\]%‰°℃℉])[-−](?=\d)")
#: what ends a Chinese quantity before a dash: 2024年-2025年, 10点-12点, 5元-10元 are ranges
_ZH_RANGE_END_RE = re.compile(r"\d[^\d\s，。、,.;；:：!！?？()（）]{1,3}\s*$")
#: 1e5, 6.02E23, 2.5e-3 (not a code such as 0x1e5 or 1e5a; 2E3 neither, see _scientific)
SCIENTIFIC_RE = re.compile(r"(?<![A-Za-z0-9_.])(\d+(?:\.\d+)?)[eE]([-+−]?)(\d{1,3})(?![A-Za-z0-9_]|\.\d)")
_EN_DECADE_RE = re.compile(r"(?<![\d,.])(1\d|20)?(\d)0s\b")
_DECADES = "hundreds tens twenties thirties forties fifties sixties seventies eighties nineties".split()
_MODEL_RE = re.compile(r"(?<![A-Za-z])([a-z]+[A-Z][A-Za-z]*|[A-Z]{2,}) (\d{1,2}[mshtgl])(?![A-Za-z0-9])")


def _outside_web(s: str, fn: Callable[[str], str]) -> str:
    """``fn`` applied to the parts of ``s`` outside web and e-mail addresses (read whole later)."""
    parts, last = [], 0
    for m in WEB_RE.finditer(s):
        parts += [fn(s[last:m.start()]), m.group()]
        last = m.end()
    return "".join(parts) + fn(s[last:])


def _spell_en(text: str) -> str:
    groups = [g for g in re.split(r"[^\d]+", text) if g]
    return (" plus " if text.lstrip().startswith("+") else " ") + ", ".join(en_digits(g) for g in groups) + " "


def _phones(s: str, lang: str) -> str:
    if lang == "zh":
        for r in _ZH_PHONE_RES:
            s = r.sub(lambda m: ("加" if m.group().startswith("+") else "") + zh_digits(m.group(), yao=True), s)
        return s
    s = _EN_CALL_RE.sub(lambda m: m.group(1) + _spell_en(m.group(2)), s)
    s = _EN_NUMBER_RE.sub(lambda m: m.group(1) + (_spell_en(m.group(2)) if len(re.sub(r"\D", "", m.group(2))) >= 5
                                                  or re.search(r"[+-]", m.group(2)) else m.group(2)), s)
    for r in _EN_PHONE_RES:
        s = r.sub(lambda m: _spell_en(m.group()), s)
    return s


def _service(m: re.Match, lang: str) -> str:
    if _DIAL_RE.search(m.string[: m.start()]):
        return zh_digits(m.group(), yao=True)
    return zh_int(int(m.group()))


def _web(m: re.Match, lang: str) -> str:
    words = {".": " dot ", "@": " at ", "/": " slash ", ":": " ", "-": " dash ", "_": " underscore "}
    if lang == "zh":
        words = {".": "点", "@": "艾特", "/": "斜杠", ":": " ", "-": "杠", "_": "下划线"}
    s = m.group("mail")
    if s is None:           # a web address: its host only, without www. (example dot com)
        s = re.sub(r"(?i)^www\.", "", m.group("host"))
        words = {**words, "-": " "}
        host = "".join(words.get(c, c) for c in s)
        if re.search(r"[/?#][^/?#]", m.group()[m.end("host") - m.start():]):   # a path or query: a link
            return f"一个{host}的链接" if lang == "zh" else f" a link on {host} "
        return " " + host + " "
    return " " + "".join(words.get(c, c) for c in s) + " "


def _version(m: re.Match, lang: str) -> str:
    parts = re.findall(r"\d+", m.group())
    v = m.group()[0] if m.group()[0] in "vV" else ""      # v2.1.3 keeps its v
    if lang == "zh":
        return v + "点".join(zh_int(int(p)) for p in parts)
    return f" {v} " + " point ".join(en_int(int(p)) for p in parts) + " "


def _quantity(m: re.Match, lang: str) -> str:
    if lang == "en" and m.group("a")[:1] in "-−":
        return " minus " + read_quantity(re.match(QUANTITY_RE.pattern, m.group()[1:]), lang)
    return read_quantity(m, lang)


def _zh_label(m: re.Match, lang: str) -> str:
    n, after = m.group(1), m.string[m.end():]
    if after.startswith(_ROOMS) and len(n) >= 3 or (len(n) > 1 and n.startswith("0")):
        return zh_digits(n)
    return zh_int(int(n))


def _code(m: re.Match, lang: str) -> str:
    tok = m.group()
    if lang == "en" and _EN_NOT_CODE_RE.fullmatch(tok):
        return tok     # 1st, 1990s, 3pm, mp3: wetext reads these right
    parts = re.findall(r"[A-Za-z]+|\d+(?:\.\d+)?", tok)
    nums = [p for p in parts if p[0].isdigit()]
    one_by_one = len(nums) > 1 or any(len(p.split(".")[0]) > 2 for p in nums)
    out = []
    for p in parts:
        if not p[0].isdigit():
            out.append(p)
        elif one_by_one and "." not in p:
            out.append(zh_digits(p) if lang == "zh" else en_digits(p))
        else:
            out.append(read_number(p, lang))
    return "".join(out) if lang == "zh" else " " + " ".join(out) + " "


def _decade(m: re.Match, lang: str) -> str:
    if m.group(1) == "20" and m.group(2) == "0":
        return "two thousands"
    return ((en_int(int(m.group(1))) + " ") if m.group(1) else "") + _DECADES[int(m.group(2))]


def _en_thousands(m: re.Match, lang: str) -> str:
    n = int(m.group(1).replace(",", ""))
    if m.group(3):
        return " " + en_ordinal(n) + " "
    return " " + en_int(n) + (" point " + en_digits(m.group(2)) if m.group(2) else "") + " "


def _scientific(m: re.Match, lang: str) -> str:
    if "E" in m.group() and "." not in m.group(1) and not m.group(2):
        return m.group()   # 2E3 is more often a seat or flat than 2000: left to the code rule
    neg = m.group(2) in ("-", "−")
    if lang == "zh":
        return zh_number(m.group(1)) + "乘以十的" + ("负" if neg else "") + zh_int(int(m.group(3))) + "次方"
    return (f" {en_number(m.group(1))} times ten to the power of {'minus ' if neg else ''}"
            f"{en_int(int(m.group(3)))} ")


def _minus(s: str, lang: str) -> str:
    if lang == "en":
        return _MINUS_RE.sub(" minus ", s)
    return _MINUS_RE.sub(lambda m: "到" if _ZH_RANGE_END_RE.search(s, 0, m.start()) else "负", s)


def _power(m: re.Match, lang: str) -> str:
    if lang == "zh":
        return zh_number(m.group(1)) + "的" + zh_number(m.group(2)) + "次方"
    return f" {m.group(1)} to the power of {m.group(2)} "


# -- the table ---------------------------------------------------------------------------------

RULES: tuple[Rule, ...] = (
    Rule("traditional", "zh", "script", "ChatTTS learned Mandarin from simplified text; OpenCC t2s "
         "converts traditional characters first", ("臺灣的電話號碼", "台湾的电话号码")),
    Rule("latin-letters", "zh en", "script", "accented and special Latin letters were reported unspeakable "
         "(ß) or folded without the language's rule; now spelled in ASCII, umlauts as ae/oe/ue in "
         "German-looking text", ("Straße und Müller", "Strasse und Mueller")),
    Rule("superscript-power", "zh en", "script", "NFKC turns 10² into 102 (a different number)",
         ("10²", "ten to the power of two")),
    Rule("language-per-clause", "zh en", "spans", "upstream and wetext pick one language for the whole "
         "request; a number is read in the language of its own clause",
         ("Meeting starts at 10:45. 请准时参加。", "Meeting starts at ten forty five. 请准时参加。")),
    Rule("punctuation-by-clause", "zh en", "spans", "upstream makes every comma full-width in Chinese "
         "requests; a mark keeps the script of the clause it ends", ("Hello, 你好吗", "Hello, 你好吗")),
    Rule("hyphen-letters-digits", "zh en", "before_spans", "wetext reads GPT-4 as GPT negative four",
         ("GPT-4很强", "GPT 四很强"),
         lambda s, lang: _outside_web(s, lambda x: re.sub(r"(?<=[A-Za-z])(?<!\d[eE])(?<!\d[AaPp][Mm])-(?=\d)", " ", x))),
    Rule("model-name", "zh en", "before_spans", "a one-letter unit glued to a number after a product name "
         "is part of the name (iPhone 5s is not five seconds): the name and number become one code",
         ("iPhone 5s很好", "iPhone五s很好"), lambda s, lang: _MODEL_RE.sub(r"\1\2", s)),
    Rule("thousands-zh", "zh", "before_wetext", "wetext zh reads 1,000 as 一,零零零; the separator goes "
         "before any other rule reads digits (the decimal rule once read 1,299.50 as 一，二百九十九点五零)",
         ("金额1,299.50元", "金额一千二百九十九点五零元"),
         lambda s, lang: _THOUSANDS_RE.sub(lambda m: m.group().replace(",", ""), s)),
    Rule("dotted-date", "zh", "before_wetext", "wetext does not know 2024.3.5 as a date",
         ("会议在2024.3.5举行", "会议在二零二四年三月五日举行"), dates.dotted_date),
    Rule("zero-padded-date", "zh", "before_wetext", "wetext reads 2024年03月 as 零三月",
         ("2024年03月05日", "二零二四年三月五日"), dates.padded_date),
    Rule("month-day", "zh", "before_wetext", "wetext reads 12月2日 as 十二月两日: a day of the month names "
         "a day and is read with 二, as months (二月) and 二号 are; see dates.py for the 二/两 convention",
         ("12月2日至5日", "十二月二日至五日"), dates.month_day),
    Rule("web-address", "zh en", "before_wetext", "wetext and upstream keep the dots of an address, read as "
         "sentence ends, and a whole URL spelled out is noise; a web address is read short, its host "
         "without www. or port, with dot (点), and one with a path or query as a link on it (一个...的链接); an "
         "e-mail address whole, with at (艾特)",
         ("see https://www.home-assistant.io/integrations/wyoming/", "see a link on home assistant dot io"),
         _sub(WEB_RE, _web)),
    Rule("version", "zh en", "before_wetext", "wetext reads 3.11.2 as a date or a decimal and drops the v of "
         "v2.1.3; a version keeps its v", ("version 3.11.2, v2.1", "version three point eleven point two, v two "
                                           "point one"), _sub(_VERSION_RE, _version)),
    Rule("range-words", "zh en", "before_wetext", "wetext and upstream read a range's dash or tilde as a pause "
         "(12点~13点半 -> 十二点 十三点半, 2:30–4 pm -> two thirty, four PM); between numbers, times, amounts, "
         "weekdays and months it is the language's to (到)",
         ("12点~13点半，2:30–4 pm", "十二点到十三点半，two thirty to four PM"),
         read_ranges),
    Rule("number-sign", "zh en", "before_wetext", "wetext reads No.5 as No.five and #5 as hash five (井号五); "
         "both are number five (五号); after the word number (No., #) a number of up to four digits is a "
         "number (number 10 was read as a phone number, one zero), a longer one is read digit by digit",
         ("No.10 and #3", "number ten and number three"),
         _sub(_NO_RE, lambda m, lang: f"number {m.group(1)}" if lang == "en"
              else m.group(1) + ("" if m.string.startswith("号", m.end()) else "号"))),
    Rule("phone", "zh en", "before_wetext", "wetext reads 555-1234 as a range, 911 as nine hundred eleven "
         "and raises on +1 555 123 4567; phone numbers are read digit by digit (zh: 1 as 幺)",
         ("我的电话是13812345678", "我的电话是幺三八幺二三四五六七八"), _phones),
    Rule("scientific", "zh en", "before_wetext", "wetext reads 1e5 as one e five; E notation is read as a "
         "power of ten, like ^: one times ten to the power of five (一乘以十的五次方); a capital E between "
         "two plain integers (2E3) is a code",
         ("1e5", "one times ten to the power of five"), _sub(SCIENTIFIC_RE, _scientific)),
    Rule("money", "zh en", "before_wetext", "wetext loses the magnitude after a currency sign with "
         "thousands separators (￥2,500 -> 二元五百), reads $12.50 as twelve point five dollars and 12.5美元 "
         "as a date; zh ¥ decimals are 角/分, a repeated 元 is said once",
         ("金额￥1,299.50元", "金额一千二百九十九元五角"), _sub(MONEY_RE, read_money)),
    Rule("percent-range", "zh en", "before_wetext", "wetext reads 30%-40% as thirty forty percent",
         ("growth of 30%-40%", "growth of thirty to forty percent"),
         lambda s, lang: _PCT_RANGE_RE.sub(r"\1到" if lang == "zh" else r"\1 to ", s)),
    Rule("minus-sign", "zh en", "before_wetext", "wetext reads -3 as negative three but -3.5 as minus three "
         "point five, and our unit reader says minus (-3℃); a minus sign before a number is minus (负) "
         "everywhere, and no later rule can take a number from behind its sign (-10000 was 一万); in "
         "Chinese a dash after a number and its unit is a range (2024年-2025年, 10点-12点: 到)",
         ("It is -3 degrees.", "It is minus three degrees."), _minus),
    Rule("power", "zh en", "before_wetext", "wetext reads ^ as circumflex", ("10^3", "ten to the power of three"),
         _sub(_POWER_RE, _power)),
    Rule("decade", "en", "before_wetext", "wetext reads 1990s as one thousand nine hundred and ninety seconds",
         ("in the 1990s", "in the nineteen nineties"), _sub(_EN_DECADE_RE, _decade)),
    Rule("units", "zh en", "before_wetext", "wetext misses μg, mL, ‰, hPa, V, W, dB, Hz, quotients with "
         "powers (μg/m³ -> g slash m three), reads 100m and m/s as minutes and 1.5L as one.five L; every unit "
         "of units.UNITS is read by us (Chinese numbers here, English numbers by wetext)",
         ("今天空气中PM2.5为35μg/m³。", "今天空气中PM二点五为每立方米三十五微克。"), _sub(QUANTITY_RE, _quantity)),
    Rule("clock", "zh", "before_wetext", "wetext reads 0:30 as a score (零比三十); 2 o'clock is 两点",
         ("0:30出发", "零点三十分出发"), dates.clock),
    Rule("service-number", "zh", "before_wetext", "wetext reads 110, 119, 120, 12315 ... digit by digit "
         "everywhere (限速120 -> 限速幺二零); only after 拨打/电话/热线/报警 ... are they a number to dial",
         ("限速120，急救请拨打120", "限速一百二十，急救请拨打幺二零"), _sub(_SERVICE_RE, _service)),
    Rule("digit-code", "zh", "before_wetext", "wetext reads pickup and verification codes as amounts "
         "(取件码8527 -> 八千五百二十七); after 码/编号/尾号 ... digits are read one by one",
         ("您的取件码是8527", "您的取件码是八五二七"),
         _sub(_DIGIT_CODE_RE, lambda m, lang: m.group(1) + zh_digits(m.group(2), yao=True))),
    Rule("am-pm", "zh", "before_wetext", "wetext leaves 3pm in a Chinese sentence as 三pm", ("请在3pm之前到达",
         "请在下午三点之前到达"), dates.am_pm),
    Rule("equals", "en", "before_wetext", "wetext reads x=3 as x equal sign three", ("x=3", "x equals three"),
         lambda s, lang: _EN_EQUALS_RE.sub(" equals ", s)),
    Rule("ordinal", "zh", "before_wetext", "wetext reads 第2名 as 第两名", ("第2名", "第二名"),
         _sub(_ZH_ORDINAL_RE, lambda m, lang: "第" + zh_int(int(m.group(1))))),
    Rule("clock-words", "zh", "before_wetext", "wetext reads 2点半 as 二点半 and 2点2分 as 二点两分: the hour "
         "2 is 两, minutes and seconds are read with 二", ("2点2分", "两点二分"), dates.clock_words),
    Rule("two-or-liang", "zh", "before_wetext", "wetext reads 2次, 2年, 2倍 as 二次, 二年, 二倍 and 2季度 as "
         "两季度: a bare 2 that counts, before a measure word, is 两; one that names a quarter or century is 二",
         ("试了2次，用了2年，2季度", "试了两次，用了两年，二季度"), dates.two_or_liang),
    Rule("range", "zh en", "before_wetext", "wetext reads 5-10 as 五减十 and 5~10 as five tilde ten",
         ("5-10人", "五到十人"),
         lambda s, lang: _RANGE_RE.sub(r"\1到" if lang == "zh" else r"\1 to ", s)),
    Rule("address", "zh", "before_wetext", "wetext reads room numbers as amounts (五百零一室) and unit "
         "numbers with 两 (两单元); rooms are digit by digit, labels plain",
         ("3号楼2单元501室", "三号楼二单元五零一室"), _sub(_ZH_LABEL_RE, _zh_label)),
    Rule("times-sign", "zh", "before_wetext", "wetext reads 3x4 as 三x四", ("尺寸3x4", "尺寸三乘四"),
         lambda s, lang: _TIMES_RE.sub("乘", s)),
    Rule("code", "zh en", "before_wetext", "letters mixed with digits are codes: wetext reads A12B34 as "
         "A twelve B thirty four, also inside Chinese; read in the sentence's language, digits one by one "
         "when there are several groups or more than two digits", ("订单号A12B34", "订单号A一二B三四"),
         _sub(CODE_RE, _code)),
    Rule("decimal", "zh", "before_wetext", "wetext reads 12.5 as a date (十二月五日) unless a unit follows",
         ("涨了12.5", "涨了十二点五"), _sub(_ZH_DECIMAL_RE, lambda m, lang: zh_number(m.group()))),
    Rule("thousands", "en", "before_wetext", "wetext en drops the 'one' of 1,234 and 1299.5 and reads 1000 "
         "as ten hundred; our thousands reader made 1,000th one thousand th: ordinals are read as ordinals",
         ("The 1,000th visitor", "The one thousandth visitor"),
         _sub(_EN_THOUSANDS_RE, _en_thousands)),
    Rule("digits-left", "zh en", "after_wetext", "any digit wetext leaves (or a span where it raises) is "
         "read by numbers.verbalize_numbers, so no digit is dropped", ("+5", "plus five")),
    Rule("symbols", "zh en", "after_wetext", "upstream deletes symbols; units.SYMBOLS reads them, a right "
         "arrow between words as 到/to", ("箭头→表示方向", "箭头向右箭头表示方向")),
    Rule("apostrophe", "en", "filter", "upstream drops the apostrophe (don't -> dont, it's -> its); the "
         "tokenizer knows ' (bert-base-chinese, which the checkpoint's vocabulary extends, has it), so it is "
         "kept inside a word and after the s of a plural possessive; ’ becomes '; a tokenizer without it "
         "reports it unspeakable",
         ("I don’t know, it's John's car.", "I don't know, it's John's car.")),
)


def apply_rules(text: str, lang: str, stage: str = "before_wetext") -> str:
    """Apply the rows of :data:`RULES` of ``stage`` (``before_spans``: the whole text, any
    language; ``before_wetext``: one span of language ``lang``), in table order."""
    for r in RULES:
        if r.apply is not None and r.stage == stage and (stage == "before_spans" or lang in r.langs.split()):
            text = r.apply(text, lang)
    return text
