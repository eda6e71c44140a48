"""bench/gpu_memory_probe.py runs where the lead runs it (an H200) and here: on this CPU it walks
the same stages of the production pipeline, without the CUDA parts, and reports each stage."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

PROBE = Path(__file__).resolve().parents[1] / "bench" / "gpu_memory_probe.py"


def test_probe_reports_every_stage_on_the_cpu(tiny_ckpt, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_memory_probe", PROBE)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    out = tmp_path / "probe.json"
    assert probe.main([str(tiny_ckpt), "--modes", "LAZY", "--device", "cpu", "--steps", "20", "--json", str(out),
                       "--model", json.dumps({"max_batch": 1, "max_seq_len": 256, "max_prompt_tokens": 64})]) == 0
    recs = json.loads(out.read_text())
    assert [r["stage"] for r in recs] == ["import", "loaded", "warmup", "request1", "request2"]
    for r in recs:
        assert r["mode"] == "LAZY" and r["Rss"] > 0 and r["Anonymous"] > 0 and r["maxrss"] >= r["Rss"] - 1
        assert "anon" in r["groups"] and "cuda_reserved" not in r          # no CUDA parts on a CPU
    assert recs[1]["Rss"] > recs[0]["Rss"]                                  # the model is in memory after the load
    table = capsys.readouterr().out
    assert "CUDA_MODULE_LOADING=LAZY" in table and "request1" in table
