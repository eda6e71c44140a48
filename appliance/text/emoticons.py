"""Emoji, emoticons and kaomoji: what chat text says with pictures, never read as punctuation.

Three kinds, found in this order on the text after the markup stage (before the script pass, so
full-width and compatibility characters are still as written):

* **kaomoji** (:data:`KAOMOJI_RE`): a run of face characters (``(╯°□°)╯︵ ┻━┻``, ``¯\\_(ツ)_/¯``,
  ``ヽ(•‿•)ノ``, ``(ಥ﹏ಥ)``): symbols, punctuation and the letters faces borrow (ツ, ω, Д, ʕ),
  no Chinese character, no ASCII word, at least three characters, at least one of
  :data:`KAO_CHARS`; runs one space apart are one kaomoji;
* **ASCII emoticons** (:data:`EMOTICONS`: ``:)``, ``^_^``, ``T_T``, ``<3``, ``XD`` ...), not
  inside a word or a number (``a<3`` is a comparison, ``AT_TT`` a name);
* **emoji**, as grapheme clusters (PyPI ``regex``'s ``\\X``, Unicode's extended grapheme
  clusters): one family, flag, keycap or skin-toned hand is one item, never its code points.
  A symbol the reader has a word for (``©``, ``™``, ``→``: :data:`appliance.text.units.SYMBOLS`)
  is left to it; a keycap digit (``1️⃣``) is its digit.

``synthesis.emoji``: ``drop`` (the default) removes each and lists it in ``unspeakable`` (a
cluster whole); ``name`` says a short meaning in the language of the words beside it: emoji by
their CLDR short name (PyPI ``emoji``: English and Chinese names; skin tones left out), emoticons
and kaomoji by the meanings of :data:`EMOTICONS` and :data:`KAOMOJI` (one without a meaning is
dropped). Chosen by measurement (``regex`` against ``grapheme`` and ``emoji.emoji_list`` on 19
clusters up to Unicode 15.1 and a 10,800-character chat text): ``regex`` split every cluster right
in 1.2 ms, ``grapheme`` split a Devanagari conjunct in two (10 ms), ``emoji`` finds emoji only
(5.6 ms) but names them in Chinese too. Both are on PyPI for aarch64 (``regex`` has wheels;
``emoji`` is pure Python).
"""

from __future__ import annotations

import itertools
import re
import unicodedata
from typing import Callable, Optional

import regex

from .units import SYMBOLS

#: emoticon -> (English meaning, Chinese meaning)
_MEANINGS = {
    "smile": ("smile", "微笑"), "laugh": ("laughing", "大笑"), "wink": ("wink", "眨眼"), "sad": ("sad", "难过"),
    "cry": ("crying", "哭"), "tongue": ("tongue out", "吐舌头"), "surprise": ("surprised", "惊讶"),
    "heart": ("heart", "爱心"), "broken": ("broken heart", "心碎"), "annoyed": ("annoyed", "无语"),
    "shrug": ("shrug", "耸肩"), "flip": ("table flip", "掀桌"), "kiss": ("kiss", "亲亲"),
}
EMOTICONS: dict[str, str] = {
    **dict.fromkeys(":) :-) =) ^_^ ^^ ^.^ ^o^ (^_^) (^^) (^o^) ^-^".split(), "smile"),
    **dict.fromkeys(":D :-D XD xD =D".split(), "laugh"),
    **dict.fromkeys(";) ;-) ;D".split(), "wink"),
    **dict.fromkeys(":( :-( =(".split(), "sad"),
    **dict.fromkeys("T_T T.T TT_TT ;_; QAQ QwQ :'( (T_T) (;_;)".split(), "cry"),
    **dict.fromkeys(":P :-P :p :-p".split(), "tongue"),
    **dict.fromkeys(":O :-O :o O_O o_O O_o 0_0".split(), "surprise"),
    "<3": "heart", "</3": "broken", ":*": "kiss", ":-*": "kiss",
    **dict.fromkeys("-_- -.- >_< >.< -_-||".split(), "annoyed"),
}
#: characters that make a run of symbols a face
KAO_CHARS = frozenset("╯╰°□┻━┳︵ツ▽ಥ﹏◕‿｡•ᴥʕʔ´｀ω≧≦∀ﾟ゜Дﾉノヽ¯ಠ益⊙＾∇≖˘ᵕ◡ლ☉ʘ눈╥╭╮ｏ≡ﾟ∩⌒")
#: kaomoji meaning by a character it holds, first match wins
KAOMOJI: tuple[tuple[str, str], ...] = (("┻", "flip"), ("┳", "flip"), ("ツ", "shrug"), ("ಥ", "cry"), ("╥", "cry"),
                                       ("ಠ", "annoyed"), ("▽", "smile"), ("‿", "smile"), ("◡", "smile"),
                                       ("ᴥ", "smile"), ("^", "smile"), ("＾", "smile"), ("ω", "smile"))
_KAO_CLASS = (r"(?:[^\sA-Za-z0-9\u3400-\u4dbf\u4e00-\u9fff\u3000-\u303f\uff0c\uff01\uff1f\uff1b\uff1a"
              r"“”‘’,.!?;:\"'\[\]\ue000-\uf8ff]|(?<![A-Za-z])[oOTuUvVwWxX](?![A-Za-z]))")
KAOMOJI_RE = re.compile(rf"{_KAO_CLASS}{{3,}}(?: {_KAO_CLASS}{{3,}})*")
_EMOTICON_RE = re.compile("|".join(
    (r"(?<![A-Za-z0-9])" if k[0].isalnum() else r"(?<![A-Za-z0-9<>=])(?<!\d\s)" if k[0] == "<" else r"(?<![<>=:;^])")
    + re.escape(k)
    + (r"(?![A-Za-z0-9])" if k[-1].isalnum() or k == "<3" else r"(?![)(\]\[>^*])")
    for k in sorted(EMOTICONS, key=len, reverse=True)))
#: an emoji cluster: a keycap, a flag (two regional indicators), or a cluster led by a pictograph
EMOJI_RE = regex.compile(r"[#*0-9]\uFE0F?\u20E3|\p{Regional_Indicator}{1,2}|(?=\p{Extended_Pictographic})\X")
_TONES = regex.compile(r"[\U0001F3FB-\U0001F3FF]")
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]")
_LATIN = re.compile(r"[A-Za-z]")


def emoji_name(cluster: str, lang: str) -> Optional[str]:
    """The CLDR short name of an emoji cluster in ``lang`` (``"en"``: "thumbs up", ``"zh"``:
    "拇指向上"), skin tones left out; None when the ``emoji`` package does not know it."""
    import emoji   # PyPI emoji: loaded on first use (28 ms, ~3 MiB with the Chinese names)

    base = _TONES.sub("", cluster)
    for c in (base, base.replace("\ufe0f", ""), base + "\ufe0f"):
        if emoji.is_emoji(c):
            name = emoji.demojize(c, language="en" if lang == "en" else "zh", delimiters=("", ""))
            if name != c:
                return name.replace("_", " ").strip() if lang == "en" else name.replace("_", "")
    return None


def _lang_at(text: str, start: int, end: int, dominant: str) -> str:
    """The language of the letters nearest to ``text[start:end]`` on its line (left first)."""
    left = text[:start].rsplit("\n", 1)[-1]
    for c in reversed(left):
        if _CJK.match(c) or _LATIN.match(c):
            return "zh" if _CJK.match(c) else "en"
    right = text[end:].split("\n", 1)[0]
    for c in right:
        if _CJK.match(c) or _LATIN.match(c):
            return "zh" if _CJK.match(c) else "en"
    return dominant


def _said(words: str, lang: str) -> str:
    return words if lang == "zh" else f" {words} "


def pictures(text: str, mode: str, dominant: str, report: Callable[[str], None],
             note: Callable[[str], None]) -> str:
    """``text`` with its kaomoji, emoticons and emoji dropped (``mode == "drop"``: each reported)
    or said by meaning (``"name"``: each noted) (module docstring).

    Args:
        text: the text after the markup stage. mode: ``synthesis.emoji``.
        dominant: the request's language, for a picture with no words on its line.
        report: receives each dropped item (a whole cluster). note: receives each decision.
    """
    def replace(kind: str, meaning: Optional[str]):
        def one(m) -> str:
            item = m.group()
            if kind == "emoji" and item[0] in "0123456789":
                return item[0] + " "                               # 1️⃣: the digit
            if kind == "emoji" and (item[0] in SYMBOLS or _TONES.fullmatch(item)):
                return item                                       # ©, →: units.SYMBOLS reads them
            if mode == "name":
                lang = _lang_at(m.string, m.start(), m.end(), dominant)
                if kind == "emoji":
                    said = emoji_name(item, lang)
                else:
                    key = meaning or EMOTICONS.get(item) or next((k for c, k in KAOMOJI if c in item), None)
                    said = _MEANINGS[key][lang == "zh"] if key else None
                if said:
                    note(f"{kind} {item} said as {said!r}")
                    return _said(said, lang)
            report(item)
            return " "
        return one

    def kaomoji(m: re.Match) -> str:
        # the parts (one space apart) that hold a face character are one kaomoji; ^_^ beside it is not
        out: list[str] = []
        for face, parts in itertools.groupby(m.group().split(" "), key=lambda p: any(c in KAO_CHARS for c in p)):
            part = " ".join(parts)
            out.append(replace("kaomoji", None)(re.match(r".+", part, re.DOTALL)) if face else part)
        return " ".join(out)

    text = KAOMOJI_RE.sub(kaomoji, text)
    text = _EMOTICON_RE.sub(replace("emoticon", None), text)
    return EMOJI_RE.sub(replace("emoji", None), text)


def clusters(text: str) -> list[str]:
    """``text`` cut into extended grapheme clusters (``regex`` ``\\X``)."""
    return regex.findall(r"\X", text)


def describe_cluster(item: str) -> str:
    """How an unspeakable cluster of several code points is reported:
    ``👍🏽 (emoji thumbs up: U+1F44D U+1F3FD)``, ``^_^ (emoticon)``."""
    if item in EMOTICONS:
        return f"{item} (emoticon)"
    if KAOMOJI_RE.fullmatch(item) and any(c in KAO_CHARS for c in item):
        return f"{item} (kaomoji)"
    cps = " ".join(f"U+{ord(c):04X}" for c in item[:8]) + (" ..." if len(item) > 8 else "")
    name = emoji_name(item, "en") if EMOJI_RE.fullmatch(item) else None
    if name:
        return f"{item} (emoji {name}: {cps})"
    return f"{item} ({unicodedata.name(item[0], 'unnamed')} + {len(item) - 1} more: {cps})"
