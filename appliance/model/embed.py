"""ChatTTS input embeddings and output heads (upstream ``ChatTTS/model/embed.py`` layout).

* ``emb_text``: text table ``[num_text_tokens, D]``.
* ``emb_code.N``: Q audio-code tables ``[V, D]``; an audio position's embedding is their sum.
* ``head_text``, ``head_code.N``: bias-free linear heads. Upstream stores them with weight
  normalisation (``torch.nn.utils.parametrizations.weight_norm``, dim=0: ``W = g * v / ||v||``
  with the norm over each output row); :func:`fold_weight_norm_` turns (g, v) into plain weights
  at load (Salimans & Kingma 2016).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .shapes import ModelShapes


def fold_weight_norm_(g32: torch.Tensor, v32: torch.Tensor) -> torch.Tensor:
    """``g32 [out, 1]``, ``v32 [out, in]`` (float32) -> ``W = g * v / ||v||_row`` ``[out, in]``, in
    place in ``v32`` (no second copy: the loader folds in the destination's rows); returns ``v32``."""
    return v32.div_(v32.norm(dim=1, keepdim=True)).mul_(g32)


#: Tables/heads stored per codebook in the checkpoint (``emb_code.N.weight``) and fused here.
FUSED = ("emb_code", "head_code")


def fused_target(key: str) -> tuple[str, int] | None:
    """``emb_code.2.weight`` -> (``emb_code.weight``, 2): the fused table a per-codebook key goes
    to and its block (rows ``2 * V .. 3 * V``); weight-norm parts (``head_code.2.parametrizations.
    weight.original1``) map likewise (folded first); None for a key loaded as it is."""
    name, _, rest = key.partition(".")
    if name in FUSED:
        n, _, tail = rest.partition(".")
        if n.isdigit() and tail in ("weight", "parametrizations.weight.original0", "parametrizations.weight.original1"):
            return f"{name}.weight", int(n)
    return None


class Embed(nn.Module):
    """Text / audio-code embeddings and heads with plain (weight-norm folded) head weights.

    The Q code tables and the Q code heads are each ONE matrix ``[Q*V, D]`` (row ``q*V + c`` is
    code ``c`` of codebook ``q``): one gather and one matrix product per step instead of Q.
    State-dict names (after folding): ``emb_text.weight``, ``head_text.weight`` and, as the
    checkpoint stores them, ``emb_code.N.weight`` / ``head_code.N.weight`` (fused at load by
    :meth:`load_state_dict`; ``emb_code.weight`` / ``head_code.weight`` load as well).
    """

    def __init__(self, s: ModelShapes):
        super().__init__()
        self.shapes = s
        d, q, v = s.hidden, s.num_vq, s.num_audio_tokens
        self.emb_code = nn.Embedding(q * v, d)
        self.emb_text = nn.Embedding(s.num_text_tokens, d)
        self.head_text = nn.Linear(d, s.num_text_tokens, bias=False)
        self.head_code = nn.Linear(d, q * v, bias=False)
        self.init_buffers()

    def init_buffers(self, device=None) -> None:
        """(Re)make the non-persistent buffer ``code_offset`` int64 ``[Q]`` (row of code 0 of each
        codebook in the fused tables) on ``device`` (see :meth:`appliance.model.gpt.GPT.init_buffers`)."""
        s = self.shapes
        off = torch.arange(s.num_vq, dtype=torch.int64, device="cpu") * s.num_audio_tokens  # [Q]
        self.register_buffer("code_offset", off if device is None else off.to(device), persistent=False)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load with per-codebook (checkpoint) or fused code tables/heads."""
        sd = dict(state_dict)
        for name in FUSED:
            keys = [f"{name}.{i}.weight" for i in range(self.shapes.num_vq)]
            if all(k in sd for k in keys):
                sd[f"{name}.weight"] = torch.cat([sd.pop(k) for k in keys], 0)
        return super().load_state_dict(sd, strict=strict, assign=assign)

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [..., T]`` int64 text ids -> ``[..., T, D]``."""
        return self.emb_text(ids)

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes [..., Q]`` int64 -> sum of the Q code embeddings ``[..., D]``."""
        return self.emb_code(codes + self.code_offset).sum(-2)

    def audio_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [..., D]`` -> audio logits ``[..., Q, V]`` (in the hidden's dtype)."""
        return self.head_code(hidden).unflatten(-1, (self.shapes.num_vq, self.shapes.num_audio_tokens))

    def code_tables(self) -> torch.Tensor:
        """The code embedding tables ``[Q, V, D]`` (a view)."""
        return self.emb_code.weight.view(self.shapes.num_vq, self.shapes.num_audio_tokens, -1)

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
