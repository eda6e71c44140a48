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
