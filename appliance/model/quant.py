"""Weight-only INT8 / FP8 linears for the GPT, applied after load (the one place).

``quantize_(gpt, mode)`` replaces every linear of the transformer blocks (fused ``qkv``,
``o_proj``, fused ``gate_up``, ``down_proj``) by a :class:`WeightOnlyLinear` holding the
quantized weight and one scale per output row, as gpt-fast's ``WeightOnlyInt8Linear``
(pytorch-labs/gpt-fast ``quantize.py``). Norms, embeddings and heads stay in the model dtype.

* ``int8``: symmetric per output row, ``scale = max|w| / 127``, ``q = round(w / scale)``.
* ``fp8``: ``float8_e4m3fn`` per output row, ``scale = max|w| / 448`` (needs sm >= 8.9 to run
  fast; elsewhere refuse it: the runner checks).

The dequantize (``wq.to(dtype)``) runs in every call: it saves weight memory (and weight reads
where a compiler fuses the cast into the matrix product), not time, on a launch-bound GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError

MODES = ("int8", "fp8")


class WeightOnlyLinear(nn.Module):
    """``y = (x @ dequant(wq).T) * scale`` with one scale per output row.

    Args:
        w: float weight ``[out, in]`` (quantized from float32).
        mode: ``int8`` or ``fp8``.

    Raises:
        ConfigError: an unknown mode.
    """

    def __init__(self, w: torch.Tensor, mode: str):
        super().__init__()
        w32 = w.detach().float()
        amax = w32.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
        if mode == "int8":
            scale = amax / 127.0
            q = torch.round(w32 / scale).clamp_(-127, 127).to(torch.int8)
        elif mode == "fp8":
            scale = amax / 448.0
            q = (w32 / scale).to(torch.float8_e4m3fn).view(torch.int8)  # stored as bytes: .to(dtype) keeps them
        else:
            raise ConfigError(f"quantization {mode!r}: use one of {', '.join(MODES)}")
        self.mode = mode
        self.register_buffer("wq", q)  # int8 [out, in] (fp8: its bytes)
        self.register_buffer("scale", scale.view(-1).to(w.dtype))  # [out], converted with the module

    def _w(self) -> torch.Tensor:
        return self.wq.view(torch.float8_e4m3fn) if self.mode == "fp8" else self.wq

    @property
    def weight(self) -> torch.Tensor:
        """Dequantized weight ``[out, in]`` in the scale's dtype (a new tensor)."""
        return self._w().to(self.scale.dtype) * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._w().to(x.dtype)) * self.scale


def quantize_(gpt: nn.Module, mode: str) -> nn.Module:
    """Replace the block linears of ``gpt`` (:class:`appliance.model.gpt.GPT`) in place; returns it.

    The weights are quantized from their current values (load in float32, then convert the rest
    of the model to the compute dtype). Raises :class:`ConfigError` for an unknown ``mode``.
    """
    if mode not in MODES:
        raise ConfigError(f"quantization {mode!r}: use one of {', '.join(MODES)}")
    for blk in gpt.layers:
        a, m = blk.self_attn, blk.mlp
        a.qkv, a.o_proj = WeightOnlyLinear(a.qkv.weight, mode), WeightOnlyLinear(a.o_proj.weight, mode)
        m.gate_up, m.down_proj = WeightOnlyLinear(m.gate_up.weight, mode), WeightOnlyLinear(m.down_proj.weight, mode)
    return gpt
