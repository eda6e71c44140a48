"""The memory budget is real: the runner is sized to ``service.memory_budget_mb`` at start
(shrink max_seq_len, then max_batch, or refuse naming what to lower), and the memory in use is
reported in STATUS. Decisions on numbers, then the real daemon (tiny checkpoint, torch CPU)."""

from __future__ import annotations

import json
import re

import pytest

from appliance.config import config_from_dict
from appliance.engines.runner import RunnerInfo
from appliance.engines.sizes import PlannedSizes, plan_sizes, torch_sizes
from appliance.ops.footprint import combine, memory_kind, nvmap_mib
from appliance.daemon.memory import (
    MIN_DECODE_TOKENS,
    plan_before_load,
)
from appliance.daemon.memory import plan_fit as _plan_fit
from tests.fixtures_service import launch_daemon, service_config

KIB = 1024


def _info(S=2048, B=3, kvpt=122880, weights=300 * 2**20) -> RunnerInfo:
    return RunnerInfo(backend="onnxruntime", precision="int8", hidden_size=768, num_vq=4, num_audio_tokens=626,
                      max_batch=B, max_seq_len=S, max_prompt_tokens=256, weight_bytes=weights, kv_bytes_per_token=kvpt)


def plan_fit(rss, dev, info, budget, max_prompt, resizable=True):
    """The measured plan on a CPU (dev 0) or a Jetson (RSS + device memory)."""
    fp = combine("cpu", rss, None, None, 0.0) if dev == 0 else combine("unified", rss, dev, None, 0.0)
    return _plan_fit(fp, info, budget, max_prompt, resizable)


def test_fits_as_configured():
    f = plan_fit(500.0, 0.0, _info(), 1500.0, 256)          # 500 + 720 MiB KV counted on a CPU
    assert f.action == "fits" and (f.max_seq_len, f.max_batch) == (2048, 3) and 1219 < f.footprint_mib < 1221
    g = plan_fit(900.0, 300.0, _info(), 1500.0, 256)        # on a GPU the KV is in the device figure
    assert g.action == "fits" and g.footprint_mib == 1200.0


def test_llama_cpp_kv_cache_is_counted_once_and_the_context_resizable():
    """llama.cpp clears its KV cache at load (resident, in the RSS measured after warm-up): not
    added again; over the budget the context is opened smaller (the GGUF fixes no length)."""
    import dataclasses

    info = dataclasses.replace(_info(kvpt=61440), backend="llama.cpp", precision="q8_0")   # 360 MiB at 3 x 2048
    f = plan_fit(950.0, 0.0, info, 1500.0, 256)
    assert f.action == "fits" and f.footprint_mib == 950.0
    g = plan_fit(1600.0, 0.0, info, 1500.0, 256)   # 1600 - 360 MiB + 3 x 1472 positions (259 MiB) fit 1500
    assert g.action == "shrink" and (g.max_seq_len, g.max_batch) == (1472, 3)


def test_shrinks_max_seq_len_first_then_max_batch():
    f = plan_fit(1000.0, 0.0, _info(), 1500.0, 256)         # 1000 + 720 > 1500: 500 MiB left for KV
    assert f.action == "shrink" and f.max_batch == 3 and f.max_seq_len == 1408
    assert f.max_seq_len % 64 == 0 and f.footprint_mib <= 1500
    assert "model.max_seq_len 2048 -> 1408" in f.text and "max_batch" not in f.text.split("to fit")[0]
    g = plan_fit(1400.0, 0.0, _info(), 1500.0, 256)         # 100 MiB: 3 x 512 does not fit, 2 x 512 does not...
    assert g.action == "shrink" and g.max_batch < 3 and g.max_seq_len >= 256 + MIN_DECODE_TOKENS
    assert f"model.max_batch 3 -> {g.max_batch}" in g.text and g.footprint_mib <= 1500


def test_fixed_size_engines_start_as_built_and_say_what_to_rebuild():
    f = plan_fit(1000.0, 0.0, _info(), 1500.0, 256, resizable=False)
    assert f.action == "over" and (f.max_seq_len, f.max_batch) == (2048, 3)
    assert "model.max_seq_len 2048 -> 1408" in f.text and "rebuild" in f.text and "onnxruntime" in f.text
    assert plan_fit(1480.0, 0.0, _info(), 1500.0, 256, resizable=False).action == "refuse"


def test_refuses_naming_what_to_lower():
    f = plan_fit(1480.0, 0.0, _info(), 1500.0, 256)
    assert f.action == "refuse"
    for words in ("service.memory_budget_mb 1500 MiB cannot hold", "Raise service.memory_budget_mb to at least",
                  "model.max_prompt_tokens", "int8"):
        assert words in f.text, f.text


def _status(d) -> dict:
    (ev,) = d.request({"type": "status"})
    return ev


def test_daemon_sizes_itself_to_the_budget_and_reports_memory(tiny_ckpt, tmp_path):
    base = service_config(tiny_ckpt, tmp_path, model={"max_batch": 16, "max_seq_len": 4096},
                          synthesis={"max_new_tokens": 60, "min_new_tokens": 60})
    d = launch_daemon(tmp_path / "big", base)
    try:
        st = _status(d)
        assert st["memory_budget_mib"] == 1500 and st["memory_note"] is None and st["memory_mib"] > 50
        # the footprint the daemon decided on after its warm-up (RSS + the whole KV cache on a CPU),
        # not STATUS's later RSS: that one also holds what the servers and threads started since then
        # (on a 16-core host more than the 32 MiB below), so a budget derived from it may fit as is
        m = re.search(r"memory: (\d+) of 1500 MiB \(service.memory_budget_mb\), held to .*: measured", d.log())
        assert m, d.log()[-2000:]
        footprint = int(m.group(1))
    finally:
        assert d.stop() == 0
    # KV cache: 16 slots x 4096 positions x 1 KiB (tiny: 2 layers x K,V x 64 x fp32) = 64 MiB;
    # leave room for about half of it
    cfg = dict(base, service=dict(base["service"], memory_budget_mb=int((footprint - 32) / (0.85 - 0.05))))
    d = launch_daemon(tmp_path / "small", cfg)
    try:
        st = _status(d)
        note = st["memory_note"]
        assert note and "model.max_seq_len 4096 -> " in note and "service.memory_budget_mb" in note, st
        new = int(note.split("model.max_seq_len 4096 -> ")[1].split()[0].rstrip(",;"))
        assert 128 + MIN_DECODE_TOKENS <= new < 4096
        assert "to stay within" in d.log() and "one hysteresis band below" in d.log()
        evs = d.request({"type": "speak", "text": "你好", "seed": 3})
        assert evs[-1]["type"] == "done", evs                      # it still speaks
    finally:
        assert d.stop() == 0


def test_daemon_refuses_to_start_when_nothing_fits(tiny_ckpt, tmp_path):
    cfg = service_config(tiny_ckpt, tmp_path, service={"memory_budget_mb": 64})
    d = launch_daemon(tmp_path / "d", cfg, wait=False)
    try:
        rc = d.proc.wait(120)
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
    log = d.log()
    assert rc == 2, log[-3000:]
    assert "service.memory_budget_mb 64 MiB cannot hold this model" in log and "Raise service.memory_budget_mb" in log
    assert "estimated before the load" in log and "pipeline loaded" not in log     # decided before any load
    assert not d.socket.exists()


# ---------------------------------------------------------------- what counts, by the kind of box


def test_each_kind_counts_its_own_memory():
    """Jetson: RSS + NvMap; desktop GPU: the process's device memory (NVML) with its CUDA context,
    host RSS apart; CPU: RSS. All-in (host + device) on every kind."""
    j = combine("unified", 900.0, 400.0, None, 300.0)
    assert (j.budget_mib, j.host_mib, j.source, j.all_in_mib) == (1300.0, None, "nvmap", 1300.0)
    d = combine("discrete", 1800.0, None, 950.0, 700.0)
    assert (d.budget_mib, d.host_mib, d.source, d.all_in_mib) == (950.0, 1800.0, "nvml", 2750.0)   # RSS not in the budget
    h200 = combine("discrete", 1798.0, None, 1910.0, 1126.0, context_mib=621.0)    # measured on an H200
    assert h200.budget_mib == 1910.0 and h200.context_mib == 621.0 and "621 MiB of it the CUDA context" in h200.describe()
    assert h200.all_in_mib == 1798.0 + 1910.0 and "all-in 3708 MiB" in h200.describe()
    nonvml = combine("discrete", 1800.0, None, None, 700.0, context_mib=400.0)      # no NVML: the backend's + context
    assert (nonvml.budget_mib, nonvml.source) == (1100.0, "backend")
    c = combine("cpu", 1100.0, None, None, 0.0)
    assert (c.budget_mib, c.host_mib, c.all_in_mib) == (1100.0, None, 1100.0)
    with pytest.raises(ValueError):
        combine("tpu", 1.0, None, None, 0.0)


def test_a_discrete_gpu_fits_where_rss_plus_device_did_not():
    """The daemon's own log on the H200: 1859 MiB RSS + 1126 MiB device memory, refused against
    1500 MiB when both counted; the device memory alone fits."""
    info = _info(kvpt=61440, weights=620 * 2**20)
    old = plan_fit(1859.0, 1126.0, info, 1500.0, 256)                  # both counted (a Jetson would)
    assert old.action in ("shrink", "refuse")
    new = _plan_fit(combine("discrete", 1859.0, None, 1126.0, 1126.0), info, 1500.0, 256)
    assert new.action == "fits" and new.footprint_mib == 1126.0 and "host RSS" in new.text


def test_memory_kind_from_the_box(tmp_path):
    root = tmp_path / "jetson"
    (root / "proc").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text("MemTotal: 7989556 kB\nNvMapMemUsed:     412340 kB\n")
    assert memory_kind("cuda:0", str(root)) == "unified" and memory_kind("cpu", str(root)) == "unified"
    assert round(nvmap_mib(str(root))) == 403
    pc = tmp_path / "pc"
    (pc / "proc").mkdir(parents=True)
    (pc / "proc" / "meminfo").write_text("MemTotal: 7989556 kB\n")
    assert memory_kind("cuda:0", str(pc)) == "discrete" and memory_kind("cpu", str(pc)) == "cpu"
    assert nvmap_mib(str(pc)) is None


# ---------------------------------------------------------------- decided before the load


def test_sizes_are_known_before_the_load(tiny_ckpt):
    """Weight bytes from the checkpoint's headers match the tensors; a GPU holds 16-bit weights by
    default (the Decoder and Vocos stay float32) and half the KV bytes."""
    from safetensors.numpy import load_file

    cfg = config_from_dict({"model": {"path": str(tiny_ckpt), "backend": "torch"}})
    asset = tiny_ckpt / "asset"
    n = {f: sum(v.size for k, v in load_file(str(asset / f)).items() if k != "embed_tokens.weight")
         for f in ("gpt/model.safetensors", "Embed.safetensors", "Decoder.safetensors", "Vocos.safetensors")}
    cpu, gpu = torch_sizes(cfg, gpu=False), torch_sizes(cfg, gpu=True)
    assert cpu.weight_bytes == 4 * sum(n.values())
    assert gpu.weight_bytes == 2 * (n["gpt/model.safetensors"] + n["Embed.safetensors"]) + \
        4 * (n["Decoder.safetensors"] + n["Vocos.safetensors"])
    gc = json.loads((asset / "gpt" / "config.json").read_text())
    assert cpu.kv_bytes_per_token == 2 * gc["num_hidden_layers"] * gc["hidden_size"] * 4 == 2 * gpu.kv_bytes_per_token
    assert plan_sizes(cfg).backend == "torch" and plan_sizes(cfg).resizable
    f32 = config_from_dict({"model": {"path": str(tiny_ckpt), "backend": "torch", "dtype": "float32"}})
    assert torch_sizes(f32, gpu=True).kv_bytes_per_token == cpu.kv_bytes_per_token     # FP32 only where asked


def test_full_model_on_a_desktop_gpu_before_the_load_counts_the_cuda_context():
    """The full-size model on a desktop GPU, its CUDA context counted (one basis for every
    backend): torch's FP16 weights (GPT + Embed; Decoder + Vocos FP32) + its 1005 MiB of context
    and workspaces do not fit the shipped 1500 MiB, and the refusal names the least budget; 2500 MiB
    fit three channels at 2048. llama.cpp's q8_0 GGUF offloaded (its vocoder on the host) with a
    q8_0 KV cache fits the shipped budget at 3 x 2048. FP32 weights (asked for) do not."""
    from appliance.daemon.memory import DEVICE_OTHER_MIB, ceiling_mib

    cfg = config_from_dict({})
    fp16 = PlannedSizes("torch", "cuda", int((189e6 + 36.4e6) * 2 + 39.4e6 * 4), 61440, True, "full, fp16")
    f = plan_before_load(cfg, fp16, "discrete", rss_now_mib=500.0)
    assert f.action == "refuse" and "Raise service.memory_budget_mb to at least" in f.text
    assert f"{DEVICE_OTHER_MIB['torch']} MiB of CUDA context" in f.text and "the context included" in f.text
    big = config_from_dict({"service": {"memory_budget_mb": 2500}})
    b = plan_before_load(big, fp16, "discrete", rss_now_mib=500.0)
    assert (b.action, b.max_batch, b.max_seq_len) == ("fits", 3, 2048) and b.footprint_mib <= ceiling_mib(big)
    gguf = PlannedSizes("llama.cpp", "cuda", (347 + 220) * MIB, int(2 * 20 * 768 * 34 / 32), True, "q8_0 GGUF",
                        host_weight_bytes=220 * MIB)
    g = plan_before_load(cfg, gguf, "discrete", rss_now_mib=500.0)
    assert (g.action, g.max_batch, g.max_seq_len) == ("fits", 3, 2048), g.text
    assert "347 MiB of them on the GPU" in g.text and g.footprint_mib == pytest.approx(457 + 347 + 191.25, abs=0.5)
    tight = config_from_dict({"service": {"memory_budget_mb": 1200}})   # the llama.cpp KV cache fitted too
    t = plan_before_load(tight, gguf, "discrete", rss_now_mib=500.0)
    assert (t.action, t.max_batch) == ("shrink", 3) and 1024 <= t.max_seq_len < 2048
    assert t.footprint_mib <= ceiling_mib(tight) and "model.max_seq_len 2048 ->" in t.text
    fp32 = PlannedSizes("torch", "cuda", int((189e6 + 36.4e6 + 39.4e6) * 4), 122880, True, "full, fp32")
    assert plan_before_load(big, fp32, "discrete", rss_now_mib=500.0).action in ("shrink", "refuse")
    j = plan_before_load(big, fp16, "unified", rss_now_mib=500.0)        # a Jetson also counts the host side
    assert j.footprint_mib > b.footprint_mib + 500.0 - DEVICE_OTHER_MIB["torch"] + 300


# --------------------------------------------------------------------------- the shipped config on real boxes
MIB = 2**20
FULL_KVPT = 20 * 2 * 768 * 2            # FP16 KV bytes per position per slot at full size (61,440)
FULL_FP16_WEIGHTS = 549 * MIB           # GPT + Embed FP16, Decoder + Vocos FP32 (H200 NVML, issue 30)
FULL_INT8_SAVING = 20 * (4 * 768 * 768 + 3 * 768 * 3072) * 1   # block linears at 1 byte instead of 2


def _level_at(cfg, mib: float) -> str:
    """The throttle's level for a memory reading alone (no other signal)."""
    from appliance.ops.throttle import Throttle

    return Throttle(cfg.throttle, (), cfg.service.memory_budget_mb).update(app_mem_mib=mib).value


def test_the_rule_keeps_ready_one_hysteresis_band_below_the_first_threshold():
    from appliance.daemon.memory import ceiling_mib

    cfg = config_from_dict({})
    assert ceiling_mib(cfg) == pytest.approx(1500 * (0.85 - 0.05))
    assert _level_at(cfg, ceiling_mib(cfg)) == "normal"
    assert _level_at(cfg, ceiling_mib(cfg) + 1500 * 0.05) == "reduced_channels"   # a band of growth is allowed
    off = config_from_dict({"throttle": {"enabled": False}})
    assert ceiling_mib(off) == 1500


def test_h200_measured_figures_start_three_channels_unthrottled():
    """The lent H200 (2026-12-04, issue 30): 1910 MiB of device memory at ready = 621 CUDA context
    + 549 weights + 360 KV (3 x 2048) + 380 other. With the context counted, torch CUDA needs a
    budget over the shipped 1500 MiB; at 2250 (ceiling 1800) the fit holds it below the ceiling:
    FP16 kept, three channels, a shorter KV cache; before the load from the checkpoint's sizes and
    again after the warm-up from the measured figure, the same decision."""
    from appliance.daemon.memory import ceiling_mib, plan_before_load

    cfg = config_from_dict({"service": {"memory_budget_mb": 2250}})
    sizes = PlannedSizes("torch", "cuda", FULL_FP16_WEIGHTS, FULL_KVPT, True, "float16 weights", FULL_INT8_SAVING)
    before = plan_before_load(cfg, sizes, "discrete", 1500.0)        # host RSS does not count on a desktop GPU
    assert before.action == "shrink" and before.max_batch == 3 and before.quant is None
    assert 1024 <= before.max_seq_len < 2048 and before.footprint_mib <= ceiling_mib(cfg)
    assert _level_at(cfg, before.footprint_mib) == "normal"
    measured = combine("discrete", 1798.0, None, 1289.0 + 621.0, 0.0, 621.0)
    info = RunnerInfo(backend="torch-cuda", precision="float16", hidden_size=768, num_vq=4, num_audio_tokens=626,
                      max_batch=3, max_seq_len=2048, max_prompt_tokens=256, weight_bytes=FULL_FP16_WEIGHTS,
                      kv_bytes_per_token=FULL_KVPT)
    after = _plan_fit(measured, info, 2250.0, 256, ceiling=ceiling_mib(cfg))
    assert (after.action, after.max_batch) == ("shrink", 3) and after.quant is None
    assert 1024 <= after.max_seq_len <= before.max_seq_len + 64 and after.footprint_mib <= ceiling_mib(cfg)
    assert _level_at(cfg, after.footprint_mib) == "normal"
    assert "one hysteresis band below the throttle's first memory threshold" in after.text


def test_a_tighter_budget_takes_int8_weights_before_it_cuts_the_kv_cache_below_1024():
    from appliance.daemon.memory import plan_before_load

    cfg = config_from_dict({"service": {"memory_budget_mb": 2000}})      # ceiling 1600 MiB, context counted
    sizes = PlannedSizes("torch", "cuda", FULL_FP16_WEIGHTS, FULL_KVPT, True, "float16 weights", FULL_INT8_SAVING)
    f = plan_before_load(cfg, sizes, "discrete", 0.0)
    assert f.action == "shrink" and f.quant == "int8" and f.max_batch == 3 and f.max_seq_len >= 1024
    none = config_from_dict({"service": {"memory_budget_mb": 2000}, "model": {"quant": "none"}})
    g = plan_before_load(none, torch_sizes_like(none, sizes), "discrete", 0.0)
    assert g.action == "shrink" and g.quant is None and g.max_seq_len < 1024   # quant none: only the KV cache moves


def torch_sizes_like(cfg, sizes):
    """``sizes`` as torch_sizes gives them for ``cfg`` (no INT8 option unless model.quant is auto)."""
    import dataclasses

    return dataclasses.replace(sizes, int8_saving_bytes=sizes.int8_saving_bytes if cfg.model.quant == "auto" else 0)


# The Orin 8 GB on paper (docs/jetson-memory.md, RSS + NvMap): TensorRT plans built at install
# (fixed sizes), INT8 weight-only plans 223 MiB + execution contexts 93 + runner buffers 73 + the
# host (Python, numpy, tokenizer, normalizer) 76 + the CUDA context and TensorRT 10 runtime ~400;
# the TensorRT runner as written also imports torch (~490 MiB RSS). FP16 plans: 621 + 80.
ORIN_INT8_FIXED = 223 + 93 + 73 + 76 + 400
ORIN_FP16_FIXED = 621 + 80 + 73 + 76 + 400
ORIN_TORCH = 490


@pytest.mark.parametrize("torch_in_process", [False, True])
def test_orin_paper_figures(torch_in_process):
    """What `engines build` must be given on an 8 GB Orin, decided by the same fit: without torch
    in the process INT8 plans hold three channels with an 1856-position KV cache under the ceiling
    (FP16 plans do not fit at 1024); with torch imported by the TensorRT runner, as it is written
    today, nothing fits under the ceiling (the fixed part alone is 1355 MiB): the fit says so
    instead of starting throttled."""
    from appliance.daemon.memory import _fit, ceiling_mib

    cfg = config_from_dict({})
    top, kvpt = ceiling_mib(cfg), FULL_KVPT / MIB
    extra = ORIN_TORCH if torch_in_process else 0
    fp16 = _fit(ORIN_FP16_FIXED + extra, kvpt, 2048, 3, 1500.0, 256, True, "tensorrt", "Orin paper, FP16", top)
    int8 = _fit(ORIN_INT8_FIXED + extra, kvpt, 2048, 3, 1500.0, 256, True, "tensorrt", "Orin paper, INT8", top)
    if not torch_in_process:
        assert fp16.action == "refuse" or fp16.max_seq_len < 1024 or fp16.max_batch < 3
        assert (int8.action, int8.max_batch, int8.max_seq_len) == ("shrink", 3, 1856)
        assert _level_at(cfg, int8.footprint_mib) == "normal"
    else:
        assert int8.action == "refuse" or int8.max_batch < 3
        assert "1500" in int8.text


def test_device_memory_from_nvidia_smi_without_nvml(tmp_path, monkeypatch):
    """Without nvidia-ml-py the driver's own tool gives this PID's device memory (CUDA context
    included), summed over GPUs; other processes' lines are not counted."""
    import os
    import sys

    from appliance.ops import footprint

    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{os.getpid()}, 1164'\necho '99999999, 5000'\necho '{os.getpid()}, 10'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setitem(sys.modules, "pynvml", None)            # import pynvml -> ImportError
    assert footprint.nvml_process_mib() == 1174.0
    assert footprint.smi_process_mib(12345) is None
