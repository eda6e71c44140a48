"""bench/gpu_heap_probe.py runs where the lead runs it (an H200) and here: on this CPU it walks the
stages of the production load (the CUDA runner's logic, without graphs) and of plain torch, each
in a fresh process with its allocator settings, and reports glibc's view of each stage."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

PROBE = Path(__file__).resolve().parents[1] / "bench" / "gpu_heap_probe.py"


def _probe():
    spec = importlib.util.spec_from_file_location("gpu_heap_probe", PROBE)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


def test_variant_environments_are_clean_and_set():
    probe = _probe()
    base = {"MALLOC_ARENA_MAX": "8", "CUDA_MODULE_LOADING": "EAGER", "HOME": "/h"}
    assert {k: v for k, v in probe.variant_env("default", base).items() if k != "PYTHONPATH"} == {"HOME": "/h"}
    env = probe.variant_env("mmap128k", base)
    assert env["MALLOC_MMAP_THRESHOLD_"] == "131072" and "mmap_threshold=131072" in env["GLIBC_TUNABLES"]
    assert "MALLOC_ARENA_MAX" not in env and probe.variant_env("eager", base)["CUDA_MODULE_LOADING"] == "EAGER"


def test_probe_attributes_every_stage_on_the_cpu(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "heap.json"
    rc = _probe().main([str(tiny_ckpt), "--variants", "default,bare", "--device", "cpu", "--cuda-runner",
                        "--json", str(out), "--model", json.dumps({"max_batch": 1, "max_seq_len": 256,
                                                                   "max_prompt_tokens": 64})])
    assert rc == 0
    recs = json.loads(out.read_text())
    prod = [r for r in recs if r["variant"] == "default" and "g" in r]
    stages = [r["stage"] for r in prod]
    for want in ("import torch", "checkpoint headers read", "load gpt: 0 MiB read (first chunk)",
                 "before malloc_trim (end of load_model)", "after malloc_trim (end of load_model)",
                 "KV cache allocated", "seam (1, 256) (eager, no graph)", "after malloc_trim (after the captures)",
                 "pipeline: normalizer made (OpenCC, wetext)", "Pipeline.from_config done", "Pipeline.warmup done"):
        assert want in stages, want
    assert stages.index("KV cache allocated") > stages.index("after malloc_trim (end of load_model)")
    for r in prod:
        assert r["Rss"] > 0 and r["g"]["[heap]"] >= 0 and "cuda" not in r        # no CUDA parts on a CPU
        assert r["m"]["in_use"] > 0 and r["m"]["arena"] >= r["m"]["in_use"]      # glibc's mallinfo2
    assert prod[-1]["Rss"] > prod[0]["Rss"]                                        # the model is in memory
    bare = [r["stage"] for r in recs if r["variant"] == "bare"]
    assert "bare: gpt weights moved" in bare and "bare: one FP16 GEMM (cuBLAS)" in bare
    assert not [r for r in recs if r["stage"] == "error"]
    table = capsys.readouterr().out
    assert "milestones (MiB)" in table and "== default" in table and "== bare" in table
    assert sum(1 for ln in table.splitlines() if ln.strip().startswith("default ")) == 6   # its 6 milestones
