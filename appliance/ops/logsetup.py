"""Logging set-up for the entry point: journald with structured fields under systemd, stderr
otherwise (library modules only create their ``logging.getLogger(__name__)``).

Per-request fields go in ``extra=`` with lower-case keys, e.g.
``log.info("done", extra={"request_id": rid, "ttfb_ms": 312.5})``: the journal gets
``REQUEST_ID``, ``TTFB_MS`` (journald drops lower-case field names), stderr gets
`` [request_id=… ttfb_ms=…]`` after the message.

Logging never blocks speech: every record goes through a bounded queue
(:data:`QUEUE_RECORDS` records) to one writer thread, which alone writes to the journal or
stderr. When the sink stalls (a full stderr pipe, a journald that restarts) the queue fills and
further records are dropped and counted, never waited for; when the sink takes records again
the writer first logs how many were dropped (:class:`DroppingQueueHandler`,
:class:`_Writer`). The event loop and the worker only format a record and put it on the queue.
"""

from __future__ import annotations

import atexit
import logging
import logging.handlers
import os
import queue
import sys
import threading
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


#: records the queue holds while the sink is stalled; more are dropped and counted.
QUEUE_RECORDS = 2000
#: seconds the writer gets at exit to write what is queued (a stalled sink is not waited for longer).
DRAIN_S = 2.0


class DroppingQueueHandler(logging.handlers.QueueHandler):
    """A :class:`~logging.handlers.QueueHandler` that never waits: a record that finds the
    bounded queue full is dropped and counted (:attr:`dropped`, read and reset by the writer)."""

    def __init__(self, q: "queue.Queue[logging.LogRecord]") -> None:
        super().__init__(q)
        self._count_lock = threading.Lock()
        self.dropped = 0

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            with self._count_lock:
                self.dropped += 1

    def take_dropped(self) -> int:
        """The records dropped since the last call (and resets the count)."""
        with self._count_lock:
            n, self.dropped = self.dropped, 0
        return n


class _Writer(logging.handlers.QueueListener):
    """The one thread that writes records to the sink; before a record it logs how many were
    dropped while the sink stalled (a WARNING from this module's logger)."""

    def __init__(self, q: "queue.Queue[logging.LogRecord]", front: DroppingQueueHandler,
                 sink: logging.Handler) -> None:
        super().__init__(q, sink, respect_handler_level=False)
        self.front = front

    def handle(self, record: logging.LogRecord) -> None:
        n = self.front.take_dropped()
        if n:
            note = logging.LogRecord(log.name, logging.WARNING, __file__, 0,
                                     "%d log records dropped while the log sink stalled", (n,), None)
            note.dropped_records = n
            super().handle(note)
        super().handle(record)

    def start(self) -> None:
        """Starts the writer as a daemon thread (interpreter exit never waits on a stalled sink)."""
        self._thread = threading.Thread(target=self._monitor, name="log-writer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = DRAIN_S) -> None:
        """Writes what is queued, waiting at most ``timeout`` s (a stalled sink is left behind:
        the thread is a daemon thread)."""
        if self._thread is None:
            return
        try:
            self.queue.put(self._sentinel, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if self._thread.is_alive():     # stuck in a write: logging.shutdown must not wait on its lock
            for h in self.handlers:
                h.createLock()
        self._thread = None


class _FdStream:
    """What the stderr handler writes to: ``os.write`` on a duplicate of stderr's descriptor, so
    a write that blocks on a full pipe holds no lock of ``sys.stderr`` (a ``print`` or the exit's
    flush never waits behind it) and there is no buffer to flush."""

    def __init__(self, fd: int) -> None:
        self.fd = os.dup(fd)

    def write(self, text: str) -> None:
        data = text.encode("utf-8", "replace")
        while data:
            data = data[os.write(self.fd, data):]

    def flush(self) -> None:
        pass

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def _stderr_stream():
    """:class:`_FdStream` on stderr's descriptor, or ``sys.stderr`` itself when it has none (a
    test's captured stream)."""
    try:
        return _FdStream(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):   # io.UnsupportedOperation is an OSError
        return sys.stderr


_writer: Optional[_Writer] = None


def stop() -> None:
    """Write what is queued (waiting at most :data:`DRAIN_S`) and close the sink (at exit; a
    second :func:`setup_logging`)."""
    global _writer
    w, _writer = _writer, None
    if w is None:
        return
    w.stop()
    for h in w.handlers:
        h.close()
        if isinstance(getattr(h, "stream", None), _FdStream):
            h.stream.close()


atexit.register(stop)


def flush(timeout: float = DRAIN_S) -> bool:
    """Waits up to ``timeout`` s until the writer has written every queued record (tests, and a
    command about to print its result after log lines); False if it has not."""
    w = _writer
    if w is None:
        return True
    q = w.queue
    with q.all_tasks_done:
        return q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout)


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

    Without ``verbose`` the :data:`QUIET_LOGGERS` show errors only. The handler is written to
    by one thread fed through a bounded queue (module docstring): a stalled sink drops records
    (counted, the count logged when it returns) instead of blocking the caller.

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
    global _writer
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    stop()
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
        handler = logging.StreamHandler(_stderr_stream())
        handler.setFormatter(_PriorityPrefixFormatter("%(name)s: %(message)s"))
        mode = "stderr-journal"
    else:
        handler = logging.StreamHandler(_stderr_stream())
        handler.setFormatter(_FieldsFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        mode = "stderr"
    handler.addFilter(_UpperFieldsFilter())
    q: "queue.Queue[logging.LogRecord]" = queue.Queue(QUEUE_RECORDS)
    front = DroppingQueueHandler(q)
    _writer = _Writer(q, front, handler)
    _writer.start()
    root.addHandler(front)
    log.debug("logging to %s", mode)
    return mode
