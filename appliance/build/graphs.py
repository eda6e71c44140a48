"""The graphs ``engines export`` writes, as torch modules (:mod:`appliance.build.export` has their
inputs, outputs and shapes): the GPT's prefill and decode step in one graph with the attention
plan of ONNX Runtime (the bound cache prefix, scores joined, keys never concatenated) or of
TensorRT (the whole static cache, sliced, the standard attention pattern), the Decoder and Vocos.
The layers are the model's own (:mod:`appliance.model`); only the attention plan is the export's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..model.checkpoint import ChatTTSModel


class _PrefixCacheAttend:
    """ONNX Runtime's attention plan: the runner binds each layer's filled cache prefix
    ``[P, M, H, hd]`` (positions first) by pointer; new token j of row b attends to cached
    positions ``< pos[b]`` of slot ``slots[b]`` and to new tokens ``<= j``. The scores against the
    cache and against the new keys are joined on the score tensor, so keys/values are never
    concatenated. The new keys/values are collected as graph outputs (the runner writes them)."""

    def __init__(self, k_cache, v_cache, slots, bias_past, bias_new, scale: float, dt: torch.dtype):
        self.k, self.v, self.slots, self.bias_past, self.bias_new = k_cache, v_cache, slots, bias_past, bias_new
        self.scale, self.dt = scale, dt
        self.ks: list[torch.Tensor] = []
        self.vs: list[torch.Tensor] = []

    def __call__(self, i, q, k, v):
        p = self.k[i].shape[0]
        kp = self.k[i].index_select(1, self.slots).permute(1, 2, 3, 0)  # [P, B, H, hd] -> [B, H, hd, P]
        vp = self.v[i].index_select(1, self.slots).permute(1, 2, 0, 3)  # -> [B, H, P, hd]
        s_past = (q @ kp).float() * self.scale + self.bias_past  # [B, H, T, P]
        s_new = (q @ k.transpose(2, 3)).float() * self.scale + self.bias_new  # [B, H, T, T]
        w = torch.softmax(torch.cat([s_past, s_new], -1), -1).to(self.dt)
        self.ks.append(k.transpose(1, 2))  # [B, T, H, hd]: the cache's position-major layout
        self.vs.append(v.transpose(1, 2))
        return w[..., :p] @ vp + w[..., p:] @ v  # [B, H, T, hd]


class _StaticCacheAttend:
    """TensorRT's attention plan: the whole cache ``[S, M, H, hd]`` is bound, the graph slices
    the ``[:P]`` prefix and uses the standard attention pattern, which TensorRT fuses (measured:
    the split-score form made TensorRT-RTX reserve 555 MiB of activations instead of 18 MiB)."""

    def __init__(self, k_cache, v_cache, slots, mask):
        self.k, self.v, self.slots, self.mask = k_cache, v_cache, slots, mask
        self.ks: list[torch.Tensor] = []
        self.vs: list[torch.Tensor] = []

    def __call__(self, i, q, k, v):
        keys = torch.cat([self.k[i].index_select(1, self.slots).permute(1, 2, 0, 3), k], 2)  # [B, H, P+T, hd]
        vals = torch.cat([self.v[i].index_select(1, self.slots).permute(1, 2, 0, 3), v], 2)
        self.ks.append(k.transpose(1, 2))
        self.vs.append(v.transpose(1, 2))
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=self.mask)


class GptGraph(nn.Module):
    """T new tokens per row over the in-place static KV cache: prefill (B=1, T=prompt) and
    decode step (T=1) in one graph, so the GPT weights exist once (see module doc). The layers
    are the model's own (:meth:`appliance.model.gpt.GPT.forward`); only the attention plan is
    the export's.

    ``static=False`` (ONNX Runtime): ``k_cache.i [P, M, H, hd]`` is the bound prefix.
    ``static=True`` (TensorRT): ``k_cache.i [S, M, H, hd]`` is the whole buffer and an extra
    input ``past [P] uint8`` gives the prefix length; the graph slices ``[:P]``.
    """

    def __init__(self, m: ChatTTSModel, static: bool = False):
        super().__init__()
        self.gpt, self.embed = m.gpt, m.embed
        self.static = static

    def forward(self, emb: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], past: torch.Tensor | None = None):
        gpt = self.gpt
        b, t = emb.shape[0], emb.shape[1]
        if self.static:
            p = past.shape[0]
            k_cache = [k[:p] for k in k_cache]
            v_cache = [v[:p] for v in v_cache]
        else:
            p = k_cache[0].shape[0]  # positions read: the runner binds the cache prefix [:P]
        dt = gpt.norm.weight.dtype
        dev = emb.device
        steps = torch.arange(t, device=dev)
        seen = (torch.arange(p, device=dev).unsqueeze(0) < pos.unsqueeze(1)).view(b, 1, 1, p)  # cached rows < pos
        causal = (steps.unsqueeze(0) <= steps.unsqueeze(1)).view(1, 1, t, t)  # new token j sees new tokens <= j
        if self.static:
            plan = _StaticCacheAttend(k_cache, v_cache, slots,
                                      torch.cat([seen.expand(b, 1, t, p), causal.expand(b, 1, t, t)], -1))
        else:
            neg = torch.tensor(float("-inf"), device=dev)
            zero = torch.tensor(0.0, device=dev)
            plan = _PrefixCacheAttend(k_cache, v_cache, slots, torch.where(seen, zero, neg),
                                      torch.where(causal, zero, neg), 1.0 / math.sqrt(gpt.shapes.head_dim), dt)
        h = gpt(emb.to(dt), pos.unsqueeze(1) + steps.unsqueeze(0), plan)[:, -1]  # [B, D] of the last new token
        logits = self.embed.audio_logits(h)
        return logits.float(), h.float(), torch.stack(plan.ks), torch.stack(plan.vs)


class DecoderGraph(nn.Module):
    """hidden [T, D] -> mel [100, 2T] float32."""

    def __init__(self, m: ChatTTSModel):
        super().__init__()
        self.decoder = m.decoder

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dt = self.decoder.out_conv.weight.dtype
        return self.decoder(hidden.to(dt).t().unsqueeze(0))[0].float()


class VocosGraph(nn.Module):
    """mel [100, F] -> (real, imag) [F, n_fft/2+1] float32."""

    def __init__(self, m: ChatTTSModel):
        super().__init__()
        self.vocos = m.vocos

    def forward(self, mel: torch.Tensor):
        dt = self.vocos.head.out.weight.dtype
        re, im = self.vocos(mel.to(dt).unsqueeze(0))
        return re[0].float(), im[0].float()
