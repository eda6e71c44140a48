"""The daemon: ``chattts-appliance serve --config config.yaml``.

Start-up order: :func:`~appliance.config.load_config` (every key validated before anything
heavy) -> the directories it writes to checked and created (:mod:`appliance.service.paths`) ->
``Pipeline.from_config`` (checkpoint sha256 verified, weights, tokenizer) -> ``pipeline.warmup()``
(if ``service.warmup``) -> the runner sized to ``service.memory_budget_mb``
(:mod:`appliance.service.memory`) -> the look-ahead calibrated where the engines have none
(:func:`~appliance.synth.calibration.calibrate_pipeline`, ``stream.calibrate_at_start``) -> audio outputs opened
(:class:`~appliance.audio.output.AudioOutput`) -> the request journal read
(:mod:`appliance.service.journal`) -> worker thread started -> the journal's unfinished requests
submitted again (:mod:`appliance.service.recovery`) -> UNIX socket listening (an inherited
systemd socket if there is one) -> Wyoming server listening (if ``wyoming.enabled``;
:mod:`appliance.transports.wyoming_server`; its ports are checked before the model loads) -> MQTT
bridge connecting (if ``mqtt.enabled``; :mod:`appliance.transports.mqtt`; built before the model
loads so a bad ``mqtt.ca_file`` fails fast) -> ``on_ready``.

Threads and how events flow::

    main thread: asyncio loop            prepare thread          worker thread      audio threads
    SocketServer reads a line
      -> Dispatcher.handle_line
         parse_line / limits / channel
         await prepare(speak) ---------> Pipeline.prepare
         Worker.submit -> sink(Accepted)
                                                                 BatchEngine.step()
                                                                 (all channels, one batch)
         Connection.send <-- call_soon_threadsafe ------------- sink(Started / AudioChunk)
                                                                 RequestAudio.write -> FIFO -> PortAudio
         Connection.send <-- call_soon_threadsafe --------------------------------- sink(Done) when played

Requests are dispatched by :class:`~appliance.service.dispatch.Dispatcher` (``Pipeline.prepare``
on its own thread, then the worker). ``done.ttfb_ms`` runs from the request's arrival to its
first sample written to the sound device (or the WAV file, or the client), queue wait included;
``done.synthesis_ttfb_ms`` is the pipeline's own part (run start to first chunk).

The loop never runs synthesis; the worker never touches a socket. Dispatch is transport-neutral:
MQTT parses its messages into the same request dataclasses and, from its own thread, calls
``Dispatcher.handle_request_threadsafe`` with its own sink; each Wyoming connection (on the loop)
passes its own audio sink down with each request (bounded, never blocking the worker).

Stop (SIGTERM / SIGINT): ``on_stopping`` -> stop accepting connections -> queued requests
that never started go to ``on_unfinished`` (default:
:func:`~appliance.service.recovery.tell_stopped`: they stay in the journal, their clients get an
``error`` ``spooled``, and they are spoken after the next start) -> the running request
finishes and plays out (drain) -> audio streams closed -> MQTT: last status, ``offline``,
disconnect -> Wyoming connections and listeners closed -> connections flushed and closed
-> socket file removed -> exit status 0, without the interpreter's teardown (:mod:`.leave`).
A second signal while draining cancels the running request.
systemd wiring points: :class:`~appliance.daemon.hooks.Hooks` (when each fires).

Health: with ``health.at_start`` the field health check runs once after warm-up (logged, kept
in ``Daemon.last_health``); a ``{"type":"health"}`` request runs it on the worker thread
before the next queued request and answers with a ``health`` event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..audio.output import AudioOutput
from ..config import Config, load_config
from ..errors import ApplianceError
from ..messages.protocol import Event, HealthReply, StatusReply
from ..ops.integrity_watch import IntegrityWatch
from ..service.dispatch import Dispatcher
from ..service.journal import Journal
from ..service.memory import MemoryFit, current_mib, fit_before_load, fit_pipeline, status_fields
from ..service.paths import prepare_dirs
from ..service.peers import RateLimiter
from ..service.recovery import Recovery, open_journal, tell_stopped
from ..service.reload import plan_reload
from ..service.request import Request
from ..service.worker import Worker
from ..synth.calibration import calibrate_pipeline
from ..synth.checkpoint_dir import require_checkpoint
from ..transports.socket_server import (
    SocketServer,
    check_socket_path,
    inherited_socket,
    listen_socket,
)
from .hooks import Hooks, build_hooks, call_hook
from .leave import leave

if TYPE_CHECKING:
    from ..ops.throttle import Change, Monitor
    from ..synth.pipeline import Pipeline
    from ..transports.mqtt import MQTTBridge
    from ..transports.wyoming_server import WyomingServer

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.25
"""Worker heartbeat period, s: well below the shortest useful WatchdogSec (1 s)."""

DRAIN_TIMEOUT_S = 600.0   # longest wait for the running request to finish and play out at stop, s


class _StopDuringStart(BaseException):
    """SIGTERM/SIGINT during start-up. A BaseException (as KeyboardInterrupt): raised wherever the
    main thread is, it must not be swallowed by an ``except Exception`` there (a start-up hook's
    did, and the daemon ignored the stop and began serving)."""


class Daemon:
    """The service: pipeline + audio + worker + socket.

    Args:
        cfg: validated configuration.
        hooks: systemd / spool callbacks.
        pipeline_factory: ``cfg -> pipeline`` (default ``Pipeline.from_config``).
        config_path: the file SIGHUP re-reads (:meth:`reload_config`).

    Attributes:
        dispatch: the :class:`~appliance.service.dispatch.Dispatcher` every transport uses.
    """

    def __init__(self, cfg: Config, hooks: Optional[Hooks] = None,
                 pipeline_factory: Optional[Callable[[Config], Pipeline]] = None,
                 config_path: Optional[str] = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.hooks = hooks or Hooks()
        self.pipeline_factory = pipeline_factory
        self.state = "starting"
        self.pipeline: Optional[Pipeline] = None
        self.audio = AudioOutput(cfg)
        self.worker: Optional[Worker] = None
        self.server: Optional[SocketServer] = None
        self.channels = [c.name for c in cfg.service.channels]
        self.dispatch = Dispatcher(cfg.service, lambda: self.state, self.status, self._health_check,
                                   RateLimiter(cfg.safety.max_requests_per_s, cfg.safety.request_burst))
        self.journal: Optional[Journal] = None
        self.recovery: Optional[Recovery] = None
        self.memory_fit: Optional[MemoryFit] = None
        self._stop: Optional[asyncio.Event] = None
        self._signals = 0
        self._pending_signals: list[int] = []
        self._socket_path: Optional[Path] = None
        self.last_health: Optional[HealthReply] = None
        self.integrity: Optional[IntegrityWatch] = None   # re-hashes the loaded weight files (safety.reverify_mib_per_s)
        self.throttle: Optional[Monitor] = None   # telemetry -> level -> scheduler limits
        self.mqtt: Optional[MQTTBridge] = None    # when mqtt.enabled (built in _load, started at ready)
        self.wyoming: Optional[WyomingServer] = None   # when wyoming.enabled (started with the socket)

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
        try:
            try:
                if self.pipeline_factory is None:               # a wrong model.path: before any directory is made
                    require_checkpoint(self.cfg)
                prepare_dirs(self.cfg, socket_inherited=bool(os.environ.get("LISTEN_FDS")))
                if not os.environ.get("LISTEN_FDS"):       # fail fast if another daemon has the socket
                    check_socket_path(self.cfg.resolve(self.cfg.service.socket))
                if self.cfg.wyoming.enabled:                 # ... or the Wyoming port
                    from ..transports.wyoming_server import check_free
                    check_free(self.cfg)
                self._load()
            except _StopDuringStart as e:
                log.info("%s during start-up; exiting", e)
                return 0
            for s in prev:
                signal.signal(s, remember)
            asyncio.run(self._serve())
        finally:
            for s, h in prev.items():
                signal.signal(s, h)
            self.dispatch.close()
        log.info("stopped")
        return 0

    def _load(self) -> None:
        t0 = time.monotonic()
        if self.cfg.mqtt.enabled:      # built first: a bad mqtt.ca_file fails before the model loads
            from ..transports.mqtt import MQTTBridge
            self.mqtt = MQTTBridge(self.cfg, self.dispatch.handle_request_threadsafe, self.status)
        call_hook(self.hooks.on_loading, "loading the model")
        factory = self.pipeline_factory
        if factory is None:
            from ..synth.pipeline import Pipeline
            factory = Pipeline.from_config
            # sized to the budget from the known sizes before anything is compiled or captured
            self.cfg, self.memory_fit = fit_before_load(self.cfg, Pipeline.planned_sizes)
        self.pipeline = factory(self.cfg)
        log.info("pipeline loaded in %.1f s (backend %s)", time.monotonic() - t0, self.pipeline.info.backend)
        if self.cfg.service.warmup:
            call_hook(self.hooks.on_loading, "warming up")
            t1 = time.monotonic()
            self.pipeline.warmup()
            log.info("warm-up took %.1f s", time.monotonic() - t1)
        before = self.memory_fit
        self.pipeline, self.memory_fit = fit_pipeline(self.cfg, self.pipeline, factory, self.cfg.service.warmup)
        if before is not None and before.action == "shrink":   # STATUS keeps saying what was lowered before the load
            self.memory_fit = before if self.memory_fit.action == "fits" else dataclasses.replace(
                self.memory_fit, text=f"before the load: {before.text}; after warm-up: {self.memory_fit.text}")
        if self.cfg.stream.calibrate_at_start and self.pipeline.lookahead.missing:   # a fresh box, before it serves
            call_hook(self.hooks.on_loading, "calibrating the look-ahead (no calibration for these engines)")
            calibrate_pipeline(self.cfg, self.pipeline)
        self.integrity = IntegrityWatch(getattr(self.pipeline.runner, "weight_files", ()), self.cfg.safety.reverify_mib_per_s)
        self.integrity.start()
        if self.cfg.health.at_start:
            call_hook(self.hooks.on_loading, "health check")
            self._health_check()
        call_hook(self.hooks.on_loading, "opening audio outputs")
        self.audio.start()
        self.journal, self.recovery = open_journal(self.cfg, self.dispatch)
        self.throttle = self._open_throttle()
        self.worker = Worker(
            self.pipeline, self.audio,
            queue_len={c.name: c.queue_len for c in self.cfg.service.channels},
            heartbeat_s=HEARTBEAT_S, on_heartbeat=self.hooks.on_heartbeat, on_finished=self._on_finished,
            audio_format=self.cfg.stream.sample_format,
            on_preempt={c.name: c.on_preempt for c in self.cfg.service.channels},
            throttle=self.throttle, journal=self.journal, stall_s=self.cfg.safety.stall_s,
        )
        self.worker.start()
        self.dispatch.pipeline, self.dispatch.worker = self.pipeline, self.worker

    def _open_throttle(self) -> Optional[Monitor]:
        """Start the throttle monitor; None (logged) if telemetry cannot be opened."""
        from ..ops.throttle import Monitor

        try:
            mon = Monitor(self.cfg, on_change=self._on_throttle)
            mon.budget_mib = lambda: current_mib(self.pipeline)
            mon.start()
        except ApplianceError as e:
            log.warning("throttle off: %s", e)
            return None
        return mon

    def _on_throttle(self, change: Change) -> None:
        if self.worker is not None:
            self.worker.poke()
        call_hook(self.hooks.on_status, self.status())

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        self.dispatch.loop = loop
        self._stop = asyncio.Event()
        for s in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(s, self.request_stop, s)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        sock = inherited_socket()
        if sock is None:
            self._socket_path = self.cfg.resolve(self.cfg.service.socket)
            sock = listen_socket(self._socket_path, self.cfg.service.socket_mode)
        if self.recovery is not None:   # before the socket accepts: a returning client finds its request
            await self.recovery.replay(self.dispatch.resubmit,
                                       self.mqtt.sink if self.mqtt else None,
                                       self.mqtt.recent.add if self.mqtt else None)
        self.server = SocketServer(sock, self.dispatch.handle_line, self.cfg.service.max_line_bytes,
                                   on_gone=self.dispatch.client_gone)
        await self.server.start()
        if self.cfg.wyoming.enabled:
            from ..transports.wyoming_server import WyomingServer
            self.wyoming = WyomingServer(self.cfg, self.dispatch)
            try:
                await self.wyoming.start()
            except ApplianceError:
                await self.wyoming.stop()
                await self.server.close()
                if self._socket_path is not None:
                    self._socket_path.unlink(missing_ok=True)
                raise
        self.state = "ready"
        log.info("ready: channels %s, audio %s", ", ".join(self.channels), self.audio.mode)
        if self.mqtt is not None:
            self.mqtt.start()
        call_hook(self.hooks.on_ready)
        call_hook(self.hooks.on_status, self.status())
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
        elif self.worker is not None:
            cur = self.worker.status()
            ids = [c["active"] for c in cur.values() if c["active"]]
            log.warning("second %s: cancelling %s", signal.Signals(signum).name, ", ".join(ids) or "nothing")
            for i in ids:
                self.worker.cancel(request_id=i)

    def _on_sighup(self) -> None:
        call_hook(self.hooks.on_reload)
        call_hook(self.hooks.on_reloaded, self.reload_config())

    def reload_config(self) -> str:
        """Re-read the config file (SIGHUP): apply the live sections
        (:data:`~appliance.service.reload.LIVE_SECTIONS`) to the daemon and the pipeline, report
        the rest. Returns the status line for systemd (``READY=1`` follows)."""
        if not self.config_path:
            return "ready (no config file to re-read)"
        assert self.pipeline is not None
        r = plan_reload(self.config_path, self.cfg, self.pipeline.info.text_mode, self.pipeline.info.backend)
        if r.live:
            self.cfg = dataclasses.replace(self.cfg, **r.live)
            self.pipeline.cfg = dataclasses.replace(self.pipeline.cfg, **r.live)
        return r.status

    async def _shutdown(self) -> None:
        loop = asyncio.get_running_loop()
        assert self.server is not None and self.worker is not None
        self.server.stop_accepting()
        left = await loop.run_in_executor(None, self.worker.stop)
        if left:
            if self.hooks.on_unfinished is not None:
                call_hook(self.hooks.on_unfinished, left)
            else:
                tell_stopped(left, self.journal is not None)
        if not await loop.run_in_executor(None, self.worker.wait_idle, DRAIN_TIMEOUT_S):
            log.warning("drain timed out after %.0f s", DRAIN_TIMEOUT_S)
        await loop.run_in_executor(None, self.audio.close)
        if self.throttle is not None:
            self.throttle.close()
        if self.integrity is not None:
            self.integrity.stop()
        call_hook(self.hooks.on_status, self.status())
        if self.mqtt is not None:      # after the drain: the last events, then 'offline'
            await loop.run_in_executor(None, self.mqtt.stop)
        if self.wyoming is not None:   # after the drain: the running request's audio went out
            await self.wyoming.stop()
        await self.server.close()
        if self.journal is not None:
            self.journal.close()
        if self._socket_path is not None:
            try:
                self._socket_path.unlink()
            except OSError:
                pass

    def _health_check(self) -> HealthReply:
        """The field health check (on the pipeline's thread); its reply, kept as :attr:`last_health`."""
        from ..ops.health import run_health_check

        watch, worker = self.integrity, self.worker     # no worker yet: the check at start
        self.last_health = run_health_check(self.pipeline, self.cfg, watch.failure if watch is not None else None,
                                            beat=worker.beat if worker is not None else lambda: None)
        if not self.last_health.healthy:
            log.warning("health check: UNHEALTHY: %s", "; ".join(self.last_health.reasons))
        return self.last_health

    def _on_finished(self, item: Request, event: Event) -> None:
        call_hook(self.hooks.on_status, self.status())

    def status(self) -> StatusReply:
        """Current :class:`StatusReply` (thread-safe)."""
        chans = {}
        wst = self.worker.status() if self.worker is not None else {}
        for name in self.channels:
            c = dict(wst.get(name, {"queued": 0, "active": None}))
            c.update(self.audio.status(name))
            c.update(self.worker.starts.status(name) if self.worker is not None and self.worker.starts else {})
            chans[name] = c
        return StatusReply(
            state=self.state, backend=self.pipeline.info.backend if self.pipeline is not None else "", channels=chans,
            last_rtf=round(self.worker.last_rtf, 4) if self.worker and self.worker.last_rtf is not None else None,
            last_ttfb_ms=round(self.worker.last_ttfb_ms, 1) if self.worker and self.worker.last_ttfb_ms is not None else None,
            throttle=self.throttle.level if self.throttle is not None else "normal",
            temperature_c=self.throttle.temperature_c if self.throttle is not None else None,
            **status_fields(self.cfg, self.pipeline, self.memory_fit),
        )


def cli_main(args: Any) -> int:
    """``chattts-appliance serve --config PATH``: exits 0 after a clean stop (never returns then)."""
    cfg = load_config(args.config)
    log.info("config %s: model %s, backend %s, socket %s, audio %s",
             os.path.abspath(args.config), cfg.resolve(cfg.model.path), cfg.model.backend,
             cfg.resolve(cfg.service.socket), cfg.audio.output)
    leave(Daemon(cfg, hooks=build_hooks(cfg), config_path=os.path.abspath(args.config)).run())
