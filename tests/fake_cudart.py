"""A host-memory stand-in for ``cuda.bindings.runtime`` (the functions the TensorRT runner's
memory uses, with the same call shapes: a status first, then the values): the CUDA boundary
faked so the plumbing above it runs on a machine without a GPU. "Device" memory is host memory;
copies are ``ctypes.memmove``; a stream runs everything at once. ``fail`` makes a named call
return an error status (the error path)."""

from __future__ import annotations

import ctypes
import enum
from types import SimpleNamespace


class cudaError_t(enum.IntEnum):  # noqa: N801 - the runtime's spelling
    cudaSuccess = 0
    cudaErrorMemoryAllocation = 2
    cudaErrorInvalidValue = 1


cudaMemcpyKind = SimpleNamespace(cudaMemcpyHostToDevice=1, cudaMemcpyDeviceToHost=2, cudaMemcpyDeviceToDevice=3)
cudaStreamNonBlocking = 1
cudaEventDisableTiming = 2

_mem: dict[int, ctypes.Array] = {}
fail: set[str] = set()
calls: list[str] = []


def _ok(name, *vals):
    calls.append(name)
    if name in fail:
        return (cudaError_t.cudaErrorMemoryAllocation,) + tuple(None for _ in vals)
    return (cudaError_t.cudaSuccess, *vals)


def cudaGetErrorString(err):  # noqa: N802
    return cudaError_t.cudaSuccess, {2: b"out of memory", 1: b"invalid argument"}.get(int(err), b"unknown")


def cudaGetDeviceCount():  # noqa: N802
    return _ok("cudaGetDeviceCount", 1)


def cudaSetDevice(d):  # noqa: N802
    return _ok("cudaSetDevice")


def _alloc(name, n):
    r = _ok(name, 0)
    if r[0] != cudaError_t.cudaSuccess:
        return r
    buf = ctypes.create_string_buffer(n)
    _mem[ctypes.addressof(buf)] = buf
    return cudaError_t.cudaSuccess, ctypes.addressof(buf)


def cudaMalloc(n):  # noqa: N802
    return _alloc("cudaMalloc", n)


def cudaMallocHost(n):  # noqa: N802
    return _alloc("cudaMallocHost", n)


def _free(name, p):
    if int(p) not in _mem:
        return (cudaError_t.cudaErrorInvalidValue,)
    del _mem[int(p)]
    return _ok(name)


def cudaFree(p):  # noqa: N802
    return _free("cudaFree", p)


def cudaFreeHost(p):  # noqa: N802
    return _free("cudaFreeHost", p)


def cudaMemset(p, v, n):  # noqa: N802
    ctypes.memset(p, v, n)
    return _ok("cudaMemset")


def cudaMemcpyAsync(dst, src, n, kind, stream):  # noqa: N802
    ctypes.memmove(dst, src, n)
    return _ok("cudaMemcpyAsync")


def cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream):  # noqa: N802
    for r in range(height):
        ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
    return _ok("cudaMemcpy2DAsync")


def cudaMemGetInfo():  # noqa: N802
    return _ok("cudaMemGetInfo", 1 << 30, 1 << 31)


def cudaStreamCreateWithFlags(flags):  # noqa: N802
    return _ok("cudaStreamCreateWithFlags", 7)


def cudaStreamDestroy(s):  # noqa: N802
    return _ok("cudaStreamDestroy")


def cudaEventCreateWithFlags(flags):  # noqa: N802
    return _ok("cudaEventCreateWithFlags", 9)


def cudaEventRecord(e, s):  # noqa: N802
    return _ok("cudaEventRecord")


def cudaEventSynchronize(e):  # noqa: N802
    return _ok("cudaEventSynchronize")


def cudaEventDestroy(e):  # noqa: N802
    return _ok("cudaEventDestroy")


def live() -> int:
    """Allocations not yet freed."""
    return len(_mem)


def cudaMemcpy(dst, src, n, kind):  # noqa: N802
    ctypes.memmove(dst, src, n)
    return _ok("cudaMemcpy")


def cudaStreamSynchronize(s):  # noqa: N802
    return _ok("cudaStreamSynchronize")


def cudaDeviceSynchronize():  # noqa: N802
    return _ok("cudaDeviceSynchronize")
