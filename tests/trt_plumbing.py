"""The TensorRT runner's memory, copies and sampling without TensorRT and without torch, run in a
child process by ``tests/test_trt_cuda_io.py``: ``python -m tests.trt_plumbing fake|cuda``.

``fake``: the host-memory CUDA stand-in (``tests/fake_cudart.py``); ``cuda``: cuda-python's real
runtime on the GPU. Prints ``ok <what was checked>`` and exits 0, or raises. Fails if torch was
imported on the way."""

from __future__ import annotations

import sys

import numpy as np

L, S, M, H, HD, Q, V, D, T = 2, 16, 3, 2, 16, 4, 626, 32, 8


def plan() -> dict:
    """A buffer plan as :func:`~appliance.engines.tensorrt.plan.plan_buffers` gives it (small shapes)."""
    def t(shape, dtype, mode="input"):
        return {"shape": list(shape), "dtype": dtype, "mode": mode,
                "nbytes": int(np.prod(shape)) * np.dtype(dtype).itemsize}

    return {"gpt": {"emb": t((M, T, D), "float32"), "pos": t((M,), "int64"), "slots": t((M,), "int64"),
                    "past": t((S - 1,), "int64"), "logits": t((M, Q, V), "float32", "output"),
                    "hidden": t((M, D), "float32", "output"), "k_new": t((L, M, T, H, HD), "float16", "output"),
                    "v_new": t((L, M, T, H, HD), "float16", "output")},
            "vocos": {"mel": t((100, 32), "float32"), "real": t((32, 513), "float32", "output"),
                      "imag": t((32, 513), "float32", "output")},
            "kv": {f"{kv}_cache.{i}": t((S, M, H, HD), "float16", "state") for kv in ("k", "v") for i in range(L)}}


def write_device(cu, io, buf, value: np.ndarray) -> None:
    """Put ``value`` into a device-only buffer (what the engine would write)."""
    from appliance.engines.tensorrt.cuda import PinnedBuffer

    h = PinnedBuffer(cu, value.shape, value.dtype)
    h.array[...] = value
    io.stream.copy(buf.ptr, h.ptr, value.nbytes, cu.H2D)
    io.stream.sync()
    h.free()


def run(kind: str) -> str:
    from appliance.core import SamplingParams
    from appliance.engines.sampling import Sampler
    from appliance.engines.tensorrt.cuda import Cuda
    from appliance.engines.tensorrt.io import TrtIO
    from appliance.errors import EngineError

    if kind == "fake":
        from tests import fake_cudart

        cu, before = Cuda(runtime=fake_cudart), fake_cudart.live()
    else:
        cu, before = Cuda(), None
    rng = np.random.default_rng(5)
    io = TrtIO(cu, plan())
    done = []

    emb = rng.standard_normal((2, 5, D)).astype(np.float32)            # a staged input, there and back
    io.put("gpt", "emb", emb)
    assert np.array_equal(io.get("gpt", "emb", emb.shape), emb)
    done.append("put/get")

    ref_k, ref_v = np.zeros((L, S, M, H, HD), np.float16), np.zeros((L, S, M, H, HD), np.float16)
    t = 5                                                               # a prompt of 5 positions into slot 2
    kn = rng.standard_normal((L, 1, t, H, HD)).astype(np.float16)
    vn = rng.standard_normal((L, 1, t, H, HD)).astype(np.float16)
    write_device(cu, io, io.dev["gpt"]["k_new"], kn)
    write_device(cu, io, io.dev["gpt"]["v_new"], vn)
    io.scatter_kv("gpt", 1, t, np.array([0]), np.array([2]))
    ref_k[:, 0:t, 2], ref_v[:, 0:t, 2] = kn[:, 0], vn[:, 0]
    pos, slots = np.array([5, 3, 7]), np.array([2, 0, 1])              # one step of three rows
    kn = rng.standard_normal((L, 3, 1, H, HD)).astype(np.float16)
    vn = rng.standard_normal((L, 3, 1, H, HD)).astype(np.float16)
    write_device(cu, io, io.dev["gpt"]["k_new"], kn)
    write_device(cu, io, io.dev["gpt"]["v_new"], vn)
    io.scatter_kv("gpt", 3, 1, pos, slots)
    for i in range(3):
        ref_k[:, pos[i], slots[i]], ref_v[:, pos[i], slots[i]] = kn[:, i, 0], vn[:, i, 0]
    k, v = io.read_kv()
    assert np.array_equal(k, ref_k) and np.array_equal(v, ref_v), "KV scatter differs from the reference"
    addr = io.kv_addresses()
    assert addr["k_cache.1"] - addr["k_cache.0"] == S * M * H * HD * 2 and len(addr) == 2 * L
    for bad in ((np.array([S - 1]), np.array([0]), 2), (np.array([0]), np.array([M]), 1)):
        try:
            io.scatter_kv("gpt", 1, bad[2], bad[0], bad[1])
        except EngineError:
            pass
        else:
            raise AssertionError(f"KV rows outside the cache accepted: {bad}")
    done.append("KV scatter (prompt and step)")

    logits = rng.standard_normal((3, Q, V)).astype(np.float32)         # the engine's output, drawn on the host
    io.put("gpt", "logits", logits)
    io.put("gpt", "hidden", np.arange(3 * D, dtype=np.float32))
    out = io.get_many("gpt", {"logits": (3, Q, V), "hidden": (3, D)})
    assert np.array_equal(out["hidden"].reshape(-1), np.arange(3 * D, dtype=np.float32))
    a, b = Sampler(M, num_vq=Q, num_tokens=V), Sampler(M, num_vq=Q, num_tokens=V)
    for s in range(3):
        a.start(s, SamplingParams(), 11 + s)
        b.start(s, SamplingParams(), 11 + s)
    n = np.zeros(3, np.int64)
    got, want = a.sample(np.arange(3), out["logits"], n), b.sample(np.arange(3), logits, n)
    assert np.array_equal(got, want) and got.shape == (3, Q)
    done.append("sampling over copied logits")

    free0 = cu.mem_info()[0]
    io.close()
    io.close()
    if before is not None:
        from tests import fake_cudart

        assert fake_cudart.live() == before, "buffers left allocated after close"
    else:
        assert cu.mem_info()[0] >= free0, "close returned no device memory"
    done.append("close")
    assert "torch" not in sys.modules, "torch was imported"
    return ", ".join(done) + "; torch not imported"


if __name__ == "__main__":
    print("ok", run(sys.argv[1]))
