"""The effective configuration, key by key, with where each value came from (``chattts-appliance
config show``).

A value's source is ``default`` (the key is not in the file), ``default (null at <file>:<line>)``
(the file sets it to ``null`` or leaves it empty: the default applies), or ``<file>:<line>`` (the
file sets it). The file itself is named by ``--config``, the environment
(``$CHATTTS_APPLIANCE_CONFIG``) or the search of the current directory
(:func:`~appliance.config.loader.find_config`); no key is read from the environment.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, NamedTuple, Optional

from .loader import config_from_dict, load_config
from .position import key_line
from .sections import Config


class Row(NamedTuple):
    """One key of the effective configuration.

    Attributes:
        key: dotted key, e.g. ``mqtt.port`` (lists whole: ``service.channels``, ``voices``).
        value: its value as the daemon uses it (YAML-like: lists of mappings for channels and
            voices; a secret that is set is ``<hidden>``).
        source: ``default``, ``default (null at <file>:<line>)`` or ``<file>:<line>``.
        resolved: for a path key, the absolute path it means (relative paths are taken from the
            config file's directory); else None.
    """

    key: str
    value: Any
    source: str
    resolved: Optional[str] = None


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v


def _source(data: Any, parts: list[str], text: str, name: str, key: str) -> str:
    node = data
    for p in parts:
        if not isinstance(node, dict) or p not in node:
            return "default"
        node = node[p]
    line = key_line(text, key)
    where = f"{name}:{line}" if line is not None else name
    return f"default (null at {where})" if node is None else where


def effective(path: Optional[str | os.PathLike]) -> tuple[Config, list[Row]]:
    """Load and validate the config at ``path`` (None: the defaults) and list every key.

    Returns:
        (the config, one :class:`Row` per key in section order).

    Raises:
        ConfigError: the file does not validate (the same checks as a start).
    """
    import yaml

    if path is None:
        cfg, data, text, name = config_from_dict({}, "."), {}, "", ""
    else:
        cfg = load_config(path)
        text = Path(path).read_text(encoding="utf-8")
        data = yaml.safe_load(text) or {}
        name = str(Path(path).resolve())
    rows: list[Row] = []
    for sec in dataclasses.fields(Config):
        if sec.name in ("base_dir", "source"):
            continue
        value = getattr(cfg, sec.name)
        if not dataclasses.is_dataclass(value):            # voices (or its old place, wyoming.voices)
            w = data.get("wyoming") if isinstance(data, dict) else None
            parts = ["voices"] if "voices" in data or not (isinstance(w, dict) and "voices" in w) else ["wyoming", "voices"]
            rows.append(Row(sec.name, _plain(value), _source(data, parts, text, name, ".".join(parts))))
            continue
        for f in dataclasses.fields(value):
            key = f"{sec.name}.{f.name}"
            v = getattr(value, f.name)
            shown = "<hidden>" if f.metadata.get("secret") and v is not None else _plain(v)
            resolved = str(cfg.resolve(v)) if f.metadata.get("path") and isinstance(v, str) else None
            rows.append(Row(key, shown, _source(data, [sec.name, f.name], text, name, key), resolved))
    return cfg, rows


def render(rows: list[Row]) -> str:
    """``rows`` as YAML-like text, one key a line, its source in a comment::

        mqtt:
          port: 1883                # default
          host: broker.local        # /etc/chattts-appliance/config.yaml:41
    """
    import json

    out: list[str] = []
    section = None
    for r in rows:
        sec, _, leaf = r.key.partition(".")
        if leaf and sec != section:
            out.append(f"{sec}:")
            section = sec
        value = "null" if r.value is None else json.dumps(r.value, ensure_ascii=False) \
            if not isinstance(r.value, (bool, int, float)) or isinstance(r.value, bool) else str(r.value)
        if isinstance(r.value, bool):
            value = "true" if r.value else "false"
        note = r.source + (f" -> {r.resolved}" if r.resolved else "")
        out.append(f"{'  ' + leaf if leaf else r.key}: {value}  # {note}")
    return "\n".join(out)


__all__ = ["Row", "effective", "render"]
