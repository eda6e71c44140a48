"""Integrity at load and at output: every weight file hashed as it is read and compared with its
recorded sha256 (checkpoint, ONNX graphs and their data, TensorRT plans), the background
re-verification, the PCM guard (NaN/Inf never reach a sink: engine_error naming the stage), and
the health check's audio checks (non-finite, silent). Real checkpoints written by ``model random``,
real exports, real pipelines; one flipped exponent bit with size, inode and mtime unchanged."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from appliance.core import SynthesisRequest, SynthParams
from appliance.errors import (
    CheckpointError,
    EngineError,
    EngineMismatchError,
    IntegrityError,
)
from appliance.model import integrity
from appliance.model.tensorfile import TensorFile
from appliance.synth.guard import check_pcm, finite
from tests.fixtures_model import ONNX_LIMITS


def _random_ckpt(root: Path) -> Path:
    from appliance.build.random_ckpt import write_random_checkpoint

    write_random_checkpoint(root, "tiny", seed=0)
    return root


def corrupt_behind_header(f: Path, value: int = 0xFF, n: int = 200_000) -> None:
    """Overwrite ``n`` bytes of a safetensors file's data (the JSON header stays intact, the size
    too): 0xFF bytes are NaN float32s."""
    b = bytearray(f.read_bytes())
    start = 8 + struct.unpack("<Q", b[:8])[0] + 4096
    end = min(len(b), start + n)
    b[start:end] = bytes([value]) * (end - start)
    f.write_bytes(bytes(b))


def flip_exponent_bit(f: Path, offset: int, itemsize: int = 4) -> None:
    """Flip the top exponent bit of the little-endian float at byte ``offset`` of ``f`` in place, as
    bit rot would: same inode, same size, mtime put back."""
    st = f.stat()
    with open(f, "r+b") as h:
        h.seek(offset + itemsize - 1)          # the byte with the sign and the top exponent bits
        b = h.read(1)[0]
        h.seek(offset + itemsize - 1)
        h.write(bytes([b ^ 0x40]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    st2 = f.stat()
    assert (st2.st_ino, st2.st_size, st2.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


def flip_safetensors_weight(f: Path) -> str:
    """Flip an exponent bit of the first float32 weight matrix of ``f``; returns its key."""
    tf = TensorFile(f)
    e = next(e for e in tf.entries if e.dtype == "F32" and len(e.shape) == 2 and e.end - e.begin >= 64)
    flip_exponent_bit(f, tf.data_start + e.begin + 4 * 5)
    return e.name


def _config(root: Path, tmp: Path, **safety):
    from appliance.config import config_from_dict

    return config_from_dict({"model": {"path": str(root), "backend": "torch", "device": "cpu", "threads": 1,
                                       "max_batch": 1, "max_seq_len": 256, "max_prompt_tokens": 64},
                             "safety": {"cache_dir": str(tmp / "cache"), **safety}}, base_dir=str(tmp))


def test_random_checkpoint_carries_its_sums_and_the_load_hashes_every_file_it_reads(tmp_path):
    from appliance.model.checkpoint import load_model

    root = _random_ckpt(tmp_path / "ck")
    sums = json.loads((root / integrity.SUMS_FILE).read_text())
    assert set(sums) == {f"asset/{r}" for r in integrity.VERIFIED_FILES}
    m = load_model(root)
    got = {str(p.relative_to(root)): d for p, d in m.verified_files}
    assert got == {k: v for k, v in sums.items() if "tokenizer" not in k}   # config + the 4 weight files
    files = integrity.verify_checkpoint(root / "asset")             # the asset dir itself works too
    assert {str(p.relative_to(root)): d for p, d in files} == sums


@pytest.mark.parametrize("rel", ["gpt/model.safetensors", "Embed.safetensors", "Decoder.safetensors",
                                 "Vocos.safetensors"])
def test_a_flipped_exponent_bit_in_a_checkpoint_weight_is_refused_at_load_naming_the_file(tmp_path, rel):
    from appliance.model.checkpoint import load_model

    root = _random_ckpt(tmp_path / "ck")
    load_model(root)                                                # loads (and verifies) once
    f = root / "asset" / rel
    want = json.loads((root / integrity.SUMS_FILE).read_text())[f"asset/{rel}"]
    flip_safetensors_weight(f)                                      # size, inode and mtime unchanged
    with pytest.raises(IntegrityError) as e:
        load_model(root)
    msg = str(e.value)
    assert str(f) in msg and want in msg and integrity.sha256_file(f) in msg
    assert "model random" in msg and "verify_checkpoint: false" in msg and e.value.code == "integrity_error"
    for other in {"model.safetensors", "Embed.safetensors", "Vocos.safetensors", "Decoder.safetensors"} - {f.name}:
        assert other not in msg                                     # only the bad file is named
    assert load_model(root, verify=False) is not None              # the check is what refuses it


def test_the_daemons_load_refuses_a_flipped_bit_before_anything_is_used(tmp_path):
    from appliance.synth.pipeline import Pipeline

    root = _random_ckpt(tmp_path / "ck")
    flip_safetensors_weight(root / "asset" / "gpt" / "model.safetensors")
    with pytest.raises(IntegrityError, match="model.safetensors: sha256"):
        Pipeline.from_config(_config(root, tmp_path))
    cfg = _config(root, tmp_path)                                   # the CUDA runner's load path, on this CPU
    from appliance.engines.torch.cuda_runner import CudaRunner

    with pytest.raises(IntegrityError, match="model.safetensors"):
        CudaRunner(cfg, quant="int8", capture_batches=[], buckets=[256], prefill_buckets=[64])


def test_a_checkpoint_without_own_sums_is_checked_against_upstreams_map(tmp_path):
    from appliance.model.checkpoint import load_model

    root = _random_ckpt(tmp_path / "ck")
    (root / integrity.SUMS_FILE).unlink()
    with pytest.raises(IntegrityError) as e:
        integrity.verify_checkpoint(root)
    msg = str(e.value)
    assert "upstream's published sums" in msg and f"model sums {root}" in msg
    assert msg.count("sha256 ") == len(integrity.VERIFIED_FILES)   # random weights are not upstream's
    with pytest.raises(IntegrityError, match="upstream's published sums"):
        load_model(root)
    from appliance.cli.main import main

    assert main(["model", "sums", str(root)]) == 0                  # record our own: accepted from now on
    assert len(integrity.verify_checkpoint(root)) == len(integrity.VERIFIED_FILES)
    (root / "asset" / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json: missing"):
        integrity.verify_checkpoint(root)


def test_a_truncated_or_malformed_weight_file_is_named(tmp_path):
    from appliance.model.checkpoint import load_model

    root = _random_ckpt(tmp_path / "ck")
    f = root / "asset" / "Vocos.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"Vocos.safetensors: not a valid safetensors file \(the tensors cover"):
        load_model(root)


# ------------------------------------------------------------------ engine files


def _onnx_copy(onnx_dir: Path, tmp: Path) -> Path:
    copy = tmp / "engines"
    shutil.copytree(onnx_dir, copy)
    return copy


def _ort_cfg(tiny_ckpt, engine_dir, **safety):
    from appliance.config import config_from_dict

    return config_from_dict({"model": {"path": str(tiny_ckpt), "backend": "onnxruntime", "threads": 1, **ONNX_LIMITS,
                                       "engine_dir": str(engine_dir)}, "safety": safety}, base_dir=str(tiny_ckpt))


def _branch_inputs(onnx_file: Path, branch: str) -> set[str]:
    """Names read in the ``If`` branch ``branch`` of a merged vocoder graph (``then_branch``: a
    sentence's first pass, ``else_branch``: the later passes); empty for a graph without one."""
    import onnx

    def walk(g) -> set[str]:
        return set().union(*(set(n.input).union(*(walk(a.g) for a in n.attribute if a.type == a.GRAPH))
                             for n in g.node))

    m = onnx.load(str(onnx_file), load_external_data=False)
    return set().union(*(walk(a.g) for n in m.graph.node if n.op_type == "If" for a in n.attribute if a.name == branch))


def _external_float(onnx_file: Path) -> int:
    """Byte offset in ``<onnx_file>.data`` of a float32 initializer stored there (merged graph: one the first pass reads)."""
    import onnx

    m = onnx.load(str(onnx_file), load_external_data=False)
    first = _branch_inputs(onnx_file, "then_branch")
    for t in m.graph.initializer:
        if t.data_type == onnx.TensorProto.FLOAT and t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            if int(info.get("length", 0)) >= 64 and (not first or t.name in first):
                return int(info.get("offset", 0))
    raise AssertionError(f"{onnx_file} has no external float initializer")


def _inline_float(onnx_file: Path) -> int:
    """Byte offset in ``onnx_file`` of a float32 constant stored in the graph itself (in a merged vocoder
    graph one of the first pass's own, ``first/...``), found by the tensor's serialized bytes, name included."""
    import onnx

    def consts(g) -> list:  # a merged vocoder graph keeps its passes' constants in If branches
        return [x for n in g.node for a in n.attribute
                for x in ([a.t] if a.HasField("t") else consts(a.g) if a.type == onnx.AttributeProto.GRAPH else [])]

    m = onnx.load(str(onnx_file), load_external_data=False)
    raw = onnx_file.read_bytes()
    for t in sorted(list(m.graph.initializer) + consts(m.graph), key=lambda t: not t.name.startswith("first/")):
        blob = t.SerializeToString()
        if t.data_type == onnx.TensorProto.FLOAT and len(t.raw_data) >= 16 and (i := raw.find(blob)) >= 0:
            return i + blob.index(t.raw_data)
    raise AssertionError(f"{onnx_file} has no inline float constant")


@pytest.mark.parametrize("name", ["vocos.onnx.data", "decoder.onnx.data", "gpt.onnx.data", "vocos.onnx",
                                  "decoder.onnx", "embed.safetensors"])
def test_a_flipped_bit_in_an_onnx_engine_file_is_refused_at_load(tiny_ckpt, onnx_dir, tmp_path, name):
    from appliance.engines.onnx.runner import OnnxRunner

    eng = _onnx_copy(onnx_dir, tmp_path)
    d = eng / "onnx" / "fp32"
    want = json.loads((d / "manifest.json").read_text())["files"][name]
    f = d / name
    if name.endswith(".data"):
        flip_exponent_bit(f, _external_float(d / name[:-len(".data")]))
    elif name.endswith(".onnx"):
        flip_exponent_bit(f, _inline_float(f))
    else:
        flip_safetensors_weight(f)
    with pytest.raises(IntegrityError) as e:
        OnnxRunner(_ort_cfg(tiny_ckpt, eng))
    msg = str(e.value)
    assert str(f) in msg and want in msg and "rebuild the engine" in msg and "engines export" in msg
    r = OnnxRunner(_ort_cfg(tiny_ckpt, eng, verify_checkpoint=False))  # only the check refuses it
    r.close()


def test_onnx_runner_lists_what_it_verified_and_an_old_manifest_is_refused(tiny_ckpt, onnx_dir, tmp_path):
    import onnx

    from appliance.engines.onnx.runner import OnnxRunner

    eng = _onnx_copy(onnx_dir, tmp_path)
    d = eng / "onnx" / "fp32"
    r = OnnxRunner(_ort_cfg(tiny_ckpt, eng))
    m = json.loads((d / "manifest.json").read_text())
    assert {p.name: s for p, s in r.weight_files} == m["files"]
    # the merged layout: one graph and one data file per vocoder network, both passes reading it
    assert set(m["files"]) == {f"{g}{x}" for g in ("gpt", "decoder", "vocos") for x in (".onnx", ".onnx.data")} \
        | {"embed.safetensors"}
    for f in (d / "decoder.onnx", d / "vocos.onnx"):
        data = {t.name for t in onnx.load(str(f), load_external_data=False).graph.initializer if t.external_data}
        assert data & _branch_inputs(f, "then_branch") & _branch_inputs(f, "else_branch"), f
    assert not list(d.glob("*_first*"))
    r.close()
    del m["files"]
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineMismatchError, match="records no sha256 of its files.*rebuild with: chattts-appliance engines export"):
        OnnxRunner(_ort_cfg(tiny_ckpt, eng))


def test_a_flipped_bit_in_a_tensorrt_plan_is_refused_before_any_cuda_call(tiny_ckpt, onnx_dir, tmp_path):
    """A plan directory whose manifest records its files' sums (TensorRT cannot run here: the plans
    are stand-in bytes; the check runs before TensorRT or CUDA are touched)."""
    from appliance.engines import manifest as mf
    from appliance.engines.tensorrt.runner import TensorRTRunner

    trt = pytest.importorskip("appliance.engines.tensorrt.trt")
    try:
        runtime = {"name": trt.flavor(), "version": trt.version()}
    except Exception:  # noqa: BLE001 - no TensorRT flavour installed: the manifest check would refuse first
        pytest.skip("no TensorRT module to write a matching manifest for")
    src = json.loads((onnx_dir / "onnx" / "fp32" / "manifest.json").read_text())
    d = tmp_path / "engines" / "trt" / "fp16"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    graphs = {}
    for g in ("gpt", "decoder", "vocos"):
        (d / f"{g}.plan").write_bytes(rng.standard_normal(4096).astype(np.float32).tobytes())
        graphs[g] = {**src["graphs"][g], "file": f"{g}.plan"}
    shutil.copy2(onnx_dir / "onnx" / "fp32" / "embed.safetensors", d / "embed.safetensors")
    man = {k: src[k] for k in ("checkpoint", "limits", "shapes", "special", "embed", "kv")}
    mf.write(d, {"kind": "tensorrt", "precision": "fp16", "runtime": runtime, "device": {}, **man, "graphs": graphs})
    sums = json.loads((d / "manifest.json").read_text())["files"]
    assert set(sums) == {"gpt.plan", "decoder.plan", "vocos.plan", "embed.safetensors"}
    flip_exponent_bit(d / "vocos.plan", 4 * 100)
    from appliance.config import config_from_dict

    cfg = config_from_dict({"model": {"path": str(tiny_ckpt), "backend": "tensorrt", **ONNX_LIMITS,
                                      "engine_dir": str(tmp_path / "engines")}}, base_dir=str(tiny_ckpt))
    with pytest.raises(IntegrityError) as e:
        TensorRTRunner(cfg, plan_dir=d)
    assert str(d / "vocos.plan") in str(e.value) and sums["vocos.plan"] in str(e.value)
    assert "engines build" in str(e.value)


# ------------------------------------------------------------------ background re-verification


def test_reverifier_walks_the_files_in_bounded_steps_and_names_the_first_rotten_one(tmp_path):
    from appliance.model.fetch import sha256_file
    from appliance.model.reverify import Reverifier, budget_bytes

    files = []
    for i, n in enumerate((3 << 20, 1 << 20, 5000)):
        f = tmp_path / f"w{i}.bin"
        f.write_bytes(np.random.default_rng(i).bytes(n))
        files.append((f, sha256_file(f)))
    r = Reverifier(files)
    steps = 0
    while r.rounds == 0:
        assert r.step(budget_bytes(mib_per_s=1, seconds=0.5)) is None   # 512 KiB per step
        steps += 1
    assert steps == 9 and r.position == (0, 0)                          # 4 MiB + 5000 B in 512 KiB steps
    flip_exponent_bit(files[1][0], 1000)
    r.step((3 << 20) + 1)                                               # all of w0 (fine), 1 byte of w1
    assert r.failure is None and r.position == (1, 1)
    err = r.step(1 << 30)
    assert isinstance(err, IntegrityError) and str(files[1][0]) in str(err) and files[1][1] in str(err)
    assert r.step(1 << 30) is err                                       # stays reported
    r.reset()
    files[2][0].unlink()
    for _ in range(3):
        err = r.step(8 << 20)
    assert err is not None and str(files[1][0]) in str(err)             # the first failure wins
    r2 = Reverifier(files[2:])
    assert "cannot be read" in str(r2.step(1)) and str(files[2][0]) in str(r2.failure)


def test_guard_passes_finite_audio_and_names_the_stage_of_nan(tmp_path):
    assert finite(np.zeros(0, np.float32)) and finite(np.ones(4, np.float32))
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones(100, np.float32)
        x[37] = bad
        assert not finite(x)
        with pytest.raises(EngineError, match="1 of 100 samples") as e:
            check_pcm(x, "r1")
        assert e.value.code == "engine_error" and "vocoder output" in str(e.value)


@pytest.fixture(scope="module")
def nan_pipeline(tmp_path_factory):
    """The issue's reproduction: NaN bytes behind an intact header of gpt/model.safetensors,
    integrity check off (bypassed) -> the weights load."""
    from appliance.synth.pipeline import Pipeline

    tmp = tmp_path_factory.mktemp("nan")
    root = _random_ckpt(tmp / "ck")
    corrupt_behind_header(root / "asset" / "gpt" / "model.safetensors")
    p = Pipeline.from_config(_config(root, tmp, verify_checkpoint=False))
    yield p
    p.close()


def test_nan_weights_end_with_engine_error_naming_the_gpt_never_pcm(nan_pipeline):
    got = []
    job = nan_pipeline.prepare(SynthesisRequest(id="nan", text="你好。", seed=1, params=SynthParams(max_new_tokens=100)))
    run = nan_pipeline.run(job)
    with pytest.raises(EngineError) as e:
        for chunk in run:
            got.append(chunk)
    assert got == []                                                # not one chunk reached the caller
    assert "the GPT" in str(e.value) and "NaN/Inf" in str(e.value)
    assert run.report.stats is None                                 # never 'done'


def test_health_check_fails_on_nan_and_on_silence(nan_pipeline, tmp_path):
    from appliance.ops.health import run_health_check
    from appliance.synth.pipeline import Pipeline

    cfg = nan_pipeline.cfg
    cfg = dataclasses.replace(cfg, health=dataclasses.replace(cfg.health, max_rtf=1e6, max_ttfb_ms=1e9))
    r = run_health_check(nan_pipeline, cfg)
    assert not r.healthy and r.reasons[0].startswith("engine_error") and "NaN/Inf" in r.reasons[0]

    # weights that compute zeros: Vocos' magnitude bias at -1e4 -> exp() == 0 -> exact silence
    from safetensors.numpy import load_file, save_file

    root = _random_ckpt(tmp_path / "silent")
    voc = root / "asset" / "Vocos.safetensors"
    t = load_file(str(voc))
    n_freq = t["head.out.bias"].shape[0] // 2
    t["head.out.bias"][:n_freq] = -1e4
    save_file(t, str(voc), metadata={"format": "pt"})
    integrity.write_sums(root)                                      # a deliberate change: new sums
    p = Pipeline.from_config(_config(root, tmp_path))
    try:
        r = run_health_check(p, dataclasses.replace(cfg, model=p.cfg.model))
    finally:
        p.close()
    assert not r.healthy and any(x.startswith("audio: silent") for x in r.reasons), r.reasons

    p = Pipeline.from_config(_config(_random_ckpt(tmp_path / "good"), tmp_path))
    try:
        r = run_health_check(p, dataclasses.replace(cfg, model=p.cfg.model))
    finally:
        p.close()
    assert not any(x.startswith("audio") for x in r.reasons), r.reasons   # healthy audio passes
