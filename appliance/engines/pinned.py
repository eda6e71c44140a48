"""Host buffers allocated once at start-up and reused: named arrays plus a slab pool for PCM.

A GPU runner copies device results (token ids, hidden states, PCM) into page-locked ("pinned")
host memory, so the copy is a DMA that can run asynchronously and no request allocates host
memory. This module holds no torch: the allocator is injected (``allocator(nbytes) -> uint8
numpy array``). :func:`numpy_allocator` gives plain pageable memory (CPU, tests);
:func:`appliance.engines.cuda_runner.torch_pinned_allocator` gives CUDA pinned memory; a TensorRT
runner can pass a ``pycuda.driver.pagelocked_empty`` wrapper.

Accounting: :attr:`PinnedPool.allocations` counts allocator calls and :attr:`PinnedPool.nbytes`
their bytes; both only change in the constructor, which tests check over many requests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ..errors import CapacityError

log = logging.getLogger(__name__)

Allocator = Callable[[int], np.ndarray]

_ALIGN = 256  # bytes: every buffer starts on a 256-byte boundary (DMA-friendly)


def numpy_allocator(nbytes: int) -> np.ndarray:
    """Plain pageable host memory: ``uint8 [nbytes]``."""
    return np.zeros(nbytes, np.uint8)


@dataclass(frozen=True)
class BufferSpec:
    """One named buffer: ``shape`` (tuple of ints) and numpy ``dtype``."""

    shape: tuple
    dtype: str

    @property
    def nbytes(self) -> int:
        """Bytes the buffer takes."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


class PinnedPool:
    """Named host arrays plus ``slabs`` fixed-size float32 PCM slabs, from ONE allocation.

    Args:
        specs: name -> :class:`BufferSpec` (or ``(shape, dtype)``).
        slabs: number of PCM slabs (e.g. 2 per channel: one being filled, one being played).
        slab_samples: float32 samples per slab (e.g. a 24-token chunk = 12288 samples at 24 kHz).
        allocator: ``nbytes -> uint8 array`` (default :func:`numpy_allocator`).

    Raises:
        ValueError: a spec has a negative dimension or an unknown dtype.
    """

    def __init__(self, specs: dict, slabs: int = 0, slab_samples: int = 0,
                 allocator: Optional[Allocator] = None):
        self.specs: dict[str, BufferSpec] = {
            k: (v if isinstance(v, BufferSpec) else BufferSpec(tuple(v[0]), str(np.dtype(v[1]))))
            for k, v in specs.items()}
        for k, s in self.specs.items():
            if any(int(d) < 0 for d in s.shape):
                raise ValueError(f"pinned buffer {k!r}: negative dimension in {s.shape}")
        offsets, off = {}, 0
        for k, s in self.specs.items():
            offsets[k] = off
            off += -(-s.nbytes // _ALIGN) * _ALIGN
        slab_bytes = -(-slab_samples * 4 // _ALIGN) * _ALIGN
        slab_off = off
        off += slabs * slab_bytes
        self.allocations = 0
        self.nbytes = 0
        whole = self._alloc(allocator or numpy_allocator, off + _ALIGN)
        start = (-whole.ctypes.data) % _ALIGN  # offsets are relative to an aligned start
        self._raw = whole[start:start + off]
        self._arrays: dict[str, np.ndarray] = {}
        for k, s in self.specs.items():
            o = offsets[k]
            self._arrays[k] = self._raw[o:o + s.nbytes].view(s.dtype).reshape(s.shape)
        self.slab_samples = slab_samples
        self._slabs = [self._raw[slab_off + i * slab_bytes: slab_off + i * slab_bytes + slab_samples * 4].view(np.float32)
                       for i in range(slabs)]
        self._free = list(range(slabs - 1, -1, -1))
        self.acquired = 0
        log.debug("pinned pool: %d buffers + %d slabs, %.2f MiB", len(self.specs), slabs, self.nbytes / 2**20)

    def _alloc(self, allocator: Allocator, nbytes: int) -> np.ndarray:
        a = allocator(nbytes)
        self.allocations += 1
        self.nbytes += int(a.nbytes)
        return a

    def __getitem__(self, name: str) -> np.ndarray:
        """The named array (a view into the pool; same object every call)."""
        return self._arrays[name]

    @property
    def raw(self) -> np.ndarray:
        """The whole pool as ``uint8 [nbytes]`` (for registering with a device API)."""
        return self._raw

    @property
    def free_slabs(self) -> int:
        """PCM slabs available to :meth:`acquire`."""
        return len(self._free)

    def acquire(self) -> tuple[int, np.ndarray]:
        """Take a PCM slab: ``(index, float32 [slab_samples])``.

        Raises:
            CapacityError: every slab is in use (release played chunks first, or size the
                pool with more slabs).
        """
        if not self._free:
            raise CapacityError(f"all {len(self._slabs)} pinned PCM slabs are in use: release played chunks "
                                "or raise the slab count")
        i = self._free.pop()
        self.acquired += 1
        return i, self._slabs[i]

    def release(self, index: int) -> None:
        """Give slab ``index`` back.

        Raises:
            ValueError: ``index`` is not a slab in use.
        """
        if not 0 <= index < len(self._slabs) or index in self._free:
            raise ValueError(f"slab {index} is not in use (pool of {len(self._slabs)})")
        self._free.append(index)
