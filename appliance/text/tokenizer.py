"""Text tokenizer: ChatTTS's BERT WordPiece vocabulary through the ``tokenizers`` library.

Upstream (``ChatTTS/model/tokenizer.py``) loads ``asset/tokenizer`` with transformers'
``BertTokenizerFast`` and encodes with ``add_special_tokens=False``; the fast tokenizer *is* the
``tokenizers`` ``tokenizer.json``, so we load that file directly (no transformers, no torch).
Control tokens (``[uv_break]``, ``[speed_5]``, ...) are added tokens of that file and come out
as single ids.

The code prompt is built as upstream ``Speaker.decorate_code_prompts``
(``ChatTTS/model/speaker.py``): the text is stripped of ``[Stts]``, ``[spk_emb]`` and
``[empty_spk]`` and of surrounding whitespace, then
``[Stts][spk_emb]{txt_smp}{prompt}{text}[Ptts]`` (``[empty_spk]`` instead of ``[spk_emb]``
without a speaker).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
from tokenizers import Tokenizer as _HFTokenizer

from ..errors import CheckpointError, TextError

log = logging.getLogger(__name__)

#: Where the tokenizer sits inside a checkpoint directory (official layout).
TOKENIZER_JSON = Path("asset/tokenizer/tokenizer.json")

_STRIPPED = ("[Stts]", "[spk_emb]", "[empty_spk]")


class Tokenizer:
    """ChatTTS text tokenizer.

    Attributes:
        vocab_size: number of ids (21178 for the real checkpoint).
        unk_id: id of ``[UNK]``.
        spk_emb_id: id of ``[spk_emb]`` (the model puts the speaker vector there).
    """

    def __init__(self, tok: _HFTokenizer, source: str = "<memory>") -> None:
        tok.no_padding()
        tok.no_truncation()
        self._tok = tok
        self.source = source
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self.unk_id: int = self._required("[UNK]")
        self.spk_emb_id: int = self._required("[spk_emb]")
        for t in ("[Stts]", "[Ptts]", "[empty_spk]"):
            self._required(t)

    # -- loading ------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: Union[str, os.PathLike]) -> "Tokenizer":
        """Load from a checkpoint directory (``asset/tokenizer/tokenizer.json`` inside it), a
        tokenizer directory (holding ``tokenizer.json``) or the ``tokenizer.json`` file itself.

        Raises:
            CheckpointError: no ``tokenizer.json`` there, it does not parse, or it lacks
                ``[UNK]`` / ``[spk_emb]`` / ``[Stts]`` / ``[Ptts]`` / ``[empty_spk]``.
        """
        p = Path(path)
        for cand in (p / TOKENIZER_JSON, p / "tokenizer.json", p):
            if cand.is_file():
                break
        else:
            raise CheckpointError(
                f"no tokenizer.json under {p} (official ChatTTS layout: <model.path>/asset/tokenizer/"
                "tokenizer.json); point model.path at a checkpoint or write one with "
                "'chattts-appliance model random --size tiny DIR'")
        try:
            tok = _HFTokenizer.from_file(str(cand))
        except Exception as e:  # the tokenizers library raises plain Exception subclasses
            raise CheckpointError(f"{cand} is not a tokenizers JSON file: {e}") from e
        return cls(tok, str(cand))

    def _required(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise CheckpointError(f"tokenizer {self.source} has no {token} token; is it a ChatTTS tokenizer?")
        return i

    # -- ids ----------------------------------------------------------------------------------

    def id_of(self, token: str) -> int:
        """Id of one vocabulary entry (e.g. ``"[spk_emb]"``).

        Raises:
            TextError: the token is not in the vocabulary.
        """
        i = self._tok.token_to_id(token)
        if i is None:
            raise TextError(f"{token!r} is not in the tokenizer's vocabulary")
        return i

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` without ``[CLS]``/``[SEP]`` (``add_special_tokens=False``).

        Returns:
            ``int64[T]``.
        """
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and their character spans in ``text``.

        Returns:
            ``(ids int64[T], offsets int64[T, 2])`` with ``text[a:b]`` the source of each token.
        """
        enc = self._tok.encode(text, add_special_tokens=False)
        return (np.asarray(enc.ids, dtype=np.int64),
                np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2))

    def decode(self, ids: Union[Sequence[int], np.ndarray], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (WordPiece joining; CJK characters come back space-separated)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def unknown_chars(self, text: str) -> list[str]:
        """Characters of ``text`` that the vocabulary cannot represent (they would become
        ``[UNK]``), each once, in order of appearance.

        A WordPiece word holding one unknown character becomes a single ``[UNK]`` as a whole,
        so every character of an ``[UNK]`` span is checked on its own.
        """
        enc = self._tok.encode(text, add_special_tokens=False)
        out: list[str] = []
        for i, (a, b) in zip(enc.ids, enc.offsets):
            if i != self.unk_id:
                continue
            for ch in text[a:b]:
                if ch.isspace() or ch in out:
                    continue
                if self.unk_id in self._tok.encode(ch, add_special_tokens=False).ids:
                    out.append(ch)
        return out

    # -- prompts ------------------------------------------------------------------------------

    @staticmethod
    def prompt_text(text: str, *, with_speaker: bool = True, prompt: str = "",
                    txt_smp: Optional[str] = None) -> str:
        """The text of upstream's code prompt for one sentence.

        Args:
            text: normalized sentence.
            with_speaker: True = ``[spk_emb]`` (a speaker vector will be inserted), False =
                ``[empty_spk]``.
            prompt: control tokens put before the text (config ``synthesis.prompt``, e.g.
                ``"[speed_5]"``).
            txt_smp: transcript of a reference clip (zero-shot cloning); None = none.

        Returns:
            ``[Stts][spk_emb]{txt_smp}{prompt}{text}[Ptts]``.
        """
        for t in _STRIPPED:
            text = text.replace(t, "")
        text = text.strip()
        if prompt:
            text = prompt + text
        return f"[Stts]{'[spk_emb]' if with_speaker else '[empty_spk]'}{txt_smp or ''}{text}[Ptts]"

    def code_prompt(self, text: str, *, with_speaker: bool = True, prompt: str = "",
                    txt_smp: Optional[str] = None, max_tokens: Optional[int] = None) -> np.ndarray:
        """Token ids of :meth:`prompt_text` (what the GPT prefill takes).

        Args:
            max_tokens: limit (``cfg.model.max_prompt_tokens``); None = no limit.

        Returns:
            ``int64[T]``.

        Raises:
            TextError: longer than ``max_tokens`` (split the text first: ``appliance.text.split``).
        """
        ids = self.encode(self.prompt_text(text, with_speaker=with_speaker, prompt=prompt, txt_smp=txt_smp))
        if max_tokens is not None and ids.size > max_tokens:
            raise TextError(
                f"the sentence is {ids.size} tokens with its prompt, over the limit of {max_tokens} "
                f"(model.max_prompt_tokens); split it with appliance.text.split or raise the limit")
        return ids
