"""Protocol messages shared by the UNIX socket and MQTT.

Framing on the socket: one JSON object per line (UTF-8), each with a ``"type"``; a request
without ``"type"`` is a ``speak`` (so ``{"text": "..."}`` is enough). An ``audio``
event (only when a ``speak`` asked for ``return_audio``) is followed by exactly ``bytes`` raw
bytes of PCM (little-endian, the ``format`` given, mono, ``rate`` Hz). MQTT carries the same
JSON objects as payloads (see :mod:`appliance.transports.mqtt`).

Requests (client -> daemon): :class:`Speak`, :class:`Cancel`, :class:`StatusRequest`,
:class:`HealthRequest`, :class:`NormalizeRequest`. Events (daemon -> client): :class:`Accepted`,
:class:`Started`, :class:`Preempted`, :class:`Replayed`, :class:`AudioChunk`, :class:`Done`,
:class:`ErrorEvent`, :class:`StatusReply`, :class:`HealthReply`, :class:`Normalized`,
:class:`CancelDone` (the end of the reply to a ``cancel``).

The event dataclasses live in :mod:`appliance.messages.events` and are re-exported here.
:func:`parse_request` turns a decoded JSON object into a request dataclass and raises
:class:`~appliance.errors.RequestError` (code ``bad_request``) naming the bad field;
:func:`to_json` turns any message into one JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import typing
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from ..config import SynthesisConfig
from ..core import SynthesisRequest, SynthParams
from ..errors import ApplianceError, RequestError
from .events import (  # noqa: F401 - re-exported: the protocol's names live on here
    EVENT_TYPES,
    Accepted,
    AudioChunk,
    CancelDone,
    Done,
    ErrorEvent,
    Event,
    EventSink,
    HealthReply,
    Normalized,
    Preempted,
    Replayed,
    Started,
    StatusReply,
)

PRIORITIES = ("alert", "normal", "background")


#: Allowed ranges of request parameters: the same bounds as the config's defaults
#: (``SynthesisConfig`` field metadata), so a request can ask for anything config may set.
_PARAM_RANGES: dict[str, tuple[float, float]] = {
    f.name: (f.metadata["min"], f.metadata["max"])
    for f in dataclasses.fields(SynthesisConfig) if "min" in f.metadata and "max" in f.metadata
    and f.name in ("temperature", "top_p", "top_k", "repetition_penalty", "min_new_tokens", "max_new_tokens")
}


# ---------------------------------------------------------------- requests


@dataclass(frozen=True)
class Speak(SynthesisRequest):
    """Speak ``text`` on a channel: a :class:`~appliance.core.SynthesisRequest` (what
    ``Pipeline.prepare`` takes, as it is) with its routing.

    Attributes:
        text: what to say (UTF-8; control tokens like ``[uv_break]`` allowed).
        id: request id (client-chosen for de-duplication; generated when absent).
        channel: channel name from config; None = the first channel.
        priority: ``alert`` (preempts), ``normal`` or ``background``.
        voice: ``seed:N`` or an upstream speaker string; None = config default.
        seed: sampling seed for reproducible output; None = config default / fresh.
        params: sampling overrides.
        return_audio: also send the PCM back as ``audio`` events.
        play: False = the audio is neither played on the box nor written to a WAV file: it only
            goes back to the client (needs ``return_audio``; the Wyoming server's requests).
    """

    channel: Optional[str] = None
    priority: str = "normal"
    return_audio: bool = False
    play: bool = True
    type: str = "speak"


@dataclass(frozen=True)
class Cancel:
    """Cancel one request (``id``) or requests on a channel (``channel``); exactly one of the
    two (both is ambiguous and refused as ``bad_request``). ``scope`` (a cancel by channel only)
    names what it hits, one of :data:`CANCEL_SCOPES`: ``current`` the request sounding on the
    channel now (of those synthesizing or playing, the one that started first; the rest go on), ``queue`` (None = the default) those and every
    queued request except alerts (a pending alarm still sounds), ``all`` alerts too."""

    id: Optional[str] = None
    channel: Optional[str] = None
    scope: Optional[str] = None
    type: str = "cancel"


CANCEL_SCOPES = ("current", "queue", "all")
"""``cancel.scope`` values; :data:`DEFAULT_CANCEL_SCOPE` when it is not given."""
DEFAULT_CANCEL_SCOPE = "queue"


@dataclass(frozen=True)
class StatusRequest:
    """Ask for a :class:`StatusReply`."""

    type: str = "status"


@dataclass(frozen=True)
class HealthRequest:
    """Run the field health check now and reply with a :class:`HealthReply`."""

    type: str = "health"


@dataclass(frozen=True)
class NormalizeRequest:
    """Dry run: what a ``speak`` of ``text`` (with this ``voice`` and ``params.prompt``) would
    say, sentence by sentence, without synthesizing; answered by :class:`Normalized`."""

    text: str
    id: str = ""
    voice: Optional[str] = None
    params: SynthParams = field(default_factory=SynthParams)
    type: str = "normalize"

    def synthesis_request(self) -> SynthesisRequest:
        """The pipeline's view of this request."""
        return SynthesisRequest(id=self.id, text=self.text, voice=self.voice, params=self.params)


REQUEST_TYPES: dict[str, type] = {"speak": Speak, "cancel": Cancel, "status": StatusRequest, "health": HealthRequest,
                                   "normalize": NormalizeRequest}

Request = typing.Union[Speak, Cancel, StatusRequest, HealthRequest, NormalizeRequest]
"""A parsed request (what :func:`parse_request` / :func:`parse_line` return)."""


def _check_value(where: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        tp = args[0]
    if tp is bool:
        if not isinstance(value, bool):
            raise RequestError(f"field '{where}' must be true or false, got {value!r}")
    elif tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise RequestError(f"field '{where}' must be an integer, got {value!r}")
    elif tp is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise RequestError(f"field '{where}' must be a number, got {value!r}")
        value = float(value)
    elif tp is str:
        if not isinstance(value, str):
            raise RequestError(f"field '{where}' must be a string, got {type(value).__name__}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:   # JSON "\ud800": a lone surrogate is not text
            raise RequestError(f"field '{where}' holds a lone UTF-16 surrogate at character {e.start}") from e
    return value


def _params(obj: Any) -> SynthParams:
    if obj is None:
        return SynthParams()
    if not isinstance(obj, dict):
        raise RequestError("field 'params' must be an object")
    hints = typing.get_type_hints(SynthParams)
    unknown = sorted(set(obj) - set(hints))
    if unknown:
        raise RequestError(f"unknown field 'params.{unknown[0]}' (known: {', '.join(hints)})")
    kw = {}
    for k, v in obj.items():
        v = _check_value(f"params.{k}", v, hints[k])
        if v is not None and k in _PARAM_RANGES:
            lo, hi = _PARAM_RANGES[k]
            if not lo <= v <= hi:
                raise RequestError(f"field 'params.{k}' = {v} is outside [{lo}, {hi}]")
        kw[k] = v
    return SynthParams(**kw)


def _valid_id(obj: Any) -> Optional[str]:
    """The request's ``id`` where it is a valid one (a string of 1-128 characters without control
    characters), else None: what an error about its other fields is answered with."""
    rid = obj.get("id") if isinstance(obj, dict) else None
    if not isinstance(rid, str) or not 0 < len(rid) <= 128:
        return None
    if any(ord(ch) < 32 or 127 <= ord(ch) < 160 or 0xD800 <= ord(ch) < 0xE000 for ch in rid):
        return None
    return rid


def parse_request(obj: Any) -> Request:
    """Validate a decoded JSON object and build the request dataclass.

    An object without ``type`` is a ``speak``. A ``speak`` or ``normalize`` without ``id`` gets
    a fresh one (``uuid4().hex[:12]``).

    Raises:
        RequestError: not an object, unknown ``type``, unknown field, wrong type or range, a
            ``cancel`` with neither or both of ``id`` and ``channel``; its ``request_id`` is the
            request's valid ``id`` (None when it had none), for the error event.
    """
    try:
        return _parse_request(obj)
    except RequestError as e:
        e.request_id = _valid_id(obj)
        raise


def _parse_request(obj: Any) -> Request:
    if not isinstance(obj, dict):
        raise RequestError(f"a request must be a JSON object, got {type(obj).__name__}")
    kind = obj.get("type", "speak")
    if not isinstance(kind, str) or kind not in REQUEST_TYPES:
        raise RequestError(f"unknown request type {kind!r} (known: {', '.join(REQUEST_TYPES)})")
    cls = REQUEST_TYPES[kind]
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(obj) - fields)
    if unknown:
        raise RequestError(f"unknown field '{unknown[0]}' in {kind} (known: {', '.join(sorted(fields - {'type'}))})")
    kw: dict[str, Any] = {}
    for k, v in obj.items():
        if k == "type":
            continue
        if k == "params":
            kw[k] = _params(v)
            continue
        kw[k] = _check_value(k, v, hints[k])
    if cls is Speak:
        seed = kw.get("seed")
        if seed is not None and not 0 <= seed < 2**63:
            raise RequestError(f"field 'seed' = {seed} must be in [0, 2**63)")
        if kw.get("priority", "normal") not in PRIORITIES:
            raise RequestError(f"field 'priority' must be one of {', '.join(PRIORITIES)}, got {kw['priority']!r}")
        if kw.get("play") is False and not kw.get("return_audio"):
            raise RequestError("field 'play' is false without 'return_audio': the audio would go nowhere")
    if cls in (Speak, NormalizeRequest):
        if "text" not in kw or kw["text"] is None:
            raise RequestError(f"field 'text' is required in {kind}")
        if not kw.get("id"):
            kw["id"] = uuid.uuid4().hex[:12]
        elif len(kw["id"]) > 128:
            raise RequestError("field 'id' is longer than 128 characters")
        elif any(ord(ch) < 32 or 127 <= ord(ch) < 160 for ch in kw["id"]):
            raise RequestError(f"field 'id' holds control characters: {kw['id']!r}")
    if cls is Cancel and not (kw.get("id") or kw.get("channel")):
        raise RequestError("cancel needs 'id' or 'channel'")
    if cls is Cancel and kw.get("id") is not None and kw.get("channel") is not None:
        raise RequestError(f"cancel with both 'id' ({kw['id']!r}) and 'channel' ({kw['channel']!r}) is ambiguous: "
                           "send 'id' to cancel one request, or 'channel' to cancel everything on that channel")
    if cls is Cancel and kw.get("scope") is not None:
        if kw["scope"] not in CANCEL_SCOPES:
            raise RequestError(f"field 'scope' must be one of {', '.join(CANCEL_SCOPES)}, got {kw['scope']!r}")
        if kw.get("channel") is None:
            raise RequestError("field 'scope' goes with 'channel' (a cancel by id hits that one request)")
    return cls(**kw)


def parse_line(line: bytes, max_bytes: int = 65536) -> Request:
    """Decode one request line (bytes, without or with its newline).

    Raises:
        RequestError: longer than ``max_bytes``, not UTF-8, not JSON, or invalid (see
            :func:`parse_request`).
    """
    if len(line) > max_bytes:
        raise RequestError(f"request of {len(line)} bytes is over the limit of {max_bytes} bytes (service.max_line_bytes)")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"request is not valid UTF-8 (byte {e.start})") from e
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"request is not valid JSON: {e.msg} at column {e.colno}") from e
    except RecursionError as e:
        raise RequestError("request JSON is nested too deeply") from e
    return parse_request(obj)


def to_dict(msg: Any) -> dict:
    """A message dataclass as a plain dict (``type`` included, ``None`` fields kept)."""
    return dataclasses.asdict(msg)


def to_json(msg: Any) -> bytes:
    """One JSON line (UTF-8, newline-terminated) for a message dataclass. A string holding a
    lone surrogate (e.g. an unknown field name echoed in an error) is written as a JSON escape."""
    d = to_dict(msg)
    try:
        return (json.dumps(d, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(d, ensure_ascii=True, separators=(",", ":")) + "\n").encode("ascii")


def error_event(exc: BaseException, request_id: Optional[str] = None) -> ErrorEvent:
    """Turn any exception into an :class:`ErrorEvent` (``internal`` for non-appliance errors)."""
    if isinstance(exc, ApplianceError):
        return ErrorEvent(code=exc.code, message=str(exc), id=request_id)
    return ErrorEvent(code="internal", message=f"{exc.__class__.__name__}: {exc}", id=request_id)


def parse_event(obj: dict) -> Any:
    """Build an event dataclass from a decoded JSON object (client side).

    Raises:
        RequestError: unknown event type.
    """
    kind = obj.get("type")
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise RequestError(f"unknown event type {kind!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in obj.items() if k in names})
