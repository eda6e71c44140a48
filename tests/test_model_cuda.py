"""The torch model on CUDA (skipped without a GPU): golden parity in
FP32, FP16/BF16 closeness, and a CUDA-graph capture of ``GPT.decode_step`` equal to eager."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_fp32_cuda_greedy_parity(golden, golden_ckpt):
    from tests.test_model_parity import run_greedy

    torch.backends.cuda.matmul.allow_tf32 = False
    st = run_greedy(golden, golden_ckpt, device="cuda", dtype="float32", rtol=1e-4)
    print(f"cuda fp32: {st}")
    assert st["steps"] >= 200


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_prefill_close(golden, golden_ckpt, dtype):
    from appliance.config import config_from_dict
    from appliance.engines.torch.cpu_runner import TorchRunner

    cfg = config_from_dict({"model": {"path": str(golden_ckpt), "backend": "torch", "device": "cuda", "dtype": dtype,
                                      "max_batch": 1, "max_seq_len": 512, "max_prompt_tokens": 128}})
    r = TorchRunner(cfg)
    lg, h = r.forward_prefill(0, golden["input_ids"], golden["spk_emb"])
    ref = golden["hiddens"][0]
    rel = float(np.abs(h - ref).max() / np.abs(ref).max())
    same = int((lg.argmax(-1) == golden["codes"][0]).sum())
    mel = r.forward_decoder(golden["hiddens"])
    mrel = float(np.abs(mel - golden["mel"]).max() / np.abs(golden["mel"]).max())
    print(f"cuda {dtype}: prefill hidden rel err {rel:.2e}, argmax agrees {same}/4, mel rel err {mrel:.2e}")
    assert np.isfinite(lg).all() and rel < 5e-2 and mrel < 5e-2


@torch.inference_mode()
def test_decode_step_cuda_graph_equals_eager(golden_model):
    m = golden_model.to("cuda")
    g = m.gpt
    b, d = 3, m.shapes.hidden
    g.setup_cache(b, 256, torch.float32, "cuda")
    rng = torch.Generator(device="cpu").manual_seed(0)
    for s in range(b):  # prompts of different lengths
        g.prefill(torch.randn(1, 5 + 3 * s, d, generator=rng).cuda(), s)
    emb = torch.zeros(b, 1, d, device="cuda")
    slots = torch.arange(b, device="cuda")
    pos = torch.tensor([5, 8, 11], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            g.decode_step(emb, slots, pos, None)  # warm-up writes positions 5/8/11: rewritten below
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = g.decode_step(emb, slots, pos, None)
    new = torch.randn(b, 1, d, generator=rng).cuda()
    emb.copy_(new)
    graph.replay()
    got = out.clone()
    ref = g.decode_step(new, slots, pos, None)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    m.to("cpu")


def test_load_streams_onto_the_device_in_the_final_dtype(golden_ckpt):
    """The CUDA runner's load (fp16 GPT/Embed, fp32 vocoder, int8 GPT linears, no text head) made
    on the GPU equals the same load made on the host (folds and quantization run on the device)."""
    from appliance.model.checkpoint import load_model

    kw = dict(vocoder_dtype=torch.float32, quant="int8", text_head=False)
    host = load_model(golden_ckpt, "cpu", torch.float16, **kw).state_dict()
    dev = load_model(golden_ckpt, "cuda", torch.float16, **kw).state_dict()
    assert host.keys() == dev.keys()
    for k, a in host.items():
        b = dev[k]
        assert b.device.type == "cuda" and b.dtype == a.dtype, k
        if a.is_floating_point():
            torch.testing.assert_close(b.cpu(), a, rtol=2e-3, atol=1e-6)
        else:
            assert int((b.cpu().int() - a.int()).abs().max()) <= 1, k
