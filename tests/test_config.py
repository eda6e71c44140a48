"""Config: frozen dataclasses validated before anything heavy loads; errors name the key."""

import dataclasses

import pytest

from appliance.config import Config, config_from_dict, load_config
from appliance.errors import ConfigError


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
