"""Pinned host pool: one allocation at start-up, views reused, slabs accounted, no growth over many requests."""

from __future__ import annotations

import numpy as np
import pytest

from appliance.engines.pinned import PinnedPool
from appliance.errors import CapacityError


def test_buffers_are_aligned_views_of_one_allocation():
    calls = []

    def alloc(n):
        calls.append(n)
        return np.zeros(n, np.uint8)

    p = PinnedPool({"codes": ((16, 3, 4), "int64"), "hidden": ((16, 3, 768), "float32")}, slabs=4, slab_samples=12288,
                   allocator=alloc)
    assert p.allocations == 1 and len(calls) == 1
    assert p["codes"].shape == (16, 3, 4) and p["hidden"].dtype == np.float32
    for name in ("codes", "hidden"):
        assert np.shares_memory(p[name], p.raw) and p[name].ctypes.data % 256 == 0
    assert p.nbytes >= 16 * 3 * 4 * 8 + 16 * 3 * 768 * 4 + 4 * 12288 * 4
    p["codes"][:] = 7
    assert (p["hidden"] == 0).all()  # no overlap


def test_slabs_reused_over_many_requests_without_allocation():
    p = PinnedPool({}, slabs=2, slab_samples=1000)
    ids = set()
    for req in range(500):
        i, a = p.acquire()
        j, b = p.acquire()
        a[:] = req
        b[:] = -req
        assert not np.shares_memory(a, b)
        ids.add(a.ctypes.data)
        ids.add(b.ctypes.data)
        p.release(i)
        p.release(j)
    assert p.allocations == 1 and len(ids) == 2 and p.acquired == 1000 and p.free_slabs == 2
    i, _ = p.acquire()
    p.acquire()
    with pytest.raises(CapacityError):
        p.acquire()
    with pytest.raises(ValueError):
        p.release(99)
    p.release(i)
    with pytest.raises(ValueError):
        p.release(i)


def test_runner_pool_is_not_reallocated_over_requests(tiny_config):
    from appliance.core import SamplingParams
    from appliance.engines.cuda_runner import CudaRunner
    from appliance.synth.decode_loop import DecodeLoop, Sequence

    r = CudaRunner(tiny_config, buckets=[512])
    loop = DecodeLoop(r, device_chunk=8)
    raw = r.pool.raw.ctypes.data
    rng = np.random.default_rng(0)
    for req in range(30):
        s = Sequence(ids=rng.integers(0, 400, 6), spk_emb=None, params=SamplingParams(max_new_tokens=10), seed=req)
        loop.join(s)
        while not s.finished:
            loop.step()
    assert r.pool.allocations == 1 and r.pool.raw.ctypes.data == raw


def test_decoder_vocos_use_pinned_buffers(tiny_config):
    from appliance.engines.cuda_runner import CudaRunner
    from appliance.engines.torch_runner import TorchRunner

    r, ref = CudaRunner(tiny_config, buckets=[512]), TorchRunner(tiny_config)
    rng = np.random.default_rng(1)
    for t in (5, 40, 17):
        h = rng.standard_normal((t, r.info.hidden_size)).astype(np.float32)
        mel = r.decoder(h)
        assert np.shares_memory(mel, r.pool.raw) and mel.shape == (100, 2 * t)
        np.testing.assert_allclose(mel, ref.decoder(h), rtol=1e-5, atol=1e-5)
        re, im = r.vocos(mel.copy())
        want = ref.vocos(mel.copy())
        assert np.shares_memory(re, r.pool.raw) and re.shape == (2 * t, 513)
        np.testing.assert_allclose(re, want[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(im, want[1], rtol=1e-4, atol=1e-5)
    assert r.pool.allocations == 1
