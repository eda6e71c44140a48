"""Scripts: what the tokenizer can read, made from what was written.

* Compatibility forms (full-width letters and digits, ``㎞``, ``①``, ``½``) become their plain
  forms by Unicode NFKC, one character at a time; Chinese punctuation and the symbols of
  :data:`appliance.text.units.SYMBOLS` are kept (NFKC would turn ``，`` into ``,`` and ``™``
  into ``TM``). Decimal digits of any script (``٣``, ``३``) become ASCII digits; superscript
  digits after a digit are a power (``10²`` -> ``10^2``), after a letter a plain digit (``m²``).
* Traditional Chinese becomes simplified with OpenCC's ``t2s`` table (PyPI ``opencc``, the
  project's own Python binding, Apache-2.0): ChatTTS learned Mandarin from simplified text.
* Latin letters with diacritics lose them (``é`` -> e, the BERT vocabulary strips accents too);
  letters that do not decompose are spelled by their Unicode name (``ß`` -> ss, ``ø`` -> o,
  ``æ`` -> ae, ``þ`` -> th). German umlauts become ``ae``/``oe``/``ue`` when the text looks
  German (it has ``ß`` or a German function word such as ``und``), else the bare vowel.
* Whatever is still not speakable is reported by :func:`describe` (character, code point,
  Unicode name).
"""

from __future__ import annotations

import logging
import re
import unicodedata

from .units import SYMBOLS

log = logging.getLogger(__name__)

#: Full-width punctuation kept as it is by the NFKC pass.
KEEP_FULL = set("，。！？：；（）、“”‘’《》【】「」『』…—～·￥")
_SUPERSCRIPT = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹", "0123456789")
_NAME_RE = re.compile(r"LATIN (SMALL|CAPITAL) (?:LETTER|LIGATURE) ([A-Z]+)\b")
_BY_NAME = {"SHARP": "ss", "AE": "ae", "OE": "oe", "IJ": "ij", "ETH": "d", "THORN": "th", "ENG": "ng",
            "DOTLESS": "i", "LONG": "s", "KRA": "k", "SCHWA": "e", "ESH": "sh", "EZH": "zh"}
_UMLAUT = {"ä": "ae", "ö": "oe", "ü": "ue", "Ä": "Ae", "Ö": "Oe", "Ü": "Ue"}
_GERMAN_RE = re.compile(r"ß|\b(?:und|oder|der|das|nicht|ist|für|mit|über|auf|bei|zum|zur|ein|eine|"
                        r"ich|wir|sie|straße|strasse|herr|frau|bitte|danke)\b", re.IGNORECASE)


def is_cjk(c: str) -> bool:
    """CJK Unified Ideographs or Extension A."""
    return "\u4e00" <= c <= "\u9fff" or "\u3400" <= c <= "\u4dbf"


def is_latin(c: str) -> bool:
    """ASCII letter."""
    return ("a" <= c <= "z") or ("A" <= c <= "Z")


def describe(item: str) -> str:
    """How an unspeakable item is reported: ``😀 (U+1F600 GRINNING FACE)``; a grapheme cluster of
    several code points whole (``👍🏽 (emoji thumbs up: U+1F44D U+1F3FD)``, ``^_^ (emoticon)``:
    :func:`appliance.text.emoticons.describe_cluster`); control tokens as ``[Stts] (control
    token of the prompt)``."""
    if len(item) != 1:
        if item.startswith("[") and item.endswith("]"):
            return f"{item} (control token of the prompt)"
        from .emoticons import describe_cluster   # emoticons imports units, as this module does

        return describe_cluster(item)
    name = unicodedata.name(item, "") or f"unnamed, category {unicodedata.category(item)}"
    return f"{item} (U+{ord(item):04X} {name})"


def latin_base(c: str, german: bool = False) -> str | None:
    """ASCII spelling of one non-ASCII Latin letter, or None if it has none."""
    if german and c in _UMLAUT:
        return _UMLAUT[c]
    base = "".join(ch for ch in unicodedata.normalize("NFKD", c) if not unicodedata.combining(ch))
    if base.isascii() and base.isalpha():
        return base
    m = _NAME_RE.match(unicodedata.name(c, ""))
    if not m:
        return None
    word = m.group(2)
    spelled = _BY_NAME.get(word) or (word.lower() if len(word) == 1 else None)
    if spelled and m.group(1) == "CAPITAL":
        spelled = spelled[0].upper() + spelled[1:]
    return spelled


class ScriptConverter:
    """The script pass (see module docstring). ``convert(text)`` is cheap; OpenCC's table is
    loaded once here (~5 ms).

    Args:
        t2s: convert traditional to simplified Chinese (needs PyPI ``opencc``; without it a
            warning is logged once and traditional characters pass unchanged).
    """

    def __init__(self, t2s: bool = True) -> None:
        self._cc = None
        if t2s:
            try:
                import opencc
            except ImportError as e:
                log.warning("opencc is not installed (%s): traditional Chinese is not converted to "
                            "simplified; pip install opencc", e)
            else:
                self._cc = opencc.OpenCC("t2s")

    @property
    def t2s(self) -> bool:
        """Whether traditional Chinese is converted."""
        return self._cc is not None

    def convert(self, text: str) -> str:
        """Apply the script pass to a whole request text (control tokens are plain ASCII and
        pass unchanged)."""
        german = bool(_GERMAN_RE.search(text))
        out: list[str] = []
        prev = ""
        for c in text:
            if c.isascii() or c in KEEP_FULL or c in SYMBOLS:
                s = c
            elif c in "⁰¹²³⁴⁵⁶⁷⁸⁹":
                s = c.translate(_SUPERSCRIPT)
                if prev.isdigit() and not _in_power(out):
                    s = "^" + s
            elif unicodedata.category(c) == "Nd":
                s = str(unicodedata.decimal(c))
            elif c == "〇":
                s = "零"
            else:
                s = unicodedata.normalize("NFKC", c).replace("\u2044", "/")
                if len(s) == 1 and not s.isascii() and not is_cjk(s) and unicodedata.category(s).startswith("L"):
                    s = latin_base(s, german) or s
            out.append(s)
            prev = s[-1:] if s else prev
        text = "".join(out)
        if self._cc is not None and any(is_cjk(c) for c in text):
            text = self._cc.convert(text)
        return text


def _in_power(out: list[str]) -> bool:
    """True when the previous outputs are ``^`` + superscript digits (``10²³`` stays one power)."""
    for s in reversed(out):
        if s.startswith("^"):
            return True
        if not s.isdigit():
            return False
    return False
