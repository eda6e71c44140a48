"""Text normalization that loses no words: what the box says is what the text meant.

One request's text goes through, in order:

0. input cleaning (:func:`clean_controls`): line breaks ``\\r\\n`` / ``\\r`` become ``\\n``, and every
   other control character (C0, DEL, C1; NUL included) except ``\\n`` and ``\\t`` becomes a space,
   so none reaches the rules, the tokenizer or a log line; then the markup stage
   (:mod:`.markup`): Markdown, HTML and SSML out, links as their text, addresses short,
   ``<break>`` as a pause token, control tokens kept; then chat text (:mod:`.lists`: list numbers
   in their item's language; :mod:`.emoticons`: kaomoji, emoticons and emoji clusters dropped or
   said by meaning; :mod:`.roman`: Roman numerals where the context makes them numbers);
1. the script pass (:mod:`.scripts`): compatibility forms, digits of any script, traditional ->
   simplified Chinese (OpenCC), Latin letters with diacritics spelled in ASCII;
   then runs collapsed and unpronounceable tokens (hashes, long codes) shortened (:mod:`.shorten`);
2. control tokens (``[uv_break]``, ``[laugh]``, ``[speed_5]`` ...) are cut out and pass
   byte for byte; the prompt's own tokens (``[Stts]``, ``[spk_emb]`` ...) are removed and reported;
3. language per span (:mod:`.spans`): Chinese or English for each stretch, numbers and codes by
   the clause they stand in;
4. per span: our rules (:mod:`.rules`, one table with the reason for each), then ``wetext``
   (PyPI, Apache-2.0; zh and en TN FSTs, offline; ~1 ms + ~0.25 ms per character per call on
   the 2-core dev box, only on sentences that still hold digits or unit signs), then our own
   verbalizer for any digit left (:mod:`.numbers`), then symbols as words (:mod:`.units`);
5. punctuation as upstream ``norm.py`` within a span: Chinese spans get full-width marks,
   ``：；！（）《》…`` become ``，``/``。`` and only ``，。、,.`` are kept; we additionally keep
   question marks as sentence ends and turn line breaks into sentence ends;
   an apostrophe is kept (``don't``, ``John's``; ``’`` becomes ``'``): the tokenizer knows it,
   and a tokenizer that does not reports it as unspeakable in step 6;
6. whatever is left that cannot be spoken (other scripts, symbols we have no word for,
   characters the tokenizer maps to ``[UNK]``) is removed and reported, each once, by name, a
   grapheme cluster whole; last, no unit of the spoken form repeats more than
   :data:`~.shorten.MAX_SPOKEN_REPEATS` times (:func:`~.shorten.bound_spoken`).

Every decision of the chat-text stages (a number, a picture, a run, a code) is noted in
:attr:`NormalizedText.notes`, which ``chattts-appliance normalize`` prints.

If ``wetext`` is not installed, our rules and verbalizer alone run (a warning says that dates
are then read as plain numbers). Homophone replacement (upstream ``homophones_map.json``) is
not done.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from dataclasses import dataclass
from typing import Optional

from ..errors import TextError
from .emoticons import clusters, pictures
from .lists import list_numbers as number_items
from .markup import Markup
from .numbers import verbalize_numbers
from .roman import read_roman
from .rules import WEB_RE, apply_rules
from .scripts import ScriptConverter, describe, is_cjk, is_latin
from .shorten import bound_spoken, collapse_runs, say_marks, shorten_codes
from .spans import detect_language, split_spans
from .tokens import CTRL_RE, USER_CONTROL_TOKENS
from .units import read_symbols

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NormalizedText:
    """Result of :class:`Normalizer`.

    Attributes:
        text: speakable text: CJK, Latin letters, ``，。、,.`` , spaces and control tokens.
        cleaned: the input after the markup stage (:mod:`.markup`), before the rules.
        unspeakable: what was removed because it cannot be spoken (characters such as emoji,
            symbols, other scripts, characters the tokenizer maps to ``[UNK]``, and structural
            control tokens such as ``[Stts]``), each once, in order of appearance.
        lang: dominant language of the input, ``"zh"`` or ``"en"``.
        notes: what the chat-text stages decided, one line each (a list number, a picture said or
            dropped, a Roman numeral, a run collapsed, a code or link shortened), in order.
    """

    text: str
    unspeakable: tuple[str, ...]
    lang: str
    cleaned: str = ""
    notes: tuple[str, ...] = ()

    @property
    def unspeakable_names(self) -> tuple[str, ...]:
        """:attr:`unspeakable` by name: ``😀 (U+1F600 GRINNING FACE)``."""
        return tuple(describe(u) for u in self.unspeakable)


_HALF2FULL = str.maketrans({"!": "！", ",": "，", ".": "。", ":": "：", ";": "；", "?": "？", "(": "（", ")": "）"})
#: upstream's simplification of full-width marks (both languages: a mark keeps its script)
_SIMPLIFY_FULL = str.maketrans({"：": "，", "；": "，", "！": "。", "？": "。", "（": "，", "）": "，", "【": "，",
                                "】": "，", "『": "，", "』": "，", "「": "，", "」": "，", "《": "，", "》": "，",
                                "－": "，", "～": "，", "·": " "})
_SIMPLIFY_ZH = str.maketrans({"…": "。", "—": "，"})
_SIMPLIFY_EN = str.maketrans({":": ",", ";": ",", "!": ".", "?": ".", "(": ",", ")": ",", "<": ",", ">": ",",
                              "-": " ", "…": ".", "—": ",", "–": ",", "~": " ", "/": " ", "_": " "})
_KEPT_PUNCT = set("，。、,.")
_APOSTROPHES = set("'’")
_QUOTES = set("'‘’")
#: wetext gets one clause at a time (it takes ``123456，5`` for one number otherwise).
_WETEXT_CUT = re.compile(r"(?<=[。！？!?\n，、；：])|(?<=\.)(?!\d)")
_WETEXT_TRIGGER = re.compile(r"[\d%‰°$¥￥€£℃]")
#: ASCII marks that no rule gave a meaning: pauses, never words (wetext reads | as vertical bar)
_NOT_SAID = re.compile(r"[|^_`\\~]|(?<!\d)[*/]|[*/](?!\d)")
#: control characters (Unicode category Cc) other than \t and \n: C0, DEL and C1
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
#: WordPiece turns a word longer than 100 characters into one [UNK]: long runs are cut.
_LONG_WORD_RE = re.compile(r"[A-Za-z]{48}(?=[A-Za-z])")


def _is_apostrophe(s: str, i: int) -> bool:
    """Whether the ``'`` or ``’`` at ``s[i]`` is an apostrophe (kept) rather than a quotation mark
    (not spoken): between two Latin letters (``don't``, ``John's``, ``o'clock``), or after the
    ``s`` that ends a word (``the drivers' seats``) unless a single quote opened before it is
    still open (``'yes'``); O(i) per quote character."""
    before = i > 0 and is_latin(s[i - 1])
    after = i + 1 < len(s) and is_latin(s[i + 1])
    if before and after:
        return True
    if not before or after or s[i - 1] not in "sS":
        return False
    quote_open = False   # scan the quotes before i: a word-initial one opens, a word-final one closes
    for k in (k for k in range(i) if s[k] in _QUOTES):
        letter_before = k > 0 and is_latin(s[k - 1])
        letter_after = k + 1 < len(s) and is_latin(s[k + 1])
        if letter_after and not letter_before:
            quote_open = True
        elif letter_before and not letter_after and quote_open:
            quote_open = False
    return not quote_open


def clean_controls(text: str) -> str:
    """``text`` with ``\\r\\n`` and ``\\r`` as ``\\n`` and every other control character (NUL and the
    rest of C0, DEL, C1) except ``\\n`` and ``\\t`` replaced by a space; same length or shorter."""
    return _CONTROLS.sub(" ", text.replace("\r\n", "\n").replace("\r", "\n"))


class Normalizer:
    """Callable text normalizer (see module docstring).

    Args:
        tokenizer: optional :class:`appliance.text.tokenizer.Tokenizer`; when given, characters
            its vocabulary cannot represent are removed and reported too.
        use_wetext: use ``wetext`` when importable (False = our own rules only).
        t2s: convert traditional to simplified Chinese (OpenCC).
    """

    def __init__(self, tokenizer=None, use_wetext: bool = True, t2s: bool = True) -> None:
        self.tokenizer = tokenizer
        self.scripts = ScriptConverter(t2s=t2s)
        self.markup = Markup()
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

    def __call__(self, text: str, request_id: Optional[str] = None, *, emoji: str = "drop",
                 list_numbers: str = "speak") -> NormalizedText:
        """Normalize one request's text.

        Args:
            text: what the sender wrote.
            request_id: named in every log line about this text.
            emoji: ``synthesis.emoji``: ``drop`` or ``name`` (:mod:`.emoticons`).
            list_numbers: ``synthesis.list_numbers``: ``speak`` or ``drop`` (:mod:`.lists`).

        Returns:
            :class:`NormalizedText`.

        Raises:
            TextError: not a string, empty, only punctuation/whitespace/control tokens, or
                nothing speakable left (the message names the unspeakable characters).
        """
        if not isinstance(text, str):
            raise TextError(f"text must be a string, got {type(text).__name__}")
        text = clean_controls(text)
        if not text.strip():
            raise TextError("text is empty; send something to speak")
        text = cleaned = self.markup(text)
        if not text:
            raise TextError("the text holds only markup (tags, Markdown signs, a link without text); "
                            "send words to speak")
        rid = request_id or "-"
        unspeakable: list[str] = []
        notes: list[str] = []

        def report(item: str) -> None:
            if item not in unspeakable:
                unspeakable.append(item)

        first = detect_language(CTRL_RE.sub(" ", text))
        text = number_items(text, list_numbers, first, notes.append)
        text = read_roman(pictures(text, emoji, first, report, notes.append), notes.append)
        text = collapse_runs(self.scripts.convert(text), notes.append)
        text = apply_rules(shorten_codes(text, WEB_RE, notes.append), "", stage="before_spans")
        dominant = detect_language(CTRL_RE.sub(" ", text))
        parts = CTRL_RE.split(text)
        out: list[str] = []
        for idx, part in enumerate(parts):
            if idx % 2 == 1:  # a control token
                if part in USER_CONTROL_TOKENS:
                    out.append(part)
                else:
                    report(part)
                continue
            out.append(self._segment(part, dominant, report, rid))
        result = re.sub(r"[ \t]+", " ", "".join(out)).strip()
        result = re.sub(r" ?([，。、]) ?", r"\1", result)
        result = re.sub(r" ([,.])", r"\1", result)
        result = re.sub(r"([，。、,.])[，。、,.]+", r"\1", result)  # runs of pauses: keep the first
        result = _LONG_WORD_RE.sub(r"\g<0> ", bound_spoken(result, notes.append))
        if self.tokenizer is not None:
            for c in self.tokenizer.unknown_chars(CTRL_RE.sub(" ", result)):
                report(c)
                result = result.replace(c, "")
        spoken = CTRL_RE.sub("", result)
        if not any(is_cjk(c) or is_latin(c) for c in spoken):
            if unspeakable:
                raise TextError("nothing speakable in the text; these cannot be spoken: "
                                + ", ".join(describe(u) for u in unspeakable))
            raise TextError("the text holds only punctuation, whitespace or control tokens; send words to speak")
        if unspeakable:
            log.info("request %s: removed what cannot be spoken: %s", rid, ", ".join(describe(u) for u in unspeakable),
                     extra={"request_id": rid})
        log.debug("request %s: speaks %r", rid, result, extra={"request_id": rid})
        return NormalizedText(result, tuple(unspeakable), dominant, cleaned, tuple(notes))

    # -- one stretch of text between control tokens ------------------------------------------

    def _segment(self, seg: str, dominant: str, report, rid: str) -> str:
        seg = re.sub(r"\s*[\r\n]+\s*", "\n", seg)  # line breaks end sentences
        return "".join(self._span(lang, span, report, rid) for lang, span in split_spans(seg, dominant))

    def _span(self, lang: str, s: str, report, rid: str) -> str:
        s = _NOT_SAID.sub(" ", apply_rules(say_marks(s, lang), lang))   # wetext would name them (vertical bar)
        if _WETEXT_TRIGGER.search(s):  # wetext costs ~0.25 ms per character: only where needed
            s = "".join(self._wetext(lang, x, rid) if _WETEXT_TRIGGER.search(x) else x for x in _WETEXT_CUT.split(s))
            s = re.sub(r"\bslash\b", "over", s) if lang == "en" else s   # a ratio wetext could not read (00/0)
        if re.search(r"\d", s):
            s = verbalize_numbers(s, lang)
        s = read_symbols(s, lang)
        if lang == "zh":
            s = s.translate(_HALF2FULL).translate(_SIMPLIFY_ZH).translate(_SIMPLIFY_FULL)
        else:
            s = s.translate(_SIMPLIFY_EN).translate(_SIMPLIFY_FULL)
        end = "。" if lang == "zh" else "."
        s = re.sub(r"([，。、,.]?)\n", lambda m: (m.group(1) if m.group(1) in ("。", ".") else end) + " ", s)
        kept = []
        i = 0
        for g in clusters(s):
            c = g[0]
            if len(g) > 1 and not (is_cjk(c) or is_latin(c) or c in _KEPT_PUNCT or c.isspace()):
                report(g)   # a cluster of another script, or a picture no stage knew: whole
                kept.append(" ")
            else:
                kept.extend(_keep(x, s, i + k, report) for k, x in enumerate(g))
            i += len(g)
        return "".join(kept)

    def _wetext(self, lang: str, s: str, rid: str) -> str:
        wt = self._wt.get(lang)
        if wt is None:
            return s
        lead = s[: len(s) - len(s.lstrip())]
        trail = s[len(s.rstrip()):]
        core = re.sub(r"[ \t]{2,}", " ", s.strip())  # wetext en raises on double spaces
        if not core:
            return s
        try:
            return lead + wt.normalize(core) + trail
        except Exception as e:  # wetext raises AssertionError on some inputs
            log.debug("request %s: wetext (%s) failed on %r (%s); read by our own rules", rid, lang, core, e,
                      extra={"request_id": rid})
            return s


def _keep(c: str, s: str, i: int, report) -> str:
    """What the character ``c`` at ``s[i]`` (in a cluster led by a speakable one) leaves in the
    spoken form: itself, an apostrophe, a space, nothing, or a space with ``c`` reported."""
    if is_cjk(c) or is_latin(c) or c in _KEPT_PUNCT or c == " ":
        return c
    if c in _APOSTROPHES and _is_apostrophe(s, i):
        return "'"       # don't, John's, o'clock, drivers': the tokenizer knows '
    if c.isspace() or unicodedata.category(c).startswith("P"):
        return " "       # quotes, brackets ...: not spoken, not words
    if unicodedata.category(c) in ("Mn", "Me", "Cf", "Cc"):
        return ""        # zero-width / format characters, emoji variation selectors: invisible
    report(c)            # symbols, other scripts
    return " "
