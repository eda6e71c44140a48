"""The ChatTTS GPT: a Llama decoder stack over input embeddings, with a static KV cache.

Our own implementation in the style of gpt-fast (pytorch-labs/gpt-fast ``model.py``): the KV
cache is one fixed buffer per layer allocated once by :meth:`GPT.setup_cache`; :meth:`GPT.prefill`
runs one prompt into one cache slot; :meth:`GPT.decode_step` runs one token for B rows, each
with its own slot and position (channels join at different times). Module and parameter names
are HF ``LlamaModel``'s (``layers.N.self_attn.q_proj.weight``, ``norm.weight``, ...), so the
state dict of ``asset/gpt/model.safetensors`` loads as is (without ``embed_tokens``).

Numerics follow HF Llama (transformers ``modeling_llama``): RMSNorm in float32, RoPE with the
``rotate_half`` convention and cos/sin computed in float32, MHA with softmax scale head_dim^-0.5,
SiLU-gated MLP. Reference: Touvron et al. 2023 (Llama); Su et al. 2021 (RoPE).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .shapes import ModelShapes


class RMSNorm(nn.Module):
    """RMS layer norm (Zhang & Sennrich 2019), computed in float32 as HF ``LlamaRMSNorm``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_table(max_pos: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables float32 ``[max_pos, head_dim]`` (HF default RoPE: freqs repeated twice)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    pos = torch.arange(max_pos, dtype=torch.int64, device=device).float()
    freqs = pos[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, T, hd]`` by ``cos/sin [B, 1, T, hd]`` (already in x's dtype)."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Multi-head self-attention (no GQA, no bias), HF names q_proj/k_proj/v_proj/o_proj."""

    def __init__(self, s: ModelShapes):
        super().__init__()
        d = s.hidden
        self.n_heads, self.head_dim = s.n_heads, s.head_dim
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # x: [B, T, D] -> q, k, v: [B, H, T, hd]
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        # y: [B, H, T, hd] -> [B, T, D]
        b, _, t, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def forward_causal(self, x, cos, sin):
        """Full causal attention over ``x [B, T, D]``; returns (out [B,T,D], k, v [B,H,T,hd])."""
        q, k, v = self._qkv(x, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self._out(y), k, v

    def forward_cached(self, x, cos, sin, k_cache, v_cache, slots, pos, kv_len: int, mask):
        """One token per row. x ``[B, 1, D]``; caches ``[S, H, Lmax, hd]``; slots, pos ``[B]``;
        attends to cache positions ``0..kv_len-1`` of each row's slot, with the additive float
        ``mask [B, 1, 1, kv_len]`` (0 = attend, -inf = masked)."""
        q, k, v = self._qkv(x, cos, sin)
        k_cache[slots, :, pos] = k[:, :, 0]  # per-row write: [B, H, hd]
        v_cache[slots, :, pos] = v[:, :, 0]
        keys = k_cache[slots, :, :kv_len]  # [B, H, kv_len, hd] (gathered copy of the filled span)
        vals = v_cache[slots, :, :kv_len]
        y = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        return self._out(y)


class MLP(nn.Module):
    """SiLU-gated feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, s: ModelShapes):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.ffn, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.ffn, bias=False)
        self.down_proj = nn.Linear(s.ffn, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm Llama block (HF ``LlamaDecoderLayer`` names)."""

    def __init__(self, s: ModelShapes):
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.rms_eps)


class GPT(nn.Module):
    """Llama stack over embeddings (HF ``LlamaModel`` without ``embed_tokens``).

    Use: ``setup_cache`` once, then ``prefill`` per prompt and ``decode_step`` per token.
    ``forward_full`` is a cache-free causal forward (tests, reference).
    """

    def __init__(self, s: ModelShapes):
        super().__init__()
        self.shapes = s
        self.layers = nn.ModuleList([Block(s) for _ in range(s.n_layers)])
        self.norm = RMSNorm(s.hidden, s.rms_eps)
        cos, sin = rope_table(s.max_pos, s.head_dim, s.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_pos, hd] float32
        self.register_buffer("rope_sin", sin, persistent=False)
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.max_batch = 0
        self.max_seq = 0

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

    def _rope(self, pos: torch.Tensor, dtype: torch.dtype):
        # pos: [B, T] int64 -> cos, sin [B, 1, T, hd] in dtype
        return self.rope_cos[pos].unsqueeze(1).to(dtype), self.rope_sin[pos].unsqueeze(1).to(dtype)

    # ------------------------------------------------------------------ forward paths
    def forward_full(self, emb: torch.Tensor) -> torch.Tensor:
        """Causal forward without cache: ``emb [B, T, D]`` -> last hidden states ``[B, T, D]``."""
        b, t, _ = emb.shape
        pos = torch.arange(t, device=emb.device).unsqueeze(0).expand(b, t)
        cos, sin = self._rope(pos, emb.dtype)
        x = emb
        for blk in self.layers:
            a, _, _ = blk.self_attn.forward_causal(blk.input_layernorm(x), cos, sin)
            x = x + a
            x = x + blk.mlp(blk.post_attention_layernorm(x))
        return self.norm(x)

    def prefill(self, emb: torch.Tensor, slot: int) -> torch.Tensor:
        """Run a prompt ``emb [1, T, D]`` into cache ``slot`` (positions 0..T-1).

        Returns the last hidden states ``[1, T, D]`` (after the final norm).
        """
        t = emb.shape[1]
        pos = torch.arange(t, device=emb.device).unsqueeze(0)
        cos, sin = self._rope(pos, emb.dtype)
        x = emb
        for i, blk in enumerate(self.layers):
            a, k, v = blk.self_attn.forward_causal(blk.input_layernorm(x), cos, sin)
            self.k_cache[i][slot, :, :t] = k[0]
            self.v_cache[i][slot, :, :t] = v[0]
            x = x + a
            x = x + blk.mlp(blk.post_attention_layernorm(x))
        return self.norm(x)

    def decode_step(self, emb: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
        """One token for B rows: ``emb [B, 1, D]``, ``slots [B]`` int64 (distinct), ``pos [B]`` int64.

        Row b's token is written at ``pos[b]`` of slot ``slots[b]`` and attends to positions
        ``0..pos[b]`` of that slot. ``kv_len`` (a host int, > max(pos)) bounds the cache span read;
        None reads the whole cache (fixed shapes, for graph capture). Returns hidden ``[B, D]``.
        """
        L = self.max_seq if kv_len is None else kv_len
        cos, sin = self._rope(pos.unsqueeze(1), emb.dtype)
        # additive mask [B, 1, 1, L]: 0 where the key position is <= the row's position, else -inf
        # (a float mask: torch's CPU SDPA is ~40x slower with a boolean one)
        valid = (torch.arange(L, device=emb.device).unsqueeze(0) <= pos.unsqueeze(1)).view(-1, 1, 1, L)
        mask = torch.zeros(valid.shape, dtype=emb.dtype, device=emb.device).masked_fill_(~valid, float("-inf"))
        x = emb
        for i, blk in enumerate(self.layers):
            x = x + blk.self_attn.forward_cached(
                blk.input_layernorm(x), cos, sin, self.k_cache[i], self.v_cache[i], slots, pos, L, mask)
            x = x + blk.mlp(blk.post_attention_layernorm(x))
        return self.norm(x)[:, 0]
