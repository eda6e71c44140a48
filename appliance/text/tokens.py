"""ChatTTS control tokens and special ids.

The official tokenizer (``asset/tokenizer/tokenizer.json``, a BERT WordPiece vocabulary of
21,128 bert-base-chinese entries) has 50 ChatTTS control tokens appended at ids 21128..21177 in
the order below (source: the layout of the HF ``2Noise/ChatTTS`` tokenizer as documented by
third-party ports). Code never hard-codes the
numeric ids: it asks the loaded tokenizer, so a real checkpoint and a random one behave alike.
"""

from __future__ import annotations

import re

#: The 50 control tokens, in vocabulary order.
CONTROL_TOKENS: tuple[str, ...] = (
    "[Sasr]", "[Pasr]", "[Easr]", "[Stts]", "[Ptts]", "[Etts]", "[Sbreak]", "[Pbreak]", "[Ebreak]",
    "[uv_break]", "[v_break]", "[lbreak]", "[llbreak]", "[undefine]", "[laugh]", "[spk_emb]",
    "[empty_spk]", "[music]", "[pure]",
    *(f"[break_{i}]" for i in range(8)),
    *(f"[laugh_{i}]" for i in range(3)),
    *(f"[oral_{i}]" for i in range(10)),
    *(f"[speed_{i}]" for i in range(10)),
)
assert len(CONTROL_TOKENS) == 50

#: BERT special tokens at the start of the vocabulary.
BERT_SPECIALS: tuple[str, ...] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

#: Control tokens a user may write inside request text (passed through normalization untouched).
USER_CONTROL_TOKENS: frozenset[str] = frozenset(
    t for t in CONTROL_TOKENS
    if t not in ("[Sasr]", "[Pasr]", "[Easr]", "[Stts]", "[Ptts]", "[Etts]", "[Sbreak]",
                 "[Pbreak]", "[Ebreak]", "[spk_emb]", "[empty_spk]")
)

#: Matches exactly the 50 control tokens (longest first), as one group: ``CTRL_RE.split`` keeps them.
CTRL_RE = re.compile("(" + "|".join(re.escape(t) for t in sorted(CONTROL_TOKENS, key=len, reverse=True)) + ")")

#: Matches any bracketed token such as ``[uv_break]`` or ``[speed_5]``.
TOKEN_RE = re.compile(r"\[[A-Za-z_]+(?:_\d+)?\]|\[[a-z]+_\d\]")
