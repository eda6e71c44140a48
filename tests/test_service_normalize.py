"""What the box says is visible: the ``done`` event carries the spoken sentences and what was
unspeakable, a ``normalize`` request (socket and MQTT payload) and ``chattts-appliance
normalize`` print it without synthesizing, and the verbose log names the request id with every
normalization warning. Real daemon subprocess on a real UNIX socket."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from appliance.messages.protocol import NormalizeRequest
from appliance.transports.mqtt_payload import parse_command
from tests.fixtures_service import ROOT, launch_daemon, service_config

TEXT = "一共￥2,500元。Meeting starts at 10:45. 你好😀"
SPOKEN = ["一共两千五百元。", "Meeting starts at ten forty five.", "你好"]


@pytest.fixture(scope="module")
def daemon(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("svc_norm")
    d = launch_daemon(tmp / "d", service_config(tiny_ckpt, tmp))
    yield d
    assert d.stop() == 0, d.log()[-4000:]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance", "normalize", *args], cwd=str(ROOT),
                          capture_output=True, text=True, timeout=60)


def test_done_carries_spoken_sentences_and_unspeakable_names(daemon):
    evs = daemon.request({"type": "speak", "text": TEXT, "id": "shown-1", "seed": 3,
                          "params": {"max_new_tokens": 8}})
    done = evs[-1]
    assert done["type"] == "done", evs
    assert done["spoken"] == SPOKEN
    assert done["unspeakable"] == ["😀"] and done["unspeakable_names"] == ["😀 (U+1F600 GRINNING FACE)"]
    # the verbose log names the request with the normalization warning and what it says
    log = daemon.log()
    assert "request shown-1: removed what cannot be spoken: 😀 (U+1F600 GRINNING FACE)" in log
    assert "request shown-1: speaks" in log


def test_normalize_request_is_a_dry_run(daemon):
    (ev,) = daemon.request({"type": "normalize", "text": TEXT, "id": "dry-1"}, until=("normalized", "error"))
    assert ev["type"] == "normalized" and ev["id"] == "dry-1"
    assert ev["spoken"] == SPOKEN and len(ev["tokens"]) == 3
    assert all(0 < n <= 128 for n in ev["tokens"])   # model.max_prompt_tokens of the test config
    assert ev["unspeakable_names"] == ["😀 (U+1F600 GRINNING FACE)"]
    st = daemon.request({"type": "status"})[0]
    assert all(not ch.get("active") for ch in st["channels"].values())   # nothing was synthesized
    (ev,) = daemon.request({"type": "normalize", "text": "😀"}, until=("normalized", "error"))
    assert ev["type"] == "error" and ev["code"] == "bad_text" and "GRINNING FACE" in ev["message"]


def test_cli_normalize_without_daemon_matches_the_daemon(daemon):
    r = _cli("--config", str(daemon.config_path), "--json", TEXT)
    assert r.returncode == 0, r.stderr
    local = json.loads(r.stdout)
    (remote,) = daemon.request({"type": "normalize", "text": TEXT, "id": "x"}, until=("normalized", "error"))
    for k in ("spoken", "tokens", "unspeakable", "unspeakable_names"):
        assert local[k] == remote[k], k
    r = _cli("--config", str(daemon.config_path), TEXT)
    assert r.returncode == 0 and r.stdout.splitlines()[0].startswith("1. 一共两千五百元。")
    assert "could not speak: 😀 (U+1F600 GRINNING FACE)" in r.stdout
    r = _cli("--config", str(daemon.config_path), "😀")
    assert r.returncode == 1 and "nothing speakable" in r.stderr


MARKDOWN = "## Today\n\nIt is **sunny**[uv_break], see [the forecast](https://weather.example.com/x).\n- <b>No.</b> 10"


def test_markup_is_cleaned_on_the_socket_and_shown_by_the_cli(daemon):
    """An agent's Markdown/HTML through the daemon's socket (the normalizer every transport
    shares) and the dry run alike: markup never spoken, control tokens kept; the CLI shows the
    cleaned text first."""
    (remote,) = daemon.request({"type": "normalize", "text": MARKDOWN, "id": "md"}, until=("normalized", "error"))
    assert remote["spoken"] == ["Today.", "It is sunny[uv_break], see the forecast.", "number ten"], remote
    r = _cli("--config", str(daemon.config_path), "--json", MARKDOWN)
    assert r.returncode == 0, r.stderr
    local = json.loads(r.stdout)
    assert local["spoken"] == remote["spoken"]
    assert local["cleaned"] == "Today\nIt is sunny[uv_break], see the forecast.\nNo. 10"
    out = _cli("--config", str(daemon.config_path), MARKDOWN).stdout.splitlines()
    assert out[:4] == ["cleaned (markup removed):", "  Today", "  It is sunny[uv_break], see the forecast.",
                       "  No. 10"], out
    assert out[4].startswith("1. Today."), out


def test_cli_normalize_prints_only_its_result_unless_verbose(daemon):
    r = _cli("--config", str(daemon.config_path), "你好😀 hello")    # the 😀 is an INFO line with -v
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", "normalize must log only warnings and above without -v"
    lines = r.stdout.splitlines()
    assert re.fullmatch(r"1\. 你好 ?hello\.?    \[\d+ tokens, at most 188 steps = 4\.0 s\]", lines[0]), lines
    assert lines[1:] == ["could not speak: 😀 (U+1F600 GRINNING FACE)"]
    v = subprocess.run([sys.executable, "-m", "appliance", "-v", "normalize", "--config", str(daemon.config_path),
                        "你好😀 hello"], cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert v.returncode == 0 and v.stdout == r.stdout
    assert " INFO appliance.text.normalize: request dry-run: removed what cannot be spoken: 😀" in v.stderr, v.stderr


def test_cli_normalize_through_the_daemon(daemon):
    r = _cli("--socket", str(daemon.socket), "--json", "我们A12B34")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["spoken"] == ["我们A一二B三四"]


def test_mqtt_normalize_payloads():
    req, err = parse_command("normalize", "箭头→表示方向".encode(), 4096)
    assert err is None and isinstance(req, NormalizeRequest) and req.text == "箭头→表示方向" and req.id
    req, err = parse_command("normalize", json.dumps({"text": "hi", "id": "n1"}).encode(), 4096)
    assert err is None and req.id == "n1"
    req, err = parse_command("normalize", json.dumps({"type": "speak", "text": "hi"}).encode(), 4096)
    assert req is None and err.code == "bad_request"
