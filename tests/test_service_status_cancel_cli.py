"""`chattts-appliance status` and `cancel` against the real daemon."""

import subprocess
import sys

from tests.fixtures_service import service_config


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True, text=True, timeout=60)


def test_status_and_cancel_commands(tiny_ckpt, tmp_path, start_daemon):
    d = start_daemon(service_config(tiny_ckpt, tmp_path, synthesis={"max_new_tokens": 400, "min_new_tokens": 400}))
    r = _cli("status", "--socket", str(d.socket))
    assert r.returncode == 0, r.stderr
    assert "state ready" in r.stdout and "main: active -" in r.stdout

    c = d.connect()
    try:
        c.send({"type": "speak", "text": "你好", "id": "long-1", "seed": 1})
        c.events(("started",))
        r = _cli("cancel", "--socket", str(d.socket), "--id", "long-1")
        assert r.returncode == 0 and "cancelled long-1" in r.stdout, (r.stdout, r.stderr)
        _, ends = c.events_until_ids({"long-1"})
        assert ends["long-1"]["code"] == "cancelled"
    finally:
        c.close()

    r = _cli("cancel", "--socket", str(d.socket), "--id", "no-such-request")
    assert r.returncode == 1 and "nothing to cancel" in r.stderr
    r = _cli("status", "--socket", str(tmp_path / "nope.sock"))
    assert r.returncode == 2 and "not reachable" in r.stderr


def test_status_prints_a_channels_start_decision_in_words():
    """A channel's ``start`` (a dict) reads as words, not as a Python dict."""
    from appliance.cli.control import _field

    got = _field({"id": "a4b5", "predicted_rtf": 0.098, "start_hold_ms": 80.0, "start_delay_ms": None})
    assert got == "(id a4b5, predicted_rtf 0.098, start_hold_ms 80, start_delay_ms -)", got
    assert _field({}) == "-"
