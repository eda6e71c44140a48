"""ONNX export + the ONNX Runtime runner against the PyTorch runner on the tiny checkpoint."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from appliance.config import config_from_dict
from appliance.core import SynthesisRequest
from appliance.errors import (
    CapacityError,
    EngineError,
    EngineMismatchError,
    IntegrityError,
)
from tests.fixtures_model import ONNX_LIMITS as LIMITS


def _cfg(tiny_ckpt, engine_dir, **model):
    m = {"path": str(tiny_ckpt), "backend": "onnxruntime", "threads": 1, **LIMITS, "engine_dir": str(engine_dir)}
    m.update(model)
    return config_from_dict({"model": m}, base_dir=str(tiny_ckpt))


def _fixed_dynamic_axes(spec: dict, inputs: list[dict]) -> list[str]:
    """'name[axis]=size' for every axis the export spec declares dynamic that the graph's inputs
    fixed: an exporter that falls back to a draft export (torch 2.8 did for the static-cache GPT:
    T fixed at the example's 3) writes a graph that only runs at the example's shapes."""
    shapes = {t["name"]: t["shape"] for t in inputs}
    flat = [d for x in spec["dynamic"] for d in (x if isinstance(x, list) else [x])]
    return [f"{n}[{a}]={shapes[n][a]}" for n, d in zip(spec["inputs"], flat) if d and n in shapes
            for a in d if str(shapes[n][a]).isdigit()]


@pytest.fixture(scope="module")
def runners(tiny_ckpt, onnx_dir):
    from appliance.engines.onnx.runner import OnnxRunner
    from appliance.engines.torch.cpu_runner import TorchRunner

    cfg = _cfg(tiny_ckpt, onnx_dir)
    ort_r = OnnxRunner(cfg, reason="test")
    ref = dataclasses.replace(cfg.model, backend="torch", device="cpu", dtype="float32")   # a GPU box too
    torch_r = TorchRunner(dataclasses.replace(cfg, model=ref), reason="ref")
    yield ort_r, torch_r
    ort_r.close()
    torch_r.close()


def test_manifest_written(tiny_ckpt, onnx_dir):
    m = json.loads((onnx_dir / "onnx" / "fp32" / "manifest.json").read_text())
    assert m["kind"] == "onnx" and m["precision"] == "fp32"
    assert set(m["graphs"]) == {"gpt", "decoder", "vocos"}
    assert m["build"]["vocoder"] == "stream-reach"
    assert [t["name"] for t in m["graphs"]["decoder"]["inputs"]][:5] == ["first", "hidden", "pos0", "reach", "cache.0"]
    # one weights file per vocoder network: the first pass reads the stateful pass's weights
    d = onnx_dir / "onnx" / "fp32"
    assert not (d / "decoder_first.onnx").exists() and not (d / "vocos_first.onnx.data").exists()
    assert len(m["checkpoint"]["sha256"]) == 64
    assert (onnx_dir / "onnx" / "fp32" / m["embed"]["file"]).is_file()
    dec_in = [t["name"] for t in m["graphs"]["gpt"]["inputs"]]
    assert dec_in[:3] == ["emb", "pos", "slots"]
    assert "k_cache.0" in dec_in and "v_cache.1" in dec_in
    assert m["limits"] == {**LIMITS, "window_tokens": 64}
    import torch

    from appliance.build import export as ex
    from appliance.model.checkpoint import load_model

    spec = ex._specs(load_model(tiny_ckpt), 3, 512, 128, 64, torch.float32)["gpt"]
    assert not _fixed_dynamic_axes(spec, m["graphs"]["gpt"]["inputs"])


def test_outputs_match_torch_and_greedy_codes_identical(runners):
    o, t = runners
    rng = np.random.default_rng(1)
    spk = rng.standard_normal(o.info.hidden_size).astype(np.float32)
    spk_id = int(o.manifest["special"]["spk_emb_id"])
    pos = np.zeros(3, np.int64)
    codes = np.zeros((3, 4), np.int64)
    for slot, n in [(0, 17), (1, 5), (2, 40)]:
        ids = rng.integers(0, 200, n)
        ids[1] = spk_id
        (la, ha), (lb, hb) = [tuple(x.copy() for x in r.forward_prefill(slot, ids, spk if slot != 1 else None)) for r in (o, t)]
        np.testing.assert_allclose(la, lb, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(ha, hb, atol=1e-4, rtol=1e-4)
        pos[slot] = n
        codes[slot] = la.argmax(-1)
    steps = 0
    for step in range(60):
        rows = np.array([0, 1, 2]) if step % 4 else np.array([2, 0])  # rows join/leave like channels
        (la, ha), (lb, hb) = [tuple(x.copy() for x in r.forward_decode(rows, codes[rows], pos[rows])) for r in (o, t)]
        np.testing.assert_allclose(la, lb, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(ha, hb, atol=1e-4, rtol=1e-4)
        assert (la.argmax(-1) == lb.argmax(-1)).all(), f"greedy codes differ at step {step}"
        codes[rows] = la.argmax(-1)
        pos[rows] += 1
        steps += 1
    assert steps >= 50
    h = rng.standard_normal((37, o.info.hidden_size)).astype(np.float32)
    np.testing.assert_allclose(o.forward_decoder(h), t.forward_decoder(h), atol=1e-4, rtol=1e-4)
    mel = rng.standard_normal((100, 51)).astype(np.float32)
    for a, b in zip(o.forward_vocos(mel), t.forward_vocos(mel)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_capacity_errors(runners):
    o, _ = runners
    with pytest.raises(CapacityError, match="max_prompt_tokens"):
        o.prefill(0, np.ones(129, np.int64), None)
    with pytest.raises(CapacityError, match="slot 3"):
        o.prefill(3, np.ones(4, np.int64), None)
    with pytest.raises(CapacityError, match="distinct"):
        o.step(np.array([1, 1]), 1)
    with pytest.raises(EngineError, match="text id"):
        o.prefill(0, np.full(4, 10**6, np.int64), None)
    o.prefill(0, np.ones(4, np.int64), None)
    o._pos[0] = 512
    with pytest.raises(CapacityError, match="max_seq_len"):
        o.step(np.array([0]), 1)


def test_manifest_mismatch_refused_with_rebuild_hint(tiny_ckpt, onnx_dir):
    from appliance.engines.onnx.runner import OnnxRunner

    with pytest.raises(EngineMismatchError, match=r"limits.max_batch is 3, expected 2.*rebuild with: chattts-appliance engines export"):
        OnnxRunner(_cfg(tiny_ckpt, onnx_dir, max_batch=2, max_seq_len=512))
    copy = onnx_dir.parent / "engines_other_ckpt"
    shutil.copytree(onnx_dir, copy, dirs_exist_ok=True)
    mpath = copy / "onnx" / "fp32" / "manifest.json"
    m = json.loads(mpath.read_text())
    m["checkpoint"]["sha256"] = "0" * 64
    m["checkpoint"]["files"] = {}
    mpath.write_text(json.dumps(m))
    with pytest.raises(EngineMismatchError, match="checkpoint sha256 is 000000000000.*rebuild with"):
        OnnxRunner(_cfg(tiny_ckpt, copy))


def test_ort_failure_wrapped(tiny_ckpt, onnx_dir):
    from appliance.engines.onnx.runner import OnnxRunner

    copy = onnx_dir.parent / "engines_broken"
    shutil.copytree(onnx_dir, copy, dirs_exist_ok=True)
    (copy / "onnx" / "fp32" / "vocos.onnx").write_bytes(b"not a model")
    with pytest.raises(IntegrityError, match="failed its integrity check: .*vocos.onnx: sha256"):
        OnnxRunner(_cfg(tiny_ckpt, copy))            # refused by its sha256 before onnxruntime sees it
    unchecked = _cfg(tiny_ckpt, copy)
    unchecked = dataclasses.replace(unchecked, safety=dataclasses.replace(unchecked.safety, verify_checkpoint=False))
    with pytest.raises(EngineError, match="onnxruntime loading vocos failed"):
        OnnxRunner(unchecked)


def test_auto_picks_onnxruntime_without_gpu(tiny_ckpt, onnx_dir, caplog):
    from appliance.engines import manifest as mf
    from appliance.engines.select import choose_backend, open_runner

    if mf.device_facts().get("compute_capability"):
        pytest.skip("a GPU is present: auto prefers TensorRT or torch on CUDA")
    cfg = _cfg(tiny_ckpt, onnx_dir, backend="auto")
    backend, reason = choose_backend(cfg)
    assert backend == "onnxruntime" and "no GPU" in reason
    caplog.set_level("INFO", logger="appliance.engines.select")
    r = open_runner(cfg)
    assert r.info.backend == "onnxruntime" and "no GPU" in r.info.reason
    assert any("inference backend: onnxruntime" in rec.getMessage() for rec in caplog.records)
    r.close()


def test_tensorrt_gpt_graph_matches(tiny_ckpt, runners, tmp_path):
    """The static-cache gpt graph that TensorRT builds (fp16 export) computes the same prefill and
    decode step; checked in fp32 with ONNX Runtime since TensorRT cannot run here."""
    import onnxruntime as ort
    import torch

    from appliance.build import export as ex
    from appliance.model.checkpoint import load_model

    o, _ = runners
    spec = ex._specs(load_model(tiny_ckpt), 3, 512, 128, 64, torch.float32, static_cache=True)["gpt"]
    path = tmp_path / "gpt_static.onnx"
    ex.export_graph("gpt", spec, path)
    assert not _fixed_dynamic_axes(spec, ex._io(path)[0])       # TensorRT's profiles vary B, T and P
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    L = o._L

    def run(emb, pos, slots, p):
        feeds = {"emb": emb, "pos": pos, "slots": slots, "past": np.zeros(p, np.uint8)}
        feeds.update({f"k_cache.{i}": o._k[i] for i in range(L)})
        feeds.update({f"v_cache.{i}": o._v[i] for i in range(L)})
        return sess.run(None, feeds)

    rng = np.random.default_rng(3)
    for slot, n in [(0, 9), (2, 14)]:
        ids = rng.integers(0, 200, n)
        logits, hidden, k_new, _ = run(o._emb_text[ids][None], np.zeros(1, np.int64), np.array([slot]), 1)
        la, ha = (x.copy() for x in o.forward_prefill(slot, ids, None))
        np.testing.assert_allclose(logits[0], la, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(k_new[:, 0], o._k[:, :n, slot], atol=1e-5)
    slots, pos = np.array([2, 0]), np.array([14, 9])
    codes = rng.integers(0, 626, (2, 4))
    emb = o._emb_code[np.arange(4)[None], codes].sum(1)[:, None].astype(np.float32)
    logits, hidden, k_new, _ = run(emb, pos, slots, 14)
    la, ha = (x.copy() for x in o.forward_decode(slots, codes, pos))
    np.testing.assert_allclose(logits, la, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(hidden, ha, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(k_new[:, :, 0], o._k[:, pos, slots], atol=1e-5)


def test_pipeline_on_onnxruntime_speaks_like_torch(tiny_ckpt, onnx_dir):
    """End to end: the same request with the same seed gives the same audio on both backends."""
    from appliance.synth.pipeline import Pipeline

    audio = {}
    for backend in ("onnxruntime", "torch"):
        p = Pipeline.from_config(_cfg(tiny_ckpt, onnx_dir, backend=backend, device="cpu", dtype="float32"))
        try:
            assert p.info.backend.startswith(backend.split("runtime")[0])
            job = p.prepare(SynthesisRequest(text="你好，今天天气很好。", id=backend, seed=3))
            audio[backend] = np.concatenate([c.samples for c in p.run(job)])
        finally:
            p.close()
    a, b = audio["onnxruntime"], audio["torch"]
    assert a.size > 0 and a.shape == b.shape
    np.testing.assert_allclose(a, b, atol=1e-3)


@pytest.mark.slow
def test_int8_weight_only_export_is_preferred_and_close(tiny_ckpt, onnx_dir, runners, tmp_path):
    """int8 export: the GPT's MatMuls are MatMulNBits, chosen over fp32 when present, logits close
    to fp32; the vocoder graphs stay FP32, so its passes equal the fp32 export's and a stream with
    the exact look-ahead equals the one-shot pass to FP32 rounding."""
    import onnx

    from appliance.synth.calibration import _stream
    from appliance.build.export import export_all
    from appliance.engines.onnx.runner import OnnxRunner, find_export
    from appliance.engines.runner import VocodeWindow
    from appliance.synth.istft import istft
    from appliance.synth.vocoder import WindowedVocoder

    shutil.copytree(onnx_dir / "onnx" / "fp32", tmp_path / "onnx" / "fp32")
    d = export_all(tiny_ckpt, tmp_path, precision="int8", **LIMITS, window_tokens=64)
    g = onnx.load(str(d / "gpt.onnx"), load_external_data=False)
    assert sum(n.op_type == "MatMulNBits" for n in g.graph.node) == 2 * 4  # 4 linears per layer (qkv, o, gate_up, down)
    for name in ("decoder", "vocos"):
        v = onnx.load(str(d / f"{name}.onnx"), load_external_data=False)
        assert not any(n.op_type == "MatMulNBits" for n in v.graph.node), name
    m = json.loads((d / "manifest.json").read_text())
    assert m["build"]["vocoder_precision"] == "fp32" and m["build"]["quantization"] == {"gpt": "MatMulNBits-8"}
    cfg = _cfg(tiny_ckpt, tmp_path)
    assert find_export(cfg) == d
    q = OnnxRunner(cfg)
    o, _ = runners
    assert q.info.precision == "int8" and q.info.weight_bytes < o.info.weight_bytes
    ids = np.arange(5, 25)
    la = q.forward_prefill(0, ids, None)[0].copy()
    lb = o.forward_prefill(0, ids, None)[0].copy()
    assert np.corrcoef(la.ravel(), lb.ravel())[0, 1] > 0.99

    rng = np.random.default_rng(3)
    h = rng.standard_normal((45, q.info.hidden_size)).astype(np.float32)
    mq, mo = q.forward_decoder(h), o.forward_decoder(h)
    assert np.abs(mq - mo).max() <= 1e-5 * np.abs(mo).max()
    slot, n = 2, 45
    q.prefill(slot, ids, None)
    q._hid[slot, :n] = h
    re, im = q.vocode(slot, VocodeWindow(0, n, 0, 2 * n, 0, 2 * n, 0, 2 * n))
    one_shot = istft(re.copy(), im.copy())
    got = _stream(WindowedVocoder(q, 512), slot, n, None, 3)   # exact look-ahead, 3-step chunks
    assert got.shape == one_shot.shape
    assert np.abs(got - one_shot).max() <= 1e-5 * np.abs(one_shot).max()
    q.close()


def test_export_says_what_to_do_under_a_torch_older_than_the_tested_floor(monkeypatch, tmp_path):
    """Older torches cannot export these graphs (2.5.1: the Decoder stream's padding by a symbolic
    length; 2.8.0 and 2.9.1: the GPT, see build/cli.py TORCH_FLOOR): `engines export` and
    install_jetson.sh say so before a long export, with the way out."""
    import torch

    from appliance.build import cli

    assert cli.torch_problem() is None                       # this torch (CI: 2.13)
    monkeypatch.setattr(torch, "__version__", "2.5.0a0+872d972e41.nv24.08")   # JetPack 6.1's wheel
    why = cli.torch_problem()
    assert "older than 2.10" in why and "--onnx-dir" in why and "engines export --precision fp16 --out DIR" in why
    import argparse

    from appliance.errors import ConfigError

    args = argparse.Namespace(config=None, checkpoint=None, out=str(tmp_path), precision="fp32")
    with pytest.raises(ConfigError, match="older than 2.10"):
        cli.cli_export(args)
