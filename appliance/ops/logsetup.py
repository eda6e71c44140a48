"""Logging set-up for the entry point: journald with structured fields under systemd, stderr
otherwise (library modules only create their ``logging.getLogger(__name__)``).

Per-request fields go in ``extra=`` with lower-case keys, e.g.
``log.info("done", extra={"request_id": rid, "ttfb_ms": 312.5})``: the journal gets
``REQUEST_ID``, ``TTFB_MS`` (journald drops lower-case field names), stderr gets
`` [request_id=… ttfb_ms=…]`` after the message.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Callable, Optional

log = logging.getLogger(__name__)

try:  # pragma: no cover - depends on the machine
    from systemd import journal as _sd_journal
except ImportError:  # pragma: no cover
    _sd_journal = None

#: Third-party loggers that report their own internals at INFO/WARNING (the ONNX exporter prints
#: dozens of "Skipping constant folding ..." and "torchvision is not installed" lines that look like
#: failures); without ``--verbose`` only their errors are shown.
QUIET_LOGGERS = ("onnxscript", "onnx_ir", "torch.onnx", "torch._dynamo", "torch.export")

#: Libraries whose DEBUG records are a trace of their own internals (markdown-it logs every rule
#: it tries on every line: 90 % of a ``-v`` log); INFO and above even with ``--verbose``.
TRACE_LOGGERS = ("markdown_it",)

#: attributes every LogRecord has; anything else on a record came from ``extra=``.
_STD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class _UpperFieldsFilter(logging.Filter):
    """Gives every ``extra=`` field of a record an upper-case alias (``request_id`` ->
    ``REQUEST_ID``), so they reach the journal (which drops lower-case field names) and the
    stderr suffix."""

    def filter(self, record: logging.LogRecord) -> bool:
        for k in [k for k in record.__dict__ if k not in _STD_ATTRS and not k.isupper()]:
            up = k.upper()
            if up.replace("_", "").isalnum() and up not in record.__dict__:
                record.__dict__[up] = record.__dict__[k]
        return True


class _FieldsFormatter(logging.Formatter):
    """Appends the ``extra=`` fields as ``key=value`` to the message (floats to 4 significant
    digits: ``rtf=0.266``, not ``rtf=0.2659693373526134``; the journal keeps them whole)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extra = {k: v for k, v in record.__dict__.items() if k not in _STD_ATTRS and k.isupper()}
        if extra:
            text += " [" + " ".join(f"{k.lower()}={v:.4g}" if isinstance(v, float) else f"{k.lower()}={v}"
                                    for k, v in extra.items()) + "]"
        return text


class _PriorityPrefixFormatter(_FieldsFormatter):
    """stderr under systemd without systemd-python: ``<N>`` syslog priority prefixes, which
    journald's stream reader turns into PRIORITY= (sd-daemon(3))."""

    _PRI = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}

    def format(self, record: logging.LogRecord) -> str:
        pri = self._PRI.get(record.levelno, 6 if record.levelno > logging.DEBUG else 7)
        return f"<{pri}>" + super().format(record)


def under_systemd(environ: Optional[dict] = None) -> bool:
    """True when started by systemd with output to the journal (``$JOURNAL_STREAM`` or
    ``$INVOCATION_ID`` set)."""
    env = os.environ if environ is None else environ
    return bool(env.get("JOURNAL_STREAM") or env.get("INVOCATION_ID"))


def _quiet_third_party() -> None:
    """Errors only from :data:`QUIET_LOGGERS` and no Python warnings from inside torch: the
    exporter's internals are not the user's problem (``--verbose`` shows them). torch resets its
    own loggers when it is imported, so they are set through ``$TORCH_LOGS`` (``-onnx``: errors
    only) unless torch is already loaded or the user set ``$TORCH_LOGS``."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    if "torch" not in sys.modules:
        os.environ.setdefault("TORCH_LOGS", "-onnx,-export")
    warnings.filterwarnings("ignore", module=r"torch(\.|$)")
    warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")   # torch's pytree, via copyreg


def setup_logging(verbose: bool = False, identifier: str = "chattts-appliance",
                  environ: Optional[dict] = None, journal_sender: Optional[Callable] = None,
                  quiet: bool = False) -> str:
    """Configure the root logger once, at the entry point (library code never does).

    Under systemd: a ``systemd.journal.JournalHandler`` (fields ``SYSLOG_IDENTIFIER``,
    ``LOGGER``, ``THREAD_NAME``, ``CODE_*`` and every ``extra=`` field, upper-cased) when
    systemd-python is importable; otherwise stderr lines with ``<N>`` priority prefixes and the
    fields appended as text. Outside systemd: stderr with timestamps and the fields appended.

    Without ``verbose`` the :data:`QUIET_LOGGERS` show errors only.

    Args:
        verbose: DEBUG instead of INFO (and every third-party logger at its own level).
        quiet: WARNING instead of INFO when not ``verbose`` (commands whose output is their
            result, e.g. ``normalize``: no INFO lines around it).
        identifier: ``SYSLOG_IDENTIFIER`` in the journal.
        environ: environment to decide from (default ``os.environ``).
        journal_sender: replaces ``systemd.journal.send`` (tests).

    Returns:
        ``"journal"``, ``"stderr-journal"`` or ``"stderr"``: which setup was chosen.
    """
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    root.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
    if not verbose:
        _quiet_third_party()
    for name in TRACE_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    if under_systemd(environ) and _sd_journal is not None:
        kw = {"SYSLOG_IDENTIFIER": identifier}
        if journal_sender is not None:
            kw["sender_function"] = journal_sender
        handler: logging.Handler = _sd_journal.JournalHandler(**kw)
        handler.setFormatter(logging.Formatter("%(message)s"))
        mode = "journal"
    elif under_systemd(environ):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_PriorityPrefixFormatter("%(name)s: %(message)s"))
        mode = "stderr-journal"
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_FieldsFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        mode = "stderr"
    handler.addFilter(_UpperFieldsFilter())
    root.addHandler(handler)
    log.debug("logging to %s", mode)
    return mode
