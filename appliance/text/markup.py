"""Markup out of a text before it is normalized: what an agent writes is spoken, its markup never.

Home Assistant's Assist hands the box the answers of LLM agents, and they write Markdown; some
clients send HTML or SSML. This stage runs first in :class:`~appliance.text.normalize.Normalizer`,
so every transport (socket, MQTT, Wyoming) gets it:

* **Markdown** is parsed by ``markdown-it-py`` (PyPI, MIT, pure Python; CommonMark plus tables,
  strikethrough and ``linkify-it-py`` for bare addresses) and rendered to HTML, which the walker
  below reads: headings, paragraphs, list items and table rows end a sentence; emphasis, code
  and strikethrough markers go, their text stays; an ordered list item keeps its number
  (``1. Preheat`` -> "one. Preheat"); table cells are joined with commas; a link is its text,
  an image its alt text; a code block is read as text, line by line.
* **Addresses**: a link whose text is its own address (an autolink, a bare ``https://...``,
  ``www.`` or ``example.com``) stays an address, which the ``web-address`` rule
  (:mod:`.rules`) reads in a short form: the host without ``www.``, port and path ("example
  dot com"), never spelled out character by character. E-mail addresses are read whole.
* **HTML and SSML tags** are never spoken (stdlib ``html.parser``; entities decoded): ``<break>``
  becomes a ChatTTS pause (``[uv_break]``; ``[lbreak]`` for ``strength`` strong/x-strong or a
  ``time`` of 1 s or more; nothing for ``none``/0), ``<sub alias>`` its alias, ``<say-as
  interpret-as="characters|spell-out|digits">`` its characters one by one, ``<p>``/``<br>`` and
  other block elements a sentence end; ``<speak>``, ``<prosody>``, ``<emphasis>``, ``<voice>``
  and the rest (any ``vendor:tag`` too) are dropped with their text kept; ``<script>``,
  ``<style>``, ``<head>``, SSML ``<desc>`` and an agent's ``<think>`` are dropped with their
  content. Something that only looks like a tag (``x<y and y>z``: no HTML or SSML element) stays
  text. A text that is one SSML document (``<speak>...</speak>``, maybe after ``<?xml ...?>``),
  or is declared SSML (a Wyoming ``text_format: ssml``), is read as SSML only: no Markdown, white
  space is only a space. Elsewhere tags are read inline, also at the start of a line (CommonMark's
  HTML blocks are off, so Markdown next to a tag still counts).
* **ChatTTS control tokens** (``[uv_break]``, ``[laugh]``, ``[lbreak]`` ...) are kept byte for
  byte: they are set aside before parsing (a link reference ``[laugh]: x`` cannot eat one).

A ``*`` between two digits stays a times sign (``2*3*4`` is no emphasis); a stray emphasis marker
that a sentence split left unmatched (``*This is one.``) is dropped, not read as "asterisk".

**No word is lost to nesting.** markdown-it stops parsing blocks :data:`MAX_NESTING` levels deep
and drops what is inside, silently (``> - `` is three levels: blockquote, list, item; a list
nested 50 deep is 100). A text that reaches that depth is flattened first: the quote and list
markers at the start of each line go (an ordered item keeps its number as text), each line
stays a line, and the flat text is read as Markdown; in the unlikely case that it is still that
deep, it is read without Markdown (tags still go). Deep *inline* nesting (``**`` or ``[`` 200
deep) loses nothing: markdown-it keeps what it no longer parses as text.
About 0.1 ms per announcement on the 2-core dev box (markdown-it-py's parse and render).
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from typing import Optional
from urllib.parse import unquote

from markdown_it import MarkdownIt

from .tokens import CTRL_RE

#: Elements whose content is not spoken (LLM reasoning, SSML descriptions, page machinery).
DROPPED = frozenset("script style head title template noscript iframe svg math desc lexicon metadata think "
                    "object canvas select".split())
#: Elements that end a sentence before and after their text.
BLOCKS = frozenset("p div h1 h2 h3 h4 h5 h6 ul ol li dl dt dd blockquote pre table thead tbody tfoot tr "
                   "hr br section article header footer nav aside main figure figcaption details summary "
                   "address caption fieldset legend form body html paragraph".split())
#: Every other HTML or SSML element: the tag goes, its text stays.
INLINE = frozenset("a abbr b bdi bdo cite code data del dfn em font i img ins kbd label mark q rp rt ruby s "
                   "samp small span strike strong sub sup time tt u var wbr big center input button area "
                   "audio video source track picture col colgroup td th meta link base option optgroup "
                   "speak break say-as phoneme prosody emphasis voice lang w token sentence".split())
#: markdown-it's block nesting limit (commonmark's 20 drops the text of a list nested 10 deep;
#: deeper than this, the text is flattened: module docstring)
MAX_NESTING = 100
_VOID = frozenset("br hr img wbr input meta link base area source track col break mark".split())
_SPELLED = ("characters", "spell-out", "digits", "verbatim")
#: a control token set aside: its index in private-use characters (never in real text)
_PUA_RE = re.compile("[\ue000-\ue00b]")
_SET_ASIDE = re.compile("\ue000([\ue001-\ue00a]+)\ue00b")
_TIMES_RE = re.compile(r"(?<=\d)\*(?=\d)")
_STRAY_RE = re.compile(r"(?<![\w*])\*+(?=[^\s*])|(?<=[^\s*])\*+(?![\w*])|~~|`+")
_SSML_DOC = re.compile(r"\s*(?:<\?xml[^>]*>\s*)?<speak\b.*</speak>\s*", re.IGNORECASE | re.DOTALL)
_SCHEME_RE = re.compile(r"[a-z][a-z0-9+.-]*:(?://)?", re.IGNORECASE)
_BLANKS = re.compile(r"[ \t]*\n\s*")
_SPACES = re.compile(r"[ \t]{2,}")
#: the container markers at the start of a line: quotes, bullets, an ordered item's ``N.``/``N)``
_CONTAINERS = re.compile(r"^(?:[ \t]*(?:>|[-+*](?=[ \t]|$)|(\d{1,9})[.)](?=[ \t]|$)))+[ \t]*", re.MULTILINE)


def _aside(i: int) -> str:
    """Control token number ``i`` set aside (:data:`_SET_ASIDE` finds it again)."""
    return "\ue000" + "".join(chr(0xE001 + int(d)) for d in str(i)) + "\ue00b"


def _pause(attrs: dict) -> str:
    """The ChatTTS pause token for an SSML ``<break>`` (module docstring)."""
    strength = (attrs.get("strength") or "").lower()
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s)\s*", attrs.get("time") or "")
    ms = None if m is None else float(m.group(1)) * (1 if m.group(2) == "ms" else 1000)
    if strength == "none" or ms == 0:
        return ""
    if strength in ("strong", "x-strong") or (ms is not None and ms >= 1000):
        return " [lbreak] "
    return " [uv_break] "


def _bare(url: str) -> str:
    """``url`` without its scheme (``https://``, ``mailto:``) and trailing ``/``, lower case."""
    return _SCHEME_RE.sub("", unquote(url.strip()), count=1).rstrip("/").lower()


def link_text(text: str, href: str) -> str:
    """What a link is read as: its text, or (an address as its own text, or no text) the address
    in a form the ``web-address`` rule reads short; an e-mail address whole.

    Args:
        text: the link's text (its markup already removed). href: its target.
    """
    t = text.strip()
    if t and not _bare(href).startswith(_bare(t)) and not _bare(t).startswith(_bare(href)):
        return text                                  # [the docs](https://...): the docs
    u = t or href.strip()
    if u.lower().startswith("mailto:"):
        u = u[7:]
    if "@" in u:
        return " " + u + " "                         # an e-mail address: read whole
    if not _SCHEME_RE.match(u) and not u.lower().startswith("www."):
        host = re.split(r"[/?#:]", u, maxsplit=1)[0]
        tld = host.rsplit(".", 1)[-1]
        if "." not in host or not tld.islower():     # end.Next is a typo, not a host
            return text
        u = "http://" + u                            # example.com: an address all the same
    return " " + u + " "


class _Speech(HTMLParser):
    """HTML (markdown-it's output, or a sender's HTML/SSML) -> the text to speak (module docstring).

    Args:
        ssml: white space is one space (SSML), not a line break that ends a sentence.
    """

    def __init__(self, ssml: bool) -> None:
        super().__init__(convert_charrefs=True)
        self.ssml = ssml
        self.out: list[str] = []
        self._break = False            # a block boundary since the last text
        self._prefix = ""              # an ordered list item's number, written before its text
        self._skip: list[str] = []     # open dropped elements
        self._lists: list[Optional[int]] = []   # open lists: the next item's number (None: bullets)
        self._cells = 0                # cells written in the open table row
        self._code = 0                 # open <code>/<pre>: markers in there are text
        self._captures: list[tuple[str, dict, int]] = []   # open <a>/<say-as>: tag, attrs, out index

    # -- text out ---------------------------------------------------------------------------

    def _text(self, s: str, raw: bool = False) -> None:
        if not s:
            return
        if self.ssml or not s.strip():
            s = re.sub(r"\s+", " ", s)      # between tags (table cells) or SSML: a space, no sentence end
        if not raw and not self._code:
            s = _STRAY_RE.sub("", s)
        if self._break:
            if not s.strip():
                return
            self.out.append("\n")
            self._break = False
            s = s.lstrip()
        if self._prefix and s.strip():
            self.out.append(self._prefix)
            self._prefix = ""
            s = s.lstrip()
        self.out.append(s)

    def _block(self) -> None:
        self._break = True

    # -- HTMLParser callbacks ---------------------------------------------------------------

    def handle_starttag(self, tag: str, attrs_list: list) -> None:
        attrs = {k: (v or "") for k, v in attrs_list}
        if self._skip:
            if tag == self._skip[-1]:
                self._skip.append(tag)
            return
        if tag in DROPPED:
            if tag not in _VOID:
                self._skip.append(tag)
            return
        if tag not in BLOCKS and tag not in INLINE and ":" not in tag:
            self._text(self.get_starttag_text() or "", raw=True)   # x<y and y>z: no element
            return
        if tag in ("code", "pre"):
            self._code += 1
        if tag in BLOCKS:
            self._block()
        if tag in ("ul", "ol"):
            start = attrs.get("start", "1")
            self._lists.append((int(start) if start.isdigit() else 1) if tag == "ol" else None)
        elif tag == "li" and self._lists and self._lists[-1] is not None:
            self._prefix = f"{self._lists[-1]}. "
            self._lists[-1] += 1
        elif tag == "tr":
            self._cells = 0
        elif tag in ("td", "th"):
            if self._cells:
                self._text(", ", raw=True)
            self._cells += 1
        elif tag == "break":
            self._text(_pause(attrs), raw=True)
        elif tag == "img":
            self._text(" " + attrs.get("alt", "") + " ")
        elif tag == "sub" and "alias" in attrs:
            self._text(attrs["alias"])
            self._skip.append(tag)
        elif tag == "a" or (tag == "say-as" and attrs.get("interpret-as", "").lower() in _SPELLED):
            self._captures.append((tag, attrs, len(self.out)))

    def handle_startendtag(self, tag: str, attrs_list: list) -> None:
        self.handle_starttag(tag, attrs_list)
        if tag not in _VOID:
            self.handle_endtag(tag)

    def handle_endtag(self, tag: str) -> None:
        if self._skip:
            if tag == self._skip[-1]:
                self._skip.pop()
            return
        if tag not in BLOCKS and tag not in INLINE and ":" not in tag:
            self._text(f"</{tag}>", raw=True)
            return
        if tag in ("code", "pre"):
            self._code = max(0, self._code - 1)
        if tag in ("ul", "ol") and self._lists:
            self._lists.pop()
        if tag in BLOCKS:
            self._block()
        if self._captures and self._captures[-1][0] == tag:
            self._close_capture()

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self._text(data)

    def _close_capture(self) -> None:
        tag, attrs, start = self._captures.pop()
        inner = "".join(self.out[start:])
        del self.out[start:]
        if tag == "a":
            self.out.append(link_text(inner, attrs.get("href", "")))
        else:            # say-as characters: one by one
            self.out.append(" " + " ".join(c for c in inner if not c.isspace()) + " ")

    def result(self) -> str:
        self.close()
        while self._captures:
            self._close_capture()
        return "".join(self.out)


#: an ordered list item numbered other than 1 at a line's start (after any quote markers)
_LATE_ITEM = re.compile(r"(?P<q>(?:[ \t]*>)*)[ \t]*(?!1[.)])\d{1,9}[.)](?:[ \t]|$)")   # one way to match: linear
_QUOTES = re.compile(r"^(?:[ \t]*>)*")


def items_anywhere(text: str) -> str:
    """``text`` (Markdown) with a blank line (in the same quote) before every ordered list item
    numbered other than 1 that follows a line of text. CommonMark lets only a list starting at 1
    interrupt a paragraph, so ``Steps:\n3) * wash`` would be a paragraph whose ``*`` is read
    aloud; an agent that writes it means a list."""
    out: list[str] = []
    after_text = False
    for line in text.split("\n"):
        m = _LATE_ITEM.match(line)
        if m and after_text:
            out.append(m.group("q").rstrip())
        out.append(line)
        after_text = bool(_QUOTES.sub("", line).strip())
    return "\n".join(out)


def flatten(text: str) -> str:
    """``text`` (Markdown) with the quote and list markers at the start of each line removed, so no
    block nests: ``> - > 1. word`` -> ``1\\. word`` (the last ordered item's number stays, escaped:
    text, not a list); everything else, line breaks too, is kept."""
    def strip(m: re.Match) -> str:
        nums = re.findall(r"(\d{1,9})[.)](?=[ \t]|$)", m.group(0))
        return nums[-1] + "\\. " if nums else ""
    return _CONTAINERS.sub(strip, text)


class Markup:
    """The markup stage (module docstring): ``Markup()(text) -> text`` to normalize. One parser,
    built once; a call keeps its state in its own walker, so calls may run on any thread."""

    def __init__(self) -> None:
        self.md = MarkdownIt("commonmark", {"html": True, "linkify": True, "maxNesting": MAX_NESTING}).enable(
            ["table", "strikethrough", "linkify"]).disable("html_block")

    def __call__(self, text: str, ssml: bool = False) -> str:
        """``text`` without its markup.

        Args:
            text: what the sender wrote (Markdown, HTML, SSML or plain text).
            ssml: the sender declared SSML (else a whole ``<speak>...</speak>`` document is).

        Returns:
            plain text with control tokens; line breaks where sentences end. Empty when the
            markup held nothing to say (the normalizer then says so).
        """
        tokens = CTRL_RE.findall(text)
        n = iter(range(len(tokens)))
        body = CTRL_RE.sub(lambda m: _aside(next(n)), _PUA_RE.sub("", text))
        ssml = ssml or bool(_SSML_DOC.fullmatch(body))
        walker = _Speech(ssml=ssml)
        walker.feed(body if ssml else self._html(items_anywhere(_TIMES_RE.sub(r"\\*", body))))
        out = walker.result()
        out = _SET_ASIDE.sub(lambda m: tokens[int("".join(str(ord(c) - 0xE001) for c in m.group(1)))], out)
        return _SPACES.sub(" ", _BLANKS.sub("\n", out)).strip()

    def _html(self, md: str) -> str:
        """Markdown -> HTML with every word of it (module docstring: flattened when too deep)."""
        for src in (md, flatten(md)):
            tokens = self.md.parse(src)
            if not any(t.level >= MAX_NESTING - 1 for t in tokens):
                return self.md.renderer.render(tokens, self.md.options, {})
        return md                                    # still too deep: no Markdown, tags still go


__all__ = ["Markup", "link_text", "flatten", "items_anywhere", "DROPPED", "BLOCKS", "INLINE", "MAX_NESTING"]
