"""The memory budget is real: the runner is sized to ``service.memory_budget_mb`` at start
(shrink max_seq_len, then max_batch, or refuse naming what to lower), and the memory in use is
reported in STATUS. Decisions on numbers, then the real daemon (tiny checkpoint, torch CPU)."""

from __future__ import annotations

from appliance.engines.runner import RunnerInfo
from appliance.service.memory import MIN_DECODE_TOKENS, plan_fit
from tests.fixtures_service import launch_daemon, service_config

KIB = 1024


def _info(S=2048, B=3, kvpt=122880, weights=300 * 2**20) -> RunnerInfo:
    return RunnerInfo(backend="onnxruntime", precision="int8", hidden_size=768, num_vq=4, num_audio_tokens=626,
                      max_batch=B, max_seq_len=S, max_prompt_tokens=256, weight_bytes=weights, kv_bytes_per_token=kvpt)


def test_fits_as_configured():
    f = plan_fit(500.0, 0.0, _info(), 1500.0, 256)          # 500 + 720 MiB KV counted on a CPU
    assert f.action == "fits" and (f.max_seq_len, f.max_batch) == (2048, 3) and 1219 < f.footprint_mib < 1221
    g = plan_fit(900.0, 300.0, _info(), 1500.0, 256)        # on a GPU the KV is in the device figure
    assert g.action == "fits" and g.footprint_mib == 1200.0


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
        rss = st["memory_mib"]
    finally:
        assert d.stop() == 0
    # KV cache: 16 slots x 4096 positions x 1 KiB (tiny: 2 layers x K,V x 64 x fp32) = 64 MiB;
    # leave room for about half of it
    cfg = dict(base, service=dict(base["service"], memory_budget_mb=int(rss + 32)))
    d = launch_daemon(tmp_path / "small", cfg)
    try:
        st = _status(d)
        note = st["memory_note"]
        assert note and "model.max_seq_len 4096 -> " in note and "service.memory_budget_mb" in note, st
        new = int(note.split("model.max_seq_len 4096 -> ")[1].split()[0].rstrip(",;"))
        assert 128 + MIN_DECODE_TOKENS <= new < 4096
        assert "to fit service.memory_budget_mb" in d.log()
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
    assert not d.socket.exists()
