"""The GGUF export + the llama.cpp runner against the ONNX Runtime and torch runners on the tiny
checkpoint: the same codes and hidden states at F32, channels stepping together as they step
alone, a channel's cache removed when its sentence ends, refine-text, and a bad GGUF refused."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from appliance.config import config_from_dict
from appliance.core import SamplingParams
from appliance.engines import manifest as mf
from appliance.errors import EngineMismatchError, IntegrityError
from tests.fixtures_model import ONNX_LIMITS as LIMITS


def _cfg(tiny_ckpt, engine_dir, **model):
    m = {"path": str(tiny_ckpt), "backend": "llama", "threads": 1, **LIMITS, "engine_dir": str(engine_dir)}
    m.update(model)
    return config_from_dict({"model": m}, base_dir=str(tiny_ckpt))


def _db(a: np.ndarray, ref: np.ndarray) -> float:
    """Error energy relative to the reference's, dB."""
    return float(10 * np.log10(((a - ref) ** 2).sum() / (ref ** 2).sum()))


@pytest.fixture(scope="module")
def runners(tiny_ckpt, llama_dir, onnx_dir):
    from appliance.engines.llama.runner import LlamaRunner
    from appliance.engines.onnx.runner import OnnxRunner

    lr = LlamaRunner(_cfg(tiny_ckpt, llama_dir, llama_kv_cache="f16"), reason="test")  # exact: F16 KV
    orr = OnnxRunner(_cfg(tiny_ckpt, onnx_dir, backend="onnxruntime"), reason="ref")
    yield lr, orr
    lr.close()
    orr.close()


def _speak(r, prompts, spk, params, steps):
    """Prefill slot i with prompts[i], start each, then ``steps`` steps of all slots together:
    (codes [steps + 1, B, Q], hidden of slot 0 [steps + 1, D])."""
    slots = np.arange(len(prompts))
    for s, ids in enumerate(prompts):
        r.prefill(s, ids, spk)
    first = np.stack([r.start(s, params, 11 + s) for s in slots])
    codes = [first] + [r.step(slots, 1)[0].copy() for _ in range(steps)]
    return np.stack(codes), r.hidden(0, 0, steps + 1)


def test_manifest_records_and_hashes_the_gguf(llama_dir):
    d = llama_dir / "llama" / "f32"
    m = json.loads((d / mf.MANIFEST).read_text())
    assert m["kind"] == "llama" and m["precision"] == "f32"
    assert m["graphs"]["gpt"]["file"] == "gpt.gguf" and set(m["graphs"]) == {"gpt", "decoder", "vocos"}
    assert m["gguf"]["n_vocab"] == 4 * 626
    for name in ("gpt.gguf", "head_text.npy", "embed.safetensors", "decoder.onnx.data", "vocos.onnx"):
        assert m["files"][name] == mf.file_sha256(d / name)


def test_codes_and_hidden_match_onnxruntime(runners):
    """F32 GGUF: three channels stepping together draw the ONNX Runtime runner's codes (same
    seeds, the one sampler) and store the same hidden states within -60 dB."""
    lr, orr = runners
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 400, n) for n in (30, 17, 44)]
    spk = rng.standard_normal(64).astype(np.float32)
    p = SamplingParams()
    c_l, h_l = _speak(lr, prompts, spk, p, 40)
    c_o, h_o = _speak(orr, prompts, spk, p, 40)
    assert (c_l == c_o).all()
    assert _db(h_l, h_o) < -60
    greedy = dataclasses.replace(p, greedy=True)
    assert (_speak(lr, prompts, spk, greedy, 30)[0] == _speak(orr, prompts, spk, greedy, 30)[0]).all()


def test_channels_step_together_as_alone_and_release_clears(runners):
    """Rows of one ``llama_decode`` do not see each other: each channel's codes are those it
    draws stepping alone; a released slot holds no positions and speaks again from its prefill."""
    lr, _ = runners
    lc = lr._lc
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 400, n) for n in (12, 25, 9)]
    p = SamplingParams()
    together, _ = _speak(lr, prompts, None, p, 25)
    for s in range(3):
        lr.prefill(s, prompts[s], None)
        alone = [lr.start(s, p, 11 + s)] + [lr.step(np.array([s]), 1)[0, 0].copy() for _ in range(25)]
        assert (np.stack(alone) == together[:, s]).all(), f"slot {s}"
    assert lc.llama_memory_seq_pos_max(lr._mem, 1) == len(prompts[1]) + 25 - 1
    lr.release(1)
    assert lc.llama_memory_seq_pos_max(lr._mem, 1) == -1
    assert lc.llama_memory_seq_pos_max(lr._mem, 0) >= 0  # the others keep theirs


def test_refine_text_matches_torch(tiny_ckpt, runners):
    from appliance.engines.torch.cpu_runner import TorchRunner

    lr, _ = runners
    tr = TorchRunner(_cfg(tiny_ckpt, "unused", backend="torch"), reason="ref")
    try:
        ids = np.random.default_rng(2).integers(0, 400, 20)
        p = SamplingParams(max_new_tokens=24)
        assert lr.info.text_mode
        assert (lr.refine(0, ids, p, 5, eos_id=7) == tr.refine(0, ids, p, 5, eos_id=7)).all()
    finally:
        tr.close()


def test_kv_cache_at_the_configured_length_and_its_planned_size(tiny_ckpt, llama_dir, runners):
    """The context is made at the config's ``max_seq_len`` (not the export's) and its KV bytes per
    position are what the memory plan counts before the load. A q8_0 KV cache needs a head width
    of a multiple of 32 (the full model's 64): the tiny checkpoint's 16 gets f16."""
    from appliance.engines.llama import lib as llama_lib
    from appliance.engines.llama.runner import LlamaRunner
    from appliance.engines.sizes import plan_sizes

    cfg = _cfg(tiny_ckpt, llama_dir, max_seq_len=LIMITS["max_seq_len"] // 2, llama_kv_cache="q8_0")
    planned = plan_sizes(cfg)
    assert planned.backend == "llama.cpp" and planned.resizable
    lr = LlamaRunner(cfg, reason="test")
    try:
        assert lr.info.max_seq_len == LIMITS["max_seq_len"] // 2
        assert lr.info.kv_bytes_per_token == planned.kv_bytes_per_token == 2 * 2 * lr.info.hidden_size * 2
        assert llama_lib.kv_type("q8_0", 64) == "q8_0" and llama_lib.kv_type("q8_0", 16) == "f16"
        rng = np.random.default_rng(3)
        prompts = [rng.integers(0, 400, n) for n in (20, 31, 11)]
        p = SamplingParams()
        assert (_speak(lr, prompts, None, p, 20)[0] == _speak(runners[0], prompts, None, p, 20)[0]).all()
    finally:
        lr.close()


def test_auto_picks_llama_when_a_gguf_is_exported(tiny_ckpt, llama_dir):
    from appliance.engines.select import choose_backend

    backend, why = choose_backend(_cfg(tiny_ckpt, llama_dir, backend="auto"))
    assert backend == "llama" and "gguf" in why.lower()


def test_auto_on_a_gpu_box_picks_llama_cpp_cuda_before_torch(tiny_ckpt, llama_dir, monkeypatch):
    """A GPU box (facts faked at the driver's boundary: nvidia-smi's compute capability): with
    llama.cpp's CUDA build and a GGUF export, auto and the recovery order take llama.cpp (the GPT
    offloaded, no torch) before torch CUDA, saying why; with a CPU build, torch CUDA, naming what
    was missing. The KV cache then defaults to q8_0 on the GPU, f16 on the CPU."""
    from appliance.engines import recover, select
    from appliance.engines.llama.lib import kv_wanted

    monkeypatch.setattr(mf, "device_facts", lambda: {"compute_capability": "9.0", "gpu": "H100", "board": None,
                                                      "l4t": None})
    cfg = _cfg(tiny_ckpt, llama_dir, backend="auto")
    monkeypatch.setattr(select, "llama_gpu_build", lambda: True)
    monkeypatch.setattr(recover, "llama_gpu_build", lambda: True)
    backend, why = select.choose_backend(cfg)
    assert backend == "llama" and "CUDA build" in why and "no torch" in why
    assert [b for b, _ in recover.candidates(cfg)][:2] == ["llama", "torch"]
    assert select.choose_backend(_cfg(tiny_ckpt, llama_dir, backend="auto", device="cpu"))[0] == "torch"
    monkeypatch.setattr(select, "llama_gpu_build", lambda: False)
    monkeypatch.setattr(recover, "llama_gpu_build", lambda: False)
    backend, why = select.choose_backend(cfg)
    assert backend == "torch" and "CPU build" in why
    assert [b for b, _ in recover.candidates(cfg)][:2] == ["torch", "llama"]
    assert (kv_wanted("auto", True), kv_wanted("auto", False), kv_wanted("f16", True)) == ("q8_0", "f16", "f16")


def test_the_thread_probe_holds_still_on_an_offloaded_gpt():
    from appliance.engines.llama.runner import step_threads

    on_gpu, on_cpu = step_threads(16, offloaded=True), step_threads(16, offloaded=False)
    for i in range(2000):                       # step times that would move a CPU probe
        for st in (on_gpu, on_cpu):
            t = st.next(1)
            st.observe(1, t, 0.001 if t == 1 else 0.010 + 0.05 * (i % 7 == 0))
    assert on_gpu.switches == 0 and on_gpu.current == 16
    assert on_cpu.switches >= 1 and on_cpu.current < 16


def test_status_names_each_network(runners):
    lr, orr = runners
    nets = lr.info.network_fields()["networks"]
    assert set(nets) == {"gpt", "decoder", "vocos"} and nets["gpt"].startswith("llama.cpp ") and "CPU" in nets["gpt"]
    assert "CPUExecutionProvider" in nets["decoder"] and "onnxruntime" in orr.info.network_fields()["networks"]["gpt"]


def _copy(llama_dir, tmp_path):
    dst = tmp_path / "eng"
    shutil.copytree(llama_dir / "llama", dst / "llama")
    return dst, dst / "llama" / "f32"


def test_a_changed_gguf_is_refused_naming_it(tiny_ckpt, llama_dir, tmp_path):
    from appliance.engines.llama.runner import LlamaRunner

    eng, d = _copy(llama_dir, tmp_path)
    raw = bytearray((d / "gpt.gguf").read_bytes())
    raw[-7] ^= 0x55
    (d / "gpt.gguf").write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="gpt.gguf"):
        LlamaRunner(_cfg(tiny_ckpt, eng))


def test_a_gguf_of_other_shapes_is_refused_naming_it(tiny_ckpt, llama_dir, tmp_path):
    """A GGUF of one layer (recorded with its own sum, so only its shapes are wrong), and a file
    that is no GGUF at all: both refused at load, naming the file."""
    import torch

    from appliance.build.gguf_export import write_gguf
    from appliance.engines.llama.runner import LlamaRunner
    from appliance.model.checkpoint import load_model

    eng, d = _copy(llama_dir, tmp_path)
    m = load_model(tiny_ckpt)
    m.gpt.layers = torch.nn.ModuleList(list(m.gpt.layers)[:1])
    m.shapes = dataclasses.replace(m.shapes, n_layers=1)
    write_gguf(m, d / "gpt.gguf")
    man = json.loads((d / mf.MANIFEST).read_text())
    mf.write(d, {k: v for k, v in man.items() if k not in ("files", "format", "created")})  # sums of the new file
    with pytest.raises(EngineMismatchError, match=r"gpt\.gguf.*n_layers 1, expected 2"):
        LlamaRunner(_cfg(tiny_ckpt, eng))
    (d / "gpt.gguf").write_bytes(b"not a gguf" * 100)
    mf.write(d, {k: v for k, v in man.items() if k not in ("files", "format", "created")})
    with pytest.raises(EngineMismatchError, match=r"cannot load .*gpt\.gguf"):
        LlamaRunner(_cfg(tiny_ckpt, eng))
