"""The Wyoming TTS server (``wyoming:`` in config): how Home Assistant finds and uses the box.

Built on the ``wyoming`` package (its :class:`~wyoming.server.AsyncTcpServer` /
:class:`~wyoming.server.AsyncUnixServer`, event classes and framing: one JSON line, optional data
and PCM payload per event). It runs on the daemon's event loop beside the UNIX socket; each
connection is a :class:`~appliance.transports.wyoming_handler.WyomingHandler` (what each event does,
errors, cancel on disconnect), whose requests go through the daemon's dispatcher and scheduler.

``describe`` is answered with one TTS program, ``chattts-appliance``: its voices are
config ``voices`` (``seed:N`` presets and upstream speaker strings, by name), languages ``zh``
and ``en``, the attribution names ChatTTS (2noise) and the licence of its weights (CC BY-NC 4.0,
non-commercial), and ``supports_synthesize_streaming`` is ``wyoming.streaming``.

Listening: every URI of ``wyoming.uris`` (``tcp://HOST:PORT``, ``unix://PATH``; a relative path
is taken from the config file's directory). A URI that cannot be listened on (its port taken,
its address not there yet) does not stop the box: the ``wyoming`` health condition names it and
why, it is tried again every :data:`RETRY_S`, and the condition clears once every URI listens.
UNIX sockets get ``service.socket_mode``.

Limits: an event header line of at most ``service.max_line_bytes``, data + payload of one event
at most ``wyoming.max_payload_bytes``; a bigger one is refused before it is read
(:mod:`.wyoming_frame`). The audio a connection holds for a client that does not read it is at
most ``wyoming.max_buffered_ms`` (:mod:`appliance.audio.stream`).

Zeroconf (``wyoming.zeroconf``): the first tcp URI is advertised as ``_wyoming._tcp.local.``
(:mod:`.wyoming_mdns`: a unique name on a conflict, the address followed, the ``mdns`` health
condition when it fails). A loopback address (``tcp://127.0.0.1:10200``, as in the shipped
``config.local.yaml``) is advertised with a warning that says how to listen on the LAN
(:func:`~.wyoming_mdns.warn_loopback`).

Bounds of each connection (start timeout, write timeout, keepalive): :mod:`.wyoming_bounds`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from functools import partial
from typing import Any, Optional
from urllib.parse import urlparse

from ..config import Config
from ..core import ConditionFlag, version
from ..errors import ConfigError
from ..service.dispatch import Dispatcher
from .socket_server import check_socket_path
from .wyoming_context import Context, Offer
from .wyoming_handler import WyomingHandler
from .wyoming_mdns import Advertiser, warn_loopback

log = logging.getLogger(__name__)

LANGUAGES = ["zh", "en"]
ATTRIBUTION = ("2noise/ChatTTS (model weights: CC BY-NC 4.0, non-commercial)", "https://github.com/2noise/ChatTTS")
RETRY_S = 5.0
"""Seconds between two attempts to listen on a URI that could not be bound."""


def parse_uri(cfg: Config, uri: str) -> tuple[str, Any]:
    """``("tcp", (host, port))`` or ``("unix", Path)`` for one ``wyoming.uris`` entry (already
    validated by the config)."""
    r = urlparse(uri)
    if r.scheme == "tcp":
        return "tcp", (r.hostname, int(r.port))
    return "unix", cfg.resolve(r.netloc + r.path)


def uris(cfg: Config) -> list[str]:
    """``wyoming.uris`` as a list."""
    return list(cfg.wyoming.uris)


def check_free(cfg: Config) -> None:
    """Fail fast, before the model loads, when a Wyoming port or socket is taken.

    Raises:
        ConfigError: a TCP port is in use (or not bindable), or another process listens on a
            UNIX socket path (a stale socket file is removed).
    """
    for uri in uris(cfg):
        kind, where = parse_uri(cfg, uri)
        if kind == "unix":
            try:
                check_socket_path(where)
            except ConfigError as e:
                raise ConfigError(f"wyoming.uris {uri}: {e}") from e
            continue
        host, port = where
        for fam, typ, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            with socket.socket(fam, typ, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(addr)
                except OSError as e:
                    why = "the port is in use" if e.errno == errno.EADDRINUSE else e.strerror
                    raise ConfigError(f"wyoming.uris: cannot listen on {uri}: {why}; stop the other server "
                                      f"or choose another port") from e
            break


def build_info(cfg: Config) -> Any:
    """The ``info`` event ``describe`` is answered with (module docstring)."""
    from wyoming.info import Attribution, Info, TtsProgram, TtsVoice

    __version__ = version()
    att = Attribution(name=ATTRIBUTION[0], url=ATTRIBUTION[1])
    voices = [TtsVoice(name=v.name, attribution=att, installed=True, version=None, languages=list(LANGUAGES),
                       description=v.description or (v.voice if v.voice and v.voice.startswith("seed:")
                                                     else "speaker string" if v.voice
                                                     else f"synthesis.voice ({cfg.synthesis.voice[:24]})"))
              for v in cfg.voices]
    prog = TtsProgram(name="chattts-appliance", attribution=att, installed=True, version=__version__,
                      description=f"ChatTTS speech appliance {__version__} (code AGPL-3.0; ChatTTS weights "
                                  f"CC BY-NC 4.0, non-commercial use only)",
                      voices=voices, supports_synthesize_streaming=cfg.wyoming.streaming)
    return Info(tts=[prog]).event()


def offer(cfg: Config) -> Offer:
    """What a server with ``cfg`` offers: its ``info`` event and its voices by name (names: the
    pipeline resolves them)."""
    return Offer(build_info(cfg), {v.name: v.name for v in cfg.voices})


class WyomingServer:
    """Every ``wyoming.uris`` listener of one daemon, and the zeroconf advertisement.

    Args:
        cfg: the daemon's config (``wyoming``, ``service``, ``synthesis.voice``).
        dispatch: the daemon's dispatcher (its ``loop`` must be running: :meth:`start` is awaited
            on it).
        listening, mdns: the ``wyoming`` and ``mdns`` health conditions (None: unread ones).
    """

    def __init__(self, cfg: Config, dispatch: Dispatcher, listening: Optional[ConditionFlag] = None,
                 mdns: Optional[ConditionFlag] = None) -> None:
        w = cfg.wyoming
        self.cfg = cfg
        self.ctx = Context(
            dispatch=dispatch, offer=offer(cfg),
            channel=w.channel or cfg.service.channels[0].name, priority=w.priority, play=w.play,
            streaming=w.streaming, max_chars=cfg.service.max_text_chars,
            max_line=cfg.service.max_line_bytes, max_payload=w.max_payload_bytes,
            max_buffered_ms=w.max_buffered_ms, start_timeout_s=w.start_timeout_s,
            write_timeout_s=w.write_timeout_s, keepalive_s=w.keepalive_s,
            waiting=lambda ch: dispatch.worker.status().get(ch, {}).get("waiting"))
        self.servers: list[Any] = []
        self.listening = listening or ConditionFlag("wyoming")
        self.mdns = mdns or ConditionFlag("mdns")
        self._failed: dict[str, str] = {}          # uri -> why it does not listen
        self._retry: Optional[asyncio.Task] = None
        self._advertiser: Optional[Advertiser] = None

    def use_voices(self, cfg: Config) -> None:
        """Offer the voices of ``cfg`` from now on (a reload, SIGHUP; the loop's thread): ``describe``
        lists them and ``synthesize`` takes them, on open connections too."""
        self.ctx.use(offer(cfg))
        log.info("wyoming: voices now %s", ", ".join(self.ctx.voices))

    async def start(self) -> None:
        """Listen on every URI (one that cannot: health, retried), then advertise over zeroconf
        (if configured). Never raises for a URI."""
        for uri in uris(self.cfg):
            await self._listen(uri)
        self._report()
        if self._failed:
            self._retry = asyncio.get_running_loop().create_task(self._retry_loop(), name="wyoming listen retry")
        if self.cfg.wyoming.zeroconf:
            await self._advertise()

    async def _listen(self, uri: str) -> bool:
        """Listen on ``uri``; False (and why, in :attr:`_failed`) when it cannot."""
        from wyoming.server import AsyncTcpServer, AsyncUnixServer

        factory = partial(WyomingHandler, self.ctx)
        kind, where = parse_uri(self.cfg, uri)
        try:
            if kind == "tcp":
                srv = AsyncTcpServer(*where)
            else:
                check_socket_path(where)          # never take over a live socket
                where.parent.mkdir(parents=True, exist_ok=True)
                srv = AsyncUnixServer(where)
            await srv.start(factory)
        except (OSError, ConfigError) as e:
            why = ("the port is in use" if getattr(e, "errno", None) == errno.EADDRINUSE
                   else getattr(e, "strerror", None) or str(e))
            if self._failed.get(uri) != why:
                log.error("wyoming.uris: cannot listen on %s: %s; retrying every %g s (the box runs without it)",
                          uri, why, RETRY_S)
            self._failed[uri] = why
            return False
        if kind == "unix":
            os.chmod(where, self.cfg.service.socket_mode)
        self.servers.append(srv)
        if self._failed.pop(uri, None) is not None:
            log.info("wyoming: %s listens now", uri)
        log.info("wyoming: listening on %s (channel %s, priority %s, %s, streaming %s, voices %s)", uri,
                 self.ctx.channel, self.ctx.priority, "also played here" if self.ctx.play else "audio to the client only",
                 "on" if self.ctx.streaming else "off", ", ".join(self.ctx.voices))
        return True

    def _report(self) -> None:
        self.listening.update("; ".join(f"cannot listen on {u}: {why} (retrying every {RETRY_S:g} s)"
                                        for u, why in self._failed.items()) or None)

    async def _retry_loop(self) -> None:
        while self._failed:
            await asyncio.sleep(RETRY_S)
            for uri in list(self._failed):
                await self._listen(uri)
            self._report()

    async def stop(self) -> None:
        """Withdraw the advertisement, close every connection (their requests are cancelled)
        and the listeners (UNIX socket files are removed)."""
        if self._retry is not None:
            self._retry.cancel()
        if self._advertiser is not None:
            await self._advertiser.stop()
            self._advertiser = None
        for srv in self.servers:
            try:
                await asyncio.wait_for(srv.stop(), 5.0)
            except Exception as e:  # noqa: BLE001
                log.warning("wyoming: stopping a listener: %s", e)
        self.servers.clear()

    async def _advertise(self) -> None:
        tcp = [parse_uri(self.cfg, u)[1] for u in uris(self.cfg) if parse_uri(self.cfg, u)[0] == "tcp"]
        if not tcp:
            log.warning("wyoming.zeroconf: no tcp:// URI to advertise (zeroconf works over TCP only)")
            return
        host, port = tcp[0]
        name = self.cfg.wyoming.zeroconf_name or f"chattts-{socket.gethostname()}"
        self._advertiser = Advertiser(name, host, port, self.mdns)
        await self._advertiser.start()


def voice_names(cfg: Config) -> list[str]:
    """Names of the configured voices (config ``voices``), Wyoming's default first."""
    return [v.name for v in cfg.voices]


__all__ = ["WyomingServer", "check_free", "build_info", "parse_uri", "voice_names", "warn_loopback"]
