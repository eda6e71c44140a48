"""The ChatTTS GPT: a Llama decoder stack over input embeddings, with a static KV cache.

Our own implementation in the style of gpt-fast (pytorch-labs/gpt-fast ``model.py``): ONE
:meth:`Block.forward` serves every use; what differs between a prompt, a decode step, a graph
captured on a GPU and an exported ONNX graph is only how attention reads and writes the KV
cache, which the caller passes in as an *attention plan* (:mod:`appliance.model.kv`). The KV
cache is one fixed buffer per layer allocated once by :meth:`GPT.setup_cache`.

Weights: q/k/v are ONE fused projection ``qkv [3D, D]`` and gate/up ONE ``gate_up [2F, D]``
(one matrix product each instead of three and two). The official checkpoint stores HF
``LlamaModel`` names (``layers.N.self_attn.q_proj.weight``, ``mlp.gate_proj.weight``, ...):
:meth:`GPT.load_state_dict` fuses them at load (:func:`fuse_state_dict`, the one place), so
``asset/gpt/model.safetensors`` loads as is (without its unused ``embed_tokens``). Weight-only
INT8/FP8 replaces the linears after load (:mod:`appliance.model.quant`).

Numerics follow HF Llama (transformers ``modeling_llama``): RMSNorm in float32, RoPE with the
``rotate_half`` convention and cos/sin computed in float32, MHA with softmax scale
head_dim^-0.5, SiLU-gated MLP. Reference: Touvron et al. 2023 (Llama); Su et al. 2021 (RoPE).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .kv import Attend, Causal, DecodeSlots, PrefillSlot
from .shapes import ModelShapes


class RMSNorm(nn.Module):
    """RMS layer norm (Zhang & Sennrich 2019): normalised in float32, cast back, times the weight
    (HF ``LlamaRMSNorm``); ``F.rms_norm`` is one fused kernel where torch has one."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_table(max_pos: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables float32 ``[max_pos, head_dim]`` (HF default RoPE: freqs repeated twice)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    pos = torch.arange(max_pos, dtype=torch.int64, device=device).float()
    freqs = pos[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [N, 2, H, hd]`` (q and k of N = B*T tokens together) by ``cos/sin [N, 1, 1, hd]``
    (``rotate_half`` convention)."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


class Attention(nn.Module):
    """Multi-head self-attention (no GQA, no bias): fused ``qkv`` and ``o_proj``."""

    def __init__(self, s: ModelShapes):
        super().__init__()
        d = s.hidden
        self.n_heads, self.head_dim = s.n_heads, s.head_dim
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, attend: Attend) -> torch.Tensor:
        """``x [B, T, D]`` -> ``[B, T, D]``; ``attend(layer, q, k, v)`` reads/writes the cache.

        q and k are rotated together as ``[B*T, 2, H, hd]``, the projection's own layout without a
        size-1 T dimension (measured on the H200: with it, or with a permuted layout, the rotation's
        concatenation left CUDA's batched-copy kernel for 2-3 elementwise kernels per layer and the
        step got 1-2 % slower), then seen as ``[B, H, T, hd]``.
        """
        b, t, _ = x.shape
        h, hd = self.n_heads, self.head_dim
        qkv = self.qkv(x).view(b * t, 3, h, hd)
        qk = apply_rope(qkv[:, :2], cos, sin).view(b, t, 2, h, hd)
        v = qkv[:, 2].view(b, t, h, hd)
        y = attend(layer, qk[:, :, 0].transpose(1, 2), qk[:, :, 1].transpose(1, 2), v.transpose(1, 2))
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SiLU-gated feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``, gate/up fused."""

    def __init__(self, s: ModelShapes):
        super().__init__()
        self.gate_up = nn.Linear(s.hidden, 2 * s.ffn, bias=False)
        self.down_proj = nn.Linear(s.ffn, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(g) * u)


class Block(nn.Module):
    """Pre-norm Llama block (HF ``LlamaDecoderLayer`` names for the norms)."""

    def __init__(self, s: ModelShapes):
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.rms_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, attend: Attend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


#: Our fused weights and the HF Llama projections they are made of, rows in this order.
FUSED = {"self_attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj")}
_PART = {f"{p}.weight": (f"{ours}.weight", i) for ours, parts in FUSED.items() for i, p in enumerate(parts)}


def fused_target(key: str) -> tuple[str, int] | None:
    """Where a checkpoint key goes when fused: ``layers.3.self_attn.k_proj.weight`` ->
    (``layers.3.self_attn.qkv.weight``, 1), the part's block (it fills rows ``1 * rows .. 2 * rows``
    of the fused weight, all parts of one weight being of equal size); None for a key loaded as it is."""
    head, sep, rest = key.partition(".")
    if head == "layers" and sep:
        n, _, tail = rest.partition(".")
        hit = _PART.get(tail)
        if hit is not None:
            return f"layers.{n}.{hit[0]}", hit[1]
    return None


def fuse_state_dict(sd: Mapping[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """HF Llama names -> ours (:data:`FUSED`): per layer ``q/k/v_proj`` -> ``self_attn.qkv`` (rows
    q, k, v) and ``gate_proj/up_proj`` -> ``mlp.gate_up`` (rows gate, up). Keys already fused pass
    through. (The checkpoint loader fuses on the device instead, :mod:`appliance.model.assemble`.)"""
    out = dict(sd)
    for i in range(n_layers):
        p = f"layers.{i}."
        for ours, parts in FUSED.items():
            keys = [f"{p}{x}.weight" for x in parts]
            if all(k in out for k in keys):
                out[f"{p}{ours}.weight"] = torch.cat([out.pop(k) for k in keys], 0)
    return out


class GPT(nn.Module):
    """Llama stack over embeddings (HF ``LlamaModel`` without ``embed_tokens``).

    :meth:`forward` is the one path; :meth:`prefill`, :meth:`decode_step` and
    :meth:`forward_full` are the common plans spelled out.
    """

    def __init__(self, s: ModelShapes):
        super().__init__()
        self.shapes = s
        self.layers = nn.ModuleList([Block(s) for _ in range(s.n_layers)])
        self.norm = RMSNorm(s.hidden, s.rms_eps)
        self.init_buffers()
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.max_batch = 0
        self.max_seq = 0

    def init_buffers(self, device=None) -> None:
        """(Re)make the non-persistent buffers on ``device``: RoPE tables float32 ``[max_pos, hd]``
        (computed on the host, as at construction) and the key positions int64 ``[max_pos]``. The
        loader builds the model on the ``meta`` device and calls this once the weights are in."""
        s = self.shapes
        cos, sin = rope_table(s.max_pos, s.head_dim, s.rope_theta, device="cpu")
        kpos = torch.arange(s.max_pos, device="cpu")
        for name, t in (("rope_cos", cos), ("rope_sin", sin), ("kpos", kpos)):
            self.register_buffer(name, t if device is None else t.to(device), persistent=False)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Load HF Llama names (fused here, :func:`fuse_state_dict`) or our own."""
        return super().load_state_dict(fuse_state_dict(state_dict, self.shapes.n_layers), strict=strict, assign=assign)

    # ------------------------------------------------------------------ cache
    def setup_cache(self, max_batch: int, max_seq: int, dtype: torch.dtype, device) -> None:
        """Allocate the static KV cache: per layer k and v ``[max_batch, H, max_seq, hd]`` (zeros).

        Raises:
            ValueError: ``max_seq`` exceeds the model's RoPE table (``shapes.max_pos``).
        """
        s = self.shapes
        if max_seq > s.max_pos:
            raise ValueError(f"max_seq {max_seq} exceeds the model's max_position_embeddings {s.max_pos}")
        shape = (max_batch, s.n_heads, max_seq, s.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.max_batch, self.max_seq = max_batch, max_seq

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per position per slot (2 x layers x D x element size)."""
        el = self.k_cache[0].element_size() if self.k_cache else 4
        return 2 * self.shapes.n_layers * self.shapes.hidden * el

    def rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``pos [B, T]`` int64 -> cos, sin ``[B*T, 1, 1, hd]`` in ``dtype`` (see :func:`apply_rope`)."""
        hd = self.shapes.head_dim
        return (self.rope_cos[pos].reshape(-1, 1, 1, hd).to(dtype), self.rope_sin[pos].reshape(-1, 1, 1, hd).to(dtype))

    # ------------------------------------------------------------------ the one forward
    def forward(self, x: torch.Tensor, pos: torch.Tensor, attend: Attend) -> torch.Tensor:
        """``x [B, T, D]`` input embeddings at positions ``pos [B, T]`` int64 -> last hidden
        states ``[B, T, D]`` after the final norm; ``attend`` is the KV-cache plan."""
        cos, sin = self.rope(pos, x.dtype)
        for i, blk in enumerate(self.layers):
            x = blk(x, cos, sin, i, attend)
        return self.norm(x)

    def forward_full(self, emb: torch.Tensor) -> torch.Tensor:
        """Causal forward without cache: ``emb [B, T, D]`` -> ``[B, T, D]`` (tests, reference)."""
        b, t, _ = emb.shape
        return self(emb, torch.arange(t, device=emb.device).unsqueeze(0).expand(b, t), Causal())

    def prefill(self, emb: torch.Tensor, slot: int) -> torch.Tensor:
        """Run a prompt ``emb [1, T, D]`` into cache ``slot`` (positions 0..T-1); returns ``[1, T, D]``."""
        t = emb.shape[1]
        return self(emb, torch.arange(t, device=emb.device).unsqueeze(0), PrefillSlot(self.k_cache, self.v_cache, slot))

    def decode_step(self, emb: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
        """One token for B rows: ``emb [B, 1, D]``, ``slots [B]`` int64 (distinct), ``pos [B]`` int64.

        Row b's token is written at ``pos[b]`` of slot ``slots[b]`` and attends to positions
        ``0..pos[b]`` of that slot. ``kv_len`` (a host int, > max(pos)) bounds the cache span read;
        None reads the whole cache (fixed shapes). Returns hidden ``[B, D]``.
        """
        plan = DecodeSlots(self.k_cache, self.v_cache, slots, pos, self.max_seq if kv_len is None else kv_len, self.kpos)
        return self(emb, pos.unsqueeze(1), plan)[:, 0]
