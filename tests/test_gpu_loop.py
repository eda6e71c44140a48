"""CudaRunner's logic on the CPU (graph seam eager, FP32): row permutation, bucketed steps, the
padded prefill, and the Runner contract against the TorchRunner (the reference host runner)."""

from __future__ import annotations

import numpy as np
import pytest

from appliance.core import SamplingParams
from appliance.engines.torch.cuda_graphs import bucket, kv_buckets
from appliance.engines.torch.cuda_runner import CudaRunner
from appliance.engines.runner import VocodeWindow
from appliance.engines.torch.cpu_runner import TorchRunner
from appliance.synth.decode_loop import DecodeLoop, Sequence


@pytest.fixture(scope="module")
def runners(tiny_config):
    return CudaRunner(tiny_config, buckets=[64, 512], step_chunk=4), TorchRunner(tiny_config)


def test_buckets_and_captures(runners):
    r, _ = runners
    assert kv_buckets(2048) == [256, 512, 1024, 2048] and kv_buckets(300, 128) == [128, 256, 300]
    steps = {k: v for k, v in r.seam.captures.items() if isinstance(k[1], int) and isinstance(k[0], int)}
    assert steps == {(b, L): 1 for b in (1, 2, 3) for L in (64, 512)}
    assert r.prefill_buckets == [32, 64, 128] and r.seam.captures[("prefill", 128)] == 1
    assert all(r.seam.captures[("begin", row)] == 1 for row in range(3))
    assert not r.seam.cuda and bucket(r.buckets, 64) == 64 and bucket(r.buckets, 65) == 512
    assert r.info.step_chunk == 4 and not r.info.text_mode


def _start_all(r, prompts, params, seeds, slots):
    return [r.prefill(s, ids, None) or r.start(s, p, seed) for s, ids, p, seed in zip(slots, prompts, params, seeds)]


def test_steps_equal_torch_runner_with_permuted_slots(runners):
    """Same prompts, seeds and sampling (not greedy) in every slot order: the same codes and hidden
    states as the host runner (the permutation moves KV rows, sampler rows and hidden buffers)."""
    r, ref = runners
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 400, 5 + 3 * s) for s in range(3)]
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=30, repetition_penalty=1.1) for _ in range(3)]
    first = [_start_all(x, prompts, params, [7, 8, 9], [0, 1, 2]) for x in (r, ref)]
    np.testing.assert_array_equal(np.array(first[0]), np.array(first[1]))
    n = {0: 1, 1: 1, 2: 1}
    for order in ([2, 0, 1], [1, 2], [0], [0, 1, 2], [2]):
        got, want = r.step(np.array(order), 1).copy(), ref.step(np.array(order), 1).copy()
        np.testing.assert_array_equal(got, want)
        assert [r.row_of[s] for s in order] == list(range(len(order)))
        for s in order:
            n[s] += 1
    for s in range(3):
        np.testing.assert_allclose(r.hidden(s, 0, n[s]), ref.hidden(s, 0, n[s]), rtol=1e-4, atol=1e-5)


def test_vocode_equals_torch_runner(runners):
    r, ref = runners
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 400, 9)
    for x in (r, ref):
        x.prefill(1, ids, None)
        x.start(1, SamplingParams(greedy=True), 0)
        x.step(np.array([1]), 4)
        x.step(np.array([1]), 4)
    for w in (VocodeWindow(0, 6, 0, 10, 0, 8, 0, 6), VocodeWindow(2, 9, 10, 16, 4, 16, 6, 16),
              VocodeWindow(0, 0, 0, 0, 0, 16, 3, 9)):
        a, b = r.vocode(1, w), ref.vocode(1, w)
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)


def _run(loop, prompts, params, join_at):
    """Drive a loop: sequence i joins at step join_at[i]; returns each sequence's codes."""
    seqs = [Sequence(ids=p, spk_emb=None, params=params[i], seed=100 + i) for i, p in enumerate(prompts)]
    out = {i: [] for i in range(len(seqs))}
    step = 0
    while step < 400 and (any(not s.finished for s in seqs)):
        for i, s in enumerate(seqs):
            if join_at[i] == step and loop.join(s):
                out[i].append(s.codes.copy())
        for s in loop.step():
            out[seqs.index(s)].append(s.codes.copy())
        for s in seqs:
            if s.finished:
                loop.release(s)
        step += 1
    return seqs, {i: np.array(v) for i, v in out.items()}


def test_device_loop_equals_host_loop(runners):
    """The decode loop over both runners: sequences joining at different steps, chunks of 4 on the
    device runner, draws from the same seeds -> the same codes and end reasons."""
    r, ref = runners
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 400, n) for n in (6, 9, 13)]
    params = [SamplingParams(max_new_tokens=n, min_new_tokens=n, repetition_penalty=1.2) for n in (30, 45, 20)]
    host_seqs, host = _run(DecodeLoop(ref), prompts, params, [0, 3, 10])
    dev_loop = DecodeLoop(r)
    assert dev_loop.chunk == 4 and DecodeLoop(ref).chunk == 1
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
    _, alone = _run(DecodeLoop(r), prompts[:1], p[:1], [0])
    _, batched = _run(DecodeLoop(r), prompts, p, [2, 0])
    np.testing.assert_array_equal(alone[0], batched[0])
    assert len(np.unique(batched[1][:, 0])) > 3  # real draws, not a constant


def test_leave_frees_slot_and_others_continue(runners):
    r, _ = runners
    loop = DecodeLoop(r)
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
        assert seqs[1] not in loop.step()
    assert seqs[0].steps > n0
    new = Sequence(ids=rng.integers(0, 400, 5), spk_emb=None, params=SamplingParams(max_new_tokens=5), seed=9)
    loop.join(new)
    while not new.finished:
        loop.step()
    assert new.steps == 5 and new.reason == "max_tokens"


def test_step_clips_at_cache_end(tiny_config):
    from dataclasses import replace

    from appliance.errors import CapacityError

    cfg = replace(tiny_config, model=replace(tiny_config.model, max_seq_len=64, max_batch=1))
    r = CudaRunner(cfg, buckets=[64], step_chunk=16)
    r.prefill(0, np.arange(1, 60), None)
    r.start(0, SamplingParams(), 1)
    assert r.step(np.array([0]), 16).shape == (5, 1, 4)
    with pytest.raises(CapacityError):
        r.step(np.array([0]), 1)


def test_compile_mode_and_quant_validation(tiny_config):
    from dataclasses import replace

    from appliance.errors import ConfigError

    for bad in ("reduce-overhead", "max-autotune", "fast"):  # modes with inductor's own CUDA graphs, or unknown
        with pytest.raises(ConfigError, match="compile mode"):
            CudaRunner(tiny_config, compile=bad)
    with pytest.raises(ConfigError, match="quantization"):
        CudaRunner(tiny_config, quant="int4")
    cfg = replace(tiny_config, model=replace(tiny_config.model, max_batch=1, max_seq_len=64))
    r = CudaRunner(cfg, buckets=[64], quant="int8")
    assert r.info.precision == "int8" and r.compiled is None
    r = CudaRunner(cfg, buckets=[64], quant="none")
    assert r.info.precision == "fp32"


@pytest.mark.slow
@pytest.mark.usefixtures("system_cxx")   # inductor's C++ built by the system compiler, loaded here
def test_compiled_step_equals_eager_cpu(tiny_config):
    """torch.compile of the step (inductor C++ on the CPU) gives the eager step's codes across an
    attention-bucket change."""
    from dataclasses import replace

    cfg = replace(tiny_config, model=replace(tiny_config.model, max_seq_len=64, max_batch=2))
    e = CudaRunner(cfg, buckets=[32, 64], capture_batches=[2])
    c = CudaRunner(cfg, buckets=[32, 64], capture_batches=[2], compile=True)
    assert c.compiled == "default" and e.compiled is None
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 400, n) for n in (6, 9)]
    outs = []
    for r in (e, c):
        for s, ids in enumerate(prompts):
            r.prefill(s, ids, None)
            r.start(s, SamplingParams(min_new_tokens=40, max_new_tokens=40, temperature=0.7), 10 + s)
        outs.append(np.concatenate([r.step(np.array([0, 1]), 8).copy() for _ in range(4)]))
        outs.append(r.hidden(1, 0, 30))
    np.testing.assert_array_equal(outs[0], outs[2])
    np.testing.assert_allclose(outs[1], outs[3], rtol=1e-4, atol=1e-4)


def test_padded_prefill_equals_torch_runner(runners):
    """The bucketed (padded) prefill and the steps after it (which overwrite the padding's K/V)
    give the host runner's hidden states and codes at bucket edges."""
    r, ref = runners
    rng = np.random.default_rng(6)
    for n in (1, 31, 32, 33, 128):
        ids = rng.integers(0, 400, n)
        p = SamplingParams(temperature=0.9)
        a = [x.prefill(1, ids, None) or x.start(1, p, 11) for x in (r, ref)]
        np.testing.assert_array_equal(a[0], a[1])
        np.testing.assert_array_equal(r.step(np.array([1]), 3), ref.step(np.array([1]), 3))
        np.testing.assert_allclose(r.hidden(1, 0, 4), ref.hidden(1, 0, 4), rtol=1e-4, atol=1e-5)


def test_compile_auto_is_the_ahead_of_time_step_or_plain_graphs():
    """model.compile: auto never compiles at start: the ahead-of-time packages where built (on any
    machine; building them needs Triton, running them does not), else plain CUDA graphs. The
    packages themselves: tests/test_engines_aot.py (CPU), test_gpu_cuda.py (GPU)."""
    from appliance.engines.torch.cuda_runner import compile_mode

    mode, why = compile_mode("auto")
    assert mode == "aot" and "else plain CUDA graphs" in why
    assert compile_mode("off") == (None, "plain CUDA graphs (model.compile: off)")
    assert compile_mode("default")[0] == "default" and "at start" in compile_mode("default")[1]
    assert compile_mode("max-autotune-no-cudagraphs")[0] == "max-autotune-no-cudagraphs"
