"""Roman numerals read as numbers where the context says they are numbers.

* Unicode Roman numeral characters (``Ⅻ``, ``ⅩⅡ``, ``ⅷ``; U+2160..U+2188) are numbers wherever
  they stand (NFKC would make them the letters ``XII``);
* after 第 (``第XII届``, ``第Ⅻ届`` -> 第12届: read 第十二届);
* after a word that counts parts (:data:`COUNTED`: Chapter, Part, Act, Book, Volume, Season,
  World War, Super Bowl ...): ``Chapter IV`` -> Chapter 4 (four);
* after a regnal name (:data:`REGNAL`: Henry, Elizabeth, Louis, Pope John Paul ...), or a title
  (King, Queen, Pope, Emperor, Tsar ...) and a capitalised name: ``Henry VIII`` -> "Henry the
  eighth", ``King Carl XVI Gustaf`` -> "King Carl the sixteenth Gustaf";

and left alone everywhere else: ``I`` is a pronoun, ``MIX`` and ``CD`` are words, ``Windows XP``
is no number. Only well-formed numerals (``IIII`` and ``IC`` are not) up to 3999 are read; after a
regnal name only ``I`` to ``XXXIX``, and a lone ``I`` only after a title or before an end, a mark
or and/of/in (``John I am here`` keeps its pronoun); after a counting word a one-letter numeral
only ``I``, ``V`` or ``X`` (``Type C``, ``Grade D`` are letters). Each reading is noted.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Callable

from .numbers import en_ordinal

_NUMERAL = r"M{0,3}(?:CM|CD|D?C{0,3})(?:XC|XL|L?X{0,3})(?:IX|IV|V?I{0,3})"
_VALID_RE = re.compile(rf"(?=[MDCLXVI]){_NUMERAL}")
_VALUES = {"M": 1000, "D": 500, "C": 100, "L": 50, "X": 10, "V": 5, "I": 1}
#: words after which a Roman numeral counts (case as written, or all capitals)
COUNTED = ("Chapter Part Act Scene Book Volume Vol. Vol Section Article Title Appendix Phase Stage Episode Season "
           "Level Round Class Type Category Tome Canto Psalm Olympiad War Bowl Grade Mark Series Unit").split()
#: names borne by monarchs and popes (followed by a numeral: Henry VIII, Elizabeth II, Louis XIV)
REGNAL = frozenset(("Henry Elizabeth Charles James William George Edward Richard Mary Louis Peter Catherine "
                    "Napoleon Alexander Nicholas Frederick Philip John Paul Benedict Pius Leo Gregory Innocent "
                    "Clement Urban Victor Emmanuel Ferdinand Francis Franz Joseph Ludwig Gustav Gustaf Carl Christian "
                    "Frederik Haakon Olav Harald Constantine Ivan Wilhelm Otto Rudolf Leopold Alfonso Juan Carlos "
                    "Felipe Umberto Ramesses Ramses Amenhotep Thutmose Ptolemy Cleopatra Antiochus Darius Xerxes "
                    "Artaxerxes Sobhuza Mswati Rama Akihito Stephen Matilda Anne Victoria Edmund Malcolm David "
                    "Robert Kamehameha Selim Mehmed Murad Suleiman Abdul Hamid Sixtus Boniface Celestine Adrian "
                    "Hadrian Julius Marcellus Lothair Pepin Hugh Sancho Alfonso Afonso Manuel Pedro Sebastian").split())
TITLES = ("King Queen Pope Emperor Empress Tsar Czar Tsarina Kaiser Pharaoh Sultan Prince Princess Duke Duchess "
          "Saint St. Lord Grand Shah").split()
_UNICODE_RE = re.compile("[\u2160-\u2188]+")
_SURE = "\ue022"       # after a numeral that was written with Unicode Roman numeral characters
_AFTER_DI_RE = re.compile(rf"(第\s?)([MDCLXVI]+){_SURE}?(?![A-Za-z])")
_COUNTED_RE = re.compile(r"(?<![A-Za-z])((?:" + "|".join(re.escape(w) for w in COUNTED) + rf")\s+)([MDCLXVI]+){_SURE}?(?![A-Za-z])",
                         re.IGNORECASE)
_NAME = r"[A-Z][a-z]+(?:\s+[A-Z][a-z]+)?"
_REGNAL_RE = re.compile(r"(?<![A-Za-z])(?:(?P<title>" + "|".join(re.escape(t) for t in TITLES) + r")\s+(?P<tname>" + _NAME
                        + rf")|(?P<name>[A-Z][a-z]+))\s+(?P<num>[XVI]+){_SURE}?(?![A-Za-z]|[-.]\d)")
_SURE_RE = re.compile(rf"([MDCLXVI]+){_SURE}")
#: what may follow "Elizabeth I" for the I to be a numeral: an end, a mark, and/of/in, a verb of reigning
_AFTER_ONE_RE = re.compile(r"\s*(?:$|[,.;:!?)]|(?:and|of|in|died|became|reigned|ruled)\b)")


def value(numeral: str) -> int:
    """The value of a well-formed Roman numeral (``"XIV"`` -> 14); 0 when it is not one."""
    if not numeral or not _VALID_RE.fullmatch(numeral):
        return 0
    total = 0
    for a, b in zip(numeral, numeral[1:] + " "):
        v = _VALUES[a]
        total += -v if b != " " and _VALUES[b] > v else v
    return total


def read_roman(text: str, note: Callable[[str], None]) -> str:
    """``text`` with the Roman numerals its context marks as numbers written in digits (``第12届``,
    ``Chapter 4``) or, after a regnal name, as "the" + an English ordinal (module docstring);
    each reading is noted."""
    def uni(m: re.Match) -> str:
        ascii_ = unicodedata.normalize("NFKC", m.group()).upper()
        return ascii_ + _SURE if value(ascii_) else m.group()

    def regnal(m: re.Match) -> str:
        name = m.group("tname") or m.group("name")
        n = value(m.group("num"))
        if not n or n >= 40 or (m.group("title") is None and name not in REGNAL):
            return m.group()
        if m.group("num") == "I" and m.group("title") is None and not _AFTER_ONE_RE.match(m.string, m.end()):
            return m.group()          # John I am here: a pronoun
        note(f"Roman numeral {m.group('num')} after {name} read as 'the {en_ordinal(n)}'")
        return m.group()[: m.start("num") - m.start()] + "the " + en_ordinal(n)

    def counted(m: re.Match) -> str:
        num = m.group(2)
        n = value(num) if num.isupper() and (len(num) > 1 or num in "IVX") else 0   # Type C, Grade D: letters
        if not n:
            return m.group()
        note(f"Roman numeral {num} after {m.group(1).strip()} read as {n}")
        return m.group(1) + str(n)

    def di(m: re.Match) -> str:
        n = value(m.group(2))
        if not n:
            return m.group()
        note(f"Roman numeral {m.group(2)} after 第 read as {n}")
        return m.group(1) + str(n)

    def sure(m: re.Match) -> str:
        n = value(m.group(1))
        note(f"Roman numeral {m.group(1)} (Unicode) read as {n}")
        before = m.string[m.start() - 1] if m.start() else " "
        after = m.string[m.end()] if m.end() < len(m.string) else " "
        return (" " if before.isascii() and before.isalnum() else "") + str(n) + \
            (" " if after.isascii() and after.isalnum() else "")

    text = _UNICODE_RE.sub(uni, text)
    text = _AFTER_DI_RE.sub(di, text)
    text = _REGNAL_RE.sub(regnal, text)
    text = _COUNTED_RE.sub(counted, text)
    return _SURE_RE.sub(sure, text)
