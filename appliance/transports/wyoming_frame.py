"""Wyoming events off the wire with limits, checked before anything acts on them.

The wire format (``wyoming`` 1.x, ``wyoming/event.py``): one JSON header line
``{"type": T, "data": {...}, "data_length": N, "payload_length": M, "version": V}`` (every key but
``type`` optional), then ``N`` bytes of UTF-8 JSON merged into ``data``, then ``M`` bytes of binary
payload. The library's own reader (``async_read_event``) reads whatever lengths a header announces
(one header announcing 300,000,000 bytes made the daemon allocate them), and a malformed line or
length ends the connection without a word. Here instead:

* :func:`read_event` reads the header line up to ``max_header`` bytes (``service.max_line_bytes``)
  and checks both lengths against ``max_payload`` (``wyoming.max_payload_bytes``) BEFORE reading a
  byte of them. A header that is too long, a length that is not a whole number of bytes, or
  lengths over the limit raise a *fatal* :class:`FrameError`: the event's end is unknown (or not
  worth reading), the connection is closed after the error is sent. Everything else that is wrong
  with an event whose bytes could be read (a header that is not a JSON object, invalid UTF-8, a
  data part that is not an object) raises a non-fatal one: the next event can still be read.
* :func:`check_event` checks the type and the fields of every event a TTS server acts on
  (``describe``, ``ping``, ``synthesize``, ``synthesize-start`` / ``-chunk`` / ``-stop``,
  ``select-program``) and returns the event with only the checked fields, so the ``wyoming``
  event classes' ``from_event`` cannot fail on it. Unknown fields are ignored (newer clients add
  some). A type that is well formed but unknown passes unchanged: the protocol asks servers to
  drop events they do not know (``wyoming.info.SelectProgram``'s documentation).
* :class:`CheckedHandler` is the ``AsyncEventHandler`` that reads with :func:`read_event`, hands
  non-fatal errors to its subclass (:meth:`CheckedHandler.refuse`), and closes the connection
  after a fatal one with the error as its last event.

Every message is plain words that name the field, the value's kind and the limit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, Optional

from wyoming.error import Error
from wyoming.event import Event as WyEvent
from wyoming.server import AsyncEventHandler

from ..errors import ApplianceError, RequestError

log = logging.getLogger(__name__)

TYPE_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}\Z")
"""A well-formed event type: lower-case letters, digits, ``-``, ``_``, ``.``, at most 64 characters."""
MAX_NAME_CHARS = 1024
"""Longest voice name, language or speaker accepted, characters."""
LINGER_BYTES, LINGER_S = 1 << 20, 2.0
"""After a fatal error: at most this many bytes the client still sends are read and dropped, for
at most this many seconds, while it takes the error (closing a socket with unread bytes resets
the connection, and the error would be lost)."""


class FrameError(RequestError):
    """A client event that cannot be used (``code`` ``bad_request``).

    Attributes:
        fatal: the connection must close: the event's end is unknown, or a limit was hit.
    """

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


# ---------------------------------------------------------------------------- framing


async def _read_line(reader: asyncio.StreamReader, limit: int) -> Optional[bytes]:
    """One header line (with its ``\\n``), at most ``limit`` bytes before the newline; None at EOF.

    Raises:
        FrameError: (fatal) the line is longer than ``limit``.
    """
    buf = bytearray()
    while True:
        try:
            chunk = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError:
            return None                                  # EOF (inside a line: the client left)
        except asyncio.LimitOverrunError as e:           # the reader's own buffer limit: go on
            if len(buf) + e.consumed > limit:
                break
            buf += await reader.readexactly(e.consumed)
            continue
        if len(buf) + len(chunk) - 1 > limit:
            break
        return bytes(buf + chunk)
    raise FrameError(f"an event header line is longer than {limit} bytes (service.max_line_bytes); "
                     "closing the connection", fatal=True)


def _json_object(raw: bytes, what: str) -> dict:
    """``raw`` (UTF-8 JSON) as a dict.

    Raises:
        FrameError: (not fatal) not UTF-8, not JSON, nested too deeply, or not an object.
    """
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise FrameError(f"{what} is not valid UTF-8 (byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise FrameError(f"{what} is not valid JSON ({e.msg} at character {e.pos})") from e
    except ValueError as e:                              # e.g. an integer of 5,000 digits
        raise FrameError(f"{what} holds a number too long to read") from e
    except RecursionError as e:
        raise FrameError(f"{what} is nested too deeply") from e
    if not isinstance(obj, dict):
        raise FrameError(f"{what} must be a JSON object, not {_kind(obj)}")
    return obj


def _length(header: dict, key: str) -> int:
    v = header.get(key)
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise FrameError(f"'{key}' must be a whole number of bytes, not {_kind(v)}; the event's end is unknown, "
                         "closing the connection", fatal=True)
    return v


async def read_event(reader: asyncio.StreamReader, max_header: int, max_payload: int) -> Optional[WyEvent]:
    """Read one event (module docstring); blank lines between events are skipped.

    Args:
        reader: the connection. max_header: longest header line, bytes. max_payload: most bytes of
            data part + payload together.

    Returns:
        The event (``type`` as sent, unchecked; ``data`` a dict; ``payload`` bytes or None), or
        None at EOF (also inside an event: the client is gone).

    Raises:
        FrameError: fatal (header too long; a length that is not a whole number; lengths over
            ``max_payload``: nothing of them is read) or not (the header is not a JSON object or not
            UTF-8; ``data`` or the data part is not an object: its bytes have been consumed).
    """
    while True:
        line = await _read_line(reader, max_header)
        if line is None:
            return None
        if line.strip():
            break
    header = _json_object(line, "the event header")
    n_data, n_payload = _length(header, "data_length"), _length(header, "payload_length")
    if n_data + n_payload > max_payload:
        raise FrameError(f"an event of {n_data + n_payload} bytes (data {n_data} + payload {n_payload}) is over "
                         f"the limit of {max_payload} bytes (wyoming.max_payload_bytes); closing the connection",
                         fatal=True)
    try:
        data_part = await reader.readexactly(n_data) if n_data else b""
        payload = await reader.readexactly(n_payload) if n_payload else None
    except asyncio.IncompleteReadError:
        return None
    data = header.get("data")
    if data is None:
        data = {}
    elif not isinstance(data, dict):
        raise FrameError(f"the event's 'data' must be a JSON object, not {_kind(data)}")
    if data_part:
        data = {**data, **_json_object(data_part, "the event's data part")}
    return WyEvent(type=header.get("type"), data=data, payload=payload)


# ---------------------------------------------------------------------------- checks


def _kind(v: Any) -> str:
    """What a JSON value is, in words (for messages; never the value itself when it is long)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"{str(v).lower()} (true/false)"
    if isinstance(v, (int, float)):
        return f"the number {v}" if len(repr(v)) <= 24 else "a number"
    if isinstance(v, str):
        return f"the text {v!r}" if len(v) <= 24 else f"a text of {len(v)} characters"
    return "a list" if isinstance(v, list) else "an object" if isinstance(v, dict) else type(v).__name__


def _text(v: Any, where: str, required: bool = False, max_chars: Optional[int] = None) -> Optional[str]:
    if v is None and not required:
        return None
    if not isinstance(v, str):
        raise FrameError(f"{where} must be a text, not {_kind(v)}")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:                      # JSON "\ud800": a lone surrogate is not text
        raise FrameError(f"{where} is not valid text: a lone UTF-16 surrogate at character {e.start}") from e
    if max_chars is not None and len(v) > max_chars:
        raise FrameError(f"{where} is longer than {max_chars} characters")
    return v


def _voice(v: Any, kind: str) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise FrameError(f"{kind}'s 'voice' must be an object like {{\"name\": \"default\"}}, not {_kind(v)}")
    return {k: _text(v[k], f"{kind}'s voice {k}", max_chars=MAX_NAME_CHARS)
            for k in ("name", "language", "speaker") if k in v}


def _format(data: dict, kind: str) -> dict:
    f = data.get("text_format")
    if f is None or f == "text":
        return {}
    if f == "ssml":
        return {"text_format": "ssml"}      # read by the markup stage (appliance.text.markup), tags never spoken
    raise FrameError(f"{kind}'s 'text_format' must be 'text' or 'ssml', not {_kind(f)}")


def _synthesize(d: dict, kind: str, text: bool) -> dict:
    out = {"text": _text(d.get("text"), f"{kind}'s 'text'", required=True)} if text else {}
    return {**out, "voice": _voice(d.get("voice"), kind), **_format(d, kind)}


_CHECKS = {
    "describe": lambda d: {},
    "ping": lambda d: {"text": _text(d.get("text"), "ping's 'text'", max_chars=MAX_NAME_CHARS)},
    "synthesize": lambda d: _synthesize(d, "synthesize", text=True),
    "synthesize-start": lambda d: _synthesize(d, "synthesize-start", text=False),
    "synthesize-chunk": lambda d: {"text": _text(d.get("text"), "synthesize-chunk's 'text'", required=True)},
    "synthesize-stop": lambda d: {},
    "select-program": lambda d: {"name": _text(d.get("name"), "select-program's 'name'", required=True,
                                               max_chars=MAX_NAME_CHARS)},
}
"""Event type -> its checked data (only the fields the server reads)."""


def check_event(event: WyEvent) -> WyEvent:
    """``event`` with its type and fields checked (module docstring).

    Returns:
        A new event: for the types in ``_CHECKS`` only their checked fields (None fields dropped
        from ``voice``), else the event as it came.

    Raises:
        FrameError: (not fatal) the type is missing or malformed, or a field has the wrong kind of
            value (a number for a text, a voice that is not an object, a lone surrogate, ...).
    """
    t = event.type
    if t is None:
        raise FrameError("the event has no 'type' (e.g. \"synthesize\")")
    if not isinstance(t, str) or not TYPE_RE.match(t):
        raise FrameError(f"the event's 'type' must be a name like \"synthesize\" (lower-case letters, digits "
                         f"and '-', at most 64), not {_kind(t)}")
    check = _CHECKS.get(t)
    if check is None:
        return event
    data = check(event.data)
    if "voice" in data:
        data["voice"] = {k: v for k, v in data["voice"].items() if v is not None}
    return WyEvent(type=t, data=data, payload=event.payload)


# ---------------------------------------------------------------------------- the handler's base


class CheckedHandler(AsyncEventHandler):
    """An ``AsyncEventHandler`` that reads with :func:`read_event` (subclasses set
    ``max_header`` and ``max_payload``) and never lets a client event raise past it.

    Subclasses implement :meth:`handle_event` (which should call :func:`check_event` and
    :meth:`refuse` what fails), :meth:`send_error` (queue an error in its place) and
    :meth:`disconnect`; :meth:`stop_writing` is called before the last error of a fatal one.
    """

    max_header: int = 65536
    max_payload: int = 1 << 20
    name: str = "wyoming"

    async def run(self) -> None:
        """Handle events until EOF, a fatal framing error, or :meth:`handle_event` returns False."""
        self._is_running = True
        try:
            while self._is_running:
                try:
                    event = await read_event(self.reader, self.max_header, self.max_payload)
                except FrameError as e:
                    if e.fatal:
                        await self._close_with(e)
                        break
                    self.refuse("event", e)
                    continue
                if event is None or not await self.handle_event(event):
                    break
        except (ConnectionError, OSError) as e:
            log.debug("%s: read failed: %s", self.name, e)
        finally:
            await self.disconnect()
            self.writer.close()

    def refuse(self, what: str, err: Exception) -> None:
        """Answer a refused ``what`` event with an ``error`` through :meth:`send_error` (the
        connection stays open): our message for an :class:`ApplianceError`; for anything else (a
        fault of ours) only that, the details go to the log."""
        label = f"{what} event" if TYPE_RE.match(what) and what != "event" else "event"
        if isinstance(err, ApplianceError):
            code, text = err.code, str(err)
            log.info("%s: %s refused: %s (%s)", self.name, label, text, code)
        else:
            log.error("%s: %s failed", self.name, label, exc_info=err)
            code, text = "internal", f"the server failed to handle this {label} (its log has the details)"
        self.send_error(Error(text=text, code=code).event())

    def send_error(self, error: WyEvent) -> None:
        """Queue an ``error`` event in its place among the replies."""
        raise NotImplementedError

    async def stop_writing(self) -> None:
        """Stop sending replies (the connection is about to close after a fatal error)."""

    async def _close_with(self, e: FrameError) -> None:
        """Send ``e`` as the last event, end our side, give the client :data:`LINGER_S` to take it."""
        log.warning("%s: %s", self.name, e)
        await self.stop_writing()
        try:
            await asyncio.wait_for(self._last_word(Error(text=str(e), code=e.code).event()), LINGER_S)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass

    async def _last_word(self, event: WyEvent) -> None:
        await self.write_event(event)
        if self.writer.can_write_eof():
            self.writer.write_eof()
        left = LINGER_BYTES
        while left > 0:
            got = await self.reader.read(min(left, 65536))
            if not got:
                return
            left -= len(got)


__all__ = ["FrameError", "CheckedHandler", "check_event", "read_event"]
