"""Sentence splitting that respects the engine's prompt length in tokens.

Each piece becomes one GPT generation with the prompt ``[Stts][spk_emb]{prompt}{piece}[Ptts]``
(:meth:`appliance.text.tokenizer.Tokenizer.code_prompt`); the whole prompt, counted with the real
tokenizer, must fit ``cfg.model.max_prompt_tokens``. Order of cuts:

1. after sentence ends (``。！？.!?`` runs, and line breaks): every sentence is its own piece
   (a sentence is the natural unit of prosody; merging many would also risk hitting
   ``synthesis.max_new_tokens`` in one generation). A full stop ``.`` is no sentence end when a
   letter or digit follows it at once (``U.S``, ``a.m``) or it closes an initial (one letter:
   ``U.S.``, ``e.g.``) or an abbreviation of :data:`ABBREVIATIONS` (``Mr.``, ``St.``): cutting
   there made one-letter generations (``S.``) and broke the prosody; two sentences merged at a
   rare real end after such a word cost nothing;
2. a sentence over the limit is cut after clause marks (``，,；;：:、``) and its clauses are
   packed greedily up to the limit;
3. a clause still over the limit is cut at token boundaries (preferring the start of a word).

With ``max_steps`` (the sentence's step ceiling) "over the limit" also means a piece whose
expected speech needs more steps than that at the language's speaking rate
(:func:`appliance.text.budget.fits`): a long unpunctuated text becomes segments that each fit.

Pieces are contiguous slices of the input with surrounding whitespace removed, so joining
them gives the input back minus whitespace: nothing is lost or repeated. A piece with nothing
to say (only punctuation or control tokens) is attached to its neighbour. Each piece comes with
the code-prompt ids counted for it, so the caller does not tokenize it again.
"""

from __future__ import annotations

import logging
import re
from typing import NamedTuple, Optional

import numpy as np

from ..errors import TextError
from . import budget
from .tokens import TOKEN_RE

log = logging.getLogger(__name__)

_SENT_END_RE = re.compile(r"(?<=[。！？.!?\n])(?![。！？.!?\n”’\"')）])")
_WORD_BEFORE_DOT = re.compile(r"([A-Za-z]+)\.+$")
#: English abbreviations whose full stop ends no sentence (lower case, without the dot).
ABBREVIATIONS = frozenset(
    "mr mrs ms mx dr st jr sr prof rev gen col capt lt sgt mt ft vs etc inc ltd co corp dept est approx "
    "fig no vol ch pp ca cf al ave blvd rd jan feb mar apr jun jul aug sep sept oct nov dec".split())
_CLAUSE_RE = re.compile(r"(?<=[，,；;：:、])(?![，,；;：:、])")


class Sentence(NamedTuple):
    """One piece of :func:`split_text`: its text and the ids of its whole code prompt
    (``[Stts][spk_emb]{prompt}{text}[Ptts]``, ``int64[T]``, ``T <= max_prompt_tokens``)."""

    text: str
    ids: np.ndarray


def _speakable(piece: str) -> bool:
    rest = TOKEN_RE.sub("", piece)
    return any(c.isalnum() for c in rest)


def split_text(text: str, tokenizer, max_prompt_tokens: int, *, prompt: str = "",
               with_speaker: bool = True, max_steps: Optional[int] = None) -> list[Sentence]:
    """Cut normalized ``text`` into pieces whose code prompt fits ``max_prompt_tokens``.

    Args:
        text: normalized text (:class:`appliance.text.normalize.Normalizer` output).
        tokenizer: :class:`appliance.text.tokenizer.Tokenizer` of the checkpoint.
        max_prompt_tokens: ``cfg.model.max_prompt_tokens``.
        prompt: control tokens put before every piece (``synthesis.prompt``).
        with_speaker: whether the prompt holds ``[spk_emb]`` (else ``[empty_spk]``).
        max_steps: the step ceiling of one sentence (``synthesis.max_new_tokens``); a piece whose
            expected speech does not fit it is cut (:func:`appliance.text.budget.fits`). None: prompt
            tokens only.

    Returns:
        non-empty pieces in order, each with its code-prompt ids.

    Raises:
        TextError: the text has nothing to split, or the prompt alone leaves no room for text.
    """
    budget_total = max_prompt_tokens
    ids: dict[str, np.ndarray] = {}   # every piece is tokenized once, its ids kept for the caller

    def prompt_ids(piece: str) -> np.ndarray:
        if piece not in ids:
            ids[piece] = tokenizer.code_prompt(piece, with_speaker=with_speaker, prompt=prompt)
        return ids[piece]

    def n_tokens(piece: str) -> int:
        return int(prompt_ids(piece).size)

    def fits(piece: str) -> bool:
        return n_tokens(piece) <= budget_total and (max_steps is None or budget.fits(piece, max_steps))

    overhead = n_tokens("")
    if overhead >= budget_total:
        raise TextError(f"the prompt {prompt!r} alone is {overhead} tokens, leaving no room for text within "
                        f"model.max_prompt_tokens={max_prompt_tokens}; shorten synthesis.prompt")
    pieces: list[str] = []
    for sent in _cut(text, _SENT_END_RE, _full_stop_ends):
        if fits(sent):
            pieces.append(sent)
            continue
        packed = _pack(_cut(sent, _CLAUSE_RE), fits)
        for c in packed:
            if fits(c):
                pieces.append(c)
            else:
                pieces.extend(_hard_split(c, tokenizer, fits))
    pieces = _attach_silent(pieces, fits)
    if not pieces:
        raise TextError("nothing to speak after splitting the text")
    if len(pieces) > 1:
        log.debug("split %d characters into %d pieces", len(text), len(pieces))
    return [Sentence(p, prompt_ids(p)) for p in pieces]


def _full_stop_ends(text: str, end: int) -> bool:
    """Whether the sentence-end run ending at ``text[end - 1]`` ends a sentence: always, unless it
    is a full stop of an initial, an abbreviation or followed at once by a letter (module doc)."""
    if text[end - 1] != ".":
        return True
    if end < len(text) and text[end].isascii() and text[end].isalnum():
        return False
    w = _WORD_BEFORE_DOT.search(text, max(0, end - 16), end)
    return w is None or (len(w.group(1)) > 1 and w.group(1).lower() not in ABBREVIATIONS)


def _cut(text: str, boundary: re.Pattern, cuts=None) -> list[str]:
    """Contiguous slices at the (zero-width) ``boundary`` positions where ``cuts(text, pos)`` is
    true (all of them without ``cuts``), stripped, empty ones dropped."""
    out, start = [], 0
    for m in boundary.finditer(text):
        if cuts is None or cuts(text, m.end()):
            out.append(text[start:m.end()])
            start = m.end()
    out.append(text[start:])
    return [p.strip() for p in out if p.strip()]


def _join(a: str, b: str) -> str:
    """Join two adjacent pieces; a space only between two Latin/digit characters."""
    if a and b and a[-1].isascii() and a[-1].isalnum() and b[0].isascii() and b[0].isalnum():
        return a + " " + b
    if a and b and a[-1] in ",.;:" and b[0].isascii() and b[0].isalnum():
        return a + " " + b
    return a + b


def _pack(parts: list[str], fits) -> list[str]:
    out: list[str] = []
    for p in parts:
        if out and fits(_join(out[-1], p)):
            out[-1] = _join(out[-1], p)
        else:
            out.append(p)
    return out


def _hard_split(clause: str, tokenizer, fits) -> list[str]:
    """Cut ``clause`` at token starts so that each part ``fits`` (prompt tokens and step budget),
    the longest such head first, stepping back to a word start where one is near."""
    out: list[str] = []
    rest = clause
    while rest and not fits(rest):
        _, offs = tokenizer.encode_with_offsets(rest)
        if len(offs) < 2:
            break
        lo, hi = 1, len(offs) - 1
        while lo < hi:                      # the longest head that fits (fits is monotone in length)
            mid = (lo + hi + 1) // 2
            if fits(rest[:int(offs[mid][0])].strip()):
                lo = mid
            else:
                hi = mid - 1
        t = lo
        # prefer a word start: after whitespace/punctuation, or a CJK character / control token
        for u in range(t, max(t // 2, 1) - 1, -1):
            a = int(offs[u][0])
            if rest[a - 1].isspace() or not rest[a - 1].isalnum() or not rest[a].isascii() or rest[a] == "[":
                t = u
                break
        a = int(offs[t][0])
        head, rest = rest[:a].strip(), rest[a:].strip()
        if head:
            out.append(head)
        else:                               # nothing fits: one token alone
            a = int(offs[1][0]) if len(offs) > 1 else len(rest)
            out.append(rest[:a].strip())
            rest = rest[a:].strip()
    if rest:
        out.append(rest)
    return out


def _attach_silent(pieces: list[str], fits) -> list[str]:
    """Attach pieces with nothing to say (punctuation, control tokens) to a neighbour: the
    previous one when it fits, else the next one."""
    out: list[str] = []
    carry = ""
    for p in pieces:
        if carry:
            if fits(_join(carry, p)):
                p = _join(carry, p)
            else:
                out.append(carry)
            carry = ""
        if not _speakable(p) and out and fits(_join(out[-1], p)):
            out[-1] = _join(out[-1], p)
        elif not _speakable(p):
            carry = p
        else:
            out.append(p)
    if carry:
        out.append(carry)
    return out
