"""Fill a model built on the ``meta`` device from its weight files, tensor by tensor, on the device.

:class:`Assembler` receives the chunks of rows that :meth:`appliance.model.tensorfile.TensorFile.stream`
reads (one bounded host buffer, reused) and copies each straight into its destination: a tensor
allocated on the target device in its final dtype, assigned to the module once its last row is in.
So the host never holds the model in FP32 beside the device copy, nor a fused copy:

* q/k/v and gate/up (:data:`appliance.model.gpt.FUSED`) and the per-codebook code tables and heads
  (:data:`appliance.model.embed.FUSED`) are fused by writing each part into its rows of the fused
  device tensor;
* weight-normalised heads (``parametrizations.weight.original0/1`` = g, v) are folded on the device
  in float32, ``W = g * v / ||v||_row`` (Salimans & Kingma 2016; upstream stores them so), with v
  staged in the destination's own rows when that is float32;
* with ``quant`` the GPT block linears (``qkv``, ``o_proj``, ``gate_up``, ``down_proj``) are staged in
  float32 on the device, one weight at a time, and replaced by
  :class:`~appliance.model.quant.WeightOnlyLinear` as soon as they are complete (quantized from the
  checkpoint's float32 values, as before).

What a part holds in which dtype is the caller's choice (``dtypes``: ``gpt``, ``embed``,
``decoder``, ``vocos``). Keys that the model does not use (the GPT's ``embed_tokens``, Vocos'
feature-extractor buffers, the text head when it is dropped) are never handed over; the reader
still hashes them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import CheckpointError
from . import embed as embed_mod
from . import gpt as gpt_mod
from . import layout
from .quant import WeightOnlyLinear
from .tensorfile import Entry

#: safetensors dtype -> torch dtype (those a ChatTTS checkpoint may hold).
TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}

#: The GPT block linears that ``quant`` replaces (their ``.weight`` leaves).
QUANT_LINEARS = ("self_attn.qkv", "self_attn.o_proj", "mlp.gate_up", "mlp.down_proj")


class _NoInit(TorchFunctionMode):
    """Skips ``torch.nn.init`` initializers (the loader overwrites every weight): on ``meta``
    tensors ``normal_`` runs a Python reference that imports torch's compiler stack (measured:
    822 modules, 68 MiB of RSS)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else (kwargs or {}).get("tensor")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def empty_model() -> Iterator[None]:
    """Build modules inside this block on the ``meta`` device, without initializing them: no
    memory, no time; :class:`Assembler` then gives every tensor its real storage."""
    with torch.device("meta"), _NoInit():
        yield


@dataclass
class _Slot:
    """A destination being filled: ``tensor`` on the device, ``left`` rows still to come."""

    tensor: torch.Tensor
    left: int


@dataclass
class _Fold:
    """A weight-normalised head being folded: g ``[n, 1]`` and v ``[n, in]`` float32 on the device."""

    g: torch.Tensor
    v: torch.Tensor
    left_g: int
    left_v: int
    v_in_dest: bool


class Assembler:
    """Receives weight chunks and builds the parts of ``model`` on ``device`` (module doc).

    Args:
        model: a :class:`~appliance.model.checkpoint.ChatTTSModel` built on the ``meta`` device.
        device: where the weights go.
        dtypes: final dtype per part (``gpt``, ``embed``, ``decoder``, ``vocos``).
        quant: None, ``int8`` or ``fp8`` (GPT block linears, weight-only).
        text_head: load the text head (refine-text); False drops it (``nn.Identity``).
    """

    def __init__(self, model: nn.Module, device: torch.device, dtypes: dict[str, torch.dtype],
                 quant: Optional[str] = None, text_head: bool = True):
        self.model, self.device, self.dtypes = model, torch.device(device), dtypes
        self.quant, self.text_head = quant, text_head
        self._slots: dict[str, _Slot] = {}
        self._folds: dict[tuple[str, int], _Fold] = {}
        self._vocos = set(layout.vocos_keys(model.shapes))

    # ------------------------------------------------------------------ routing
    def route(self, part: str, key: str) -> Optional[tuple[str, int, Optional[str]]]:
        """(destination name in the model, first row, fold role ``g``/``v`` or None) of a
        checkpoint key of ``part``; None for a key the model does not use."""
        if part == "gpt":
            if key in layout.GPT_IGNORED:
                return None
            hit = gpt_mod.fused_target(key)
            return (f"gpt.{hit[0]}", hit[1], None) if hit else (f"gpt.{key}", 0, None)
        if part == "embed":
            role = {"original0": "g", "original1": "v"}.get(key.rsplit(".", 1)[-1]) if ".parametrizations." in key else None
            if key.startswith("head_text."):
                return ("embed.head_text.weight", 0, role) if self.text_head else None
            hit = embed_mod.fused_target(key)
            return (f"embed.{hit[0]}", hit[1], role) if hit else (f"embed.{key}", 0, role)
        if part == "vocos":
            return (f"vocos.{key}", 0, None) if key in self._vocos else None
        return (f"{part}.{key}", 0, None)

    def wanted(self, part: str) -> Callable[[str], bool]:
        """Which keys of ``part`` the model uses (for :meth:`TensorFile.stream`)."""
        return lambda key: self.route(part, key) is not None

    def sink(self, part: str) -> Callable[[Entry, int, np.ndarray], None]:
        """The :data:`~appliance.model.tensorfile.Sink` for the file of ``part``."""

        def take(e: Entry, r0: int, raw: np.ndarray) -> None:
            dest, block, role = self.route(part, e.name)
            t = torch.from_numpy(raw).view(TORCH_DTYPES[e.dtype])
            t = t.view(-1, *e.shape[1:]) if e.shape else t.view(())
            row0 = block * e.rows
            if role is None:
                self._write(dest, row0 + r0, t)
            else:
                self._fold_part(dest, row0, role, e, r0, t)
        return take

    # ------------------------------------------------------------------ destinations
    def _meta(self, dest: str) -> torch.Tensor:
        mod, _, leaf = dest.rpartition(".")
        m = self.model.get_submodule(mod)
        t = m._parameters.get(leaf) if leaf in m._parameters else m._buffers.get(leaf)
        if t is None:
            raise CheckpointError(f"the model has no tensor {dest} for a checkpoint key")
        return t

    def _quantized(self, dest: str) -> bool:
        return bool(self.quant) and dest.startswith("gpt.layers.") and dest.endswith(".weight") and \
            dest[:-len(".weight")].split(".", 3)[-1] in QUANT_LINEARS

    def _slot(self, dest: str) -> _Slot:
        s = self._slots.get(dest)
        if s is None:
            meta = self._meta(dest)
            part = dest.split(".", 1)[0]
            dt = torch.float32 if self._quantized(dest) else (self.dtypes[part] if meta.is_floating_point() else meta.dtype)
            s = self._slots[dest] = _Slot(torch.empty(meta.shape, dtype=dt, device=self.device),
                                          meta.shape[0] if meta.dim() else 1)
        return s

    def _write(self, dest: str, row: int, t: torch.Tensor) -> None:
        """Copy rows ``t`` into ``dest`` from ``row`` on (dtype and device converted by the copy)."""
        s = self._slot(dest)
        n = t.shape[0] if t.dim() else 1
        if s.tensor.dim():
            s.tensor[row:row + n].copy_(t)
        else:
            s.tensor.copy_(t)
        self._done(dest, s, n)

    def _done(self, dest: str, s: _Slot, n: int) -> None:
        s.left -= n
        if s.left > 0:
            return
        del self._slots[dest]
        mod_name, _, leaf = dest.rpartition(".")
        if self._quantized(dest):  # the float32 staging becomes int8/fp8 + scales in the GPT's dtype
            parent, _, child = mod_name.rpartition(".")
            q = WeightOnlyLinear(s.tensor, self.quant).to(dtype=self.dtypes["gpt"])
            setattr(self.model.get_submodule(parent), child, q)
            return
        m = self.model.get_submodule(mod_name)
        if leaf in m._parameters:
            m._parameters[leaf] = nn.Parameter(s.tensor, requires_grad=False)
        else:
            m._buffers[leaf] = s.tensor

    def _fold_part(self, dest: str, row0: int, role: str, e: Entry, r0: int, t: torch.Tensor) -> None:
        key = (dest, row0)
        f = self._folds.get(key)
        if f is None:
            n = e.rows
            slot = self._slot(dest)
            in_dest = slot.tensor.dtype == torch.float32
            v = slot.tensor[row0:row0 + n] if in_dest else torch.empty(n, slot.tensor.shape[1], device=self.device)
            f = self._folds[key] = _Fold(torch.empty(n, 1, device=self.device), v, n, n, in_dest)
        n = t.shape[0]
        if role == "g":
            f.g[r0:r0 + n].copy_(t.reshape(n, 1))
            f.left_g -= n
        else:
            f.v[r0:r0 + n].copy_(t)
            f.left_v -= n
        if f.left_g or f.left_v:
            return
        del self._folds[key]
        w = embed_mod.fold_weight_norm_(f.g, f.v)
        if f.v_in_dest:
            self._done(dest, self._slots[dest], w.shape[0])
        else:
            self._write(dest, row0, w)

    # ------------------------------------------------------------------ the end
    def finish(self) -> nn.Module:
        """Make the non-persistent buffers on the device, drop the text head if asked, and check
        that every tensor of the model was loaded; returns the model (eval mode).

        Raises:
            CheckpointError: a tensor was not (completely) loaded (names them; should not happen
                after :func:`~appliance.model.checkpoint.read_checkpoint` validated the layout).
        """
        m = self.model
        if not self.text_head:
            m.embed.head_text = nn.Identity()
        m.gpt.init_buffers(self.device)
        m.embed.init_buffers(self.device)
        left = sorted(set(self._slots) | {d for d, _ in self._folds})
        left += [n for n, t in list(m.named_parameters()) + list(m.named_buffers()) if t.is_meta and n not in left]
        if left:
            raise CheckpointError(f"checkpoint did not provide (all rows of) {', '.join(left[:8])}"
                                  + (f" and {len(left) - 8} more" if len(left) > 8 else ""))
        return m.eval()
