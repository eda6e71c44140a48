"""``config.yaml`` documents every section and key the code reads, with the defaults; and
``config.local.yaml`` (the development config README and quickstart name) is valid."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import yaml

from appliance.config import Config, load_config
from appliance.config.loader import _SECTION_ITEM

ROOT = Path(__file__).resolve().parent.parent
INTERNAL = ("base_dir", "source")          # set by load_config, not YAML keys


def _sections() -> dict[str, type]:
    """Top-level keys that are sections (dataclasses); lists of entries (``voices``) are in ``_lists``."""
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)
            if f.name not in INTERNAL and dataclasses.is_dataclass(hints[f.name])}


def _lists() -> dict[str, type]:
    """Top-level keys that are lists of entries: key -> the entry dataclass."""
    return {key: cls for (sec, key), cls in _SECTION_ITEM.items() if sec == ""}


def test_config_yaml_has_every_section_and_key():
    data = yaml.safe_load((ROOT / "config.yaml").read_text(encoding="utf-8"))
    sections = _sections()
    tops = {f.name for f in dataclasses.fields(Config) if f.name not in INTERNAL}
    assert tops == set(sections) | set(_lists()), "a top-level Config field is neither a section nor a list"
    assert sorted(data) == sorted(tops), "config.yaml sections differ from appliance/config.py's Config"
    for key, item_cls in _lists().items():
        assert data[key], f"config.yaml {key} shows no example entry"
        for i, it in enumerate(data[key]):
            assert set(it) == {f.name for f in dataclasses.fields(item_cls)}, f"config.yaml {key}[{i}]: keys {sorted(it)}"
    for name, cls in sections.items():
        want = {f.name for f in dataclasses.fields(cls)}
        got = set(data[name] or {})
        assert got == want, f"config.yaml section {name}: missing {sorted(want - got)}, unknown {sorted(got - want)}"
        for (sec, key), item_cls in _SECTION_ITEM.items():
            if sec != name:
                continue
            items = data[name][key]
            assert items, f"config.yaml {sec}.{key} shows no example entry"
            want_item = {f.name for f in dataclasses.fields(item_cls)}
            for i, it in enumerate(items):
                assert set(it) == want_item, f"config.yaml {sec}.{key}[{i}]: keys {sorted(it)} != {sorted(want_item)}"


def test_config_yaml_shows_the_defaults():
    cfg, default = load_config(ROOT / "config.yaml"), Config()
    diff = []
    for name in _sections():
        a, b = getattr(cfg, name), getattr(default, name)
        diff += [f"{name}.{f.name}: {getattr(a, f.name)!r} != {getattr(b, f.name)!r}"
                 for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]
    diff += [f"{key}: {getattr(cfg, key)!r} != {getattr(default, key)!r}"
             for key in _lists() if getattr(cfg, key) != getattr(default, key)]
    assert not diff, "config.yaml says these are the defaults, the code disagrees:\n" + "\n".join(diff)


def test_every_field_has_help():
    for key in _lists():
        assert Config.__dataclass_fields__[key].metadata.get("help"), f"{key} has no help text"
    for name, cls in _sections().items():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{name}.{f.name} has no help text"
    for item_cls in _SECTION_ITEM.values():
        for f in dataclasses.fields(item_cls):
            assert f.metadata.get("help"), f"{item_cls.__name__}.{f.name} has no help text"


def test_local_config_is_valid_and_stays_in_the_checkout():
    cfg = load_config(ROOT / "config.local.yaml")
    for p in (cfg.model.path, cfg.model.engine_dir, cfg.service.socket, cfg.service.spool_dir, cfg.audio.wav_dir):
        assert cfg.resolve(p).is_relative_to(ROOT), p          # nothing under /run or /var: no root needed
    assert len(str(cfg.resolve(cfg.service.socket))) < 100    # fits a UNIX socket path
