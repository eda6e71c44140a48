"""CudaRunner on a real GPU (skipped without CUDA): graph replay equals
eager, the captured prefill equals the eager model, the compiled step (torch.compile at start, and
the ahead-of-time package built by ``engines compile``) equals the plain graph,
FP16 close to FP32 (logits within 1e-2, greedy codes equal for 200+ steps on the tiny golden
checkpoint; the full one too when ``APPLIANCE_FULL_CKPT`` names a checkpoint), INT8/FP8 close,
pinned host buffers, and no device-memory growth over requests."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

# system_cxx (tests/fixtures_model.py): the AOT tests compile with the system C++ compiler, not $CXX of the GPU image
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("system_cxx")]

STEPS = 210


def _cfg(ckpt, dtype, max_batch=3, max_seq=512):
    from appliance.config import config_from_dict

    return config_from_dict({"model": {"path": str(ckpt), "backend": "torch", "device": "cuda", "dtype": dtype,
                                       "max_batch": max_batch, "max_seq_len": max_seq, "max_prompt_tokens": 128}})


def _runner(ckpt, dtype, **kw):
    from appliance.engines.torch.cuda_runner import CudaRunner

    return CudaRunner(_cfg(ckpt, dtype, max_seq=kw.pop("max_seq", 512)), buckets=kw.pop("buckets", [256, 512]), **kw)


def _sampled(r, ids, spk, seeds, n=48, params=None):
    """Three slots started with ``seeds``, ``n`` steps of chunks of 8 -> codes [n + 1, 3, 4], hidden of slot 1."""
    from appliance.core import SamplingParams

    prm = params or SamplingParams(min_new_tokens=200, max_new_tokens=200, temperature=0.7)
    first = []
    for s in range(3):
        r.prefill(s, ids[: 10 + 5 * s], spk)
        first.append(r.start(s, prm, seeds[s]))
    codes = [np.array(first)] + [c.copy() for _ in range(n // 8) for c in r.step(np.array([0, 1, 2]), 8)]
    return np.array(codes), r.hidden(1, 0, n + 1)


def _greedy(r, ids, spk, n):
    from appliance.core import SamplingParams

    p = SamplingParams(greedy=True, min_new_tokens=n, max_new_tokens=n)
    r.prefill(0, ids, spk)
    codes = [r.start(0, p, 0)]
    while len(codes) < n:
        codes.extend(r.step(np.array([0]), min(8, n - len(codes)))[:, 0].copy())
    return np.array(codes)


def _logits_along(ckpt, dtype, quant, ids, spk, codes, n):
    """The model's logits along ``codes`` (teacher forcing) in ``dtype`` (+ weight-only ``quant``)."""
    from appliance.engines.torch.cpu_runner import TorchRunner
    from appliance.model.quant import quantize_

    r = TorchRunner(_cfg(ckpt, "float32", max_batch=1))
    if quant:
        quantize_(r.model.gpt, quant)
    r.model.to(dtype=getattr(torch, dtype))
    r.model.gpt.setup_cache(1, 512, getattr(torch, dtype), "cuda")
    r.dtype = getattr(torch, dtype)
    lg, _ = r.forward_prefill(0, ids, spk)
    out = [lg.copy()]
    for i in range(min(n, len(codes) - 1)):
        lg, _ = r.forward_decode(np.array([0]), codes[i:i + 1], np.array([len(ids) + i]))
        out.append(lg[0].copy())
    r.close()
    return np.array(out)


def _compare(ckpt, ids, spk, dtype="float16", quant=None, max_seq=512, buckets=(256, 512)):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = _runner(ckpt, "float32", max_seq=max_seq, buckets=list(buckets))
    c32 = _greedy(ref, ids, spk, STEPS)
    ref.close()
    r = _runner(ckpt, dtype, quant=quant, max_seq=max_seq, buckets=list(buckets))
    c16 = _greedy(r, ids, spk, STEPS)
    r.close()
    l32 = _logits_along(ckpt, "float32", None, ids, spk, c32, STEPS)
    l16 = _logits_along(ckpt, dtype, quant, ids, spk, c32, STEPS)
    rel = max(float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(l16, l32))
    same = (c16 == c32).all(axis=1)
    first = None if same.all() else int(np.argmin(same))
    gap = None
    if first is not None:
        s = np.sort(l32[first], -1)
        gap = (s[:, -1] - s[:, -2]).tolist()
    print(f"{dtype}/{quant}: logits rel L2 max {rel:.2e}; greedy identical for "
          f"{STEPS if first is None else first}/{STEPS} steps; fp32 top1-top2 gap at divergence {gap}")
    return rel, first, gap, l32


def test_graph_replay_equals_eager(golden_ckpt, golden):
    torch.backends.cuda.matmul.allow_tf32 = False
    g = _runner(golden_ckpt, "float32")
    e = _runner(golden_ckpt, "float32", graphs=False)
    assert g.seam.cuda and not e.seam.cuda and len(g.seam.graphs) == 6 + len(g.prefill_buckets) + 3
    (cg, hg), (ce, he) = (_sampled(r, golden["input_ids"], golden["spk_emb"], [100, 101, 102]) for r in (g, e))
    np.testing.assert_array_equal(cg, ce)
    np.testing.assert_allclose(hg, he, rtol=1e-4, atol=1e-4)


def test_captured_prefill_equals_eager_model(golden_ckpt, golden):
    """Prefill and first draw as captured graphs (prompt padded to a bucket) == the eager model on
    CUDA (TorchRunner, host sampler), then the same codes and hidden states."""
    from appliance.core import SamplingParams
    from appliance.engines.torch.cpu_runner import TorchRunner

    torch.backends.cuda.matmul.allow_tf32 = False
    g = _runner(golden_ckpt, "float32")
    e = TorchRunner(_cfg(golden_ckpt, "float32"))
    ids = golden["input_ids"]
    p = SamplingParams(temperature=0.8)
    for n in (5, 32, 33, len(ids)):
        a = [r.prefill(2, ids[:n], golden["spk_emb"]) or r.start(2, p, 5) for r in (g, e)]
        np.testing.assert_array_equal(a[0], a[1])
        np.testing.assert_array_equal(g.step(np.array([2]), 4), e.step(np.array([2]), 4))
        np.testing.assert_allclose(g.hidden(2, 0, 5), e.hidden(2, 0, 5), rtol=1e-4, atol=1e-4)


def test_compiled_graph_equals_graph(golden_ckpt, golden):
    """torch.compile of the step captured in our CUDA graph == the plain captured step."""
    torch.backends.cuda.matmul.allow_tf32 = False
    g = _runner(golden_ckpt, "float32", buckets=[256], max_seq=256, capture_batches=[3])
    c = _runner(golden_ckpt, "float32", buckets=[256], max_seq=256, capture_batches=[3], compile="default")
    assert c.seam.cuda and c.compiled == "default" and (3, 256) in c.seam.graphs
    (cg, hg), (cc, hc) = (_sampled(r, golden["input_ids"], golden["spk_emb"], [7, 8, 9]) for r in (g, c))
    same = (cg == cc).all(axis=2).mean()
    assert same > 0.95, f"sampled codes compiled vs plain graph agree on {same:.1%} only"
    np.testing.assert_allclose(hg[:8], hc[:8], rtol=1e-3, atol=1e-3)


def test_fp16_close_to_fp32_tiny(golden_ckpt, golden):
    rel, first, gap, l32 = _compare(golden_ckpt, golden["input_ids"], golden["spk_emb"], "float16")
    assert rel < 1e-2
    if first is not None:  # allowed only on a near tie of the FP32 logits
        assert min(gap) < 2e-2 * float(np.abs(l32).max()), f"diverged at {first} with a clear fp32 gap {gap}"


@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_weight_only_quant_close(golden_ckpt, golden, quant):
    if quant == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm >= 8.9")
    rel, first, gap, _ = _compare(golden_ckpt, golden["input_ids"], golden["spk_emb"], "float16", quant)
    assert rel < 5e-2


@pytest.mark.skipif(not os.environ.get("APPLIANCE_FULL_CKPT"), reason="APPLIANCE_FULL_CKPT not set")
def test_fp16_close_to_fp32_full(golden):
    from appliance.text.speaker import resolve_voice
    from appliance.text.tokenizer import Tokenizer

    ck = os.environ["APPLIANCE_FULL_CKPT"]
    tok = Tokenizer.from_dir(os.path.join(ck, "asset", "tokenizer"))
    ids = tok.encode(Tokenizer.prompt_text("今天天气很好我们一起去公园散步吧你说好吗", prompt="[speed_5]"))
    rel, first, gap, l32 = _compare(ck, ids, resolve_voice("seed:2", 768), "float16", max_seq=1024, buckets=(512, 1024))
    assert rel < 1e-2
    if first is not None:
        assert min(gap) < 2e-2 * float(np.abs(l32).max()), f"diverged at {first} with a clear fp32 gap {gap}"


def test_pinned_buffers_and_no_memory_growth(golden_ckpt, golden):
    from appliance.core import SamplingParams
    from appliance.engines.runner import VocodeWindow
    from appliance.synth.decode_loop import DecodeLoop, Sequence

    r = _runner(golden_ckpt, "float16")
    assert r._h_codes.is_pinned() and r.voc.h_spec.is_pinned()
    loop = DecodeLoop(r)
    before = None
    for req in range(40):
        seqs = [Sequence(ids=golden["input_ids"][: 20 + k], spk_emb=golden["spk_emb"],
                         params=SamplingParams(max_new_tokens=30 + 7 * k), seed=req * 3 + k) for k in range(3)]
        for s in seqs:
            loop.join(s)
        while loop.active:
            loop.step()
        for s in seqs:
            if s.steps > 2:
                r.vocode(s.slot, VocodeWindow(0, s.steps, 0, 2 * s.steps, 0, 2 * s.steps, 0, 2 * s.steps))
            loop.release(s)
        torch.cuda.synchronize()
        if req == 2:
            before = torch.cuda.memory_allocated()
    assert torch.cuda.memory_allocated() == before


def test_same_seed_cuda_fp32_equals_host(tiny_ckpt, tiny_config):
    """The device sampler and the host sampler draw the same codes from the same seed (CUDA FP32
    runner against torch CPU); the cross-backend test (tests/test_same_seed.py) covers more."""
    from appliance.core import SamplingParams
    from appliance.engines.torch.cuda_runner import CudaRunner
    from appliance.engines.torch.cpu_runner import TorchRunner

    torch.backends.cuda.matmul.allow_tf32 = False
    cuda = CudaRunner(dataclasses.replace(tiny_config, model=dataclasses.replace(tiny_config.model, device="cuda")))
    host = TorchRunner(tiny_config)
    ids = np.arange(3, 30)
    p = SamplingParams(min_new_tokens=100, max_new_tokens=100)
    out = []
    for r in (cuda, host):
        r.prefill(1, ids, None)
        out.append(np.concatenate([r.start(1, p, 42)[None]] + [r.step(np.array([1]), 1)[:, 0].copy() for _ in range(99)]))
    np.testing.assert_array_equal(out[0], out[1])


def test_stateful_vocoder_stream_on_the_gpu_equals_the_host_one_shot(tiny_config):
    """The CUDA runner's stateful Decoder/Vocos passes (their caches on the device, FP32), streamed
    with the exact look-ahead in uneven chunks, give the PCM of the torch CPU runner's one-shot
    pass over the same hidden states."""
    from appliance.synth.calibration import _stream
    from appliance.engines.torch.cuda_runner import CudaRunner
    from appliance.engines.runner import VocodeWindow
    from appliance.engines.torch.cpu_runner import TorchRunner
    from appliance.synth.istft import istft
    from appliance.synth.vocoder import WindowedVocoder

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cuda = CudaRunner(dataclasses.replace(tiny_config, model=dataclasses.replace(tiny_config.model, device="cuda")))
    host = TorchRunner(tiny_config)
    n, slot = 70, 1
    h = np.random.default_rng(5).standard_normal((n, host.info.hidden_size)).astype(np.float32)
    for r in (cuda, host):
        r.prefill(slot, np.arange(1, 9), None)
    host._hid[slot, :n] = h
    cuda.hid[slot, :n] = torch.from_numpy(h).to(cuda.hid)
    re, im = host.vocode(slot, VocodeWindow(0, n, 0, 2 * n, 0, 2 * n, 0, 2 * n))
    exact = istft(re.copy(), im.copy())
    for chunk in (1, 4, 13):
        got = _stream(WindowedVocoder(cuda, 512), slot, n, None, chunk)
        assert got.shape == exact.shape
        assert np.abs(got - exact).max() <= 1e-4 * np.abs(exact).max(), chunk
    # a look-ahead of 4 steps: the Decoder freezes its frames after 8 mel frames (its reach) on the
    # device as on the host (one model definition): the two streams agree, and differ from exact
    for chunk in (2, 13):
        got = _stream(WindowedVocoder(cuda, 512), slot, n, 4, chunk)
        ref = _stream(WindowedVocoder(host, 512), slot, n, 4, chunk)
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max(), chunk
        assert np.abs(ref - exact).max() > 1e-3 * np.abs(exact).max()


def _open_in_fresh_process(ckpt, eng, compile_setting, env_extra=None):
    """open_runner in a fresh process (``model.compile`` as given) -> (compiled, step_source, codes [25, 1, 4], log)."""
    import json
    import subprocess
    import sys

    code = (
        "import json, logging, sys; logging.basicConfig(level=logging.INFO)\n"
        "import numpy as np\n"
        "from appliance.config import config_from_dict\n"
        "from appliance.core import SamplingParams\n"
        "from appliance.engines.select import open_runner\n"
        f"cfg = config_from_dict({{'model': {{'path': {str(ckpt)!r}, 'backend': 'torch', 'device': 'cuda', "
        f"'dtype': 'float32', 'compile': {compile_setting!r}, 'engine_dir': {str(eng)!r}, 'max_batch': 1, "
        "'max_seq_len': 256, 'max_prompt_tokens': 64}})\n"
        "r = open_runner(cfg)\n"
        "r.prefill(0, np.arange(3, 20), None)\n"
        "c = [r.start(0, SamplingParams(min_new_tokens=30, max_new_tokens=30, temperature=0.7), 77)[None, None]]\n"
        "c += [r.step(np.array([0]), 8) for _ in range(3)]\n"
        "print('RESULT', json.dumps([r.compiled, r.step_source, np.concatenate(c).tolist()]))\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400, env={**env, **(env_extra or {})})
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, out.stderr[-3000:]
    compiled, source, codes = json.loads(line[7:])
    return compiled, source, np.array(codes), out.stderr


def test_compile_auto_loads_what_engines_compile_built(tiny_ckpt, tmp_path):
    """model.compile: auto on a GPU: without packages plain CUDA graphs (and the log says which
    command builds them); after ``chattts-appliance engines compile`` a fresh process loads the
    ahead-of-time step (no tracing) and draws the plain graphs' codes for the same seed."""
    import json
    import subprocess
    import sys

    eng = tmp_path / "eng"
    compiled, source, plain, log = _open_in_fresh_process(tiny_ckpt, eng, "auto")
    assert compiled is None and "no ahead-of-time compiled step" in source and "engines compile" in log
    cfg = tmp_path / "config.yaml"
    cfg.write_text(json.dumps({"model": {"path": str(tiny_ckpt), "backend": "torch", "device": "cuda", "dtype": "float32",
                                         "engine_dir": str(eng), "max_batch": 1, "max_seq_len": 256,
                                         "max_prompt_tokens": 64}}))
    r = subprocess.run([sys.executable, "-m", "appliance", "engines", "compile", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "compiled 1 packages" in r.stdout, r.stdout + r.stderr[-3000:]
    compiled, source, codes, _ = _open_in_fresh_process(tiny_ckpt, eng, "auto")
    assert compiled == "aot" and str(eng / "aot") in source, source
    np.testing.assert_array_equal(codes, plain)


def test_compile_default_caches_in_the_engine_dir(tiny_ckpt, tmp_path):
    """model.compile: default compiles at start with inductor's cache in engine_dir/torch_compile
    (a restart reuses it). A fresh process: inductor reads its cache directory once per process."""
    compiled, _, _, _ = _open_in_fresh_process(tiny_ckpt, tmp_path / "eng", "default")
    assert compiled == "default"
    assert any((tmp_path / "eng" / "torch_compile").rglob("*")), "nothing cached in engine_dir/torch_compile"


def test_aot_graph_equals_graph(golden_ckpt, golden, tmp_path):
    """The AOTInductor package of the step captured in our CUDA graph draws the plain captured
    step's codes for the same seeds (FP32, TF32 off), three rows at once."""
    from appliance.build.aot import build as aot_build
    from appliance.engines import manifest as mf

    torch.backends.cuda.matmul.allow_tf32 = False
    kw = dict(buckets=[256], max_seq=256, capture_batches=[3])
    b = _runner(golden_ckpt, "float32", graphs=False, **kw)
    aot_build(b, tmp_path / "aot", mf.checkpoint_identity(golden_ckpt), [(3, 256)])
    b.close()
    g = _runner(golden_ckpt, "float32", **kw)
    a = _runner(golden_ckpt, "float32", compile="aot", aot_dir=str(tmp_path / "aot"), **kw)
    assert a.compiled == "aot" and a.seam.cuda and (3, 256) in a.seam.graphs, a.step_source
    (cg, hg), (ca, ha) = (_sampled(r, golden["input_ids"], golden["spk_emb"], [7, 8, 9]) for r in (g, a))
    np.testing.assert_array_equal(ca, cg)
    np.testing.assert_allclose(ha, hg, rtol=1e-3, atol=1e-3)