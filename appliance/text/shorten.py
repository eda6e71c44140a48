"""What chat text repeats or cannot pronounce, made short: runs collapsed, codes summarised.

* **Runs** (:func:`collapse_runs`, on the text after the script pass): a unit of one to four
  letters or Chinese characters said more than :data:`MAX_REPEATS` (3) times in a row, with or
  without a space or comma between (``hahahahaha``, ``哈哈哈哈哈``, ``aaaa``, ``no no no no``), is
  said 3 times. Digits are not runs (``13800000000`` is a number). After everything,
  :func:`bound_spoken` cuts any unit of one to four letters (or characters) that the spoken form
  (control tokens and non-letters left out) still repeats more than :data:`MAX_SPOKEN_REPEATS`
  (8) times (a long digit string read digit by digit): the longest a code's ``0000`` reads.
* **Unpronounceable tokens** (:func:`shorten_codes`, before the language spans): a UUID, a hash
  (12 or more hexadecimal digits with letters and digits, one case), a token of 16 or more
  letters and digits with at least two of each, a token of 10 or more that switches between
  letters and digits 4 or more times (``A12B34C56D78``), and a digit string over 18 digits become
  "a code" / 一串代码 (a long number: "a long number" / 一串长数字), in the language of their
  clause: at most about 1 s of audio where spelling them took up to 10. Web and e-mail addresses
  are left to the ``web-address`` rule (:mod:`.rules`), which says one with a path or query as
  "a link on example dot com" (一个example点com的链接).

Each change is noted (``chattts-appliance normalize`` shows it).
"""

from __future__ import annotations

import re
from typing import Callable

from .tokens import CTRL_RE

#: a run of one unit is said at most this many times
MAX_REPEATS = 3
#: no unit of the spoken form repeats more than this many times (digits read one by one included)
MAX_SPOKEN_REPEATS = 8
#: placeholders the spans carry to the language's words (private-use characters)
CODE_MARK, NUMBER_MARK = "\ue020", "\ue021"
SAID = {CODE_MARK: (" a code ", "一串代码"), NUMBER_MARK: (" a long number ", "一串长数字")}

_UNIT = r"[A-Za-z]{1,4}?|[\u3400-\u4dbf\u4e00-\u9fff]{1,4}?"
_RUN_RE = re.compile(rf"(?<![A-Za-z])({_UNIT})((?:[ ,，]?\1){{{MAX_REPEATS},}})(?![a-z])", re.IGNORECASE)
_UUID_RE = re.compile(r"(?<![A-Za-z0-9-])[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}(?![A-Za-z0-9-])")
_TOKEN_RE = re.compile(r"(?<![A-Za-z0-9])[A-Za-z0-9]{10,}(?![A-Za-z0-9])")
_HEX_RE = re.compile(r"[0-9a-f]{12,}|[0-9A-F]{12,}")
_SWITCH_RE = re.compile(r"[A-Za-z]+|\d+")


def collapse_runs(text: str, note: Callable[[str], None]) -> str:
    """``text`` with each run of a unit said more than ``MAX_REPEATS`` times cut to that many
    (module docstring); each cut is noted. Control tokens are never touched."""
    def one(m: re.Match) -> str:
        copies = re.findall(r"[ ,，]?" + re.escape(m.group(1)), m.group(2), re.IGNORECASE)
        kept = m.group(1) + "".join(copies[:MAX_REPEATS - 1])
        note(f"run {_short(m.group())} said as {kept!r} ({len(copies) + 1} times -> {MAX_REPEATS})")
        return kept
    parts = CTRL_RE.split(text)
    return "".join(p if i % 2 else _RUN_RE.sub(one, p) for i, p in enumerate(parts))


def _is_code(tok: str) -> str | None:
    """The placeholder for an unpronounceable ``tok`` (letters and digits), or None."""
    if tok.isdigit():
        return NUMBER_MARK if len(tok) > 18 else None
    letters = sum(c.isalpha() for c in tok)
    digits = len(tok) - letters
    if _HEX_RE.fullmatch(tok) and letters and digits:
        return CODE_MARK
    if len(tok) >= 16 and letters >= 2 and digits >= 2:
        return CODE_MARK
    if len(_SWITCH_RE.findall(tok)) >= 5:
        return CODE_MARK
    return None


def shorten_codes(text: str, protected: re.Pattern, note: Callable[[str], None]) -> str:
    """``text`` with each unpronounceable token replaced by :data:`CODE_MARK` or
    :data:`NUMBER_MARK` (:data:`SAID` gives the words), noted; nothing inside a match of
    ``protected`` (web and e-mail addresses) or a control token is touched."""
    keep = [(m.start(), m.end()) for rx in (protected, CTRL_RE) for m in rx.finditer(text)]

    def free(m: re.Match) -> bool:
        return not any(a < m.end() and m.start() < b for a, b in keep)

    def one(m: re.Match) -> str:
        mark = CODE_MARK if m.re is _UUID_RE else _is_code(m.group())
        if mark is None or not free(m):
            return m.group()
        note(f"{'code' if mark == CODE_MARK else 'number'} {_short(m.group())} said as "
             f"{SAID[mark][0].strip()!r} / {SAID[mark][1]!r}")
        return mark

    for m in protected.finditer(text):
        if "host" in m.re.groupindex and m.group("host") and re.search(r"[/?#][^/?#]", m.group()[m.end("host") - m.start():]):
            note(f"link {_short(m.group(), 48)}: its path and query left out, said as a link on {m.group('host')}")
    return _TOKEN_RE.sub(one, _UUID_RE.sub(one, text))


def say_marks(text: str, lang: str) -> str:
    """The placeholders of :func:`shorten_codes` in ``text`` as words of ``lang``."""
    for mark, words in SAID.items():
        text = text.replace(mark, words[lang == "zh"])
    return text


def bound_spoken(text: str, note: Callable[[str], None]) -> str:
    """``text`` (the spoken form) without any unit of 1-4 characters that its letters (Latin
    and Chinese; control tokens, spaces and marks left out) repeat more than
    ``MAX_SPOKEN_REPEATS`` times in a row: the copies after that many are cut (control tokens
    between them kept), noted."""
    masked = CTRL_RE.sub(lambda m: "\0" * len(m.group()), text)
    idx = [i for i, c in enumerate(masked) if c.isalpha()]
    proj = "".join(masked[i] for i in idx)
    rx = re.compile(rf"(.{{1,4}}?)\1{{{MAX_SPOKEN_REPEATS},}}", re.DOTALL)
    cuts = []
    for m in rx.finditer(proj):
        a = idx[m.start() + MAX_SPOKEN_REPEATS * len(m.group(1))]
        b = idx[m.end() - 1] + 1
        cuts.append((a, b))
        note(f"repeat {_short(text[idx[m.start()]:b])} cut after {MAX_SPOKEN_REPEATS} times")
    for a, b in reversed(cuts):
        text = text[:a] + "".join(CTRL_RE.findall(text[a:b])) + text[b:]
    return text


def _short(s: str, n: int = 24) -> str:
    return repr(s if len(s) <= n else s[:n] + "...")
