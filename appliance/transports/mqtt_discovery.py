"""Home Assistant MQTT discovery: the box appears in Home Assistant as ONE device, no YAML.

With ``mqtt.enabled`` and ``mqtt.discovery`` (default on) the bridge publishes, retained, one
config per entity under ``<mqtt.discovery_prefix>/<component>/<node>/<object>/config``
(``<node>`` = ``chattts_<device_id>``, characters outside ``[A-Za-z0-9_-]`` replaced by ``_``;
``device_id`` defaults to one unique per box, see :attr:`~appliance.config.MQTTConfig.box_id`),
all with the same ``device`` block (identifiers ``[<node>]``; ``suggested_area`` and
``configuration_url`` from ``mqtt`` when set), the same ``origin`` and ``availability_topic`` =
our ``availability`` (``online``/``offline``, the last will):

============== ============================== =====================================================
component      entity                          topics / value
============== ============================== =====================================================
``text``       Say                             command: ``say`` (the typed text is spoken on the
                                               first channel)
``notify``     Speak                           command: ``say`` (``notify.send_message``)
``button``     Stop [<channel>], per channel   command: ``cancel``, payload ``{"channel": ...}``
``select``     Voice (category ``config``)     command ``voice/set``, state ``voice`` (retained);
                                               options: the names of config ``voices``; the voice
                                               of ``say`` messages that name none
``sensor``     Queue [<channel>], per channel  ``status``: ``channels[<channel>].queued``
``sensor``     Last RTF (diagnostic)           ``status``: ``last_rtf``
``sensor``     Last TTFB (ms, diagnostic)      ``status``: ``last_ttfb_ms``
``sensor``     Temperature (°C, diagnostic)    ``status``: ``temperature_c``
``sensor``     Throttle level (diagnostic)     ``status``: ``throttle``
``sensor``     Health (diagnostic)             ``status``: ``health`` (``healthy``, ``degraded``,
                                               ``unhealthy``: the one verdict,
                                               :mod:`appliance.ops.verdict`); attributes
                                               ``conditions`` (name, severity, reason, for_s)
                                               and ``reasons``
``binary_sensor`` Speaking [<channel>]         ``status``: the channel synthesizes or plays
============== ============================== =====================================================

(``[<channel>]``: the channel's name is added to the entity name when there is more than one
channel.) Command entities (text, notify, button, select) carry ``qos: 1``, as our command
topics are QoS 1; the box's health readings carry ``entity_category: diagnostic`` (Home Assistant
lists them apart from the controls). Values come from the retained ``status`` JSON through
``value_template`` (a value the daemon does not have renders ``None``, which Home Assistant shows
as unknown).

The voice select's choice survives a restart: it is kept in ``<service.spool_dir>/voice-select``
(written atomically at each change) and read back at start; a name no longer in ``voices`` falls
back to the first one (logged).

The configs are published at every connect and again whenever Home Assistant announces itself
(``<discovery_prefix>/status`` = ``online``, its birth message after a restart). To remove the
device, publish empty retained payloads to the config topics (:meth:`Discovery.configs` lists
them).

No network here: :class:`Discovery` builds topics and payloads; :class:`~appliance.transports.mqtt.MQTTBridge`
publishes them and hands it the messages of its two extra subscriptions.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Optional

from ..config import Config
from ..core import version
from ..files import write_atomic
from ..ops.throttle import Level
from .mqtt_payload import Topics

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")

VOICE_FILE = "voice-select"
"""The file in ``service.spool_dir`` that keeps the voice select's choice across restarts."""

DIAGNOSTIC = "diagnostic"
CONFIG = "config"
COMMAND_QOS = 1


class Discovery:
    """Discovery configs and the voice select of one box.

    Args:
        cfg: the daemon's config (``mqtt``, ``service.channels``, ``voices``).
        topics: the bridge's :class:`~appliance.transports.mqtt_payload.Topics`.
        state_dir: where the voice select's choice is kept (``service.spool_dir``); None: not kept.
    """

    def __init__(self, cfg: Config, topics: Topics, state_dir: Optional[Path] = None) -> None:
        m = cfg.mqtt
        self.topics = topics
        self.prefix = m.discovery_prefix.strip("/")
        self.node = _UNSAFE.sub("_", f"chattts_{m.box_id}")
        self.channels = [c.name for c in cfg.service.channels]
        self.voices = [v.name for v in cfg.voices]
        self.voice_file = state_dir / VOICE_FILE if state_dir is not None else None
        self.voice_name = self._restore_voice()
        self.ha_status = f"{self.prefix}/status"
        self.voice_state = topics.of("voice")
        self.voice_set = topics.of("voice/set")
        ver = version()
        self.device = {"identifiers": [self.node], "name": f"ChatTTS {m.box_id}", "manufacturer": "chattts-appliance",
                       "model": "ChatTTS speech appliance", "sw_version": ver}
        if m.suggested_area:
            self.device["suggested_area"] = m.suggested_area
        if m.configuration_url:
            self.device["configuration_url"] = m.configuration_url
        self.origin = {"name": "chattts-appliance", "sw_version": ver}

    def _restore_voice(self) -> str:
        """The voice select's choice kept by the last run, else the first voice."""
        if self.voice_file is None:
            return self.voices[0]
        try:
            name = self.voice_file.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return self.voices[0]
        except (OSError, UnicodeDecodeError) as e:
            log.warning("mqtt: cannot read the voice select's last choice from %s (%s); using %s",
                        self.voice_file, e, self.voices[0])
            return self.voices[0]
        if name in self.voices:
            log.info("mqtt: voice for say messages: %s (the voice select's last choice)", name)
            return name
        log.warning("mqtt: the voice select's last choice %r is no longer in voices (%s); using %s",
                    name, ", ".join(self.voices), self.voices[0])
        return self.voices[0]

    def _keep_voice(self) -> None:
        if self.voice_file is None:
            return
        try:
            write_atomic(self.voice_file, self.voice_name.encode("utf-8") + b"\n")
        except OSError as e:
            log.warning("mqtt: cannot keep the voice select's choice in %s (%s): it resets to %s at the next start",
                        self.voice_file, e, self.voices[0])

    # ------------------------------------------------------------------ what to publish

    def subscriptions(self) -> list[tuple[str, int]]:
        """Topics the bridge subscribes to for discovery: Home Assistant's status, the voice select."""
        return [(self.ha_status, 1), (self.voice_set, 1)]

    def _entity(self, component: str, obj: str, name: str, **fields: Any) -> tuple[str, dict]:
        uid = f"{self.node}_{_UNSAFE.sub('_', obj)}"
        cfg = {"name": name, "unique_id": uid, "device": self.device, "origin": self.origin,
               "availability_topic": self.topics.availability, "payload_available": "online",
               "payload_not_available": "offline", **fields}
        return f"{self.prefix}/{component}/{self.node}/{_UNSAFE.sub('_', obj)}/config", cfg

    def configs(self) -> list[tuple[str, dict]]:
        """Every ``(config topic, config payload)`` of this box."""
        t, status = self.topics, self.topics.status
        many = len(self.channels) > 1
        out = [
            self._entity("text", "say", "Say", command_topic=t.of("say"), mode="text", min=0, max=255,
                         qos=COMMAND_QOS, icon="mdi:account-voice"),
            self._entity("notify", "speak", "Speak", command_topic=t.of("say"), qos=COMMAND_QOS,
                         icon="mdi:account-voice"),
            self._entity("select", "voice", "Voice", command_topic=self.voice_set, state_topic=self.voice_state,
                         options=list(self.voices), qos=COMMAND_QOS, entity_category=CONFIG,
                         icon="mdi:account-music"),
            self._entity("sensor", "last_rtf", "Last RTF", state_topic=status, state_class="measurement",
                         value_template="{{ value_json.last_rtf }}", entity_category=DIAGNOSTIC,
                         icon="mdi:speedometer"),
            self._entity("sensor", "last_ttfb", "Last TTFB", state_topic=status, state_class="measurement",
                         device_class="duration", unit_of_measurement="ms", entity_category=DIAGNOSTIC,
                         value_template="{{ value_json.last_ttfb_ms }}"),
            self._entity("sensor", "temperature", "Temperature", state_topic=status, state_class="measurement",
                         device_class="temperature", unit_of_measurement="°C", entity_category=DIAGNOSTIC,
                         value_template="{{ value_json.temperature_c }}"),
            self._entity("sensor", "throttle", "Throttle level", state_topic=status, device_class="enum",
                         options=[lv.value for lv in Level], value_template="{{ value_json.throttle }}",
                         entity_category=DIAGNOSTIC, icon="mdi:thermometer-alert"),
            self._entity("sensor", "health", "Health", state_topic=status, device_class="enum",
                         options=["healthy", "degraded", "unhealthy"], value_template="{{ value_json.health }}",
                         json_attributes_topic=status,
                         json_attributes_template=("{{ {'conditions': value_json.conditions, 'reasons': "
                                                   "value_json.conditions | map(attribute='reason') | list} | tojson }}"),
                         entity_category=DIAGNOSTIC, icon="mdi:heart-pulse"),
        ]
        for ch in self.channels:
            suffix = f" {ch}" if many else ""
            key = json.dumps(ch, ensure_ascii=False)        # a quoted string literal in the template
            c = f"value_json.channels[{key}]"
            out += [
                self._entity("button", f"stop_{ch}", f"Stop{suffix}", command_topic=t.of("cancel"),
                             payload_press=json.dumps({"channel": ch}, ensure_ascii=False), qos=COMMAND_QOS,
                             icon="mdi:stop"),
                self._entity("sensor", f"queue_{ch}", f"Queue{suffix}", state_topic=status, state_class="measurement",
                             value_template=f"{{{{ {c}.queued }}}}", icon="mdi:tray-full"),
                self._entity("binary_sensor", f"speaking_{ch}", f"Speaking{suffix}", state_topic=status,
                             value_template=f"{{{{ 'ON' if {c}.active or {c}.playing else 'OFF' }}}}",
                             icon="mdi:account-voice"),
            ]
        return out

    def publish(self, client: Any) -> int:
        """Publish every config and the voice state (QoS 1, retained) with a paho client; returns
        how many configs."""
        items = self.configs()
        for topic, cfg in items:
            client.publish(topic, json.dumps(cfg, ensure_ascii=False, separators=(",", ":")).encode("utf-8"),
                           qos=1, retain=True)
        client.publish(self.voice_state, self.voice_name.encode("utf-8"), qos=1, retain=True)
        log.info("mqtt: published %d Home Assistant discovery configs under %s/+/%s/", len(items), self.prefix, self.node)
        return len(items)

    # ------------------------------------------------------------------ what comes in

    def handle(self, client: Any, topic: str, payload: bytes) -> bool:
        """A message on one of :meth:`subscriptions`: republish after Home Assistant's ``online``,
        or set the voice. Returns False for any other topic (the bridge handles it)."""
        if topic == self.ha_status:
            if payload.strip() == b"online":
                log.info("mqtt: Home Assistant is online; publishing the discovery configs again")
                self.publish(client)
            return True
        if topic == self.voice_set:
            name = payload.decode("utf-8", errors="replace").strip()
            if name in self.voices:
                if name != self.voice_name:
                    self.voice_name = name
                    self._keep_voice()
                log.info("mqtt: voice for say messages set to %s", name)
            else:
                log.warning("mqtt: voice/set %r is not a configured voice (voices: %s)", name, ", ".join(self.voices))
            client.publish(self.voice_state, self.voice_name.encode("utf-8"), qos=1, retain=True)
            return True
        return False

    def use_voices(self, client: Any, names: list) -> None:
        """New voice names (a reload, SIGHUP): the select's options are published again (when
        ``client`` is connected; else at the next connect), and a chosen voice that is gone falls
        back to the first."""
        self.voices = list(names)
        if self.voice_name not in self.voices:
            log.warning("mqtt: the selected voice %r is no longer in voices; using %s", self.voice_name, self.voices[0])
            self.voice_name = self.voices[0]
            self._keep_voice()
        if client is not None:
            self.publish(client)

    @property
    def voice(self) -> str:
        """The selected voice's name (a ``speak`` carries it; the pipeline resolves it)."""
        return self.voice_name
