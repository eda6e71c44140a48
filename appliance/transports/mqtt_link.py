"""The MQTT link as health sees it: connected, reconnecting, refused (with the broker's or the TLS
layer's reason), its back-off when the broker keeps closing it, and the TLS files, re-readable.

:class:`Link` keeps the ``mqtt`` health condition (a :class:`~appliance.core.ConditionFlag`,
``degraded``: the box speaks, MQTT does not reach it) from what paho reports:

* a failed attempt: why, in words: the broker's certificate expired, or is signed by a CA that
  ``mqtt.ca_file`` does not hold, or names another host (:func:`tls_reason`), or the network's
  error (refused, no route, name not resolved);
* a refusal (CONNACK): the broker's reason (bad user name or password, not authorized);
* a lost connection: sessions the broker closes within :data:`SHORT_SESSION_S` of their CONNACK,
  two or more in a row with every reconnect accepted at once, are what a client-id takeover looks
  like in MQTT 3.1.1 (the broker closes the older connection of two with one client id, without a
  reason; one short session alone is a broker restart as often): from the second, each doubles
  the wait before the next attempt (``mqtt.reconnect_min_s`` up to ``reconnect_max_s``), where paho would start over at
  the minimum after every successful CONNACK and two boxes would take the id from each other
  once a second forever; the condition names the client id;
* a missing or unreadable CA bundle: MQTT waits for it (the box runs, health says why) instead
  of stopping the start.

:class:`TlsFiles` is the TLS context paho is given: it re-reads ``mqtt.ca_file`` on
:meth:`TlsFiles.load` (at start, when it was missing, and on SIGHUP), and the next connection
attempt uses what it read; a working connection is kept.
"""

from __future__ import annotations

import logging
import ssl
import time
from typing import Any, Callable, Optional

from ..config import Config
from ..core import ConditionFlag
from ..errors import ConfigError

log = logging.getLogger(__name__)

SHORT_SESSION_S = 10.0
"""A session the broker closes sooner than this after its CONNACK counts as taken over."""


def tls_reason(e: BaseException, host: str) -> Optional[str]:
    """What a TLS failure means, in words (None: not a TLS failure)."""
    if isinstance(e, ssl.SSLCertVerificationError):
        msg = e.verify_message or str(e)
        low = msg.lower()
        if "expired" in low:
            return f"TLS: the broker's certificate has expired ({msg})"
        if "not yet valid" in low:
            return f"TLS: the broker's certificate is not valid yet: check this box's clock ({msg})"
        if "mismatch" in low or "hostname" in low:
            return f"TLS: the broker's certificate is not for host {host!r} ({msg}); set mqtt.host to a name it holds"
        if "issuer" in low or "self-signed" in low or "self signed" in low or "unknown ca" in low:
            return (f"TLS: the broker's certificate is signed by a CA this box does not trust ({msg}); "
                    f"point mqtt.ca_file at the broker's CA")
        return f"TLS: the broker's certificate was refused ({msg})"
    if isinstance(e, ssl.SSLError):
        return f"TLS: the handshake with the broker failed ({e.reason or e})"
    return None


class TlsFiles:
    """The TLS context given to paho (``tls_set_context``): a stand-in that wraps each new
    connection with the :class:`ssl.SSLContext` last read from ``mqtt.ca_file`` (the system's CAs
    without one), hostname checked.

    Args:
        cfg: the config (``mqtt.ca_file`` resolved against it).
    """

    check_hostname = True

    def __init__(self, cfg: Config) -> None:
        self.path = cfg.resolve(cfg.mqtt.ca_file) if cfg.mqtt.ca_file else None
        self.ctx: Optional[ssl.SSLContext] = None

    def load(self) -> None:
        """Read the CA bundle again (the next connection attempt uses it).

        Raises:
            ConfigError: it is missing or not a CA bundle (the current context is kept).
        """
        if self.path is not None and not self.path.is_file():
            raise ConfigError(f"mqtt.ca_file: {self.path} does not exist; point it at the broker's CA bundle (PEM)")
        try:
            ctx = ssl.create_default_context(cafile=str(self.path) if self.path else None)
        except (OSError, ValueError, ssl.SSLError) as e:
            raise ConfigError(f"mqtt.ca_file: cannot set up TLS with {self.path}: {e}") from e
        self.ctx = ctx

    def wrap_socket(self, sock: Any, **kw: Any) -> ssl.SSLSocket:
        """What paho calls for each connection."""
        if self.ctx is None:
            raise ssl.SSLError("no TLS context: mqtt.ca_file is not readable")
        return self.ctx.wrap_socket(sock, **kw)


class Link:
    """The ``mqtt`` health condition and the takeover back-off (module docstring).

    Args:
        cfg: the config (``mqtt.host``, ``port``, ``reconnect_min_s``, ``reconnect_max_s``).
        client_id: the MQTT client id in use. flag: the condition to raise and clear.
        clock: monotonic clock, s (tests).
    """

    def __init__(self, cfg: Config, client_id: str, flag: ConditionFlag,
                 clock: Callable[[], float] = time.monotonic) -> None:
        m = cfg.mqtt
        self.where = f"{m.host}:{m.port}"
        self.host, self.client_id = m.host, client_id
        self.min_s, self.max_s = float(m.reconnect_min_s), float(m.reconnect_max_s)
        self.flag = flag
        self._clock = clock
        self.connected_at: Optional[float] = None
        self.short = 0                 # short sessions in a row
        self.failures = 0              # failed attempts since the last CONNACK
        self.last_error: Optional[BaseException] = None

    def up(self) -> None:
        """CONNACK accepted (a takeover's condition stays until the session lasts, :meth:`settle`)."""
        self.connected_at = self._clock()
        self.failures = 0
        if self.short < 2:
            self.flag.clear()

    def settle(self) -> None:
        """Called now and then: a session that has lasted :data:`SHORT_SESSION_S` ends a takeover."""
        if self.short and self.connected_at is not None and self._clock() - self.connected_at >= SHORT_SESSION_S:
            self.short = 0
            self.flag.clear()

    def failed(self) -> str:
        """An attempt failed before CONNACK (:attr:`last_error` says why); returns the reason."""
        self.failures += 1
        self.short = 0                 # the broker is away, nobody takes the id from us
        e = self.last_error
        why = (tls_reason(e, self.host) if e is not None else None) or (
            f"cannot reach the broker {self.where}" + (f": {getattr(e, 'strerror', None) or e}" if e else ""))
        self.flag.set(f"{why}; retrying with back-off {self.min_s:g}-{self.max_s:g} s "
                      f"({self.failures} attempt{'s' if self.failures > 1 else ''})")
        return why

    def refused(self, reason: Any) -> None:
        """The broker answered CONNACK with a failure (``reason``: its reason code)."""
        self.flag.set(f"the broker {self.where} refused the connection: {reason} "
                      f"(check mqtt.username, mqtt.password, mqtt.client_id)")

    def down(self, reason: Any) -> float:
        """The connection was lost; returns the wait before the next attempt, s (module docstring)."""
        now = self._clock()
        lasted = now - self.connected_at if self.connected_at is not None else None
        self.connected_at = None
        if lasted is None:                 # closed at or before its CONNACK: a refusal keeps its reason
            if not self.flag():
                self.flag.set(f"lost the broker {self.where} ({reason}) before it accepted the connection; "
                              f"reconnecting with back-off {self.min_s:g}-{self.max_s:g} s")
            return self.min_s if self.short < 2 else min(self.max_s, self.min_s * 2 ** (self.short - 1))
        self.short = self.short + 1 if lasted < SHORT_SESSION_S else 0
        if self.short >= 2:
            wait = min(self.max_s, self.min_s * 2 ** (self.short - 1))
            self.flag.set(f"the broker {self.where} closed the connection {lasted or 0:.1f} s after it was made "
                          f"({self.short} time{'s' if self.short > 1 else ''} in a row): another client may "
                          f"use client id {self.client_id!r} (mqtt.client_id must be unique per box); "
                          f"next try in {wait:g} s")
            return wait
        self.flag.set(f"lost the broker {self.where} ({reason}); reconnecting with back-off "
                      f"{self.min_s:g}-{self.max_s:g} s")
        return self.min_s

    def waiting_for_tls(self, e: ConfigError) -> None:
        """The CA bundle cannot be read: MQTT waits for it."""
        self.flag.set(f"{e}; MQTT waits for it (checked every few seconds and at SIGHUP), the box speaks")


def client_class(paho: Any) -> type:
    """paho's client, keeping the error of each failed connection attempt for the health
    condition (paho reports the failure without it)."""

    class Client(paho.Client):
        link: Optional[Link] = None

        def reconnect(self) -> Any:
            try:
                return super().reconnect()
            except OSError as e:
                if self.link is not None:
                    self.link.last_error = e
                raise

    return Client


__all__ = ["Link", "TlsFiles", "tls_reason", "client_class", "SHORT_SESSION_S"]
