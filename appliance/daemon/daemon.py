"""The daemon: ``chattts-appliance serve --config config.yaml``.

Start-up order: :func:`~appliance.config.load_config` (every key validated before anything
heavy) -> :func:`~appliance.daemon.build.check` (the checkpoint, the directories it writes to
(:mod:`appliance.daemon.paths`), the socket, the Wyoming ports, the MQTT CA bundle) ->
:func:`~appliance.daemon.build.build`: the pipeline loaded, warmed up and sized to
``service.memory_budget_mb`` (:mod:`appliance.daemon.memory`), the weights' watch, the health
check, the audio outputs, the request journal, the throttle, the worker thread, the dispatcher,
the MQTT bridge, each built complete -> in the event loop: the journal's unfinished requests
submitted again (:mod:`appliance.service.recovery`) -> UNIX socket listening (an inherited
systemd socket if there is one) -> Wyoming server listening (if ``wyoming.enabled``;
:mod:`appliance.transports.wyoming_server`) -> MQTT bridge connecting (if ``mqtt.enabled``;
:mod:`appliance.transports.mqtt`) -> ``on_ready``.

The loop never runs synthesis; the worker never touches a socket. Which thread does what, and a
request's walk through the modules: ``docs/architecture.md``. ``done.ttfb_ms`` runs from the
request's arrival to its first sample written to the sound device (or the WAV file, or the
client), queue wait included; ``done.synthesis_ttfb_ms`` is the pipeline's own part.

Stop (SIGTERM / SIGINT): ``on_stopping`` -> stop accepting connections -> queued requests
that never started go to ``on_unfinished`` (default:
:func:`~appliance.service.recovery.tell_stopped`: they stay in the journal, their clients get an
``error`` ``spooled``, and they are spoken after the next start) -> the running request
finishes and plays out (drain) -> audio streams closed -> MQTT: last status, ``offline``,
disconnect -> Wyoming connections and listeners closed -> connections flushed and closed
-> socket file removed -> exit status 0, without the interpreter's teardown (:mod:`.leave`).
A second signal while draining cancels the running request.
systemd wiring points: :class:`~appliance.daemon.hooks.Hooks` (when each fires).

Health: one verdict (:class:`~appliance.ops.verdict.Health`: throttle, sound devices, weights,
the last field check, a failed reload) for ``status``, ``STATUS=`` (re-read every second), MQTT
and ``health``. The field check runs after warm-up (``health.at_start``) and for a ``health``
request, on the worker thread before the next queued request (kept in ``Daemon.last_health``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..audio.volume import Volume
from ..config import Config, load_config
from ..errors import ApplianceError
from ..messages.protocol import Event, HealthReply, StatusReply
from ..service.dispatch import Dispatcher
from ..service.recovery import tell_stopped
from ..service.request import Request
from ..transports.socket_server import SocketServer, inherited_socket, listen_socket
from .build import Parts, Ports, build, check
from .hooks import Hooks, build_hooks, call_hook
from .leave import leave
from .memory import status_fields
from .reload import Coalescer, plan_reload

if TYPE_CHECKING:
    from ..ops.throttle import Change
    from ..synth.pipeline import Pipeline
    from ..transports.wyoming_server import WyomingServer

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 600.0   # longest wait for the running request to finish and play out at stop, s


class _StopDuringStart(BaseException):
    """SIGTERM/SIGINT during start-up. A BaseException (as KeyboardInterrupt): raised wherever the
    main thread is, it must not be swallowed by an ``except Exception`` there (a start-up hook's
    did, and the daemon ignored the stop and began serving)."""


class Daemon:
    """The service: its parts (:mod:`appliance.daemon.build`), the event loop, the servers, the signals.

    Args:
        cfg: validated configuration.
        hooks: systemd / spool callbacks.
        pipeline_factory: ``cfg -> pipeline`` (default ``Pipeline.from_config``).
        config_path: the file SIGHUP re-reads (:meth:`reload_config`).

    Attributes:
        parts: every part, built complete when :meth:`run` loads (None before).
        dispatch: the :class:`~appliance.service.dispatch.Dispatcher` every transport uses (None
            before the load).
        last_health: the latest field health check's reply.
    """

    def __init__(self, cfg: Config, hooks: Optional[Hooks] = None,
                 pipeline_factory: Optional[Callable[[Config], Pipeline]] = None,
                 config_path: Optional[str] = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.hooks = hooks or Hooks()
        self.pipeline_factory = pipeline_factory
        self.state = "starting"
        self.channels = [c.name for c in cfg.service.channels]
        self.parts: Optional[Parts] = None
        self.last_health: Optional[HealthReply] = None
        self.server: Optional[SocketServer] = None
        self.wyoming: Optional[WyomingServer] = None   # when wyoming.enabled (started with the socket)
        self._stop: Optional[asyncio.Event] = None
        self._signals = 0
        self._pending_signals: list[int] = []
        self._socket_path: Optional[Path] = None

    @property
    def dispatch(self) -> Optional[Dispatcher]:
        """The dispatcher every transport uses (None before the parts are built)."""
        return self.parts.dispatch if self.parts is not None else None

    # ------------------------------------------------------------------ life cycle

    def run(self) -> int:
        """Load, warm up, serve until SIGTERM/SIGINT, drain; returns the exit status (0).

        Raises:
            ApplianceError: start-up failed (bad checkpoint, socket in use, ...).
        """
        def early_stop(signum, frame):
            raise _StopDuringStart(signal.Signals(signum).name)

        def remember(signum, frame):   # between start-up and the loop's own handlers
            self._pending_signals.append(signum)
        prev = {s: signal.signal(s, early_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        loop = asyncio.new_event_loop()
        try:
            try:
                check(self.cfg, own_model=self.pipeline_factory is None)
                ports = Ports(lambda: self.state, self.status, self._health_check, self._on_finished, self._on_throttle)
                self.parts = build(self.cfg, self.hooks, ports, loop, self.pipeline_factory)
            except _StopDuringStart as e:
                log.info("%s during start-up; exiting", e)
                return 0
            self.cfg, self.last_health = self.parts.cfg, self.parts.start_health
            for s in prev:
                signal.signal(s, remember)
            _run(loop, self._serve())
        finally:
            for s, h in prev.items():
                signal.signal(s, h)
            if not loop.is_closed():
                loop.close()
            if self.parts is not None:
                self.parts.dispatch.close()
        log.info("stopped")
        return 0

    def _on_throttle(self, change: Change) -> None:
        if self.parts is not None:
            self.parts.worker.poke()
        call_hook(self.hooks.on_status, self.status())

    async def _serve(self) -> None:
        p = self.parts
        assert p is not None
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for s in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(s, self.request_stop, s)
        reloads = Coalescer(loop, lambda: call_hook(self.hooks.on_reload),
                            lambda: call_hook(self.hooks.on_reloaded, self.reload_config()))
        loop.add_signal_handler(signal.SIGHUP, reloads.signal)    # a burst of them: one reload
        sock = inherited_socket()
        if sock is None:
            self._socket_path = self.cfg.resolve(self.cfg.service.socket)
            sock = listen_socket(self._socket_path, self.cfg.service.socket_mode, group=self.cfg.service.socket_group)
        if p.recovery is not None:   # before the socket accepts: a returning client finds its request
            await p.recovery.replay(p.dispatch.resubmit, p.mqtt.sink if p.mqtt else None,
                                    p.mqtt.recent.add if p.mqtt else None)
        self.server = SocketServer(sock, p.dispatch.handle_line, self.cfg.service.max_line_bytes,
                                   on_gone=p.dispatch.client_gone, max_buffered_ms=self.cfg.service.max_buffered_ms,
                                   sample_format=self.cfg.stream.sample_format, limits=self.cfg.service)
        await self.server.start()
        if self.cfg.wyoming.enabled:
            from ..transports.wyoming_server import WyomingServer
            self.wyoming = WyomingServer(self.cfg, p.dispatch, p.net.wyoming, p.net.mdns)
            try:
                await self.wyoming.start()
            except ApplianceError:
                await self.wyoming.stop()
                await self.server.close()
                if self._socket_path is not None:
                    self._socket_path.unlink(missing_ok=True)
                raise
        self.state = "ready"
        st = self.status()
        log.info("ready: channels %s, audio %s, memory all-in %s MiB (%s), torch %s", ", ".join(self.channels),
                 p.audio.mode, st.memory_all_in_mib, st.memory_kind, "loaded" if st.torch_loaded else "not loaded")
        if p.mqtt is not None:
            p.mqtt.start()
        call_hook(self.hooks.on_ready)
        call_hook(self.hooks.on_status, self.status())
        p.health.watch(lambda verdict: call_hook(self.hooks.on_status, self.status()))
        for s in self._pending_signals[:1]:     # arrived between start-up and the loop's handlers
            self.request_stop(s)
        await self._stop.wait()
        await self._shutdown()

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Begin the drain-and-exit sequence (signal handler; loop thread)."""
        self._signals += 1
        if self._signals == 1:
            log.info("%s: stopping (finishing the running request)", signal.Signals(signum).name)
            self.state = "stopping"
            call_hook(self.hooks.on_stopping)
            if self._stop is not None:
                self._stop.set()
        elif self.parts is not None:
            worker = self.parts.worker
            ids = [c["active"] for c in worker.status().values() if c["active"]]
            log.warning("second %s: cancelling %s", signal.Signals(signum).name, ", ".join(ids) or "nothing")
            for i in ids:
                worker.cancel(request_id=i)

    def reload_config(self) -> str:
        """Re-read the config file (SIGHUP, :mod:`appliance.daemon.reload`): apply the live sections
        to the daemon's config and to the parts that use them (``synthesis`` and ``voices``: the
        pipeline, Wyoming's offer, the MQTT voice select; the volume: the sound devices), report
        the rest; a failed reload raises ``reload_failed`` until a good one. Returns the status
        line for systemd (``READY=1`` follows)."""
        if not self.config_path:
            return "ready (no config file to re-read)"
        p = self.parts
        assert p is not None
        info = p.pipeline.info
        r = plan_reload(self.config_path, self.cfg, info.text_mode, info.backend, info.hidden_size)
        p.reload_failed.update(r.failed)
        if p.mqtt is not None:        # the CA bundle re-read (a replaced one is used from the next connection)
            p.mqtt.reload_tls()
        if r.live:
            self.cfg = dataclasses.replace(self.cfg, **r.live)
            if "synthesis" in r.live:
                p.pipeline.use_synthesis(self.cfg.synthesis)
            if "voices" in r.live:
                p.pipeline.use_voices(self.cfg.voices)
                if p.mqtt is not None:
                    p.mqtt.use_voices([v.name for v in self.cfg.voices])
            if self.wyoming is not None and ("voices" in r.live or "synthesis" in r.live):
                self.wyoming.use_voices(self.cfg)
            if r.volume:
                p.audio.use_volume(Volume.from_config(self.cfg))
        p.audio.reroute()              # the sound route (default, an .asoundrc entry) may point elsewhere now
        return r.status

    async def _shutdown(self) -> None:
        loop = asyncio.get_running_loop()
        p = self.parts
        assert self.server is not None and p is not None
        self.server.stop_accepting()
        left = await loop.run_in_executor(None, p.worker.stop)
        if left:
            if self.hooks.on_unfinished is not None:
                call_hook(self.hooks.on_unfinished, left)
            else:
                tell_stopped(left, p.journal is not None)
        if not await loop.run_in_executor(None, p.worker.wait_idle, DRAIN_TIMEOUT_S):
            log.warning("drain timed out after %.0f s", DRAIN_TIMEOUT_S)
        await loop.run_in_executor(None, p.audio.close)
        if p.throttle is not None:
            p.throttle.close()
        p.health.close()
        p.integrity.stop()
        call_hook(self.hooks.on_status, self.status())
        if p.mqtt is not None:         # after the drain: the last events, then 'offline'
            await loop.run_in_executor(None, p.mqtt.stop)
        if self.wyoming is not None:   # after the drain: the running request's audio went out
            await self.wyoming.stop()
        await self.server.close()
        if p.journal is not None:
            p.journal.close()
        if self._socket_path is not None:
            try:
                self._socket_path.unlink()
            except OSError:
                pass

    def _health_check(self) -> HealthReply:
        """The field health check on the worker thread (a ``health`` request), its findings recorded
        for the verdict; the verdict's reply, kept as :attr:`last_health`."""
        from ..ops.health import run_health_check

        p = self.parts
        assert p is not None
        check = run_health_check(p.pipeline, self.cfg, beat=p.worker.beat)
        p.checks.record(check)
        self.last_health = p.health.reply(check)   # the verdict's watch logs changes
        return self.last_health

    def _on_finished(self, item: Request, event: Event) -> None:
        call_hook(self.hooks.on_status, self.status())

    def status(self) -> StatusReply:
        """Current :class:`StatusReply` (thread-safe)."""
        p = self.parts
        wst = p.worker.status() if p is not None else {}
        chans = {}
        for name in self.channels:
            c = dict(wst.get(name, {"queued": 0, "active": None}))
            if p is not None:
                c.update(p.audio.status(name))
                c.update(p.worker.starts.status(name) if p.worker.starts else {})
            chans[name] = c
        w, th = (p.worker.ends if p else None), (p.throttle if p else None)
        return StatusReply(
            state=self.state, backend=p.pipeline.info.backend if p is not None else "", channels=chans,
            **(p.pipeline.info.thread_fields() if p is not None else {}),
            **(p.pipeline.info.network_fields() if p is not None else {}),
            last_rtf=round(w.last_rtf, 4) if w and w.last_rtf is not None else None,
            last_ttfb_ms=round(w.last_ttfb_ms, 1) if w and w.last_ttfb_ms is not None else None,
            throttle=th.level if th is not None else "normal",
            temperature_c=th.temperature_c if th is not None else None,
            **(p.health.fields() if p is not None else {}),
            **status_fields(self.cfg, p.pipeline if p else None, p.memory_fit if p else None),
        )


def _run(loop: asyncio.AbstractEventLoop, main) -> None:
    """:func:`asyncio.run` on a loop made beforehand (the parts are built with it): run ``main``,
    then cancel what is left, finish async generators and the default executor, close the loop."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(main)
    finally:
        try:
            left = asyncio.all_tasks(loop)
            for t in left:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def cli_main(args: Any) -> int:
    """``chattts-appliance serve --config PATH``: exits 0 after a clean stop (never returns then)."""
    cfg = load_config(args.config)
    log.info("config %s: model %s, backend %s, socket %s, audio %s",
             os.path.abspath(args.config), cfg.resolve(cfg.model.path), cfg.model.backend,
             cfg.resolve(cfg.service.socket), cfg.audio.output)
    leave(Daemon(cfg, hooks=build_hooks(cfg), config_path=os.path.abspath(args.config)).run())
