"""MQTT input and event output (paho-mqtt 2.x, ``CallbackAPIVersion.VERSION2``).

The bridge is a second transport beside the UNIX socket: it turns MQTT messages into the same
request dataclasses (:mod:`appliance.messages.protocol`, parsed by
:mod:`appliance.transports.mqtt_payload`) and hands them, parsed, to
:meth:`Dispatcher.handle_request_threadsafe <appliance.service.dispatch.Dispatcher.handle_request_threadsafe>`;
the daemon's events come back through one :data:`~appliance.messages.protocol.EventSink` and are
published as the same JSON objects the socket sends (without the trailing newline).

Topics (``say``, ``cancel``, ``health`` in; ``event``, ``status``, ``availability`` out) and
payloads: :mod:`appliance.transports.mqtt_payload`. ``status`` is published (retained) at connect,
on change (polled every 0.5 s; ``buffered_ms``, ``temperature_c`` and ``memory_mib`` alone do
not count) and
every ``mqtt.status_interval_s``; ``availability`` is ``online`` after connect and ``offline``
at a clean stop and as the last will.

Retained commands: a command published with retain=true is handled once when it is published
(live delivery clears the flag) and refused with an ``error`` event when the broker replays it
at a later (re)connect, so it is never spoken again at every reconnect. Clearing it (an empty
retained message, as that error advises) delivers an empty message: on ``say``, ``cancel`` and
``normalize`` an empty payload is ignored (logged), never answered with an error
(:data:`IGNORED_WHEN_EMPTY`); on ``health`` it still runs the check.

Only requests that came over MQTT have their events on ``event``; socket clients get theirs on
the socket.

Home Assistant discovery (``mqtt.discovery``): :mod:`appliance.transports.mqtt_discovery` builds the
retained configs (one device: say, stop, voice select, sensors, speaking); they are published at
every connect and when ``<mqtt.discovery_prefix>/status`` says ``online``; the voice select sets
the voice of ``say`` messages that name none (its name, resolved by the pipeline like any
``voice``; the choice is kept across restarts).

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
same id. A ``say`` without an id gets a fresh one and cannot be de-duplicated: send ids.

Acknowledgement: commands are acknowledged (PUBACK, paho ``manual_ack``) only once the daemon has
handled them, i.e. a ``say`` is in the request journal and ``accepted`` (or refused), so a
command the broker handed over is never lost in a crash: the broker redelivers an unacknowledged
one at the next connect, and its id then finds the journaled request
(:mod:`appliance.service.recovery`: ``replayed`` on ``event``, never spoken twice); the requests
replayed from the journal are also entered into the LRU.

Connection: ``connect_async`` + paho's own network thread (``loop_start``); the daemon starts even
when the broker is down, paho reconnects with exponential backoff between
``mqtt.reconnect_min_s`` and ``mqtt.reconnect_max_s``. Requests already accepted keep running
while the broker is away; their events (QoS 1) wait in paho's queue (at most
:data:`MAX_QUEUED` messages) and are sent after the reconnect. With ``mqtt.clean_session: false``
(default) the broker also keeps this client's subscriptions and queues commands sent while the
connection was down. QoS 1 is at-least-once: around a reconnect a subscriber may get an ``event``
twice (identical JSON, e.g. ``started`` of one id twice in a row; a request resumed after a
preemption also has a second ``started``, after its ``preempted``).

Health (:mod:`appliance.transports.mqtt_link`): the ``mqtt`` condition says why the link is
down (the broker unreachable, its refusal, a TLS reason: expired, unknown CA, host name), a
broker that keeps closing a fresh session (a client-id takeover) doubles the wait before the next
attempt, and a missing or unreadable ``mqtt.ca_file`` leaves MQTT waiting for it (re-read every
few seconds and on SIGHUP, :meth:`MQTTBridge.reload_tls`) instead of stopping the box.

Threads: paho's network thread runs ``on_connect`` / ``on_message``; the worker, audio and event
loop threads call the sink (``publish`` is thread-safe and never blocks); one ``mqtt-status``
thread polls :meth:`Daemon.status`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional

from ..config import Config
from ..errors import ApplianceError, ConfigError, RequestError
from ..messages.protocol import (
    Accepted,
    AudioChunk,
    ErrorEvent,
    Event,
    EventSink,
    Request,
    Speak,
    StatusReply,
    error_event,
    to_dict,
)
from ..core import ConditionFlag
from .mqtt_discovery import Discovery
from .mqtt_link import Link, TlsFiles, client_class
from .mqtt_payload import COMMANDS, RecentIds, Topics, event_payload, parse_command

log = logging.getLogger(__name__)

STATUS_POLL_S = 0.5
"""How often the status thread compares the daemon's status with the last one published, s."""

MAX_QUEUED = 1000
"""Most outgoing messages paho keeps while disconnected (older events are kept, newer dropped)."""

_VOLATILE = ("buffered_ms", "temperature_c", "memory_mib", "for_s")

TLS_RETRY_POLLS = 10
"""A missing CA bundle is looked for again every this many status polls (5 s)."""

IGNORED_WHEN_EMPTY = ("say", "cancel", "normalize")
"""Command topics on which a zero-byte payload is ignored: it is what clearing a retained message
there delivers, and no command of theirs is empty."""



class MQTTBridge:
    """Connects one daemon to one broker (see the module docstring for topics and behaviour).

    Args:
        cfg: validated configuration (``cfg.mqtt`` used; TLS paths resolved against the config).
        submit: ``(request, sink) -> Future``, normally
            :meth:`~appliance.service.dispatch.Dispatcher.handle_request_threadsafe`; may raise
            :class:`~appliance.errors.ApplianceError` (e.g. busy while stopping).
        status: ``() -> StatusReply``, normally ``Daemon.status``.
        health: the ``mqtt`` condition this bridge raises and clears (None: its own, unread).
    """

    def __init__(self, cfg: Config, submit: Callable[[Request, EventSink], Future],
                 status: Callable[[], StatusReply], health: Optional[ConditionFlag] = None) -> None:
        import paho.mqtt.client as paho

        self.cfg = cfg
        self.m = cfg.mqtt
        self.topics = Topics.from_config(cfg)
        self.submit = submit
        self.status = status
        self.recent = RecentIds(self.m.dedup_ids)
        self.duplicates = 0
        self.connected = threading.Event()
        self._stopping = threading.Event()
        self._status_thread: Optional[threading.Thread] = None
        self._last_sig: Any = None
        self._last_status_at = 0.0
        self._status_lock = threading.Lock()
        self.client_id = self.m.client_id or f"chattts-{self.m.box_id}"
        self.link = Link(cfg, self.client_id, health or ConditionFlag("mqtt"))
        self.client = client_class(paho)(paho.CallbackAPIVersion.VERSION2, client_id=self.client_id,
                                          clean_session=self.m.clean_session, protocol=paho.MQTTv311,
                                          manual_ack=True)
        self.client.link = self.link
        self.client.suppress_exceptions = True
        if self.m.username is not None:
            self.client.username_pw_set(self.m.username, self.m.password)
        self.tls: Optional[TlsFiles] = TlsFiles(cfg) if self.m.tls else None
        self._tls_ok = self.tls is None or self.reload_tls()
        if self.tls is not None:
            self.client.tls_set_context(self.tls)    # type: ignore[arg-type] - wraps the context read last
        self.client.will_set(self.topics.availability, b"offline", qos=1, retain=True)
        self.client.reconnect_delay_set(min_delay=self.m.reconnect_min_s, max_delay=self.m.reconnect_max_s)
        self.client.max_queued_messages_set(MAX_QUEUED)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_connect_fail = self._on_connect_fail
        self.client.on_message = self._on_message
        self.discovery: Optional[Discovery] = (Discovery(cfg, self.topics, cfg.resolve(cfg.service.spool_dir))
                                               if self.m.discovery else None)

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Begin connecting (non-blocking) and start paho's network thread and the status thread."""
        if self._tls_ok:
            self._connect()
        self._status_thread = threading.Thread(target=self._status_loop, name="mqtt-status", daemon=True)
        self._status_thread.start()

    def _connect(self) -> None:
        log.info("mqtt: connecting to %s:%d%s as %s, topics %s/#", self.m.host, self.m.port,
                 " (TLS)" if self.m.tls else "", self.client_id, self.topics.base)
        self.client.connect_async(self.m.host, self.m.port, keepalive=self.m.keepalive_s)
        self.client.loop_start()
        self._started = True

    def reload_tls(self) -> bool:
        """Read ``mqtt.ca_file`` again (start, SIGHUP, and every few seconds while it is missing);
        the next connection attempt uses it, a working connection is kept. True when it was read."""
        if self.tls is None:
            return True
        try:
            self.tls.load()
        except ConfigError as e:
            log.error("mqtt: %s; MQTT waits for it, the box runs on", e)
            self.link.waiting_for_tls(e)
            return False
        if not getattr(self, "_tls_ok", True):
            log.info("mqtt: %s read; connecting", self.tls.path)
            self.link.flag.clear()
        return True

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
        if getattr(self, "_started", False):
            self.client.disconnect()
            self.client.loop_stop()
        log.info("mqtt: disconnected (%d duplicate say message(s) dropped)", self.duplicates)

    def use_voices(self, names: list) -> None:
        """The voices after a reload: the Home Assistant voice select lists them (``say`` messages
        with a ``voice`` name are resolved by the pipeline, which has them already)."""
        if self.discovery is not None:
            self.discovery.use_voices(self.client if self.connected.is_set() else None, names)

    # ------------------------------------------------------------------ paho callbacks (network thread)

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("mqtt: broker %s:%d refused the connection: %s (check mqtt.username/password/tls)",
                      self.m.host, self.m.port, reason_code)
            self.link.refused(reason_code)
            return
        log.info("mqtt: connected to %s:%d (session present: %s)", self.m.host, self.m.port,
                 getattr(flags, "session_present", "?"))
        self.link.up()
        client.subscribe([(self.topics.of(k), 1) for k in COMMANDS]
                         + (self.discovery.subscriptions() if self.discovery is not None else []))
        client.publish(self.topics.availability, b"online", qos=1, retain=True)
        self.connected.set()
        self._publish_status(force=True)
        if self.discovery is not None:
            self.discovery.publish(client)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connected.clear()
        if self._stopping.is_set():
            return
        was_up = self.link.connected_at is not None
        wait = self.link.down(reason_code)
        # paho starts over at its minimum after every CONNACK: a taken-over session waits longer
        client.reconnect_delay_set(min_delay=wait, max_delay=max(wait, self.m.reconnect_max_s))
        if was_up:
            log.warning("mqtt: %s", self.link.flag()[0].reason)

    def _on_connect_fail(self, client, userdata) -> None:
        why = self.link.failed()
        if self.link.failures == 1:
            log.warning("mqtt: %s; retrying with backoff %g-%g s (logged once per outage)",
                        why, self.m.reconnect_min_s, self.m.reconnect_max_s)
        else:
            log.debug("mqtt: connection attempt %d to %s:%d failed: %s", self.link.failures, self.m.host,
                      self.m.port, why)

    def _on_message(self, client, userdata, msg) -> None:
        fut = None
        try:
            handled = self.discovery is not None and self.discovery.handle(client, msg.topic, bytes(msg.payload))
            if not handled:
                fut = self._command(msg.topic, bytes(msg.payload), bool(msg.retain))
        except Exception:   # never let an exception reach paho's network thread
            log.exception("mqtt: message on %s failed", msg.topic)
        if fut is None:
            self._ack(msg)
        else:               # after the journal write and 'accepted' (or the refusal)
            fut.add_done_callback(lambda f, m=msg: self._ack(m))

    def _ack(self, msg) -> None:
        if msg.qos > 0:
            try:
                self.client.ack(msg.mid, msg.qos)
            except Exception:  # noqa: BLE001 - a lost ack only means a redelivery (de-duplicated)
                log.exception("mqtt: cannot acknowledge message %s", msg.mid)

    # ------------------------------------------------------------------ commands and events

    def _command(self, topic: str, payload: bytes, retained: bool = False) -> Optional[Future]:
        """Handle one command; returns the dispatcher's future when one was submitted."""
        kind = topic.rsplit("/", 1)[-1]
        if not payload and kind in IGNORED_WHEN_EMPTY:
            # what clearing a retained message delivers (as the error below advises): not a command
            log.info("mqtt: ignored an empty message on %s (a retained message being cleared)", topic)
            return None
        req, err = parse_command(kind, payload, self.m.max_payload_bytes)
        if retained:    # replayed by the broker at (re)subscribe: would speak again at every connect
            rid = getattr(req, "id", None) or (err.id if err is not None else None)
            log.warning("mqtt: ignored a retained %s message on %s", kind, topic)
            self.sink(ErrorEvent(code=RequestError.code, id=rid, message=(
                f"retained {kind} message ignored: the broker replays it at every connect; publish commands "
                f"with retain=false and clear it with an empty retained message on {topic}")))
            return
        if err is not None:
            log.info("mqtt: bad %s payload (%d bytes): %s", kind, len(payload), err.message)
            self.sink(err)
            return
        if isinstance(req, Speak):
            if req.voice is None and self.discovery is not None:     # the Home Assistant voice select
                req = dataclasses.replace(req, voice=self.discovery.voice)
            if not self.recent.add(req.id):
                self.duplicates += 1
                log.info("mqtt: say %s is a duplicate (redelivered or re-sent); dropped", req.id)
                return
        try:
            return self.submit(req, self.sink)
        except ApplianceError as e:
            self.sink(error_event(e, getattr(req, "id", None)))
        return None

    def sink(self, event: Event) -> None:
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
            log.exception("mqtt: cannot publish %s event", event.type)

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
        polls = 0
        while not self._stopping.wait(STATUS_POLL_S):
            polls += 1
            if not self._tls_ok and polls % TLS_RETRY_POLLS == 0 and self.reload_tls():
                self._tls_ok = True
                self._connect()
            if self.connected.is_set():
                self.link.settle()
                self._publish_status()


def _strip_volatile(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip_volatile(v) for k, v in obj.items() if k not in _VOLATILE}
    if isinstance(obj, list):      # e.g. the health conditions, each with its age
        return [_strip_volatile(v) for v in obj]
    return obj
