"""ChatTTS input embeddings and output heads (upstream ``ChatTTS/model/embed.py`` layout).

* ``emb_text``: text table ``[num_text_tokens, D]``.
* ``emb_code.N``: Q audio-code tables ``[V, D]``; an audio position's embedding is their sum.
* ``head_text``, ``head_code.N``: bias-free linear heads. Upstream stores them with weight
  normalisation (``torch.nn.utils.parametrizations.weight_norm``, dim=0: ``W = g * v / ||v||``
  with the norm over each output row); :func:`fold_weight_norm` turns (g, v) into plain weights
  at load (Salimans & Kingma 2016).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .shapes import ModelShapes


def fold_weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``g [out, 1]``, ``v [out, in]`` -> ``W = g * v / ||v||_row`` ``[out, in]`` (float32 math)."""
    g32, v32 = g.float(), v.float()
    return (g32 * (v32 / v32.norm(dim=1, keepdim=True))).to(v.dtype)


class Embed(nn.Module):
    """Text / audio-code embeddings and heads with plain (weight-norm folded) head weights.

    State-dict names (after folding): ``emb_code.N.weight``, ``emb_text.weight``,
    ``head_text.weight``, ``head_code.N.weight``.
    """

    def __init__(self, s: ModelShapes):
        super().__init__()
        self.shapes = s
        d = s.hidden
        self.emb_code = nn.ModuleList([nn.Embedding(s.num_audio_tokens, d) for _ in range(s.num_vq)])
        self.emb_text = nn.Embedding(s.num_text_tokens, d)
        self.head_text = nn.Linear(d, s.num_text_tokens, bias=False)
        self.head_code = nn.ModuleList([nn.Linear(d, s.num_audio_tokens, bias=False) for _ in range(s.num_vq)])

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [..., T]`` int64 text ids -> ``[..., T, D]``."""
        return self.emb_text(ids)

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes [..., Q]`` int64 -> sum of the Q code embeddings ``[..., D]``."""
        embs = [self.emb_code[i](codes[..., i]) for i in range(self.shapes.num_vq)]
        return torch.stack(embs, -1).sum(-1)

    def audio_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [..., D]`` -> audio logits ``[..., Q, V]`` (float32 as the hidden dtype)."""
        return torch.stack([h(hidden) for h in self.head_code], -2)

    def text_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [..., D]`` -> text logits ``[..., num_text_tokens]``."""
        return self.head_text(hidden)


def apply_speaker(emb: torch.Tensor, ids: torch.Tensor, spk_emb: torch.Tensor, spk_id: int) -> torch.Tensor:
    """Replace the embedding at every ``[spk_emb]`` position by the L2-normalised speaker vector.

    ``emb [T, D]``, ``ids [T]``, ``spk_emb [D]``; returns a new ``[T, D]`` tensor.
    Source: upstream ``ChatTTS/model/speaker.py`` ``Speaker.apply`` (``F.normalize(p=2, eps=1e-12)``).
    """
    n = F.normalize(spk_emb.to(emb.dtype), p=2.0, dim=0, eps=1e-12)
    return torch.where((ids == spk_id).unsqueeze(-1), n.unsqueeze(0).expand_as(emb), emb)
