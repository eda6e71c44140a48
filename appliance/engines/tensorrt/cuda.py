"""The CUDA runtime through ``cuda-python`` (``cuda.bindings.runtime``; ``cuda.cudart`` on the
older wheels JetPack 5/6 boxes install): device buffers, pinned host buffers, one stream and one
event, the copies between them. No torch: the TensorRT runner's memory is this module's.

Every call goes through :meth:`Cuda.call`, which raises :class:`~appliance.errors.EngineError`
naming the call and CUDA's own error string when the status is not ``cudaSuccess``: a caller
never checks a status. The module is the CUDA boundary of the runner: the tests replace the
runtime module (``Cuda(runtime=fake)``) with a host-memory fake on a machine without a GPU, and
run the same code on the real one where CUDA is present (``tests/test_trt_cuda_io.py``).

Pointers are plain ``int`` device or host addresses; sizes are bytes.
"""

from __future__ import annotations

import ctypes
import importlib
from typing import Any, Optional

import numpy as np

from ...errors import ConfigError, EngineError

#: Module names tried in order: cuda-python 12.6+ / 13 (``cuda.bindings``), then the older layout.
MODULES = ("cuda.bindings.runtime", "cuda.cudart")


def load_runtime() -> Any:
    """The CUDA runtime module of ``cuda-python``.

    Raises:
        ConfigError: ``cuda-python`` is not installed (says how to install it).
    """
    errors = []
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise ConfigError("the tensorrt backend's buffers need cuda-python: pip install 'cuda-python>=12' "
                      "(the [jetson] extra; on JetPack 5 the 11.x wheel): " + "; ".join(errors))


class Cuda:
    """One CUDA runtime (the real one, or a fake with the same functions) and its calls.

    Args:
        runtime: the runtime module (default :func:`load_runtime`).
        device: the CUDA device ordinal to use (0).

    Raises:
        ConfigError: no cuda-python. EngineError: no CUDA device, or selecting it failed.
    """

    def __init__(self, runtime: Any = None, device: int = 0) -> None:
        self.rt = load_runtime() if runtime is None else runtime
        n = self.call("cudaGetDeviceCount")
        if int(n) <= device:
            raise EngineError(f"the tensorrt backend needs a CUDA GPU; CUDA sees {int(n)} device(s)")
        self.call("cudaSetDevice", device)
        self.device = device
        k = self.rt.cudaMemcpyKind
        self.H2D, self.D2H, self.D2D = k.cudaMemcpyHostToDevice, k.cudaMemcpyDeviceToHost, k.cudaMemcpyDeviceToDevice

    def call(self, name: str, *args: Any) -> Any:
        """Run ``runtime.<name>(*args)``; returns its values after the status (None, one value,
        or a tuple).

        Raises:
            EngineError: the status is not ``cudaSuccess`` (names the call and CUDA's message).
        """
        out = getattr(self.rt, name)(*args)
        err, vals = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
        if err != self.rt.cudaError_t.cudaSuccess:
            msg = self.rt.cudaGetErrorString(err)
            msg = msg[1] if isinstance(msg, tuple) else msg
            msg = msg.decode(errors="replace") if isinstance(msg, bytes) else str(msg)
            raise EngineError(f"CUDA {name} failed: {getattr(err, 'name', err)}: {msg}")
        return None if not vals else vals[0] if len(vals) == 1 else vals

    def mem_info(self) -> tuple[int, int]:
        """(free, total) device memory, bytes."""
        free, total = self.call("cudaMemGetInfo")
        return int(free), int(total)


class DeviceBuffer:
    """``nbytes`` of device memory (``cudaMalloc``), zeroed; ``shape`` / ``dtype`` describe it.
    ``ptr`` is its device address. :meth:`free` is idempotent."""

    def __init__(self, cu: Cuda, shape: tuple[int, ...], dtype: Any) -> None:
        self.cu, self.shape, self.dtype = cu, tuple(int(x) for x in shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.ptr = int(cu.call("cudaMalloc", max(1, self.nbytes)))
        cu.call("cudaMemset", self.ptr, 0, max(1, self.nbytes))

    def free(self) -> None:
        if self.ptr:
            self.cu.call("cudaFree", self.ptr)
            self.ptr = 0


class PinnedBuffer:
    """Page-locked host memory (``cudaMallocHost``) seen as a numpy array ``[shape]`` of
    ``dtype`` (:attr:`array`): the staging side of every copy, so the copies are asynchronous
    DMA. :meth:`free` is idempotent; the array must not be used after it."""

    def __init__(self, cu: Cuda, shape: tuple[int, ...], dtype: Any) -> None:
        self.cu, self.shape, self.dtype = cu, tuple(int(x) for x in shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.ptr = int(cu.call("cudaMallocHost", max(1, self.nbytes)))
        raw = (ctypes.c_char * max(1, self.nbytes)).from_address(self.ptr)
        self.array = np.frombuffer(raw, self.dtype, count=self.nbytes // self.dtype.itemsize).reshape(self.shape)
        self.array[...] = 0

    def free(self) -> None:
        if self.ptr:
            self.array = np.zeros((0,), self.dtype)
            self.cu.call("cudaFreeHost", self.ptr)
            self.ptr = 0


class Stream:
    """A non-blocking CUDA stream (``handle``: the ``int`` TensorRT's ``execute_async_v3`` takes)
    with one event to wait on what was queued on it."""

    def __init__(self, cu: Cuda) -> None:
        self.cu = cu
        # the runtime's flag values (1, 2) where a binding does not export the macros
        self._s = cu.call("cudaStreamCreateWithFlags", getattr(cu.rt, "cudaStreamNonBlocking", 1))
        self._e = cu.call("cudaEventCreateWithFlags", getattr(cu.rt, "cudaEventDisableTiming", 2))
        self.handle = int(self._s)

    def copy(self, dst: int, src: int, nbytes: int, kind: Any) -> None:
        """Queue a copy of ``nbytes`` from ``src`` to ``dst`` (``kind``: ``Cuda.H2D`` ...)."""
        if nbytes > 0:
            self.cu.call("cudaMemcpyAsync", dst, src, nbytes, kind, self._s)

    def copy_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: Any) -> None:
        """Queue ``height`` rows of ``width`` bytes, rows ``spitch`` bytes apart at ``src`` and
        ``dpitch`` apart at ``dst`` (``cudaMemcpy2DAsync``)."""
        if width > 0 and height > 0:
            self.cu.call("cudaMemcpy2DAsync", dst, dpitch, src, spitch, width, height, kind, self._s)

    def sync(self) -> None:
        """Wait until everything queued so far has run (an event recorded now, then waited on)."""
        self.cu.call("cudaEventRecord", self._e, self._s)
        self.cu.call("cudaEventSynchronize", self._e)

    def destroy(self) -> None:
        """Release the event and the stream (idempotent)."""
        if self._s is not None:
            self.cu.call("cudaEventDestroy", self._e)
            self.cu.call("cudaStreamDestroy", self._s)
            self._s = self._e = None


def shape_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes of a ``shape`` array of ``dtype``."""
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def free_all(*bufs: Optional[Any]) -> None:
    """:meth:`free` every buffer given (None skipped)."""
    for b in bufs:
        if b is not None:
            b.free()
