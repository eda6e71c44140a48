"""Any locale: the daemon and the command line run in Python's UTF-8 mode whatever ``LANG`` says.

A box's image may carry any locale (``C``, ``en_US.ISO-8859-1``, none at all). Outside UTF-8 mode
Python encodes file names, arguments and standard streams in the locale's encoding: under
Latin-1 a configured ``wav_dir`` of ``/var/lib/声音`` cannot be made (``UnicodeEncodeError``),
``say 你好`` reads its UTF-8 argument as Latin-1 mojibake, and printing a reply that holds such
text fails. So:

* :func:`reexec_in_utf8_mode`: the entry points (``chattts-appliance``, ``python -m appliance``)
  run themselves again with ``PYTHONUTF8=1`` when UTF-8 mode is off (PEP 540; the systemd unit
  sets ``Environment=PYTHONUTF8=1`` so the daemon starts in it at once). The arguments cross the
  ``exec`` as the bytes they were, so nothing is lost. ``PYTHONUTF8=0`` set by the user is
  respected (no re-exec); then :func:`check_paths` turns a configured path the locale cannot
  represent into one error naming the key and the path (exit 2, which the unit does not restart).
* :func:`text_arg`: a text argument (``say TEXT``, ``normalize TEXT``) is read as UTF-8; bytes
  that are not UTF-8 (a terminal really in Latin-1) are read in the locale's own encoding
  (``locale.getencoding()``), never as lone surrogates.
"""

from __future__ import annotations

import codecs
import locale
import os
import sys
from typing import Any, Optional

from ..errors import ConfigError

ENV = "PYTHONUTF8"


def reexec_in_utf8_mode() -> None:
    """Replace this process by the same command in UTF-8 mode when it is off (module docstring);
    returns only when nothing needs doing (or the ``exec`` failed: the command goes on as it is)."""
    if sys.flags.utf8_mode or os.environ.get(ENV) == "0":
        return
    argv = list(getattr(sys, "orig_argv", []) or [])
    if not argv or not sys.executable:
        return
    os.environ[ENV] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(sys.executable, [sys.executable, *argv[1:]])
    except OSError as e:   # pragma: no cover - e.g. the interpreter is gone (an upgrade)
        print(f"chattts-appliance: cannot restart in UTF-8 mode ({e}); going on in {locale.getencoding()}",
              file=sys.stderr)


def text_arg(s: str) -> str:
    """``s`` as the text the user meant: a command-line argument decoded as UTF-8 where it is,
    else in the locale's own encoding where that is not UTF-8 (module docstring); bytes a UTF-8
    locale cannot read stay as they are (the command names the byte)."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        raw = os.fsencode(s)
    enc = locale.getencoding()
    try:
        if codecs.lookup(enc).name == "utf-8":
            return s
        return raw.decode(enc)
    except (LookupError, UnicodeDecodeError):
        return s


def _paths(obj: Any, prefix: str) -> list[tuple[str, str]]:
    """``(dotted key, value)`` of every string setting that names a file or directory."""
    import dataclasses

    out: list[tuple[str, str]] = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(v):
            out += _paths(v, key + ".")
        elif isinstance(v, str) and (f.name.endswith(("_dir", "_file", "path")) or f.name in ("socket", "root")):
            out.append((key, v))
    return out


def check_paths(cfg: Any, encoding: Optional[str] = None) -> None:
    """Every configured path can be represented in the file-system encoding (``encoding``:
    ``sys.getfilesystemencoding()``); always true in UTF-8 mode.

    Raises:
        ConfigError: one that cannot, naming the key, the path and what to do.
    """
    enc = encoding or sys.getfilesystemencoding()
    for key, value in _paths(cfg, ""):
        try:
            value.encode(enc, "surrogateescape")
        except UnicodeEncodeError:
            raise ConfigError(f"{key}: the path {value!r} cannot be represented in this locale's encoding "
                              f"({enc}); run in UTF-8 mode (PYTHONUTF8=1, as the unit sets; do not set "
                              f"PYTHONUTF8=0) or use a UTF-8 locale (LANG=C.UTF-8)") from None


__all__ = ["reexec_in_utf8_mode", "text_arg", "check_paths"]
