"""Text normalization that loses no words: numbers, dates, times, units and currencies become
speakable words (Chinese in Chinese context, English in English context); control tokens pass
through; everything that cannot be spoken is reported, not silently dropped.

Why wetext, plus our own rules: PyPI ``wetext`` (Apache-2.0) is the pynini-free runtime of
WeTextProcessing, the zh normalizer upstream ChatTTS recommends; it ships compiled FSTs for zh
and en TN in the wheel (works offline, ~45 MB installed, ~1 ms + ~0.25 ms per character per
call on the 2-core dev box, ~50-110 MB RSS with both languages loaded) and needs only
``kaldifst`` (wheels for x86-64 and aarch64, cp310/cp311). Judged on the cases of issue 2 it
gets zh dates, times, negatives, decimals, percentages, units (°C, km/h, kg), ``打99折`` and
``拨打110`` (幺幺零) right, and en cardinals, decimals, units, money, dates. What it gets wrong,
and what we do before it:

* en phone-like digit strings (``555-1234`` becomes a range "to", ``call 911`` "nine hundred
  and eleven", ``+1 555 123 4567`` raises AssertionError): spelled digit by digit here;
* en money with cents (``$12.50`` -> "twelve point five dollars"): "12 dollars and 50 cents";
* en ``m/s`` read as "minutes per second": rewritten to "meters per second";
* en ``1,234`` read as "thousand two hundred ..." (the "one" is LOST), ``1000`` as "ten
  hundred", ``1990s`` as "... ninety seconds": numbers with thousands separators, round
  thousands and decades are read by our own rules; ``100m`` ("minutes") is meters, ``$5m``
  five million dollars, ``30%-40%`` a range;
* zh dotted dates (``2024.3.5``) become ``2024年3月5日`` first;
* zh zero-padded dates (``2024年03月05日`` -> "零三月"): zeros stripped; zh thousands
  separators outside a unit (``一共1,000`` -> "一,零零零"): commas removed; zh mobile/landline
  numbers with spaces or dashes: spelled digit by digit;
* a hyphen between letters and digits (``GPT-4`` -> "GPT负四"): read as a space.

Anything with digits that wetext leaves (or any span where it raises) goes through our own
small verbalizer (cardinals, decimals, percent, sign), so no digit ever reaches the tokenizer
or is deleted. If ``wetext`` is not installed, that verbalizer alone runs (and a warning says
that dates/units are then read as plain numbers).

Language is decided per span: letters decide (CJK -> zh, Latin -> en); runs of digits,
punctuation and symbols (numbers with their units) take the language of their neighbours, or
the text's dominant language when the neighbours disagree (dominance as upstream
``norm.py``: CJK characters vs English words). Punctuation then follows upstream ``norm.py``:
in zh spans half-width punctuation becomes full-width, then ``：；！（）《》…`` are simplified to
``，``/``。`` and only ``，。、,.`` are kept; we additionally keep question marks as sentence ends
(``？``->``。``, ``?``->``.``; upstream deletes them) and turn line breaks into sentence ends.
Homophone replacement (upstream ``homophones_map.json``) is not done.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from dataclasses import dataclass
from typing import Optional

from ..errors import TextError
from .tokens import CONTROL_TOKENS, USER_CONTROL_TOKENS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NormalizedText:
    """Result of :class:`Normalizer`.

    Attributes:
        text: speakable text: CJK, Latin letters, ``，。、,.`` , spaces and control tokens.
        unspeakable: what was removed because it cannot be spoken (characters such as emoji,
            symbols, other scripts, characters the tokenizer maps to ``[UNK]``, and structural
            control tokens such as ``[Stts]``), each once, in order of appearance.
        lang: dominant language of the input, ``"zh"`` or ``"en"``.
    """

    text: str
    unspeakable: tuple[str, ...]
    lang: str


# ------------------------------------------------------------------------------------------
# character classes
# ------------------------------------------------------------------------------------------

_CTRL_RE = re.compile("(" + "|".join(re.escape(t) for t in sorted(CONTROL_TOKENS, key=len, reverse=True)) + ")")
_CJK_RE = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]")
_EN_WORD_RE = re.compile(r"\b[A-Za-z]+\b")
# full-width punctuation kept as-is by the NFKC pass (it would turn them half-width)
_KEEP_FULL = set("，。！？：；（）、“”‘’《》【】「」『』…—～·")


def _is_cjk(c: str) -> bool:
    return "\u4e00" <= c <= "\u9fff" or "\u3400" <= c <= "\u4dbf"


def _is_latin(c: str) -> bool:
    return ("a" <= c <= "z") or ("A" <= c <= "Z")


def _pre_nfkc(text: str) -> str:
    """NFKC per character (full-width digits/letters, ℃, ㎞, ½ ...), keeping CJK punctuation;
    Latin letters with accents lose them (the BERT vocabulary strips accents too)."""
    out = []
    for c in text:
        if c in _KEEP_FULL or c.isascii():
            out.append(c)
            continue
        n = unicodedata.normalize("NFKC", c).replace("\u2044", "/")
        if len(n) == 1 and not n.isascii() and unicodedata.category(n).startswith("L") and not _is_cjk(n):
            base = "".join(ch for ch in unicodedata.normalize("NFKD", n) if not unicodedata.combining(ch))
            if base.isascii() and base.isalpha():
                n = base
        out.append(n)
    return "".join(out)


# ------------------------------------------------------------------------------------------
# our own verbalizer (fallback, and pieces the rules need)
# ------------------------------------------------------------------------------------------

_ZH_DIGITS = "零一二三四五六七八九"
_EN_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
            "fifteen sixteen seventeen eighteen nineteen").split()
_EN_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def zh_digits(s: str, yao: bool = False) -> str:
    """Digit by digit in Chinese (``110`` -> 一一零, or 幺幺零 with ``yao``)."""
    d = _ZH_DIGITS.replace("一", "幺") if yao else _ZH_DIGITS
    return "".join(d[int(c)] for c in s if c.isdigit())


def en_digits(s: str) -> str:
    """Digit by digit in English (``110`` -> "one one zero")."""
    return " ".join(_EN_ONES[int(c)] for c in s if c.isdigit())


def zh_int(n: int) -> str:
    """Chinese cardinal of ``0 <= n < 10**16`` (larger: digit by digit)."""
    if n == 0:
        return "零"
    if n >= 10 ** 16:
        return zh_digits(str(n))
    units, big = ("", "十", "百", "千"), ("", "万", "亿", "万亿")
    groups = []
    while n:
        groups.append(n % 10000)
        n //= 10000
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
    return r[1:] if r.startswith("一十") else r


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


_NUM_RE = re.compile(r"(?<![A-Za-z0-9_.])([-−+]?)(\d+(?:,\d{3})*|\d+)(?:\.(\d+))?(\s?%)?")


def verbalize_numbers(text: str, lang: str) -> str:
    """Our own plain reading of every number left in ``text`` (sign, decimals, percent).
    Digits that are not part of a number pattern are read one by one."""

    def one(m: re.Match) -> str:
        sign, ip, frac, pct = m.group(1), m.group(2).replace(",", ""), m.group(3), m.group(4)
        long_run = len(ip) > 1 and ip.startswith("0")
        if lang == "zh":
            s = zh_digits(ip) if long_run else zh_int(int(ip))
            if frac:
                s += "点" + zh_digits(frac)
            if pct:
                s = "百分之" + s
            if sign in "-−" and sign:
                s = "负" + s
            elif sign == "+":
                s = "正" + s
            return s
        s = en_digits(ip) if long_run else en_int(int(ip))
        if frac:
            s += " point " + en_digits(frac)
        if pct:
            s += " percent"
        if sign in "-−" and sign:
            s = "minus " + s
        elif sign == "+":
            s = "plus " + s
        return " " + s + " "

    text = _NUM_RE.sub(one, text)
    if lang == "zh":
        return re.sub(r"\d+", lambda m: zh_digits(m.group()), text)
    return re.sub(r"\d+", lambda m: " " + en_digits(m.group()) + " ", text)


# ------------------------------------------------------------------------------------------
# rules applied before wetext (what it gets wrong)
# ------------------------------------------------------------------------------------------

_EN_PHONE_RES = (
    re.compile(r"(?<!\w)(?:\+\d{1,3}[\s.-]?)?\(?\d{3}\)?[\s.-]\d{3}[\s.-]\d{4}(?!\w)"),
    re.compile(r"(?<![\w.,])\d{3}-\d{4}(?!\w)"),
)
_EN_CALL_RE = re.compile(r"\b((?:call|dial|phone|tel|fax|ring|text|number)\b\s*:?\s*)(\+?\d[\d\s-]*\d|\d)(?![\d.,]\d)",
                         re.IGNORECASE)
_EN_MONEY_RE = re.compile(r"([$€£])\s?(\d[\d,]*)(?:\.(\d{1,2}))?(?:\s?(k|K|m|M|bn|B)\b)?(?!\d|\.\d)")
_SCALE = {"k": "thousand", "K": "thousand", "m": "million", "M": "million", "bn": "billion", "B": "billion"}
# wetext reads "1990s" as "... ninety seconds"
_EN_DECADE_RE = re.compile(r"(?<![\d,.])(1\d|20)?(\d)0s\b")
_DECADES = "hundreds tens twenties thirties forties fifties sixties seventies eighties nineties".split()
_MONEY_WORDS = {"$": ("dollar", "dollars", "cents"), "€": ("euro", "euros", "cents"), "£": ("pound", "pounds", "pence")}
# wetext en drops the "one" of "1,234" ("thousand two hundred ...") and reads 1000 as "ten hundred"
_EN_THOUSANDS_RE = re.compile(r"(?<![\d,.])(\d{1,3}(?:,\d{3})+|[1-9]000)(?:\.(\d+))?(?![\d,])")
_ZH_PHONE_RES = (
    re.compile(r"(?<!\d)(?:\+?86[\s-]?)?1[3-9]\d[\s-]?\d{4}[\s-]?\d{4}(?!\d)"),
    re.compile(r"(?<!\d)0\d{2,3}-\d{7,8}(?!\d)"),
)
_ZH_DATE_RE = re.compile(r"(\d{2,4})\s*年\s*0?(\d{1,2})\s*月(?:\s*0?(\d{1,2})\s*[日号])?")
_THOUSANDS_RE = re.compile(r"(?<![\d,])\d{1,3}(?:,\d{3})+(?![\d,])")


def _spell_en(m_text: str) -> str:
    groups = [g for g in re.split(r"[^\d]+", m_text) if g]
    return (" plus " if m_text.lstrip().startswith("+") else " ") + ", ".join(en_digits(g) for g in groups) + " "


_VERSION_RE = re.compile(r"(?<![\d.])[vV]?\d+(?:\.\d+){2,}(?![\d.]*\d)")


def _version(m: re.Match, lang: str) -> str:
    parts = re.findall(r"\d+", m.group())
    if lang == "zh":
        return "点".join(zh_int(int(p)) for p in parts)
    return " " + " point ".join(en_int(int(p)) for p in parts) + " "


_PCT_RANGE_RE = re.compile(r"(\d+(?:\.\d+)?)\s?%\s?[-~～]\s?(\d+(?:\.\d+)?)\s?%")


def _rules_en(s: str) -> str:
    s = _VERSION_RE.sub(lambda m: _version(m, "en"), s)
    s = _PCT_RANGE_RE.sub(r"\1% to \2%", s)  # wetext: "30%-40%" -> "thirty forty percent"
    s = re.sub(r"(?<![$€£\d.,])(\d+(?:\.\d+)?)\s?m\b(?!/)", r"\1 meters", s)  # wetext: "100m" -> minutes
    s = _EN_CALL_RE.sub(lambda m: m.group(1) + _spell_en(m.group(2)), s)
    for r in _EN_PHONE_RES:
        s = r.sub(lambda m: _spell_en(m.group()), s)

    def money(m: re.Match) -> str:
        one, many, small = _MONEY_WORDS[m.group(1)]
        whole = m.group(2)
        big = one if whole == "1" else many
        if m.group(4):  # $5m, $1.5bn: "5 million dollars", "1.5 billion dollars"
            num = whole + ("." + m.group(3) if m.group(3) else "")
            return f"{num} {_SCALE[m.group(4)]} {many}"
        if not m.group(3) or int(m.group(3)) == 0:
            return f"{whole} {big}"
        cents = int(m.group(3)) * (10 if len(m.group(3)) == 1 else 1)
        return f"{whole} {big} and {cents} {small}"

    s = _EN_MONEY_RE.sub(money, s)
    s = _EN_DECADE_RE.sub(
        lambda m: ("two thousands" if m.group(1) == "20" and m.group(2) == "0" else
                   ((en_int(int(m.group(1))) + " ") if m.group(1) else "") + _DECADES[int(m.group(2))]), s)
    s = _EN_THOUSANDS_RE.sub(
        lambda m: " " + en_int(int(m.group(1).replace(",", "")))
        + (" point " + en_digits(m.group(2)) if m.group(2) else "") + " ", s)
    s = re.sub(r"(\d)\s?m/s\b", r"\1 meters per second", s)
    return s


def _rules_zh(s: str) -> str:
    s = re.sub(r"(?<![\d.])(\d{4})[./](\d{1,2})[./](\d{1,2})(?![\d.])",
               lambda m: f"{m.group(1)}年{int(m.group(2))}月{int(m.group(3))}日", s)  # 2024.3.5
    s = _VERSION_RE.sub(lambda m: _version(m, "zh"), s)
    s = _PCT_RANGE_RE.sub(r"\1%到\2%", s)
    for r in _ZH_PHONE_RES:
        s = r.sub(lambda m: zh_digits(m.group(), yao=True), s)
    s = _ZH_DATE_RE.sub(lambda m: f"{m.group(1)}年{int(m.group(2))}月" + (f"{int(m.group(3))}日" if m.group(3) else ""), s)
    s = _THOUSANDS_RE.sub(lambda m: m.group().replace(",", ""), s)
    return s


# ------------------------------------------------------------------------------------------
# punctuation and symbols
# ------------------------------------------------------------------------------------------

_HALF2FULL = str.maketrans({"!": "！", ",": "，", ".": "。", ":": "：", ";": "；", "?": "？", "(": "（", ")": "）"})
_SIMPLIFY_ZH = str.maketrans({"：": "，", "；": "，", "！": "。", "？": "。", "（": "，", "）": "，", "【": "，",
                              "】": "，", "『": "，", "』": "，", "「": "，", "」": "，", "《": "，", "》": "，",
                              "－": "，", "…": "。", "—": "，", "～": "，", "·": " "})
_SIMPLIFY_EN = str.maketrans({":": ",", ";": ",", "!": ".", "?": ".", "(": ",", ")": ",", "<": ",", ">": ",",
                              "-": " ", "…": ".", "—": ",", "–": ",", "~": " ", "/": " ", "_": " ",
                              "，": ",", "。": ".", "！": ".", "？": ".", "：": ",", "；": ","})
_SYMBOL_WORDS = {
    "zh": {"&": "和", "@": "艾特", "+": "加", "=": "等于", "%": "百分号", "°": "度", "#": "井号", "×": "乘"},
    "en": {"&": " and ", "@": " at ", "+": " plus ", "=": " equals ", "%": " percent ", "°": " degrees ",
           "#": " number ", "×": " times "},
}
_KEPT_PUNCT = set("，。、,.")
_SENTENCE_CUT = re.compile(r"(?<=[。！？!?\n])|(?<=\.)(?!\d)")
_WETEXT_TRIGGER = re.compile(r"[\d%‰°$¥￥€£℃]")


# ------------------------------------------------------------------------------------------
# spans
# ------------------------------------------------------------------------------------------

# a number with its unit counts as neutral, so "120km/h" stays with the text around it
_NEUTRAL_UNIT_RE = re.compile(
    r"\d(?:[\d.,:/]*\d)?\s?(?:km/h|m/s|mph|kHz|MHz|GHz|Hz|km|kg|mg|ml|mL|cm|mm|nm|GB|MB|KB|TB|kb|mb|"
    r"pm|am|PM|AM|min|ms|kWh|kW|W|V|A|L|m|g|h|t|°\s?[CF]|°)(?![A-Za-z])")


def _spans(seg: str, dominant: str) -> list[tuple[str, str]]:
    """Cut ``seg`` into ``(lang, text)`` spans; neutral runs join a side (see module doc)."""
    kinds = []
    neutral_mask = [False] * len(seg)
    for m in _NEUTRAL_UNIT_RE.finditer(seg):
        for i in range(m.start(), m.end()):
            neutral_mask[i] = True
    for i, c in enumerate(seg):
        if neutral_mask[i]:
            kinds.append(None)
        elif _is_cjk(c):
            kinds.append("zh")
        elif _is_latin(c):
            kinds.append("en")
        else:
            kinds.append(None)
    n = len(seg)
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
        if left and right:
            lang = left if left == right else dominant
        else:
            lang = left or right or dominant
        for k in range(i, j):
            kinds[k] = lang
        i = j
    spans: list[tuple[str, str]] = []
    start = 0
    for i in range(1, n + 1):
        if i == n or kinds[i] != kinds[start]:
            spans.append((kinds[start], seg[start:i]))
            start = i
    return spans


def detect_language(text: str) -> str:
    """``"zh"`` if CJK characters outnumber English words, else ``"en"`` (upstream norm.py)."""
    return "zh" if len(_CJK_RE.findall(text)) > len(_EN_WORD_RE.findall(text)) else "en"


# ------------------------------------------------------------------------------------------
# the normalizer
# ------------------------------------------------------------------------------------------

class Normalizer:
    """Callable text normalizer (see module docstring).

    Args:
        tokenizer: optional :class:`appliance.text.tokenizer.Tokenizer`; when given, characters
            its vocabulary cannot represent are removed and reported too.
        use_wetext: use ``wetext`` when importable (False = our own rules only).
    """

    def __init__(self, tokenizer=None, use_wetext: bool = True) -> None:
        self.tokenizer = tokenizer
        self._wt: dict[str, object] = {}
        self.wetext = False
        if use_wetext:
            try:
                from wetext import Normalizer as _WT
            except ImportError as e:
                log.warning("wetext is not installed (%s): numbers are read plainly, dates/units less well; "
                            "pip install wetext", e)
            else:
                self._wt = {"zh": _WT(lang="zh", operator="tn"), "en": _WT(lang="en", operator="tn")}
                self.wetext = True

    def __call__(self, text: str) -> NormalizedText:
        """Normalize one request's text.

        Returns:
            :class:`NormalizedText`.

        Raises:
            TextError: not a string, empty, only punctuation/whitespace/control tokens, or
                nothing speakable left (the message lists the unspeakable characters).
        """
        if not isinstance(text, str):
            raise TextError(f"text must be a string, got {type(text).__name__}")
        if not text.strip():
            raise TextError("text is empty; send something to speak")
        unspeakable: list[str] = []

        def report(item: str) -> None:
            if item not in unspeakable:
                unspeakable.append(item)

        text = re.sub(r"(?<=[A-Za-z])-(?=\d)", " ", _pre_nfkc(text))
        dominant = detect_language(_CTRL_RE.sub(" ", text))
        parts = _CTRL_RE.split(text)
        out: list[str] = []
        for idx, part in enumerate(parts):
            if idx % 2 == 1:  # a control token
                if part in USER_CONTROL_TOKENS:
                    out.append(part)
                else:
                    report(part)
                continue
            out.append(self._segment(part, dominant, report))
        result = re.sub(r"[ \t]+", " ", "".join(out)).strip()
        result = re.sub(r" ?([，。、]) ?", r"\1", result)
        result = re.sub(r" ([,.])", r"\1", result)
        result = re.sub(r"([，。、,.])[，。、,.]+", r"\1", result)  # runs of pauses: keep the first
        if self.tokenizer is not None:
            for c in self.tokenizer.unknown_chars(_CTRL_RE.sub(" ", result)):
                report(c)
                result = result.replace(c, "")
        spoken = _CTRL_RE.sub("", result)
        if not any(_is_cjk(c) or _is_latin(c) for c in spoken):
            if unspeakable:
                raise TextError(f"nothing speakable in the text; these cannot be spoken: {' '.join(unspeakable)}")
            raise TextError("the text holds only punctuation, whitespace or control tokens; send words to speak")
        if unspeakable:
            log.info("unspeakable characters removed: %s", " ".join(unspeakable))
        return NormalizedText(result, tuple(unspeakable), dominant)

    # -- one stretch of text between control tokens ------------------------------------------

    def _segment(self, seg: str, dominant: str, report) -> str:
        # line breaks end sentences
        seg = re.sub(r"\s*[\r\n]+\s*", "\n", seg)
        out = []
        for lang, span in _spans(seg, dominant):
            out.append(self._span(lang, span, report))
        return "".join(out)

    def _span(self, lang: str, s: str, report) -> str:
        s = _rules_zh(s) if lang == "zh" else _rules_en(s)
        if _WETEXT_TRIGGER.search(s):  # wetext costs ~0.25 ms per character: only where needed
            s = "".join(self._wetext(lang, x) if _WETEXT_TRIGGER.search(x) else x for x in _SENTENCE_CUT.split(s))
        if re.search(r"\d", s):
            s = verbalize_numbers(s, lang)
        # symbols that carry words
        s = "".join(_SYMBOL_WORDS[lang].get(c, c) for c in s)
        # punctuation as upstream: zh -> full-width, simplified; en -> half-width, simplified
        if lang == "zh":
            s = s.translate(_HALF2FULL).translate(_SIMPLIFY_ZH)
        else:
            s = s.translate(_SIMPLIFY_EN)
        end = "。" if lang == "zh" else "."
        s = re.sub(r"([，。、,.]?)\n", lambda m: (m.group(1) if m.group(1) in ("。", ".") else end) + " ", s)
        kept = []
        for c in s:
            if _is_cjk(c) or _is_latin(c) or c in _KEPT_PUNCT or c == " ":
                kept.append(c)
            elif c.isspace():
                kept.append(" ")
            elif unicodedata.category(c).startswith("P"):
                kept.append(" ")  # quotes, brackets ...: not spoken, not words
            elif unicodedata.category(c) in ("Mn", "Me", "Cf", "Cc"):
                continue  # zero-width / format characters, emoji variation selectors: invisible
            else:
                report(c)  # emoji, symbols, other scripts
                kept.append(" ")
        return "".join(kept)

    def _wetext(self, lang: str, s: str) -> str:
        wt = self._wt.get(lang)
        if wt is None:
            return s
        lead = s[: len(s) - len(s.lstrip())]
        trail = s[len(s.rstrip()):]
        core = s.strip()
        if not core:
            return s
        try:
            return lead + wt.normalize(core) + trail
        except Exception as e:  # wetext raises AssertionError on some inputs
            log.debug("wetext (%s) failed on %r: %s; using our own reading", lang, core, e)
            return s


_default: Optional[Normalizer] = None


def normalize(text: str, tokenizer=None) -> NormalizedText:
    """Normalize with a shared :class:`Normalizer` (created on first use; with ``tokenizer``, a
    new one each call: prefer keeping your own ``Normalizer(tokenizer)``)."""
    global _default
    if tokenizer is not None:
        return Normalizer(tokenizer)(text)
    if _default is None:
        _default = Normalizer()
    return _default(text)
