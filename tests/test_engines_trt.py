"""TensorRT plans built on this CPU with TensorRT-RTX; the TensorRT runner's testable parts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from appliance.config import config_from_dict
from appliance.errors import ConfigError, EngineMismatchError

pytest.importorskip("tensorrt_rtx")

LIMITS = {"max_batch": 3, "max_seq_len": 512, "max_prompt_tokens": 128}


@pytest.fixture(scope="module")
def fp16_plans(tiny_ckpt, tmp_path_factory):
    """fp16 export of the tiny checkpoint and its four fp16 plans, built for sm 8.9."""
    from appliance.build.export import export_all
    from appliance.build.trt_build import build_all

    root = tmp_path_factory.mktemp("trt_engines")
    export_all(tiny_ckpt, root, precision="fp16", **LIMITS, window_tokens=64)
    out = build_all(root, "fp16", target="8.9", workspace_mib=256)
    return root, out


def test_fp16_build_of_every_graph_and_manifest(fp16_plans):
    from appliance.engines.tensorrt import trt as trtshim

    root, out = fp16_plans
    m = json.loads((out / "manifest.json").read_text())
    assert m["kind"] == "tensorrt" and m["precision"] == "fp16"
    assert m["runtime"] == {"name": trtshim.flavor(), "version": trtshim.version()}
    assert m["device"]["compute_capability"] == "8.9"
    assert set(m["graphs"]) == {"gpt", "decoder", "vocos"}
    assert (out / m["embed"]["file"]).is_file()  # host-side embeddings travel with the plans
    onnx_m = json.loads((root / "onnx" / "fp16" / "manifest.json").read_text())
    assert m["checkpoint"]["sha256"] == onnx_m["checkpoint"]["sha256"]
    for name, e in m["graphs"].items():
        assert (out / e["file"]).stat().st_size == e["plan_bytes"] > 0
        assert e["weights_bytes"] > 0 and e["activation_bytes"] > 0, name
    dec = {t["name"]: t for t in m["graphs"]["gpt"]["inputs"]}
    assert dec["k_cache.0"]["dtype"] == "half" and dec["k_cache.0"]["shape"] == [512, 3, 4, 16]
    decode_p, prefill_p = m["graphs"]["gpt"]["profiles"]
    assert dec["past"]["shape"] == [-1] and decode_p["past"][2] == [511]
    assert decode_p["emb"][2] == [3, 1, 64] and prefill_p["emb"][2] == [1, 128, 64]
    outs = {t["name"]: t["dtype"] for t in m["graphs"]["gpt"]["outputs"]}
    assert outs["logits"] == "float" and outs["k_new"] == "half"
    assert m["build"]["strongly_typed"] is True and m["build"]["workspace_mib"] == 256
    if trtshim.is_rtx():  # timing caches are no-ops in TensorRT-RTX (deprecated since 1.2)
        assert m["build"]["timing_cache"] is None
    else:
        assert (root / "trt" / "timing.cache").is_file()
    assert m["memory"]["weights_bytes"] == sum(e["weights_bytes"] for e in m["graphs"].values())


def test_int8_weight_only_build(fp16_plans):
    import onnx

    from appliance.build.trt_build import build_all

    root, _ = fp16_plans
    out = build_all(root, "int8", target="8.6", workspace_mib=256, graphs=("gpt",))  # sm 8.6: no FP8
    m = json.loads((out / "manifest.json").read_text())
    e = m["graphs"]["gpt"]
    assert e["quantized_weights"] >= 2 * 4 + 1  # 4 linear weights per layer (qkv, o, gate_up, down), 2 layers, + the fused head
    g = onnx.load(str(out / "gpt.int8.onnx"), load_external_data=False)
    assert sum(n.op_type == "DequantizeLinear" for n in g.graph.node) == e["quantized_weights"]
    fp16 = json.loads((root / "trt" / "fp16" / "manifest.json").read_text())["graphs"]["gpt"]
    assert e["weights_bytes"] < fp16["weights_bytes"]


def test_orin_target_refused_by_tensorrt_rtx(fp16_plans):
    from appliance.build.trt_build import build_all
    from appliance.engines.tensorrt import trt as trtshim

    if not trtshim.is_rtx():
        pytest.skip("classic TensorRT builds for the local GPU")
    with pytest.raises(ConfigError, match=r"--target 8.7: TensorRT-RTX .* builds for .*8.6"):
        build_all(fp16_plans[0], "int8", target="8.7", graphs=("decoder",))


def test_fp8_for_orin_refused_before_any_work(tmp_path):
    from appliance.build.trt_build import build_all

    empty = tmp_path / "nothing_here"
    with pytest.raises(ConfigError, match=r"compute capability 8.7, FP8 needs >= 8.9.*int8"):
        build_all(empty, "fp8", target="8.7")
    assert not empty.exists()  # refused before reading or writing anything
    with pytest.raises(ConfigError, match="fp8 needs a known target"):
        build_all(empty, "fp8", target=None) if not _gpu() else pytest.skip("GPU present")


def _gpu() -> bool:
    from appliance.engines import manifest as mf

    return mf.device_facts().get("compute_capability") is not None


def test_cli_build_reports_memory_and_refuses_fp8_for_orin(fp16_plans, capsys, tmp_path):
    from appliance.cli.main import main

    root, _ = fp16_plans
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"model:\n  engine_dir: {root}\n  max_batch: 3\n  max_seq_len: 512\n  max_prompt_tokens: 128\n")
    rc = main(["engines", "build", "--config", str(cfg), "--precision", "fp8", "--target", "8.7"])
    assert rc == 2
    assert "FP8 needs >= 8.9" in capsys.readouterr().err
    rc = main(["engines", "build", "--config", str(cfg), "--precision", "fp16", "--target", "8.9", "--graphs", "decoder"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "decoder" in out and "weights" in out and "budget service.memory_budget_mb = 1500 MiB" in out
    m = json.loads((root / "trt" / "fp16" / "manifest.json").read_text())
    assert set(m["graphs"]) == {"gpt", "decoder", "vocos"}  # a subset rebuild keeps the rest


def _trt_cfg(tiny_ckpt, engine_dir, **model):
    m = {"path": str(tiny_ckpt), "backend": "tensorrt", **LIMITS, "engine_dir": str(engine_dir)}
    m.update(model)
    return config_from_dict({"model": m}, base_dir=str(tiny_ckpt))


def test_tensorrt_manifest_mismatch_refused(tiny_ckpt, fp16_plans, tmp_path):
    import shutil

    from appliance.engines.tensorrt.runner import load_manifest

    root, out = fp16_plans
    # built for 8.9 on a machine whose GPU is unknown: the device check is skipped, the rest holds
    if not _gpu():
        assert load_manifest(_trt_cfg(tiny_ckpt, root), out)["precision"] == "fp16"
    copy = tmp_path / "fp16"
    shutil.copytree(out, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["runtime"]["version"] = "8.6.2"
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineMismatchError, match=r"runtime.version is '8.6.2'.*rebuild with: chattts-appliance engines export .*--precision fp16 && chattts-appliance engines build .*--precision fp16"):
        load_manifest(_trt_cfg(tiny_ckpt, root), copy)
    with pytest.raises(EngineMismatchError, match="limits.max_seq_len is 512, expected 1024"):
        load_manifest(_trt_cfg(tiny_ckpt, root, max_seq_len=1024), out)


def test_buffer_plan_from_manifest(fp16_plans):
    from appliance.engines.tensorrt.runner import plan_buffers

    _, out = fp16_plans
    plan = plan_buffers(json.loads((out / "manifest.json").read_text()))
    g = plan["gpt"]
    assert g["pos"] == {"shape": [3], "mode": "input", "dtype": "int64", "nbytes": 24}
    assert g["emb"]["shape"] == [3, 128, 64] and g["emb"]["dtype"] == "float32"  # max over both profiles
    assert g["past"]["shape"] == [511]
    assert g["logits"]["shape"] == [3, 4, 626] and g["logits"]["dtype"] == "float32"
    assert g["k_new"]["shape"] == [2, 3, 128, 4, 16] and g["k_new"]["dtype"] == "float16"
    assert plan["decoder"]["mel"]["shape"] == [100, 128] and plan["vocos"]["real"]["shape"] == [128, 513]
    assert len(plan["kv"]) == 4 and plan["kv"]["k_cache.0"]["shape"] == [512, 3, 4, 16]
    assert plan["kv"]["k_cache.0"]["nbytes"] == 512 * 3 * 4 * 16 * 2
    assert not any(n.startswith("k_cache") for n in g)


def test_runner_without_cuda_says_what_to_install(tiny_ckpt, fp16_plans):
    from appliance.engines.tensorrt.runner import TensorRTRunner
    from appliance.errors import EngineError

    root, out = fp16_plans
    if _gpu():
        pytest.skip("GPU present")
    with pytest.raises((ConfigError, EngineError), match="pycuda|cuda-python|CUDA|TensorRT cannot load"):
        TensorRTRunner(_trt_cfg(tiny_ckpt, root), reason="test", plan_dir=out)


def test_windowed_runs_are_exact():
    from appliance.engines.tensorrt.runner import run_windowed

    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 3)).astype(np.float32)
    k = rng.standard_normal(9).astype(np.float32)  # receptive field 4 each side

    def conv(a):  # [T, 3] -> [2T]: same-padded conv then 2x repeat
        y = np.stack([np.convolve(a[:, c], k, mode="same") for c in range(3)]).sum(0)
        return np.repeat(y, 2)

    full = conv(x)
    np.testing.assert_allclose(run_windowed(conv, x, 0, 40, 5, 0, 2), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="context"):
        run_windowed(conv, x, 0, 10, 5, 0, 2)
