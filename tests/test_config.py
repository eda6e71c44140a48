"""Config: frozen dataclasses validated before anything heavy loads; errors name the key."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.config import Config, config_from_dict, load_config
from appliance.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_repository_config_yaml_loads_and_matches_defaults(tmp_path):
    cfg = load_config("config.yaml")
    assert cfg.service.socket_mode == 0o660
    assert cfg.model.backend == "auto"
    assert [c.name for c in cfg.service.channels] == ["main"]
    # relative paths resolve against the file's directory
    assert cfg.resolve(cfg.model.path).is_absolute()


def test_config_is_frozen():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.backend = "torch"  # type: ignore[misc]


@pytest.mark.parametrize(
    "data, key",
    [
        ({"modle": {}}, "modle"),
        ({"model": {"backnd": "torch"}}, "model.backnd"),
        ({"model": {"backend": "cuda"}}, "model.backend"),
        ({"synthesis": {"top_p": 1.5}}, "synthesis.top_p"),
        ({"synthesis": {"top_k": "20"}}, "synthesis.top_k"),
        ({"synthesis": {"temperature": True}}, "synthesis.temperature"),
        ({"service": {"channels": [{"name": "a", "colour": 1}]}}, "service.channels[0].colour"),
        ({"service": {"channels": []}}, "service.channels"),
        ({"stream": {"chunk_tokens": 0}}, "stream.chunk_tokens"),
    ],
)
def test_bad_values_name_the_key(data, key):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert key in str(e.value)


def test_cross_section_checks():
    with pytest.raises(ConfigError, match="max_batch"):
        config_from_dict({"model": {"max_batch": 1},
                          "service": {"channels": [{"name": "a"}, {"name": "b"}]}})
    with pytest.raises(ConfigError, match="unique"):
        config_from_dict({"service": {"channels": [{"name": "a"}, {"name": "a"}]}})


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_int_accepted_for_float_and_empty_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("synthesis: {temperature: 1}\n")
    assert load_config(p).synthesis.temperature == 1.0
    p.write_text("")
    assert load_config(p) == dataclasses.replace(Config(), base_dir=str(tmp_path.resolve()), source=str(p.resolve()))
    assert load_config(p).file_hint == str(p.resolve())
    with pytest.raises(ConfigError, match="unknown config key 'source'"):
        config_from_dict({"source": "x"})


def test_bare_off_in_yaml_means_off(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: {compile: off}\n")
    assert load_config(p).model.compile == "off"
    p.write_text("model: {compile: default}\n")
    assert load_config(p).model.compile == "default"
    p.write_text("model: {compile: on}\n")
    with pytest.raises(ConfigError, match="model.compile"):
        load_config(p)


def test_no_config_file_found_names_the_search_order(tmp_path, monkeypatch):
    from appliance.config import CONFIG_ENV, find_config

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert find_config() is None                              # optional: the caller uses defaults
    with pytest.raises(ConfigError) as e:
        find_config(required=True)
    msg = str(e.value)
    assert ("looked for --config (not given), then $CHATTTS_APPLIANCE_CONFIG (not set), then ./config.local.yaml, "
            f"./config.yaml in {tmp_path}: pass --config PATH") in msg
    (tmp_path / "config.yaml").write_text("{}\n")
    assert find_config(required=True) == Path("config.yaml")


@pytest.mark.parametrize("argv", [["normalize", "hello"], ["serve"], ["calibrate"]])
def test_commands_that_need_a_config_say_where_they_looked(tmp_path, argv):
    env = {k: v for k, v in os.environ.items() if k != "CHATTTS_APPLIANCE_CONFIG"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-m", "appliance", *argv], cwd=str(tmp_path), env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"chattts-appliance {argv[0]}: error: no config file found; looked for --config" in r.stderr
    assert "./config.local.yaml, ./config.yaml" in r.stderr and "pass --config PATH" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("key, value", [
    ("device_id", "+"), ("device_id", "box/1"), ("device_id", "a#"), ("device_id", "a\x00b"), ("device_id", ""),
    ("topic_prefix", "home/+"), ("topic_prefix", "#"), ("topic_prefix", "x\x00"), ("topic_prefix", ""),
    ("topic_prefix", "/"), ("discovery_prefix", "ha/#"),
])
def test_mqtt_topic_parts_that_break_topics_are_refused_naming_the_key(key, value):
    """'+'/'#' would subscribe to other boxes' topics, NUL and '' make the broker drop the client
    (the daemon said 'ready' and reconnected for ever): refused at load."""
    with pytest.raises(ConfigError) as e:
        config_from_dict({"mqtt": {key: value}})
    assert f"mqtt.{key}" in str(e.value)
    config_from_dict({"mqtt": {"topic_prefix": "home/tts", "device_id": "car-1"}})     # levels in the prefix are fine


def test_mqtt_device_id_defaults_to_one_per_box(tmp_path, monkeypatch):
    """Default device_id: the host name plus a digest of /etc/machine-id (two boxes with the
    image's host name still differ), only topic-safe characters, stable; never 'appliance'."""
    from appliance.config import default_device_id
    m = Config().mqtt
    assert m.device_id is None and m.box_id == default_device_id() != "appliance"
    assert m.box_id == Config().mqtt.box_id                              # stable
    import socket as socket_mod
    monkeypatch.setattr(socket_mod, "gethostname", lambda: "Ubuntu.local")
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("0123456789abcdef0123456789abcdef\n")
    b.write_text("fedcba9876543210fedcba9876543210\n")
    ida, idb = default_device_id.__wrapped__(str(a)), default_device_id.__wrapped__(str(b))
    assert ida != idb and ida.startswith("ubuntu-local-") and len(ida) == len("ubuntu-local-") + 6
    assert "0123456789" not in ida                                        # the machine id itself is not published
    assert default_device_id.__wrapped__(str(tmp_path / "missing")) == "ubuntu-local"
    cfg = config_from_dict({"mqtt": {"device_id": ida}})                  # and it passes the topic checks
    assert cfg.mqtt.box_id == ida


def test_voices_top_level_and_the_old_wyoming_name():
    calm = {"name": "calm", "voice": "seed:11"}
    assert [v.name for v in config_from_dict({"voices": [{"name": "default"}, calm]}).voices] == ["default", "calm"]
    old = config_from_dict({"wyoming": {"voices": [calm], "enabled": False}})
    assert [(v.name, v.voice) for v in old.voices] == [("calm", "seed:11")]
    with pytest.raises(ConfigError, match="both set"):
        config_from_dict({"voices": [calm], "wyoming": {"voices": [calm]}})
    with pytest.raises(ConfigError, match=r"^wyoming\.voices"):         # the key as written
        config_from_dict({"wyoming": {"voices": [calm, calm]}})
    with pytest.raises(ConfigError, match=r"^voices: \['seed:2'\]"):    # a name is never a voice string
        config_from_dict({"voices": [{"name": "seed:2"}]})


def test_a_config_error_is_located_by_file_and_line(tmp_path):
    """``reload failed: <file>:<line>: <reason>``'s location: a bad value, an unknown key, an entry
    of a list, a YAML syntax error, a key the file does not hold (its section's line)."""
    from appliance.config.position import key_line, located

    text = "synthesis:\n  seed: 3\n  top_p: 7\nservice:\n  channels:\n    - name: main\n    - name: alert\n      volume_db: 99\n"
    assert key_line(text, "synthesis.top_p") == 3
    assert key_line(text, "service.channels[1].volume_db") == 8
    assert key_line(text, "service.channels[1]") == 7
    assert key_line(text, "service.max_text_chars") == 4          # not there: its section
    assert key_line(text, "mqtt.port") is None
    p = tmp_path / "c.yaml"
    p.write_text(text)
    for message, want in [
        ("synthesis.top_p: 7.0 is above the maximum 1.0", f"{p}:3: synthesis.top_p: 7.0 is above the maximum 1.0"),
        ("unknown config key 'service.channels[1].volume_db' (known here: a)", f"{p}:8: unknown config key"),
        (f"{p} is not valid YAML: while scanning\n  in \"<unicode string>\", line 5, column 2:\n  x\n ^",
         f"{p}:5: not valid YAML: while scanning"),
        ("the text holds no key", f"{p}: the text holds no key"),
    ]:
        assert located(str(p), message).startswith(want), located(str(p), message)
