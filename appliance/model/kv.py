"""Attention plans: how one layer's attention reads and writes the static KV cache.

:meth:`appliance.model.gpt.Block.forward` calls ``attend(layer, q, k, v)`` with the rotated
queries/keys and the values of the new tokens, ``[B, H, T, hd]`` each, and gets the attention
output ``[B, H, T, hd]`` back. A plan is a small object built once per forward call (or once per
captured graph); the model itself never branches on who runs it. The cache is a list of per-layer
tensors ``k[i], v[i]`` of ``[S, H, Lmax, hd]`` (S slots), as :meth:`GPT.setup_cache` allocates.

* :class:`Causal` – no cache, causal attention among the new tokens (reference forward).
* :class:`PrefillSlot` – a prompt ``[1, T]`` written into one slot, causal attention.
* :class:`DecodeSlots` – one token per row, rows in any slots (gathered); additive mask.
* :class:`DecodeRows` – one token per row, the rows are the cache's first ``b`` rows (the CUDA
  runner keeps active slots there), read as views: no gather; the plan of the captured step.

Export plans (ONNX's position-major cache, TensorRT's static cache) live with the export
(:mod:`appliance.build.export`) and follow the same call.
"""

from __future__ import annotations

from typing import Protocol, Union

import torch
import torch.nn.functional as F


class Attend(Protocol):
    """``attend(layer, q, k, v) -> y``: q/k/v/y ``[B, H, T, hd]`` in the model dtype."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def decode_mask(pos: torch.Tensor, length: int, dtype: torch.dtype, kpos: torch.Tensor | None = None) -> torch.Tensor:
    """Additive mask ``[B, 1, 1, length]``: 0 where key position <= the row's ``pos [B]``, else
    -inf (a float mask: torch's CPU SDPA is ~40x slower with a boolean one). ``kpos`` is a cached
    ``arange`` (``GPT.kpos``) of at least ``length``; with it the mask is three kernels."""
    b = pos.shape[0]
    keys = torch.arange(length, device=pos.device) if kpos is None else kpos[:length]
    later = (keys.unsqueeze(0) > pos.unsqueeze(1)).view(b, 1, 1, length)
    return torch.zeros((b, 1, 1, length), dtype=dtype, device=pos.device).masked_fill_(later, float("-inf"))


class Causal:
    """No cache: causal attention among the T new tokens."""

    def __call__(self, layer, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class PrefillSlot:
    """Prompt ``[1, T]`` into slot ``slot`` (positions 0..T-1), causal attention.

    ``slot`` is an int, or an int64 tensor ``[1]`` on the cache's device (a captured graph's
    row input: written with ``index_copy_``, no host value needed).
    """

    def __init__(self, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], slot: Union[int, torch.Tensor]):
        self.k, self.v, self.slot = k_cache, v_cache, slot

    def __call__(self, layer, q, k, v):
        t = k.shape[2]
        if isinstance(self.slot, torch.Tensor):
            self.k[layer][:, :, :t].index_copy_(0, self.slot, k)
            self.v[layer][:, :, :t].index_copy_(0, self.slot, v)
        else:
            self.k[layer][self.slot, :, :t] = k[0]
            self.v[layer][self.slot, :, :t] = v[0]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class DecodeSlots:
    """One new token per row; row b lives in slot ``slots[b]`` at position ``pos[b]`` and attends
    to positions ``0..pos[b]``; the first ``length`` cache positions of each slot are gathered."""

    def __init__(self, k_cache, v_cache, slots: torch.Tensor, pos: torch.Tensor, length: int, kpos=None):
        self.k, self.v, self.slots, self.pos, self.length, self.kpos = k_cache, v_cache, slots, pos, length, kpos
        self.mask = None

    def __call__(self, layer, q, k, v):
        kc, vc = self.k[layer], self.v[layer]
        kc[self.slots, :, self.pos] = k[:, :, 0]  # per-row write: [B, H, hd]
        vc[self.slots, :, self.pos] = v[:, :, 0]
        if self.mask is None:
            self.mask = decode_mask(self.pos, self.length, q.dtype, self.kpos)
        keys, vals = kc[self.slots, :, :self.length], vc[self.slots, :, :self.length]
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=self.mask)


class DecodeRows:
    """One new token for each of the cache's first ``b`` rows at positions ``pos [b]`` (device
    tensor), attention over the first ``length`` positions, read as views ``k[:b, :, :length]``.

    Everything is on the device and has a fixed shape for ``(b, length)``: the plan of the CUDA
    runner's captured decode step.
    """

    def __init__(self, k_cache, v_cache, b: int, pos: torch.Tensor, length: int, rows: torch.Tensor, kpos=None):
        self.k, self.v, self.b, self.pos, self.length, self.rows = k_cache, v_cache, b, pos, length, rows
        self.kpos = kpos
        self.mask = None

    def __call__(self, layer, q, k, v):
        kc, vc, b, L = self.k[layer], self.v[layer], self.b, self.length
        kc[self.rows, :, self.pos] = k[:, :, 0]
        vc[self.rows, :, self.pos] = v[:, :, 0]
        if self.mask is None:
            self.mask = decode_mask(self.pos, L, q.dtype, self.kpos)
        return F.scaled_dot_product_attention(q, kc[:b, :, :L], vc[:b, :, :L], attn_mask=self.mask)
