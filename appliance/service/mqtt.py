"""MQTT input and event output (paho-mqtt 2.x, ``CallbackAPIVersion.VERSION2``).

The bridge is a second transport beside the UNIX socket: it turns MQTT messages into the same
request dataclasses (:mod:`appliance.service.protocol`) and hands them to
:meth:`Daemon.handle_line_threadsafe <appliance.service.daemon.Daemon.handle_line_threadsafe>`;
the daemon's events come back through one :data:`~appliance.service.worker.EventSink` and are
published as the same JSON objects the socket sends (without the trailing newline).

Topics, all under ``<mqtt.topic_prefix>/<mqtt.device_id>/``:

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
``event``        out       1        ``accepted`` / ``started`` / ``preempted`` / ``done`` /
                                    ``error`` (and ``health``) objects, exactly as on the socket
``status``       out       1, ret.  :class:`~appliance.service.protocol.StatusReply` JSON; at
                                    connect, on change (polled every 0.5 s; ``buffered_ms`` and
                                    ``temperature_c`` alone do not count) and every
                                    ``mqtt.status_interval_s``
``availability`` out       1, ret.  ``online`` after connect; ``offline`` at a clean stop and as
                                    the last will (the broker sends it when the daemon dies)
================ ========= ======== ===============================================================

Retained commands: a command published with retain=true is handled once when it is published
(live delivery clears the flag) and refused with an ``error`` event when the broker replays it
at a later (re)connect, so it is never spoken again at every reconnect.

Only requests that came over MQTT have their events on ``event``; socket clients get theirs on
the socket.

Refusals: a command payload over ``mqtt.max_payload_bytes``, not UTF-8, starting with ``{`` but
not a valid JSON object, with an unknown field / bad value, ``return_audio`` (not available over
MQTT), or one the daemon refuses (unknown channel, empty text, busy, ...) gets one ``error``
event (``code`` from :mod:`appliance.errors`, ``id`` when it could be read) and nothing else.

De-duplication: every ``say`` id is remembered in a bounded LRU (``mqtt.dedup_ids`` entries).
A ``say`` whose id is in it (a QoS 1 redelivery, or the same id published again) is **dropped
silently** (logged at INFO, counted in :attr:`MQTTBridge.duplicates`): the first copy already
produces the request's one ``accepted`` ... ``done``/``error`` sequence on ``event``, and a
second terminal event for the same id would break that rule. An id the daemon *refused* before
accepting it (busy, unknown channel, ...) is forgotten at once, so the sender may retry with the
same id. A ``say`` without an id gets a fresh one and cannot be de-duplicated: send ids. The LRU
lives in memory: after a daemon restart a message the broker redelivers (one that was received
but not acknowledged before a crash) is spoken again.

Connection: ``connect_async`` + paho's own network thread (``loop_start``); the daemon starts even
when the broker is down, paho reconnects with exponential backoff between
``mqtt.reconnect_min_s`` and ``mqtt.reconnect_max_s``. Requests already accepted keep running
while the broker is away; their events (QoS 1) wait in paho's queue (at most
:data:`MAX_QUEUED` messages) and are sent after the reconnect. With ``mqtt.clean_session: false``
(default) the broker also keeps this client's subscriptions and queues commands sent while the
connection was down. QoS 1 is at-least-once: around a reconnect a subscriber may get an ``event``
twice (identical JSON, e.g. ``started`` of one id twice in a row; a request resumed after a
preemption also has a second ``started``, after its ``preempted``).

Threads: paho's network thread runs ``on_connect`` / ``on_message``; the worker, audio and event
loop threads call the sink (``publish`` is thread-safe and never blocks); one ``mqtt-status``
thread polls :meth:`Daemon.status`.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..config import Config
from ..errors import ApplianceError, ConfigError, RequestError
from .protocol import (
    Accepted,
    AudioChunk,
    ErrorEvent,
    HealthRequest,
    Speak,
    error_event,
    parse_request,
    to_dict,
    to_json,
)

log = logging.getLogger(__name__)

STATUS_POLL_S = 0.5
"""How often the status thread compares the daemon's status with the last one published, s."""

MAX_QUEUED = 1000
"""Most outgoing messages paho keeps while disconnected (older events are kept, newer dropped)."""

COMMANDS = ("say", "cancel", "health")
"""Command topics (last topic level) the bridge subscribes to."""

_VOLATILE = ("buffered_ms", "temperature_c")


@dataclass(frozen=True)
class Topics:
    """Full topic names for one device: ``<prefix>/<device_id>/<leaf>``."""

    base: str

    @classmethod
    def from_config(cls, cfg: Config) -> "Topics":
        return cls(f"{cfg.mqtt.topic_prefix.strip('/')}/{cfg.mqtt.device_id}")

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
    if not isinstance(obj, dict):   # cannot happen for text starting with '{', kept for clarity
        raise RequestError("payload must be a JSON object")
    return obj


def parse_command(kind: str, payload: bytes, max_bytes: int) -> tuple[Any, Optional[ErrorEvent]]:
    """Turn one MQTT command payload into a request.

    Args:
        kind: the command topic's last level: ``say``, ``cancel`` or ``health``.
        payload: the raw message payload.
        max_bytes: ``mqtt.max_payload_bytes``.

    Returns:
        ``(request, None)`` with a :class:`Speak` (id filled in), :class:`Cancel` or
        :class:`HealthRequest`; or ``(None, ErrorEvent)`` (code ``bad_request``, ``id`` when the
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


def event_payload(msg: Any) -> bytes:
    """An event dataclass as an MQTT payload: the socket's JSON line without its newline."""
    return to_json(msg).rstrip(b"\n")


# ---------------------------------------------------------------- de-duplication


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


# ---------------------------------------------------------------- the bridge


class MQTTBridge:
    """Connects one daemon to one broker (see the module docstring for topics and behaviour).

    Args:
        cfg: validated configuration (``cfg.mqtt`` used; TLS paths resolved against the config).
        handle_line: ``(line: bytes, sink) -> Future``, normally ``Daemon.handle_line_threadsafe``;
            may raise :class:`~appliance.errors.ApplianceError` (e.g. busy while stopping).
        status: ``() -> StatusReply``, normally ``Daemon.status``.

    Raises:
        ConfigError: ``mqtt.ca_file`` is set but missing, or TLS cannot be set up with it.
    """

    def __init__(self, cfg: Config, handle_line: Callable[[bytes, Any], Any], status: Callable[[], Any]) -> None:
        import paho.mqtt.client as paho

        self.cfg = cfg
        self.m = cfg.mqtt
        self.topics = Topics.from_config(cfg)
        self.handle_line = handle_line
        self.status = status
        self.recent = RecentIds(self.m.dedup_ids)
        self.duplicates = 0
        self.connected = threading.Event()
        self._stopping = threading.Event()
        self._status_thread: Optional[threading.Thread] = None
        self._last_sig: Any = None
        self._last_status_at = 0.0
        self._status_lock = threading.Lock()
        self._failures = 0          # failed connection attempts since the last success

        self.client_id = self.m.client_id or f"chattts-{self.m.device_id}"
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=self.client_id,
                                  clean_session=self.m.clean_session, protocol=paho.MQTTv311)
        self.client.suppress_exceptions = True
        if self.m.username is not None:
            self.client.username_pw_set(self.m.username, self.m.password)
        if self.m.tls:
            ca = None
            if self.m.ca_file:
                ca_path = cfg.resolve(self.m.ca_file)
                if not ca_path.is_file():
                    raise ConfigError(f"mqtt.ca_file: {ca_path} does not exist; point it at the broker's CA bundle (PEM)")
                ca = str(ca_path)
            try:
                self.client.tls_set(ca_certs=ca)
            except (OSError, ValueError) as e:
                raise ConfigError(f"mqtt.ca_file: cannot set up TLS with {ca or 'the system CAs'}: {e}") from e
        self.client.will_set(self.topics.availability, b"offline", qos=1, retain=True)
        self.client.reconnect_delay_set(min_delay=self.m.reconnect_min_s, max_delay=self.m.reconnect_max_s)
        self.client.max_queued_messages_set(MAX_QUEUED)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_connect_fail = self._on_connect_fail
        self.client.on_message = self._on_message

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Begin connecting (non-blocking) and start paho's network thread and the status thread."""
        log.info("mqtt: connecting to %s:%d%s as %s, topics %s/#", self.m.host, self.m.port,
                 " (TLS)" if self.m.tls else "", self.client_id, self.topics.base)
        self.client.connect_async(self.m.host, self.m.port, keepalive=self.m.keepalive_s)
        self.client.loop_start()
        self._status_thread = threading.Thread(target=self._status_loop, name="mqtt-status", daemon=True)
        self._status_thread.start()

    def stop(self, timeout_s: float = 3.0) -> None:
        """Publish the final status and ``offline`` (retained), disconnect, join the threads.

        Call after the daemon drained, so that the last ``done`` events go out first.
        """
        self._stopping.set()
        if self._status_thread is not None:
            self._status_thread.join(timeout_s)
        if self.connected.is_set():
            self._publish_status(force=True)
            info = self.client.publish(self.topics.availability, b"offline", qos=1, retain=True)
            try:
                info.wait_for_publish(timeout_s)
            except (RuntimeError, ValueError):
                pass
        self.client.disconnect()
        self.client.loop_stop()
        log.info("mqtt: disconnected (%d duplicate say message(s) dropped)", self.duplicates)

    # ------------------------------------------------------------------ paho callbacks (network thread)

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("mqtt: broker %s:%d refused the connection: %s (check mqtt.username/password/tls)",
                      self.m.host, self.m.port, reason_code)
            return
        log.info("mqtt: connected to %s:%d (session present: %s)", self.m.host, self.m.port,
                 getattr(flags, "session_present", "?"))
        self._failures = 0
        client.subscribe([(self.topics.of(k), 1) for k in COMMANDS])
        client.publish(self.topics.availability, b"online", qos=1, retain=True)
        self.connected.set()
        self._publish_status(force=True)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connected.clear()
        if self._stopping.is_set():
            return
        log.warning("mqtt: lost the broker %s:%d (%s); reconnecting with backoff %g-%g s",
                    self.m.host, self.m.port, reason_code, self.m.reconnect_min_s, self.m.reconnect_max_s)

    def _on_connect_fail(self, client, userdata) -> None:
        self._failures += 1
        if self._failures == 1:
            log.warning("mqtt: cannot reach the broker %s:%d; retrying with backoff %g-%g s (logged once per outage)",
                        self.m.host, self.m.port, self.m.reconnect_min_s, self.m.reconnect_max_s)
        else:
            log.debug("mqtt: connection attempt %d to %s:%d failed", self._failures, self.m.host, self.m.port)

    def _on_message(self, client, userdata, msg) -> None:
        try:
            self._command(msg.topic, bytes(msg.payload), bool(msg.retain))
        except Exception:   # never let an exception reach paho's network thread
            log.exception("mqtt: message on %s failed", msg.topic)

    # ------------------------------------------------------------------ commands and events

    def _command(self, topic: str, payload: bytes, retained: bool = False) -> None:
        kind = topic.rsplit("/", 1)[-1]
        req, err = parse_command(kind, payload, self.m.max_payload_bytes)
        if retained:    # replayed by the broker at (re)subscribe: would speak again at every connect
            rid = getattr(req, "id", None) or (err.id if err is not None else None)
            log.warning("mqtt: ignored a retained %s message on %s", kind, topic)
            self.sink(ErrorEvent(code=RequestError.code, id=rid, message=(
                f"retained {kind} message ignored: the broker replays it at every connect; publish commands "
                f"with retain=false and clear it with an empty retained message on {topic}")), None)
            return
        if err is not None:
            log.info("mqtt: bad %s payload (%d bytes): %s", kind, len(payload), err.message)
            self.sink(err, None)
            return
        if isinstance(req, Speak):
            if not self.recent.add(req.id):
                self.duplicates += 1
                log.info("mqtt: say %s is a duplicate (redelivered or re-sent); dropped", req.id)
                return
        try:
            self.handle_line(to_json(req), self.sink)
        except ApplianceError as e:
            self.sink(error_event(e, getattr(req, "id", None)), None)

    def sink(self, event: Any, payload: Optional[bytes] = None) -> None:
        """The :data:`EventSink` of every MQTT request: publishes ``event`` on ``event`` (QoS 1).

        One sink for all requests, so a cancel sent over MQTT does not add a second ``cancelled``
        event for a request that also came over MQTT. ``audio`` events are not published.
        """
        if isinstance(event, AudioChunk):
            return
        rid = getattr(event, "id", None)
        if rid:
            if isinstance(event, Accepted):
                self.recent.accepted(rid)
            elif isinstance(event, ErrorEvent):
                self.recent.refused(rid)
        try:
            self.client.publish(self.topics.event, event_payload(event), qos=1)
        except Exception:
            log.exception("mqtt: cannot publish %s event", getattr(event, "type", "?"))

    # ------------------------------------------------------------------ status

    def _publish_status(self, force: bool = False) -> None:
        try:
            st = to_dict(self.status())
        except Exception:
            log.exception("mqtt: status() failed")
            return
        sig = json.dumps(_strip_volatile(st), sort_keys=True)
        now = time.monotonic()
        with self._status_lock:
            if not force and sig == self._last_sig and now - self._last_status_at < self.m.status_interval_s:
                return
            self._last_sig, self._last_status_at = sig, now
        payload = json.dumps(st, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        self.client.publish(self.topics.status, payload, qos=1, retain=True)

    def _status_loop(self) -> None:
        while not self._stopping.wait(STATUS_POLL_S):
            if self.connected.is_set():
                self._publish_status()


def _strip_volatile(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip_volatile(v) for k, v in obj.items() if k not in _VOLATILE}
    return obj
