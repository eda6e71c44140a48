"""MQTT topics and payloads: command payload -> request dataclass, event -> payload, and the
de-duplication of ``say`` ids. No network here (the bridge is :mod:`appliance.transports.mqtt`).

Topics, all under ``<mqtt.topic_prefix>/<mqtt.device_id>/`` (``device_id`` defaults to one unique
per box: :attr:`~appliance.config.MQTTConfig.box_id`):

================ ========= ======== ===============================================================
topic            direction QoS/ret  payload
================ ========= ======== ===============================================================
``say``          in        1        a ``speak`` object ``{"text", "id", "channel", "priority",
                                    "voice", "seed", "params"}`` (``"type"`` optional); a payload
                                    that does not start with ``{`` is plain UTF-8 text spoken on
                                    the default channel (``[uv_break]hi`` is text, not JSON)
``cancel``       in        1        ``{"id": ...}`` or ``{"channel": ...}``; plain text = an id
``health``       in        1        anything (ignored): run the field health check; the
                                    ``health`` reply goes to ``event``
``normalize``    in        1        a ``normalize`` object ``{"text", "id", "voice", "params"}``
                                    or plain text: a dry run; the ``normalized`` reply (what
                                    would be said) goes to ``event``
``event``        out       1        ``accepted`` / ``started`` / ``preempted`` / ``done`` /
                                    ``error`` (and ``health``, ``normalized``) objects, exactly as
                                    on the socket
``status``       out       1, ret.  :class:`~appliance.messages.protocol.StatusReply` JSON; at
                                    connect, on change (polled every 0.5 s; ``buffered_ms`` and
                                    ``temperature_c`` alone do not count) and every
                                    ``mqtt.status_interval_s``
``availability`` out       1, ret.  ``online`` after connect; ``offline`` at a clean stop and as
                                    the last will (the broker sends it when the daemon dies)
================ ========= ======== ===============================================================

Refusals: a command payload over ``mqtt.max_payload_bytes``, not UTF-8, starting with ``{`` but
not a valid JSON object, with an unknown field / bad value, or ``return_audio`` (not available
over MQTT) gets one ``error`` event (``code`` from :mod:`appliance.errors`, ``id`` when it could
be read) and nothing else.

De-duplication (:class:`RecentIds`): every ``say`` id is remembered in a bounded LRU
(``mqtt.dedup_ids`` entries); a ``say`` whose id is in it is dropped by the bridge. An id the
daemon *refused* before accepting it (busy, unknown channel, ...) is forgotten at once, so the
sender may retry with the same id.
"""

from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass
from typing import Optional

from ..config import Config
from ..errors import RequestError
from ..messages.protocol import (
    ErrorEvent,
    Event,
    HealthRequest,
    Request,
    error_event,
    parse_request,
    to_json,
)

COMMANDS = ("say", "cancel", "health", "normalize")
"""Command topics (last topic level) the bridge subscribes to."""


@dataclass(frozen=True)
class Topics:
    """Full topic names for one device: ``<prefix>/<device_id>/<leaf>``."""

    base: str

    @classmethod
    def from_config(cls, cfg: Config) -> "Topics":
        return cls(f"{cfg.mqtt.topic_prefix.strip('/')}/{cfg.mqtt.box_id}")

    def of(self, leaf: str) -> str:
        """``<base>/<leaf>``, e.g. ``of("say")``."""
        return f"{self.base}/{leaf}"

    @property
    def event(self) -> str:
        return self.of("event")

    @property
    def status(self) -> str:
        return self.of("status")

    @property
    def availability(self) -> str:
        return self.of("availability")


# ---------------------------------------------------------------- payload -> request


def _decode(payload: bytes, max_bytes: int) -> str:
    if len(payload) > max_bytes:
        raise RequestError(f"payload of {len(payload)} bytes is over the limit of {max_bytes} bytes "
                           f"(mqtt.max_payload_bytes); shorten the text")
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"payload is not valid UTF-8 (byte {e.start}); send UTF-8 text or JSON") from e


def _json_object(text: str) -> Optional[dict]:
    """The JSON object in ``text`` if it starts with ``{`` (JSON clearly intended), else None.

    Raises:
        RequestError: it starts with ``{`` but is not a valid JSON object.
    """
    if not text.lstrip().startswith("{"):
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"payload starts with '{{' but is not valid JSON: {e.msg} at column {e.colno}") from e
    except RecursionError as e:
        raise RequestError("payload JSON is nested too deeply") from e
    if not isinstance(obj, dict):   # cannot happen for text starting with '{', kept for clarity
        raise RequestError("payload must be a JSON object")
    return obj


def parse_command(kind: str, payload: bytes, max_bytes: int) -> tuple[Optional[Request], Optional[ErrorEvent]]:
    """Turn one MQTT command payload into a request.

    Args:
        kind: the command topic's last level: ``say``, ``cancel``, ``health`` or ``normalize``.
        payload: the raw message payload.
        max_bytes: ``mqtt.max_payload_bytes``.

    Returns:
        ``(request, None)`` with a :class:`Speak` (id filled in), :class:`Cancel`,
        :class:`HealthRequest` or :class:`NormalizeRequest`; or ``(None, ErrorEvent)`` (code ``bad_request``, ``id`` when the
        payload was readable enough to hold one).
    """
    obj: Optional[dict] = None
    try:
        text = _decode(payload, max_bytes)
        obj = _json_object(text)
        if kind == "health":
            return HealthRequest(), None
        if kind == "say":
            if obj is None:
                return parse_request({"type": "speak", "text": text.strip()}), None
            if obj.get("type", "speak") != "speak":
                raise RequestError(f"the say topic takes speak requests, got type {obj.get('type')!r}; "
                                   f"send cancel/health to their own topics")
            req = parse_request({**obj, "type": "speak"})
            if req.return_audio:
                raise RequestError("return_audio is not available over MQTT; use the UNIX socket for PCM")
            return req, None
        if kind == "normalize":
            if obj is None:
                obj = {"text": text.strip()}
            if obj.get("type", "normalize") != "normalize":
                raise RequestError(f"the normalize topic takes normalize requests, got type {obj.get('type')!r}")
            return parse_request({**obj, "type": "normalize"}), None
        if kind == "cancel":
            if obj is None:
                rid = text.strip()
                if not rid:
                    raise RequestError("cancel payload is empty; send a request id or {\"channel\": ...}")
                obj = {"id": rid}
            if obj.get("type", "cancel") != "cancel":
                raise RequestError(f"the cancel topic takes cancel requests, got type {obj.get('type')!r}")
            return parse_request({**obj, "type": "cancel"}), None
        raise RequestError(f"unknown command topic {kind!r} (known: {', '.join(COMMANDS)})")
    except RequestError as e:
        rid = obj.get("id") if isinstance(obj, dict) and isinstance(obj.get("id"), str) else None
        return None, error_event(e, rid)


def event_payload(msg: Event) -> bytes:
    """An event dataclass as an MQTT payload: the socket's JSON line without its newline."""
    return to_json(msg).rstrip(b"\n")


class RecentIds:
    """Bounded LRU of request ids seen on ``say`` (thread-safe).

    Each id is ``pending`` (handed to the daemon) or ``accepted`` (the daemon sent ``accepted``).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._ids: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def add(self, rid: str) -> bool:
        """Remember ``rid`` as pending; False if it is already there (a duplicate)."""
        with self._lock:
            if rid in self._ids:
                self._ids.move_to_end(rid)
                return False
            self._ids[rid] = "pending"
            while len(self._ids) > self.size:
                self._ids.popitem(last=False)
            return True

    def accepted(self, rid: str) -> None:
        with self._lock:
            if rid in self._ids:
                self._ids[rid] = "accepted"

    def refused(self, rid: str) -> None:
        """Forget ``rid`` if it was never accepted (so the sender may retry with it)."""
        with self._lock:
            if self._ids.get(rid) == "pending":
                del self._ids[rid]

    def __contains__(self, rid: str) -> bool:
        with self._lock:
            return rid in self._ids

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)
