"""Reading and validating ``config.yaml`` into :class:`~appliance.config.sections.Config`.

Every value is checked (type, choices, bounds, text that must not be blank, ports, hosts,
voices, cross-section rules) *before* anything heavy (torch, engines, audio) is loaded, by the
same code at start and on SIGHUP; an unknown key or a bad value raises
:class:`~appliance.errors.ConfigError` naming the dotted key and what it expects in words, e.g.
``wyoming.uris: 'tcp://0.0.0.0:70000': the port must be an integer between 1 and 65535`` or
``mqtt.keepalive_s: expected an integer between 5 and 3600, got 'x'``. ``null`` (or an empty
value) for a key means its default, wherever it has one.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Optional

from ..errors import ConfigError
from .sections import ChannelConfig, Config, Lookahead, MQTTConfig, VoiceConfig, WyomingConfig

# --------------------------------------------------------------------------------------------
# building and validation
# --------------------------------------------------------------------------------------------

_SECTION_ITEM = {("service", "channels"): ChannelConfig, ("", "voices"): VoiceConfig}
"""(section, key) -> the dataclass of each entry of that list ("" = a top-level key)."""

_VOICE_NAME = re.compile(r"[\w.-]{1,64}")
"""A voice name: 1-64 letters (any script: ``温柔``, ``Zoë``), digits, '-', '_', '.' (never a voice
string: those hold ':' (``seed:N``), or are hundreds of characters of base16384 text; a request's
voice is looked up as a name first)."""


def _type_ok(value: Any, tp: Any) -> tuple[bool, Any]:
    """Check ``value`` against annotation ``tp``; return (ok, coerced value)."""
    origin = typing.get_origin(tp)
    if tp == Lookahead:                 # auto | exact | steps (a string of digits: steps)
        if isinstance(value, str) and value.isdigit():
            return True, int(value)
        return isinstance(value, (str, int)) and not isinstance(value, bool), value     # checked in _check
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return True, None
        for a in args:
            if a is type(None):
                continue
            ok, v = _type_ok(value, a)
            if ok:
                return True, v
        return False, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:     # finite: a NaN passes every bound
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return True, float(value)
        return False, value
    if tp is str:
        if isinstance(value, int) and not isinstance(value, bool):   # e.g. stream.lookahead: 16
            return True, str(value)
        return isinstance(value, str), value
    if tp is tuple:     # a YAML list
        return isinstance(value, (list, tuple)), tuple(value) if isinstance(value, list) else value
    return True, value


def _num(x: Any) -> str:
    """A bound in words: ``65535``, ``0.5``, ``1073741824`` (never ``1073741824.0``)."""
    return str(int(x)) if isinstance(x, float) and x.is_integer() and abs(x) < 1e18 else str(x)


def expected(tp: Any, md: Any = None) -> str:
    """What a field of annotation ``tp`` (and checks ``md``, its metadata) takes, in words:
    ``an integer between 1 and 65535``, ``a number of at least 0``, ``true or false``, ``one of
    auto, cpu, cuda``, ``text (not blank), or null``."""
    md = md or {}
    if tp == Lookahead:
        return "auto, exact or a number of decode steps between 1 and 256"
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        words = " or ".join(expected(a, md) for a in args)
        return f"{words}, or null" if len(args) < len(typing.get_args(tp)) else words
    if "choices" in md:
        return "one of " + ", ".join(map(str, md["choices"]))
    if tp is bool:
        return "true or false"
    if tp in (int, float):
        noun = "an integer" if tp is int else "a number"
        lo, hi = md.get("min"), md.get("max")
        if lo is not None and hi is not None:
            return f"{noun} between {_num(lo)} and {_num(hi)}"
        if lo is not None:
            return f"{noun} of at least {_num(lo)}"
        return f"{noun} of at most {_num(hi)}" if hi is not None else noun
    if tp is str:
        return ("a path" if md.get("path") else "a host name or address" if md.get("host")
                else "text (not blank)" if md.get("nonempty") else "text")
    if tp is tuple:
        return "a list"
    return getattr(tp, "__name__", str(tp))


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    internal = ("base_dir", "source") if cls is Config else ()   # set by load_config, not YAML keys
    voices_key = "voices"
    if cls is Config:
        data, voices_key = _voices_alias(data)
    known = {f.name: f for f in dataclasses.fields(cls) if f.name not in internal}
    unknown = sorted(set(data) - set(known))
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ConfigError(f"unknown config key '{key}' (known here: {', '.join(sorted(known))})")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        f = known[name]
        key = f"{where}.{name}" if where else (voices_key if name == "voices" else name)
        tp = hints[name]
        if value is None:           # null (or `key:` with nothing after it): the default
            continue
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value if value is not None else {}, key)
            continue
        item_cls = _SECTION_ITEM.get((where, name))
        if item_cls is not None:
            if not isinstance(value, list) or not value:
                raise ConfigError(f"{key}: expected a non-empty list")
            kwargs[name] = tuple(_build(item_cls, v, f"{key}[{i}]") for i, v in enumerate(value))
            if item_cls is VoiceConfig:
                _check_voice_names(kwargs[name], key)
            continue
        ok, v = _type_ok(value, tp)
        if not ok and value is False and "off" in f.metadata.get("choices", ()):
            ok, v = True, "off"  # YAML 1.1 reads a bare `off` as false
        if not ok:
            shown = "a value of another type (not shown: secret)" if f.metadata.get("secret") else repr(value)
            raise ConfigError(f"{key}: expected {expected(tp, f.metadata)}, got {shown}{_hint(f)}")
        kwargs[name] = v
    obj = cls(**kwargs)
    _check(obj, where)
    return obj


def _voices_alias(data: dict) -> tuple[dict, str]:
    """Move ``wyoming.voices`` (the old place of the voice table) to top-level ``voices``;
    returns the data and the key to name in messages.

    Raises:
        ConfigError: both are set.
    """
    w = data.get("wyoming")
    if not isinstance(w, dict) or "voices" not in w:
        return data, "voices"
    if "voices" in data:
        raise ConfigError("voices and wyoming.voices are both set: keep only voices (wyoming.voices is its old "
                          "name; the names now work on every transport)")
    w = {k: v for k, v in w.items() if k != "voices"}
    return {**data, "wyoming": w, "voices": data["wyoming"]["voices"]}, "wyoming.voices"


def _check_voice_names(voices: tuple, key: str) -> None:
    names = [v.name for v in voices]
    if len(set(names)) < len(names) or not all(isinstance(n, str) and _VOICE_NAME.fullmatch(n) for n in names):
        raise ConfigError(f"{key}: {names} must be 1 or more unique names of 1-64 letters, digits, '-', '_', '.'")


def _check_topic_part(key: str, value: Optional[str], slash_ok: bool) -> None:
    """An MQTT topic level (or levels, with ``slash_ok``) taken from config: refuse what breaks
    subscriptions or reaches other devices' topics."""
    if value is None:
        return
    bad = [c for c in ("+", "#", "\0") if c in value] + ([] if slash_ok else ["/"] if "/" in value else [])
    if not value.strip("/").strip():
        raise ConfigError(f"{key}: {value!r} is empty; MQTT topics need a name here")
    if bad:
        shown = ", ".join("NUL" if c == "\0" else repr(c) for c in bad)
        why = "'+' and '#' are MQTT wildcards (the box would subscribe to other boxes' topics)" if {"+", "#"} & set(bad) \
            else "NUL is not allowed in MQTT topics" if "\0" in bad else "a device id is one topic level"
        raise ConfigError(f"{key}: {value!r} holds {shown}: {why}; use letters, digits, '-', '_'")


def _check_mqtt(m: MQTTConfig) -> None:
    """Topic parts of the ``mqtt`` section (checked even while disabled)."""
    _check_topic_part("mqtt.topic_prefix", m.topic_prefix, slash_ok=True)
    _check_topic_part("mqtt.device_id", m.device_id, slash_ok=False)
    _check_topic_part("mqtt.discovery_prefix", m.discovery_prefix, slash_ok=True)
    if m.configuration_url is not None and not re.match(r"(https?|homeassistant)://\S+$", m.configuration_url):
        raise ConfigError(f"mqtt.configuration_url: {m.configuration_url!r} is not an http://, https:// or "
                          f"homeassistant:// URL (Home Assistant refuses the device otherwise)")


def _hint(f: dataclasses.Field) -> str:
    return f" ({f.metadata['hint']})" if "hint" in f.metadata else ""


def _check(obj: Any, where: str) -> None:
    """Apply the ``choices`` / ``min`` / ``max`` metadata of every field of ``obj``."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        key = f"{where}.{f.name}" if where else f.name
        md = f.metadata
        if v is None:
            continue
        if "choices" in md and v not in md["choices"]:
            raise ConfigError(f"{key}: {v!r} is not one of {', '.join(map(str, md['choices']))}")
        if isinstance(v, str):
            _check_text(key, v, md)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if ("min" in md and v < md["min"]) or ("max" in md and v > md["max"]):
                raise ConfigError(f"{key}: expected {expected(type(v), md)}, got {v}{_hint(f)}")


_HOST_BAD = re.compile(r"[\s/]")


def _check_text(key: str, v: str, md: Any) -> None:
    """The ``nonempty`` / ``path`` / ``host`` checks of one text value."""
    if (md.get("nonempty") or md.get("path") or md.get("host")) and not v.strip():
        raise ConfigError(f"{key}: {v!r} is blank: expected {expected(str, md)}")
    if md.get("path") and "\0" in v:
        raise ConfigError(f"{key}: {v!r} holds a NUL character: expected a path")
    if md.get("host") and _HOST_BAD.search(v):
        raise ConfigError(f"{key}: {v!r} holds a space or '/': expected a host name or address (e.g. "
                          f"broker.local or 192.168.1.10), without a scheme or path")


_SEED = re.compile(r"seed:(\d{1,19})")


def check_voice(key: str, v: str) -> None:
    """A voice string from config (``synthesis.voice``, ``voices[i].voice``): ``seed:N``
    (0 <= N < 2**63), ``none``, or an upstream speaker string (base16384 text: never ASCII; it is
    decoded against the model at start and on SIGHUP, :class:`~appliance.text.voices.VoiceBook`).

    Raises:
        ConfigError: blank, a malformed ``seed:``, or other ASCII text (e.g. a voice name).
    """
    t = v.strip()
    low = t.lower().replace(" ", "")
    if not t:
        raise ConfigError(f"{key}: {v!r} is blank: expected 'seed:N', 'none' or an upstream speaker string")
    if low == "none" or not t.isascii():
        return
    m = _SEED.fullmatch(low)
    if m is None or int(m.group(1)) >= 2**63:
        what = "a voice name: name it in a request, or use that voice's string here" if _VOICE_NAME.fullmatch(t) else "not a voice"
        raise ConfigError(f"{key}: {v!r} is {what}: expected 'seed:N' (N an integer between 0 and "
                          f"{2**63 - 1}), 'none' or an upstream speaker string")


def _cross_check(cfg: Config) -> None:
    names = [c.name for c in cfg.service.channels]
    if len(set(names)) != len(names):
        raise ConfigError(f"service.channels: channel names must be unique, got {names}")
    if len(names) > cfg.model.max_batch:
        raise ConfigError(
            f"service.channels: {len(names)} channels need model.max_batch >= {len(names)} "
            f"(it is {cfg.model.max_batch})"
        )
    if cfg.model.max_prompt_tokens + 16 >= cfg.model.max_seq_len:
        raise ConfigError(
            f"model.max_prompt_tokens ({cfg.model.max_prompt_tokens}) must leave room for decode "
            f"steps in model.max_seq_len ({cfg.model.max_seq_len})"
        )
    if cfg.stream.first_chunk_tokens > cfg.stream.chunk_tokens:
        raise ConfigError("stream.first_chunk_tokens must not exceed stream.chunk_tokens")
    la = cfg.stream.lookahead
    if la not in ("auto", "exact") if isinstance(la, str) else not 1 <= la <= 256:
        raise ConfigError(f"stream.lookahead {la!r}: use auto, exact or a number of decode steps (1..256)")
    _check_wyoming(cfg.wyoming, names)
    _check_mqtt(cfg.mqtt)
    check_voice("synthesis.voice", cfg.synthesis.voice)
    key = "voices"
    for i, v in enumerate(cfg.voices):
        if v.voice is not None:
            check_voice(f"{key}[{i}].voice", v.voice)


def _check_wyoming(w: WyomingConfig, channels: list[str]) -> None:
    """URIs and channel of the ``wyoming`` section (checked even while disabled)."""
    for u in w.uris or [""]:
        m = re.fullmatch(r"tcp://(?P<host>[^/]*):(?P<port>\d{1,9})/?|unix://(?P<path>.+)", u) if isinstance(u, str) else None
        if m is None:
            raise ConfigError(f"wyoming.uris: {u!r} is not tcp://HOST:PORT (e.g. tcp://0.0.0.0:10200) or unix://PATH")
        if m["port"] is not None and not 1 <= int(m["port"]) <= 65535:
            raise ConfigError(f"wyoming.uris: {u!r}: the port must be an integer between 1 and 65535")
        if m["port"] is not None and not m["host"].strip("[] "):
            raise ConfigError(f"wyoming.uris: {u!r}: the host is blank: expected a host name or address "
                              f"(0.0.0.0: every IPv4 address; [::]: every address)")
        if m["path"] is not None and "\0" in m["path"]:
            raise ConfigError(f"wyoming.uris: {u!r} holds a NUL character: expected a path")
    if w.channel is not None and w.channel not in channels:
        raise ConfigError(f"wyoming.channel: {w.channel!r} is not a configured channel ({', '.join(channels)})")


def config_from_dict(data: dict, base_dir: str | os.PathLike = ".") -> Config:
    """Build and validate a :class:`Config` from a parsed mapping.

    Raises:
        ConfigError: unknown key, wrong type, value out of range, inconsistent sections.
    """
    cfg = _build(Config, data or {}, "")
    cfg = dataclasses.replace(cfg, base_dir=str(Path(base_dir).resolve()))
    _cross_check(cfg)
    return cfg


CONFIG_ENV = "CHATTTS_APPLIANCE_CONFIG"
CONFIG_SEARCH = ("config.local.yaml", "config.yaml")


def find_config(explicit: str | os.PathLike | None = None, required: bool = False) -> Optional[Path]:
    """The config file every command uses: ``explicit`` (``--config``), else ``$CHATTTS_APPLIANCE_CONFIG``
    (both returned even if missing, so reading fails naming them), else the first of
    :data:`CONFIG_SEARCH` in the current directory; None when there is none.

    Raises:
        ConfigError: ``required`` and none was found (the message lists the search order and
            says to pass ``--config PATH``).
    """
    named = explicit or os.environ.get(CONFIG_ENV)
    found = Path(named) if named else next((Path(n) for n in CONFIG_SEARCH if Path(n).is_file()), None)
    if found is None and required:
        looked = ", ".join(f"./{n}" for n in CONFIG_SEARCH)
        raise ConfigError(f"no config file found; looked for --config (not given), then ${CONFIG_ENV} (not set), "
                          f"then {looked} in {Path.cwd()}: pass --config PATH (config.yaml in the source tree "
                          f"documents every key)")
    return found


def load_config(path: str | os.PathLike | None) -> Config:
    """Read ``config.yaml`` (or return defaults for ``None``) and validate it.

    Relative paths inside the file are resolved against the file's directory.

    Raises:
        ConfigError: the file is missing, not YAML, or fails validation (message names the key).
    """
    if path is None:
        return config_from_dict({}, ".")
    import yaml

    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {e}") from e
    if data is None:
        data = {}
    return dataclasses.replace(config_from_dict(data, p.parent), source=str(p.resolve()))


def replace(cfg: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` that re-runs the field checks (for tests and overrides)."""
    new = dataclasses.replace(cfg, **changes)
    _check(new, "")
    return new
