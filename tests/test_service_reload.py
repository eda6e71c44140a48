"""SIGHUP re-reads config.yaml: live sections applied, the rest reported, a bad file kept out."""

import signal
import time

import yaml

from tests.fixtures_service import service_config


def _wait_log(d, text, timeout_s=30.0):
    t = time.time() + timeout_s
    while time.time() < t:
        if text in d.log():
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in the daemon log:\n{d.log()[-3000:]}")


def test_sighup_applies_synthesis_and_reports_restart(tiny_ckpt, tmp_path, start_daemon):
    cfg = service_config(tiny_ckpt, tmp_path, synthesis={"max_new_tokens": 30, "seed": 11})
    d = start_daemon(cfg)
    ev = d.request({"type": "speak", "text": "你好", "id": "a"})
    assert ev[-1]["type"] == "done" and ev[-1]["seed"] == 11

    # a live change (default seed) and one that needs a restart (KV-cache length)
    new = yaml.safe_load(d.config_path.read_text())
    new["synthesis"]["seed"] = 23
    new["model"]["max_seq_len"] = 256
    d.config_path.write_text(yaml.safe_dump(new))
    d.proc.send_signal(signal.SIGHUP)
    _wait_log(d, "restart needed for model")
    assert "applied synthesis" in d.log()
    ev = d.request({"type": "speak", "text": "你好", "id": "b"})
    assert ev[-1]["type"] == "done" and ev[-1]["seed"] == 23

    # an invalid file is refused and the running config kept
    d.config_path.write_text("synthesis: {top_p: 7}\n")
    d.proc.send_signal(signal.SIGHUP)
    _wait_log(d, "keeping the running configuration")
    ev = d.request({"type": "speak", "text": "你好", "id": "c"})
    assert ev[-1]["type"] == "done" and ev[-1]["seed"] == 23
