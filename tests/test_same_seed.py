"""Same seed, same audio, whichever backend speaks: every runner draws from one counter-based
random stream (appliance.engines.rng) with one sampler algorithm, so a request with a fixed seed
gives IDENTICAL codes on torch CPU, ONNX Runtime (FP32 graphs), the CUDA runner's logic run
eagerly on the CPU, and (on a GPU) the CUDA runner in FP32, with the default sampling
(temperature 0.3, top-P 0.7, top-K 20, repetition penalty 1.05).

Logits differ between backends by FP32 rounding (other kernels, other summation orders), so a
draw that falls within rounding of a cumulative-probability boundary could flip. If that ever
happens the failure names the step, both codes and the margin of the draw to the boundary.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from appliance.core import SamplingParams
from appliance.synth.decode_loop import DecodeLoop, Sequence
from tests.fixtures_model import ONNX_LIMITS

STEPS = 120
PARAMS = SamplingParams(min_new_tokens=STEPS, max_new_tokens=STEPS)   # defaults otherwise (upstream's)


def _runners(tiny_ckpt, tiny_config, onnx_dir):
    from appliance.config import config_from_dict
    from appliance.engines.torch.cuda_runner import CudaRunner
    from appliance.engines.onnx.runner import OnnxRunner
    from appliance.engines.torch.cpu_runner import TorchRunner

    out = {"torch-cpu": lambda: TorchRunner(tiny_config),
           "cuda-runner-on-cpu": lambda: CudaRunner(tiny_config, buckets=[128, 512], step_chunk=8),
           "onnxruntime-fp32": lambda: OnnxRunner(config_from_dict(
               {"model": {"path": str(tiny_ckpt), "backend": "onnxruntime", "threads": 1, **ONNX_LIMITS,
                          "engine_dir": str(onnx_dir)}}, base_dir=str(tiny_ckpt)))}
    import torch

    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        cfg = dataclasses.replace(tiny_config, model=dataclasses.replace(tiny_config.model, device="cuda"))
        out["torch-cuda-fp32"] = lambda: CudaRunner(cfg, step_chunk=8)
    return out


def _speak(runner, prompts, seeds, spk):
    """Three sentences decoded together (joining at different steps) -> codes [STEPS, 4] each."""
    loop = DecodeLoop(runner)
    seqs = [Sequence(ids=p, spk_emb=spk if i == 0 else None, params=PARAMS, seed=s)
            for i, (p, s) in enumerate(zip(prompts, seeds))]
    codes = {i: [] for i in range(len(seqs))}
    for step in range(STEPS + 10):
        for i, s in enumerate(seqs):
            if step == 3 * i and loop.join(s):
                codes[i].append(s.codes.copy())
        for s in loop.step():
            codes[seqs.index(s)].append(s.codes.copy())
        for s in seqs:
            if s.finished:
                loop.release(s)
    return [np.array(codes[i]) for i in range(len(seqs))]


def _margin(ref_runner, prompt, spk, codes, step, seed) -> str:
    """Why two backends may differ at ``step``: replay the reference's logits and report how close
    the draw came to a cumulative-probability boundary, and the top-1/top-2 gap."""
    from appliance.engines.rng import uniform
    from appliance.engines.sampling import Sampler, softmax_rows

    r = ref_runner
    logits, _ = r.forward_prefill(0, prompt, spk)
    for j in range(step):
        logits, _ = r.forward_decode(np.array([0]), codes[j:j + 1], np.array([len(prompt) + j]))
        logits = logits[0]
    smp = Sampler(1)
    smp.start(0, PARAMS, seed)
    for j in range(max(0, step - 16), step):
        smp.record(0, codes[j])
    x = smp.process(np.array([0]), np.asarray(logits, np.float32).reshape(1, 4, -1), np.array([step])).copy()
    cum = np.cumsum(softmax_rows(x.reshape(4, -1), np.empty((4, x.shape[-1]), np.float32)), axis=1)
    u = uniform(np.uint64(seed), step * 4 + np.arange(4)).astype(np.float32)
    margin = np.min(np.abs(cum - u[:, None] * cum[:, -1:]), axis=1)
    top2 = np.sort(x.reshape(4, -1), axis=1)[:, -2:]
    return f"draw margin to the nearest boundary per codebook {margin.tolist()}, top-1 minus top-2 {(top2[:, 1] - top2[:, 0]).tolist()}"


def test_same_seed_gives_identical_codes_on_every_backend(tiny_ckpt, tiny_config, onnx_dir):
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 400, n) for n in (9, 14, 21)]
    spk = rng.standard_normal(64).astype(np.float32)  # the tiny model's hidden size
    seeds = [3, 2**40 + 7, 2**63 + 5]
    results = {}
    ref = None
    for name, make in _runners(tiny_ckpt, tiny_config, onnx_dir).items():
        r = make()
        results[name] = _speak(r, prompts, seeds, spk)
        if name == "torch-cpu":
            ref = r
        else:
            r.close()
    base = results["torch-cpu"]
    assert all(len(c) == STEPS for c in base)
    assert len(np.unique(base[0][:, 0])) > 10, "real draws expected, not a constant"
    for name, got in results.items():
        for i in range(len(prompts)):
            if not np.array_equal(got[i], base[i]):
                step = int(np.argmax((got[i] != base[i]).any(axis=1))) if got[i].shape == base[i].shape else -1
                why = _margin(ref, prompts[i], spk if i == 0 else None, base[i], step, seeds[i]) if step >= 0 else ""
                pytest.fail(f"{name}: sentence {i} differs from torch-cpu at step {step}: "
                            f"{got[i][step].tolist() if step >= 0 else got[i].shape} vs "
                            f"{base[i][step].tolist() if step >= 0 else base[i].shape}; {why}")
    print("identical codes on:", ", ".join(results))
