"""The ahead-of-time compiled decode step (AOTInductor) on the CPU with the tiny checkpoint.

One package (batch 1 of 2 KV slots: the step writes views of the state) is built by the real
command (``chattts-appliance engines compile``, inductor's C++ backend here; skipped cleanly where
that cannot compile), then a FRESH process loads it through
``model.compile``'s path (``CudaRunner(compile="aot")``: no tracing, no compiling) and must draw
the same codes and hidden states as the eager step for the same seed. Then what keys and guards
it: a changed config, a damaged package and a package set for another checkpoint all fall back
to the plain step with the reason, and a manifest records every file's sha256.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
LIMITS = {"max_batch": 2, "max_seq_len": 64, "max_prompt_tokens": 32}

# runs in a fresh process: codes and hidden states of the eager step and of the loaded package
PROBE = """
import json, sys, time, numpy as np
from appliance.config import config_from_dict
from appliance.core import SamplingParams
from appliance.engines.cuda_runner import CudaRunner
cfg = config_from_dict(json.loads(sys.argv[1]))
out = {}
for name, kw in (("eager", {}), ("aot", {"compile": "aot", "aot_dir": sys.argv[2]})):
    t0 = time.perf_counter()
    r = CudaRunner(cfg, **kw)
    ready = time.perf_counter() - t0
    r.prefill(0, np.arange(5, 14), None)
    first = r.start(0, SamplingParams(min_new_tokens=40, max_new_tokens=40, temperature=0.7), 2**40 + 9)
    codes = [first[None]] + [r.step(np.array([0]), 8)[:, 0].copy() for _ in range(5)]
    out[name] = {"codes": np.concatenate(codes).tolist(), "hidden": r.hidden(0, 0, 40).tolist(),
                 "compiled": r.compiled, "source": r.step_source, "ready_s": ready}
print(json.dumps(out))
"""


def _cfg_dict(ckpt: Path, eng: Path, **model) -> dict:
    return {"model": {"path": str(ckpt), "backend": "torch", "device": "cpu", "dtype": "float32", "threads": 1,
                      "engine_dir": str(eng), **LIMITS, **model}}


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def built(tiny_ckpt, tmp_path_factory):
    """``engines compile`` for the tiny checkpoint on the CPU -> (config dict, aot dir, package dir)."""
    from appliance.engines.aot_step import SUBDIR

    eng = tmp_path_factory.mktemp("aot_engines")
    cfg_path = eng / "config.json.yaml"
    cfg = _cfg_dict(tiny_ckpt, eng)
    cfg_path.write_text(json.dumps(cfg))  # JSON is YAML
    r = subprocess.run([sys.executable, "-m", "appliance", "engines", "compile", "--config", str(cfg_path),
                        "--device", "cpu", "--batches", "1"], capture_output=True, text=True, timeout=600, env=_env(), cwd=str(eng))
    if r.returncode != 0 and ("CppCompileError" in r.stderr or "InvalidCxxCompiler" in r.stderr):
        pytest.skip(f"inductor cannot compile C++ here: {r.stderr[-400:]}")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "compiled 1 packages" in r.stdout, r.stdout
    dirs = [p.parent for p in (eng / SUBDIR).glob("*/manifest.json")]
    assert len(dirs) == 1
    return cfg, eng / SUBDIR, dirs[0]


def test_package_in_a_fresh_process_gives_the_eager_codes(built):
    cfg, aot, pkg = built
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cfg), str(aot)], capture_output=True, text=True,
                       timeout=300, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    eager, got = out["eager"], out["aot"]
    assert got["compiled"] == "aot" and str(pkg) in got["source"], got["source"]
    assert "plain step for b2_L64 (not built)" in got["source"]   # only batch 1 was built: rows 0..0 of 2
    assert eager["compiled"] is None
    codes = np.array(got["codes"])
    assert codes.shape == (41, 4) and len(np.unique(codes[:, 0])) > 5, "real draws expected"
    np.testing.assert_array_equal(codes, np.array(eager["codes"]))
    np.testing.assert_allclose(np.array(got["hidden"]), np.array(eager["hidden"]), rtol=1e-4, atol=1e-5)


def test_manifest_records_identity_and_file_digests(built, tiny_ckpt):
    from appliance.engines import manifest as mf

    _, _, pkg = built
    m = mf.read(pkg)
    assert m["kind"] == "aot-inductor" and m["key"] == pkg.name
    ident = m["identity"]
    assert ident["checkpoint_sha256"] == mf.checkpoint_sha256(tiny_ckpt)
    assert ident["kv"] == {"max_batch": 2, "max_seq_len": 64, "dtype": "torch.float32"}
    assert ident["torch"] == torch.__version__ and ident["device"]["type"] == "cpu" and ident["precision"] == "fp32"
    (name, g), = m["graphs"].items()
    assert name == "step_b1_L64.pt2" and (g["batch"], g["span"]) == (1, 64)
    assert g["sha256"] == mf.file_sha256(pkg / name) and g["bytes"] == (pkg / name).stat().st_size
    assert any(n.startswith("kv.k.") for n, _, _ in m["inputs"]) and ["runner.t", [1], "torch.int64"] in m["inputs"]


def _config(d: dict):
    from appliance.config import config_from_dict

    return config_from_dict(d)


def test_other_config_falls_back_to_plain_graphs_with_the_reason(built):
    from appliance.engines.cuda_runner import CudaRunner

    cfg, aot, _ = built
    c = _config(cfg)
    c = dataclasses.replace(c, model=dataclasses.replace(c.model, max_seq_len=48))
    r = CudaRunner(c, compile="aot", aot_dir=str(aot))
    assert r.compiled is None and r._aot is None
    assert "plain CUDA graphs" in r.step_source and "kv.max_seq_len is 64, here 48" in r.step_source
    assert "chattts-appliance engines compile" in r.step_source
    r = CudaRunner(_config(cfg), compile="aot", aot_dir=str(aot.parent / "nowhere"))
    assert r.compiled is None and "no ahead-of-time compiled step in" in r.step_source


def test_damaged_package_is_refused(built, tmp_path):
    import shutil

    from appliance.engines.cuda_runner import CudaRunner

    cfg, aot, pkg = built
    copy = tmp_path / "aot" / pkg.name
    shutil.copytree(pkg, copy)
    f = copy / "step_b1_L64.pt2"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10   # one flipped bit, size unchanged
    f.write_bytes(bytes(data))
    r = CudaRunner(_config(cfg), compile="aot", aot_dir=str(tmp_path / "aot"))
    assert r.compiled is None
    assert "does not match the sha256 its manifest records" in r.step_source and str(f) in r.step_source


def test_identity_names_what_differs(built, tmp_path):
    from appliance.engines import aot_step
    from appliance.engines.cuda_runner import CudaRunner

    cfg, aot, pkg = built
    r = CudaRunner(_config(cfg))
    m = json.loads((pkg / "manifest.json").read_text())
    mine = aot_step.identity(r, m["identity"]["checkpoint_sha256"], "default")
    assert aot_step.key_of(mine) == pkg.name   # the key is the identity's hash
    other = tmp_path / "aot" / "x"
    other.mkdir(parents=True)
    m["identity"] = {**m["identity"], "checkpoint_sha256": "0" * 64, "torch": "2.0.0"}
    (other / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(Exception, match=r"checkpoint_sha256 is 000000000000\.\.\., here .*torch is '2\.0\.0', here"):
        aot_step.find(r, tmp_path / "aot", cfg["model"]["path"])
