"""A sentence's step budget: how long its audio should be, from its length and the language's
speaking rate, and the decode-step cap it gets.

ChatTTS makes 46.875 decode steps (codes) per second of audio (24 kHz, 512 samples per code,
``appliance.core``). A sentence is expected to last (normalized text, :func:`expected_s`):

* Chinese: :data:`ZH_CHARS_PER_S` = 4.5 characters per second (ChatTTS's usual 4 to 5 at
  ``[speed_5]``, the default prompt);
* English: :data:`EN_WORDS_PER_S` = 2.5 words per second (150 words per minute; a letter spelled
  alone, as in a code, counts as a word);
* plus :data:`PAUSE_S` for each pause the model makes: 0.2 s per kept mark (``，。、,.``), 0.3 s per
  ``[uv_break]``/``[v_break]``/``[break_N]``, 0.6 s per ``[lbreak]``, 0.8 s per ``[laugh]``.

Its cap (:func:`step_cap`) is proportional: :data:`CAP_FACTOR` (2) times the expected length,
at least :data:`MIN_CAP_S` (4 s) and the request's ``min_new_tokens``, at most the configured ceiling (``synthesis.max_new_tokens``, or
a request's lower ``params.max_new_tokens``). The splitter (:mod:`.split`) cuts a segment whose
proportional cap would pass the ceiling (:func:`fits`), so a long unpunctuated text becomes
segments that each fit; it never cuts below :data:`MIN_CUT_S` (10 s) of expected speech, so a
small ceiling (a test's, a debugging one) does not chop sentences into words: those segments
reach their cap and are reported (``done.truncated``).
"""

from __future__ import annotations

import math
import re

#: decode steps per second of audio (24000 Hz / 512 samples per code)
STEPS_PER_S = 46.875
#: Chinese characters spoken per second (ChatTTS at ``[speed_5]``: 4 to 5)
ZH_CHARS_PER_S = 4.5
#: English words spoken per second (150 words per minute)
EN_WORDS_PER_S = 2.5
#: seconds of pause per mark or control token
PAUSE_S = {"mark": 0.2, "[uv_break]": 0.3, "[v_break]": 0.3, "[lbreak]": 0.6, "[llbreak]": 0.8, "[laugh]": 0.8}
#: the cap is this many times the expected length
CAP_FACTOR = 2.0
#: no cap below this many seconds of audio (a short sentence's silence before and after)
MIN_CAP_S = 4.0
#: segments are not cut below this many seconds of expected speech, whatever the ceiling
MIN_CUT_S = 10.0

_ZH_RE = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]")
_EN_WORD_RE = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")
_MARK_RE = re.compile(r"[，。、,.!?！？；;：:]")
_TOKEN_RE = re.compile(r"\[[a-z_]+(?:_\d)?\]")


def expected_s(text: str) -> float:
    """Seconds of speech expected for normalized ``text`` (module docstring), >= 0."""
    s = len(_ZH_RE.findall(text)) / ZH_CHARS_PER_S + len(_EN_WORD_RE.findall(_TOKEN_RE.sub(" ", text))) / EN_WORDS_PER_S
    s += PAUSE_S["mark"] * len(_MARK_RE.findall(text))
    for tok in _TOKEN_RE.findall(text):
        s += PAUSE_S.get(tok, 0.3 if tok.startswith("[break_") else 0.0)
    return s


def step_cap(text: str, ceiling: int, min_steps: int = 0) -> int:
    """The decode-step cap of one sentence: ``CAP_FACTOR`` x its expected length, at least
    ``MIN_CAP_S`` and at least ``min_steps`` (``min_new_tokens``: what the request asked to
    hear), at most ``ceiling`` steps (>= 1)."""
    want = max(math.ceil(STEPS_PER_S * max(MIN_CAP_S, CAP_FACTOR * expected_s(text))), int(min_steps))
    return max(1, min(int(ceiling), want))


def fits(text: str, ceiling: int) -> bool:
    """Whether ``text`` may be one segment under a ceiling of ``ceiling`` steps: its proportional
    cap stays within the ceiling, or it is under ``MIN_CUT_S`` of expected speech."""
    e = expected_s(text)
    return e <= MIN_CUT_S or CAP_FACTOR * e * STEPS_PER_S <= ceiling
