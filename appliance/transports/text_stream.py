"""Sentences out of text that arrives in pieces (a Wyoming ``synthesize-chunk`` stream, e.g. an
LLM's answer): pieces are not on sentence or even word boundaries, so the text is buffered and
each sentence is handed out as soon as it is known to be complete.

A sentence ends after a run of sentence marks (``。！？`` , ``.!?``, a line break) and any closing
quotes or brackets after them, and it is only known to be complete once the character AFTER that
run has arrived (the run might go on: ``"Really?!"``). An ASCII mark ends a sentence only when
that next character is whitespace or not ASCII (``3.14``, ``e.g.x`` and ``v1.2`` stay whole; a
Chinese sentence written with ``!`` still ends). Pieces with nothing to speak (only marks or
control tokens) stay attached to the next sentence. A buffer longer than ``max_chars`` without
an end is cut at its last clause mark or space (else at ``max_chars``), so no piece exceeds the
daemon's ``service.max_text_chars``.

Markdown that spans lines stays whole, so the markup stage (:mod:`appliance.text.markup`) sees it
whole: a fenced code block (from its opening ``````` or ``~~~`` to its closing fence) and a table
(its run of lines starting with ``|``) are one piece each, handed out once their end has arrived.

Pure string handling, no I/O: :class:`SentenceBuffer`.
"""

from __future__ import annotations

import re
from typing import Optional

from ..text.markup import Markup
from ..text.tokens import TOKEN_RE

ENDS_CJK = "。！？"
ENDS_ASCII = ".!?"
CLOSERS = "\"')]}”’」』）】》"
CLAUSE_MARKS = "，,；;：:、"
_FENCE = re.compile(r"\s*(`{3,}|~{3,})")
_TABLE = re.compile(r"\s*\|")
_TABLE_END = re.compile(r"\n(?=[ \t]*[^|\s]|[ \t]*\n)")    # a line that is not a row, or a blank one


def speakable(piece: str) -> bool:
    """True when ``piece`` has a letter or digit outside control tokens like ``[uv_break]``."""
    return any(c.isalnum() for c in TOKEN_RE.sub("", piece))


def _sentence_end(buf: str, start: int) -> Optional[int]:
    """Index just after the first complete sentence end at or after ``start``, or None when no
    end is known yet (none seen, or the buffer stops inside or right after a run of marks)."""
    i = start
    n = len(buf)
    while i < n:
        c = buf[i]
        if c in ENDS_CJK or c in ENDS_ASCII or c == "\n":
            j = i
            while j < n and (buf[j] in ENDS_CJK or buf[j] in ENDS_ASCII or buf[j] == "\n" or buf[j] in CLOSERS):
                j += 1
            if j == n:
                return None                 # what follows decides: wait for more text
            run, nxt = buf[i:j], buf[j]
            if any(ch in ENDS_CJK or ch == "\n" for ch in run) or nxt.isspace() or not nxt.isascii():
                return j
            i = j
            continue
        i += 1
    return None


def _block_end(buf: str, start: int) -> tuple[bool, Optional[int]]:
    """``(True, end)`` when a fenced code block or a table starts at ``start`` (``end``: just after
    it, None while its end has not arrived); ``(False, None)`` otherwise."""
    m = _FENCE.match(buf, start)
    if m:
        fence = m.group(1)
        close = re.compile(r"\n[ \t]*" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}[ \t]*\n")
        c = close.search(buf, m.end())
        return True, None if c is None else c.end()
    if _TABLE.match(buf, start):
        t = _TABLE_END.search(buf, start)
        return True, None if t is None else t.end()
    return False, None


def _cut_long(buf: str, max_chars: int) -> int:
    """Where to cut a buffer longer than ``max_chars`` that has no sentence end: after its last
    clause mark, else its last space, within the limit; else at ``max_chars``."""
    head = buf[:max_chars]
    for marks in (CLAUSE_MARKS, " \t"):
        k = max(head.rfind(m) for m in marks)
        if k > 0:
            return k + 1
    return max_chars


_SSML = Markup()


class SentenceBuffer:
    """Collects streamed text and returns the sentences completed so far.

    Args:
        max_chars: longest piece handed out, characters (``service.max_text_chars``).
        whole: hand nothing out before :meth:`finish` (``wyoming.streaming: false``, or SSML).
        ssml: the text is SSML (a Wyoming ``text_format: ssml``): an SSML document is read whole,
            so this implies ``whole``; at :meth:`finish` the markup stage
            (:mod:`appliance.text.markup`) turns it into text with pause tokens first.
    """

    def __init__(self, max_chars: int, whole: bool = False, ssml: bool = False) -> None:
        self.max_chars = max(1, max_chars)
        self.whole = whole or ssml
        self.ssml = ssml
        self.buf = ""

    def add(self, text: str) -> list[str]:
        """Append ``text``; returns the sentences (stripped, in order) now complete."""
        self.buf += text
        if self.whole:
            return []
        out: list[str] = []
        start = 0
        while True:
            block, end = _block_end(self.buf, start)
            if not block:
                end = _sentence_end(self.buf, start)
            forced = False
            if end is None and len(self.buf) > self.max_chars:
                end, forced = _cut_long(self.buf, self.max_chars), True
            if end is None:
                return out
            piece = self.buf[:end]
            if forced or speakable(piece):
                if speakable(piece):
                    out.append(piece.strip())
                self.buf = self.buf[end:].lstrip()
                start = 0
            else:
                start = end                # nothing to say yet: keep it with the next sentence

    def finish(self) -> list[str]:
        """The rest at the end of the stream (empty when it has nothing to speak)."""
        if self.whole:
            text, self.buf = self.buf, ""
            pieces = SentenceBuffer(self.max_chars)
            return pieces.add(_SSML(text, ssml=True) if self.ssml else text) + pieces.finish()
        rest, self.buf = self.buf.strip(), ""
        if not rest:
            return []
        out = []
        while len(rest) > self.max_chars:
            k = _cut_long(rest, self.max_chars)
            out.append(rest[:k].strip())
            rest = rest[k:].strip()
        out.append(rest)
        return [p for p in out if speakable(p)]
