"""A stand-in for the ``tensorrt`` module (full TensorRT cannot be installed in this workplace):
engines whose ``execute_async_v3`` reads their bound input buffers from device memory, computes
simple numpy functions and writes their outputs back, through the same CUDA runtime the runner
uses (the real one on a GPU, :mod:`tests.fake_cudart` elsewhere). What it checks is the runner's
side: shapes set, every tensor bound, the KV cache written where the plan says, the sampler fed.

The functions (``W`` fixed, ``D = H * hd``): gpt: ``hidden[b] = tanh(emb[b, t-1] + 0.01 * past)``,
``logits[b] = hidden[b] @ W`` as ``[Q, V]``, ``k_new[l, b, j] = emb[b, j] + l``, ``v_new = -k_new``;
decoder: mel frames ``2i`` and ``2i+1`` = ``hidden[i]`` resized to the mel bins; vocos: ``real[f]``
= mel frame ``f`` resized to the bins, ``imag = -real``."""

from __future__ import annotations

from typing import Any

import numpy as np

__version__ = "10.3.0"
CU: Any = None          # the runner's Cuda, set by the test
W: np.ndarray = np.zeros(0)
SHAPES: dict = {}
LOG: list = []


def _read(ptr: int, shape, dtype) -> np.ndarray:
    out = np.empty(shape, dtype)
    if out.nbytes:
        CU.call("cudaMemcpy", out.ctypes.data, ptr, out.nbytes, CU.D2H)
    return out


def _write(ptr: int, value: np.ndarray) -> None:
    value = np.ascontiguousarray(value)
    if value.nbytes:
        CU.call("cudaMemcpy", ptr, value.ctypes.data, value.nbytes, CU.H2D)


class Logger:
    def errors(self) -> list:
        return []


class Runtime:
    def __init__(self, logger) -> None:
        self.logger = logger

    def deserialize_cuda_engine(self, raw: bytes) -> "Engine":
        return Engine(raw.decode())


class Engine:
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def create_execution_context(self) -> "Context":
        return Context(self.kind)


class Context:
    def __init__(self, kind: str) -> None:
        self.kind, self.shapes, self.addr, self.profile = kind, {}, {}, 0

    def set_optimization_profile_async(self, i: int, stream: int) -> bool:
        self.profile = i
        return True

    def set_input_shape(self, name: str, shape: tuple) -> bool:
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.addr[name] = ptr
        return True

    def execute_async_v3(self, stream: int) -> bool:
        CU.call("cudaDeviceSynchronize")               # the inputs queued before this run
        LOG.append((self.kind, self.profile, dict(self.shapes)))
        s = SHAPES
        if self.kind == "gpt":
            b, t, d = self.shapes["emb"]
            emb = _read(self.addr["emb"], (b, t, d), np.float32)
            past = self.shapes["past"][0]
            hidden = np.tanh(emb[:, -1] + 0.01 * past).astype(np.float32)
            _write(self.addr["hidden"], hidden)
            _write(self.addr["logits"], (hidden @ W).astype(np.float32))
            k = np.stack([emb + layer for layer in range(s["n_layers"])]).astype(np.float16)   # [L, b, t, D]
            _write(self.addr["k_new"], k)
            _write(self.addr["v_new"], -k)
            assert all(f"k_cache.{i}" in self.addr for i in range(s["n_layers"])), "cache layers not bound"
        elif self.kind == "decoder":
            n, d = self.shapes["hidden"]
            h = _read(self.addr["hidden"], (n, d), np.float32)
            mel = np.repeat(np.stack([np.resize(r, s["n_mels"]) for r in h], 1), 2, axis=1)
            _write(self.addr["mel"], mel.astype(np.float32))
        else:
            m, f = self.shapes["mel"]
            mel = _read(self.addr["mel"], (m, f), np.float32)
            re = np.stack([np.resize(mel[:, i], s["n_fft"] // 2 + 1) for i in range(f)]).astype(np.float32)
            _write(self.addr["real"], re)
            _write(self.addr["imag"], -re)
        return True
