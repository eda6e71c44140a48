"""Config values as add-on UIs write them (appliance.config.loader, appliance.config.sources):
null means the default, every error names the dotted key and what it takes in words, the same
checks stop ``serve`` with one line and exit 2 (SIGHUP: tests/test_reload_live.py), and
``config show`` names where each value came from."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from appliance.cli.main import main
from appliance.config import Config, config_from_dict
from appliance.errors import ConfigError
from tests.fixtures_service import ROOT


def test_null_means_the_default():
    cfg = config_from_dict({"mqtt": {"port": None, "host": None, "keepalive_s": None}, "synthesis": {"voice": None},
                            "service": {"channels": None, "socket": None}, "voices": None,
                            "audio": None, "stream": {"lookahead": None}})
    d = Config()
    assert (cfg.mqtt.port, cfg.mqtt.host, cfg.mqtt.keepalive_s) == (d.mqtt.port, d.mqtt.host, d.mqtt.keepalive_s)
    assert (cfg.synthesis.voice, cfg.service.channels, cfg.service.socket) == (d.synthesis.voice, d.service.channels, d.service.socket)
    assert (cfg.voices, cfg.audio, cfg.stream.lookahead) == (d.voices, d.audio, d.stream.lookahead)
    assert config_from_dict({"service": {"channels": [{"name": "a", "volume_db": None}]}}).service.channels[0].volume_db == 0.0


@pytest.mark.parametrize("data, message", [
    ({"wyoming": {"uris": ["tcp://0.0.0.0:70000"]}},
     "wyoming.uris: 'tcp://0.0.0.0:70000': the port must be an integer between 1 and 65535"),
    ({"wyoming": {"uris": ["tcp://0.0.0.0:0"]}}, "wyoming.uris: 'tcp://0.0.0.0:0': the port must be an integer between 1 and 65535"),
    ({"mqtt": {"port": 70000}}, "mqtt.port: expected an integer between 1 and 65535, got 70000"),
    ({"mqtt": {"port": "1883x"}}, "mqtt.port: expected an integer between 1 and 65535, got '1883x'"),
    ({"mqtt": {"host": ""}}, "mqtt.host: '' is blank: expected a host name or address"),
    ({"mqtt": {"host": "mqtt://box:1883"}}, "mqtt.host: 'mqtt://box:1883' holds a space or '/'"),
    ({"synthesis": {"voice": ""}}, "synthesis.voice: '' is blank: expected 'seed:N', 'none' or an upstream speaker string"),
    ({"synthesis": {"voice": "calm"}}, "synthesis.voice: 'calm' is a voice name"),
    ({"synthesis": {"voice": "seed:-1"}}, "synthesis.voice: 'seed:-1' is not a voice"),
    ({"synthesis": {"seed": "x"}}, "synthesis.seed: expected an integer between 0 and 9223372036854775807, or null, got 'x'"),
    ({"audio": {"sample_rate": 1.5}}, "audio.sample_rate: expected an integer between 8000 and 192000, or null, got 1.5"),
    ({"health": {"max_rtf": float("nan")}}, "health.max_rtf: expected a number between 0 and 1000, got nan"),
    ({"model": {"backend": "gpu"}}, "model.backend: 'gpu' is not one of auto, tensorrt, llama, onnxruntime, torch"),
    ({"model": {"spin_wait": "yes"}}, "model.spin_wait: expected true or false, got 'yes'"),
    ({"service": {"spool_dir": " "}}, "service.spool_dir: ' ' is blank: expected a path"),
    ({"service": {"channels": [{"name": ""}]}}, "service.channels[0].name: '' is blank: expected text (not blank)"),
])
def test_a_bad_value_is_named_with_what_the_key_takes(data, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert str(e.value).startswith(message), str(e.value)
    assert "Optional" not in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text, key", [
    ("wyoming:\n  enabled: true\n  uris: ['tcp://0.0.0.0:99999']\n", "wyoming.uris"),
    ("mqtt:\n  enabled: true\n  host: ''\n", "mqtt.host"),
    ("synthesis:\n  voice: ''\n", "synthesis.voice"),
])
def test_serve_refuses_a_bad_value_with_one_line_and_exit_2(tmp_path, text, key):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(text)
    p = subprocess.run([sys.executable, "-m", "appliance", "serve", "--config", str(cfg)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"chattts-appliance serve: error: {key}: "), p.stderr


def test_config_show_names_where_each_value_came_from(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("mqtt:\n  host: broker.local\n  port: null\n  password: s3cret\nmodel:\n  path: ckpt\n")
    monkeypatch.delenv("CHATTTS_APPLIANCE_CONFIG", raising=False)
    assert main(["config", "show", "--config", str(cfg), "--json"]) == 0
    rows = {r["key"]: r for r in json.loads(capsys.readouterr().out)}
    where = str(cfg.resolve())
    assert (rows["mqtt.host"]["value"], rows["mqtt.host"]["source"]) == ("broker.local", f"{where}:2")
    assert (rows["mqtt.port"]["value"], rows["mqtt.port"]["source"]) == (1883, f"default (null at {where}:3)")
    assert (rows["mqtt.password"]["value"], rows["mqtt.keepalive_s"]["source"]) == ("<hidden>", "default")
    assert rows["model.path"]["resolved"] == str(tmp_path.resolve() / "ckpt")
    assert "voices" in rows and "service.channels" in rows
    assert main(["config", "show", "--config", str(cfg)]) == 0
    text = capsys.readouterr().out
    assert f'  host: "broker.local"  # {where}:2' in text and "s3cret" not in text
    cfg.write_text("mqtt:\n  port: 0\n")
    p = subprocess.run([sys.executable, "-m", "appliance", "config", "show", "--config", str(cfg)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "", p
    assert p.stderr.strip() == (f"chattts-appliance config show: error: {cfg}:2: mqtt.port: expected an integer "
                                f"between 1 and 65535, got 0")
