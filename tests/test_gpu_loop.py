"""CudaRunner's logic on the CPU (graph seam eager): row permutation, bucketed steps, decode_many
and the DecodeLoop device path (join / step / leave) against the host path."""

from __future__ import annotations

import numpy as np
import pytest

from appliance.core import SamplingParams
from appliance.engines.cuda_runner import CudaRunner, kv_buckets
from appliance.engines.torch_runner import TorchRunner
from appliance.synth.decode_loop import DecodeLoop, Sequence


@pytest.fixture(scope="module")
def runners(tiny_config):
    return CudaRunner(tiny_config, buckets=[64, 512]), TorchRunner(tiny_config)


def test_buckets_and_captures(runners):
    r, _ = runners
    assert kv_buckets(2048) == [256, 512, 1024, 2048] and kv_buckets(300, 128) == [128, 256, 300]
    steps = {k: v for k, v in r.seam.captures.items() if isinstance(k[1], int) and isinstance(k[0], int)}
    assert steps == {(b, L): 1 for b in (1, 2, 3) for L in (64, 512)}
    assert r.prefill_buckets == [32, 64, 128] and r.seam.captures[("prefill", 128)] == 1
    assert all(r.seam.captures[("begin", row)] == 1 for row in range(3))
    assert not r.seam.cuda and r._bucket(64) == 64 and r._bucket(65) == 512


def test_plain_decode_equals_torch_runner_with_permuted_slots(runners):
    r, ref = runners
    rng = np.random.default_rng(1)
    for s in range(3):
        ids = rng.integers(0, 400, 5 + 3 * s)
        a, b = r.prefill(s, ids, None), ref.prefill(s, ids, None)
        np.testing.assert_allclose(a[0], b[0], rtol=1e-5, atol=1e-5)
    pos = {0: 5, 1: 8, 2: 11}
    for order in ([2, 0, 1], [1, 2], [0], [0, 1, 2], [2]):
        codes = rng.integers(0, 625, (len(order), 4))
        p = np.array([pos[s] for s in order])
        got, want = r.decode(np.array(order), codes, p), ref.decode(np.array(order), codes, p)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-5)
        assert [r.row_of[s] for s in order] == list(range(len(order)))
        for s in order:
            pos[s] += 1


def _run(loop, prompts, params, join_at):
    """Drive a loop: sequence i joins at step join_at[i]; returns each sequence's codes."""
    seqs = [Sequence(ids=p, spk_emb=None, params=params[i], seed=100 + i) for i, p in enumerate(prompts)]
    out = {i: [] for i in range(len(seqs))}
    step = 0
    while step < 400 and (any(not s.finished for s in seqs)):
        for i, s in enumerate(seqs):
            if join_at[i] == step:
                if loop.join(s) is not None:
                    out[i].append(s.codes.copy())
        got, hidden = loop.step()
        assert hidden.shape == (len(got), loop.runner.info.hidden_size)
        for s in got:
            out[seqs.index(s)].append(s.codes.copy())
        step += 1
    return seqs, {i: np.array(v) for i, v in out.items()}


def test_device_loop_greedy_equals_host_loop(runners, tiny_config):
    r, ref = runners
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 400, n) for n in (6, 9, 13)]
    params = [SamplingParams(greedy=True, max_new_tokens=n, min_new_tokens=n, repetition_penalty=1.2) for n in (30, 45, 20)]
    host_seqs, host = _run(DecodeLoop(ref), prompts, params, [0, 3, 10])
    dev_loop = DecodeLoop(r, device_chunk=4)
    assert dev_loop.device_sampling and not DecodeLoop(ref).device_sampling
    dev_seqs, dev = _run(dev_loop, prompts, params, [0, 3, 10])
    for i in range(3):
        assert host_seqs[i].reason == dev_seqs[i].reason == "max_tokens"
        assert len(dev[i]) == params[i].max_new_tokens
        np.testing.assert_array_equal(dev[i], host[i])
    assert dev_loop.free_slots == 3


def test_device_sampling_reproducible_alone_or_batched(runners):
    r, _ = runners
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 400, n) for n in (7, 8)]
    p = [SamplingParams(max_new_tokens=25, temperature=1.0), SamplingParams(max_new_tokens=40, temperature=1.0)]
    _, alone = _run(DecodeLoop(r, device_chunk=8), prompts[:1], p[:1], [0])
    _, batched = _run(DecodeLoop(r, device_chunk=8), prompts, p, [2, 0])
    np.testing.assert_array_equal(alone[0], batched[0])
    assert len(np.unique(batched[1][:, 0])) > 3  # real draws, not a constant


def test_leave_frees_slot_and_others_continue(runners):
    r, _ = runners
    loop = DecodeLoop(r, device_chunk=4)
    rng = np.random.default_rng(4)
    seqs = [Sequence(ids=rng.integers(0, 400, 6), spk_emb=None, params=SamplingParams(max_new_tokens=30), seed=i)
            for i in range(3)]
    for s in seqs:
        loop.join(s)
    loop.step()
    loop.leave(seqs[1])
    assert seqs[1].reason == "left" and loop.free_slots == 1
    n0 = seqs[0].steps
    for _ in range(6):
        got, _ = loop.step()
        assert seqs[1] not in got
    assert seqs[0].steps > n0
    new = Sequence(ids=rng.integers(0, 400, 5), spk_emb=None, params=SamplingParams(max_new_tokens=5), seed=9)
    loop.join(new)
    while not new.finished:
        loop.step()
    assert new.steps == 5 and new.reason == "max_tokens"


def test_decode_many_clips_at_cache_end(tiny_config):
    from dataclasses import replace

    cfg = replace(tiny_config, model=replace(tiny_config.model, max_seq_len=64, max_batch=1))
    r = CudaRunner(cfg, buckets=[64])
    r.prefill(0, np.arange(1, 60), None)
    r.begin(0, SamplingParams(), 1)
    codes, hidden = r.decode_many(np.array([0]), 16)
    assert codes.shape == (5, 1, 4) and hidden.shape == (5, 1, 64)
    from appliance.errors import CapacityError
    with pytest.raises(CapacityError):
        r.decode_many(np.array([0]), 1)


def test_compile_mode_and_quant_validation(tiny_config):
    from dataclasses import replace

    from appliance.errors import ConfigError

    for bad in ("reduce-overhead", "max-autotune", "fast"):  # modes with inductor's own CUDA graphs, or unknown
        with pytest.raises(ConfigError, match="compile mode"):
            CudaRunner(tiny_config, compile=bad)
    with pytest.raises(ConfigError, match="quantization"):
        CudaRunner(tiny_config, quant="int4")
    cfg = replace(tiny_config, model=replace(tiny_config.model, quant="int8", max_batch=1, max_seq_len=64))
    r = CudaRunner(cfg, buckets=[64])  # model.quant from the config
    assert r.info.precision == "int8" and r.compiled is None
    r = CudaRunner(replace(cfg, model=replace(cfg.model, quant="none")), buckets=[64])
    assert r.info.precision == "fp32"


@pytest.mark.slow
def test_compiled_step_equals_eager_cpu(tiny_config):
    """torch.compile of the step body (inductor C++ on the CPU; ~40 s cold), sizes made symbolic
    (``compile_dynamic``) so that both attention buckets share compilations, gives the eager
    step's codes and logits across the bucket change."""
    from dataclasses import replace

    cfg = replace(tiny_config, model=replace(tiny_config.model, max_seq_len=64, max_batch=2))
    e = CudaRunner(cfg, buckets=[32, 64], capture_batches=[2])
    c = CudaRunner(cfg, buckets=[32, 64], capture_batches=[2], compile=True, compile_dynamic=True)
    assert c.compiled == "default" and e.compiled is None
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 400, n) for n in (6, 9)]
    outs = []
    for r in (e, c):
        for s, ids in enumerate(prompts):
            r.prefill(s, ids, None)
            r.begin(s, SamplingParams(min_new_tokens=40, max_new_tokens=40, temperature=0.7), 10 + s)
        outs.append(np.concatenate([r.decode_many(np.array([0, 1]), 8)[0].copy() for _ in range(3)]))
        outs.append(r.decode(np.array([1, 0]), outs[-1][-1], np.array([9 + 24, 6 + 24]))[0].copy())
    np.testing.assert_array_equal(outs[0], outs[2])
    np.testing.assert_allclose(outs[1], outs[3], rtol=1e-4, atol=1e-4)


def test_padded_prefill_equals_torch_runner(runners, tiny_config):
    """The bucketed (padded) prefill gives TorchRunner's logits/hidden at bucket edges, and the
    decode steps after it (which overwrite the padding's K/V) too; begin draws the same codes
    as the eager first draw."""
    r, ref = runners
    plain = CudaRunner(tiny_config, buckets=[64, 512], prefill_graphs=False)
    rng = np.random.default_rng(6)
    for n in (1, 31, 32, 33, 128):
        ids = rng.integers(0, 400, n)
        a, b = r.prefill(1, ids, None), ref.prefill(1, ids, None)
        np.testing.assert_allclose(a[0], b[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(a[1], b[1], rtol=1e-5, atol=1e-5)
        codes = rng.integers(0, 625, (1, 4))
        got, want = r.decode(np.array([1]), codes, np.array([n])), ref.decode(np.array([1]), codes, np.array([n]))
        np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
        for x in (r, plain):
            x.prefill(0, ids, None)
        p = SamplingParams(temperature=0.9)
        np.testing.assert_array_equal(r.begin(0, p, 11), plain.begin(0, p, 11))
