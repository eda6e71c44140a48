"""The TensorRT runner's memory, without TensorRT: one device buffer per planned I/O tensor, the
KV cache, pinned host staging for what crosses to the host, one stream, and the copies.

Made from :func:`~appliance.engines.tensorrt.plan.plan_buffers` (profile maxima, allocated once at
load). What crosses per call is small: a decode step sends the summed code embeddings
``emb [B, 1, D]``, ``pos [B]``, ``slots [B]`` and reads back ``logits [B, Q, V]`` and ``hidden
[B, D]`` (float32: 30 KiB at B = 3 on the full model), which the host sampler draws from
(:mod:`appliance.engines.sampling`, the same sampler and random stream as every host runner). The
engine's new keys and values (``k_new`` / ``v_new [L, B, T, H, hd]``) never leave the device:
:meth:`TrtIO.scatter_kv` copies them into the cache ``[L, S, M, H, hd]`` (positions first; layer
``i`` is bound as ``k_cache.i``) with strided 2-D copies: one per layer for a prompt (T
consecutive positions of one slot), one per row for a decode step (the L layers of one position).

Every call that returns host data waits on the stream; the arrays returned are views of the
pinned staging, valid until the next call. Raises :class:`~appliance.errors.EngineError` (through
:class:`~appliance.engines.tensorrt.cuda.Cuda`) on any CUDA failure.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import EngineError, EngineMismatchError
from .cuda import Cuda, DeviceBuffer, PinnedBuffer, Stream

#: Outputs that stay on the device (no pinned staging): the new KV rows.
DEVICE_ONLY = ("k_new", "v_new")


class TrtIO:
    """Device buffers, pinned staging, the KV cache and the stream of one runner.

    Args:
        cu: the CUDA runtime (:class:`~appliance.engines.tensorrt.cuda.Cuda`).
        plan: :func:`~appliance.engines.tensorrt.plan.plan_buffers` of the manifest (``kv`` entry:
            ``k_cache.i`` / ``v_cache.i`` of shape ``[S, M, H, hd]``).

    Raises:
        EngineMismatchError: the graph's ``k_new`` dtype differs from the cache's (rebuild).
        EngineError: an allocation failed (the message names CUDA's error).
    """

    def __init__(self, cu: Cuda, plan: dict[str, dict[str, dict[str, Any]]]) -> None:
        self.cu = cu
        self.stream = Stream(cu)
        self.dev: dict[str, dict[str, DeviceBuffer]] = {}
        self.host: dict[str, dict[str, PinnedBuffer]] = {}
        try:
            for g, ts in plan.items():
                if g == "kv":
                    continue
                self.dev[g] = {n: DeviceBuffer(cu, t["shape"], t["dtype"]) for n, t in ts.items()}
                self.host[g] = {n: PinnedBuffer(cu, t["shape"], t["dtype"]) for n, t in ts.items()
                                if n not in DEVICE_ONLY}
            kv = plan["kv"]
            self.L = sum(1 for n in kv if n.startswith("k_cache."))
            first = kv["k_cache.0"]
            self.S, self.M, H, hd = first["shape"]
            self.kv_dtype = np.dtype(first["dtype"])
            self.row = H * hd                                   # values per (layer, position, slot)
            new = plan.get("gpt", {}).get("k_new")
            if new is not None and np.dtype(new["dtype"]) != self.kv_dtype:
                raise EngineMismatchError(f"the gpt plan writes k_new as {new['dtype']} but its cache is "
                                          f"{self.kv_dtype.name}: rebuild the plans (chattts-appliance engines build)")
            self.k = DeviceBuffer(cu, (self.L, self.S, self.M, H, hd), self.kv_dtype)
            self.v = DeviceBuffer(cu, (self.L, self.S, self.M, H, hd), self.kv_dtype)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ addresses
    def address(self, graph: str, name: str) -> int:
        """Device address of ``graph``'s tensor ``name``."""
        return self.dev[graph][name].ptr

    def kv_addresses(self) -> dict[str, int]:
        """``k_cache.i`` / ``v_cache.i`` -> the device address of layer ``i`` of the cache."""
        layer = self.S * self.M * self.row * self.kv_dtype.itemsize
        return {f"{n}_cache.{i}": buf.ptr + i * layer for n, buf in (("k", self.k), ("v", self.v)) for i in range(self.L)}

    def addresses(self, graph: str) -> dict[str, int]:
        """Every planned tensor of ``graph`` -> its device address."""
        return {n: b.ptr for n, b in self.dev[graph].items()}

    # ------------------------------------------------------------------ copies
    def put(self, graph: str, name: str, value: np.ndarray) -> None:
        """Stage ``value`` (its first ``value.size`` elements, cast to the tensor's dtype) and queue
        its copy to the device. Raises EngineError when it is larger than the buffer."""
        h, d = self.host[graph][name], self.dev[graph][name]
        flat = np.asarray(value).reshape(-1)
        if flat.size > h.array.size:
            raise EngineError(f"{graph}: {name} of {flat.size} values is over its buffer's {h.array.size}")
        view = h.array.reshape(-1)[: flat.size]
        np.copyto(view, flat, casting="unsafe")
        self.stream.copy(d.ptr, h.ptr, view.nbytes, self.cu.H2D)

    def get(self, graph: str, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Copy the first ``prod(shape)`` values of ``graph``'s output ``name`` to the host, wait,
        and return them as ``[shape]`` (a view of the pinned staging, valid until the next call)."""
        out = self.get_many(graph, {name: shape})
        return out[name]

    def get_many(self, graph: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """:meth:`get` for several outputs of ``graph`` with one wait."""
        views = {}
        for name, shape in shapes.items():
            h, d = self.host[graph][name], self.dev[graph][name]
            n = int(np.prod(shape, dtype=np.int64))
            if n > h.array.size:
                raise EngineError(f"{graph}: {name} of {n} values is over its buffer's {h.array.size}")
            self.stream.copy(h.ptr, d.ptr, n * h.dtype.itemsize, self.cu.D2H)
            views[name] = h.array.reshape(-1)[:n].reshape(shape)
        self.stream.sync()
        return views

    def scatter_kv(self, graph: str, b: int, t: int, pos: np.ndarray, slots: np.ndarray) -> None:
        """Queue the copy of ``graph``'s ``k_new`` / ``v_new [L, b, t, H, hd]`` into the cache at
        positions ``pos[i] .. pos[i] + t - 1`` of slot ``slots[i]`` for each row ``i < b``.

        Raises:
            EngineError: a position or slot outside the cache.
        """
        pos, slots = np.asarray(pos, np.int64)[:b], np.asarray(slots, np.int64)[:b]
        if b < 1 or t < 1 or (pos < 0).any() or (pos + t > self.S).any() or (slots < 0).any() or (slots >= self.M).any():
            raise EngineError(f"KV rows outside the cache: positions {pos.tolist()} + {t} of {self.S}, "
                              f"slots {slots.tolist()} of {self.M}")
        el, M, S, L = self.kv_dtype.itemsize, self.M, self.S, self.L
        w = self.row * el                                       # one (layer, position, slot) row, bytes
        for new, cache in (("k_new", self.k), ("v_new", self.v)):
            src = self.dev[graph][new].ptr                      # [L, b, t, row], contiguous
            if t > 1:    # a prompt: per layer, t positions of one slot, M rows apart in the cache
                for i in range(b):
                    for layer in range(L):
                        s0 = src + ((layer * b + i) * t) * w
                        d0 = cache.ptr + ((layer * S + int(pos[i])) * M + int(slots[i])) * w
                        self.stream.copy_2d(d0, M * w, s0, w, w, t, self.cu.D2D)
            else:        # a step: per row, the L layers of one position, S * M rows apart in the cache
                for i in range(b):
                    d0 = cache.ptr + (int(pos[i]) * M + int(slots[i])) * w
                    self.stream.copy_2d(d0, S * M * w, src + i * w, b * w, w, L, self.cu.D2D)

    def read_kv(self) -> tuple[np.ndarray, np.ndarray]:
        """The whole cache on the host, ``(k, v)`` each ``[L, S, M, H, hd]`` (tests; slow)."""
        out = []
        for c in (self.k, self.v):
            h = PinnedBuffer(self.cu, c.shape, c.dtype)
            self.stream.copy(h.ptr, c.ptr, c.nbytes, self.cu.D2H)
            self.stream.sync()
            out.append(h.array.copy())
            h.free()
        return out[0], out[1]

    # ------------------------------------------------------------------ lifetime
    @property
    def nbytes(self) -> int:
        """Device bytes held (I/O buffers and the KV cache)."""
        kv = sum(getattr(self, n).nbytes for n in ("k", "v") if hasattr(self, n))
        return kv + sum(b.nbytes for ts in self.dev.values() for b in ts.values())

    def close(self) -> None:
        """Free every buffer and the stream (idempotent)."""
        for ts in list(self.dev.values()) + list(self.host.values()):
            for buf in ts.values():
                buf.free()
        for n in ("k", "v"):
            if hasattr(self, n):
                getattr(self, n).free()
        self.dev, self.host = {}, {}
        self.stream.destroy()
