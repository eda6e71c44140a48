"""Where in ``config.yaml`` a :class:`~appliance.errors.ConfigError` points: ``<file>:<line>: <reason>``.

A reload that fails (SIGHUP with a file that no longer validates) is reported by ``health``,
``status`` and the MQTT health sensor in this one line until a good reload, so the person who
edited the file is sent to the line. The line comes from the error itself: a YAML syntax error
carries it (PyYAML's ``line N, column M``); a validation error names the dotted key
(``service.channels[1].volume_db``, ``unknown config key 'synthesis.foo'``), which is looked up in
the file's node tree (``yaml.compose``: every node keeps its start line). A key the file does not
hold (a default that a cross-section rule refused) points at its deepest ancestor that it does
hold; nothing found: ``<file>: <reason>``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

_YAML_LINE = re.compile(r"line (\d+), column \d+")
_KEY = re.compile(r"^(?:unknown config key ')?([a-z_]\w*(?:\[\d+\])?(?:\.\w+(?:\[\d+\])?)*)")
_PART = re.compile(r"(\w+)|\[(\d+)\]")


def key_line(text: str, key: str) -> Optional[int]:
    """1-based line of dotted ``key`` (``voices[2].name``) in YAML ``text``, or of its deepest
    ancestor present; None when not even its section is there or the text does not parse."""
    import yaml

    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for name, index in _PART.findall(key):
        if isinstance(node, yaml.MappingNode) and name:
            hit = next(((k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == name), None)
            if hit is None:
                break
            line, node = hit[0].start_mark.line + 1, hit[1]
        elif isinstance(node, yaml.SequenceNode) and index and int(index) < len(node.value):
            node = node.value[int(index)]
            line = node.start_mark.line + 1
        else:
            break
    return line


def located(path: str, message: str) -> str:
    """``<file>:<line>: <reason>`` for a config error ``message`` about the file at ``path``
    (``<file>: <reason>`` without a line); the reason on one line."""
    reason = " ".join(message.split())
    if " is not valid YAML: " in reason:       # PyYAML's text: drop the file again and its mark
        reason = "not valid YAML: " + reason.split(" is not valid YAML: ", 1)[1].split(' in "<', 1)[0]
    m = _YAML_LINE.search(message)
    line: Optional[int] = int(m.group(1)) if m else None
    if line is None:
        k = _KEY.match(message)
        if k is not None:
            try:
                line = key_line(Path(path).read_text(encoding="utf-8"), k.group(1))
            except (OSError, UnicodeDecodeError):
                line = None
    return f"{path}:{line}: {reason}" if line is not None else f"{path}: {reason}"


__all__ = ["key_line", "located"]
