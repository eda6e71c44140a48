"""The daemon: ``chattts-appliance serve --config config.yaml``.

Start-up order: :func:`~appliance.config.load_config` (every key validated before anything
heavy) -> ``Pipeline.from_config`` (weights, tokenizer) -> ``pipeline.warmup()`` (if
``service.warmup``) -> audio outputs opened (:class:`~appliance.service.sound.AudioOutput`) ->
worker thread started -> UNIX socket listening (an inherited systemd socket if there is one)
-> MQTT bridge connecting (if ``mqtt.enabled``; :mod:`appliance.service.mqtt`; built before the
model loads so a bad ``mqtt.ca_file`` fails fast) -> ``on_ready``.

Threads and how events flow::

    main thread: asyncio loop            prepare thread          worker thread      audio threads
    SocketServer reads a line
      -> Daemon.handle_line
         parse_line / limits / channel
         await prepare(speak) ---------> Pipeline.prepare
         Worker.submit -> sink(Accepted)
                                                                 BatchEngine.step()
                                                                 (all channels, one batch)
         Connection.send <-- call_soon_threadsafe ------------- sink(Started / AudioChunk)
                                                                 RequestAudio.write -> FIFO -> PortAudio
         Connection.send <-- call_soon_threadsafe --------------------------------- sink(Done) when played

``Pipeline.prepare`` runs on its own single thread (so bad text is answered at once, even while
a long request synthesizes) concurrently with the worker thread, which drives the pipeline's
``BatchEngine`` (``engine.step()``): prepare must only read the tokenizer/normalizer, never the
runner or decode state. ``done.ttfb_ms`` is
measured here from accept to the first PCM chunk (queue wait included); the pipeline's own TTFB
(run start to first chunk) is logged beside it.

The loop never runs synthesis; the worker never touches a socket. ``Daemon.handle_line`` and
``Daemon.handle_request`` are transport-neutral: another input (MQTT) passes its own sink (an
:data:`~appliance.service.worker.EventSink`: thread-safe, non-blocking) and, from its own
thread, calls ``Daemon.handle_line_threadsafe``.

Stop (SIGTERM / SIGINT): ``on_stopping`` -> stop accepting connections -> queued requests
that never started go to ``on_unfinished`` (default: the spool, :meth:`Daemon._spool`: their
clients get an ``error`` ``spooled`` and they are spoken after the next start) -> the running request finishes and plays out (drain) -> audio
streams closed -> MQTT: last status, ``offline``, disconnect -> connections flushed and closed
-> socket file removed -> exit status 0.
A second signal while draining cancels the running request.

systemd wiring points (:class:`Hooks`, all optional, none may raise or block):

* ``on_loading(text)`` – during start-up stages (send ``EXTEND_TIMEOUT_USEC`` + ``STATUS=``).
* ``on_ready()`` – after warm-up, once the socket accepts (``READY=1``).
* ``on_status(StatusReply)`` – at ready, after every finished request (from the worker or the
  audio watcher thread), at stop (``STATUS=``).
* ``on_heartbeat()`` – from the worker thread, at least every ``heartbeat_s`` while it is
  healthy; a hung synthesis stops it (``WATCHDOG=1``).
* ``on_reload()`` – SIGHUP received (``RELOADING=1``); ``on_reloaded(status)`` once the reload is
  over (``READY=1``, with a status line saying what was applied and what needs a restart; see
  :meth:`Daemon.reload_config`).
* ``on_stopping()`` – SIGTERM/SIGINT received, before the drain (``STOPPING=1``).
* ``on_unfinished(items)`` – queued requests left at stop (spool them).

Health: with ``health.at_start`` the field health check runs once after warm-up (logged, kept
in ``Daemon.last_health``); a ``{"type":"health"}`` request runs it on the worker thread
before the next queued request and answers with a ``health`` event.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ..config import Config, load_config
from ..errors import (
    ApplianceError,
    BusyError,
    CancelledError,
    RequestError,
    TextError,
    UnknownChannelError,
)
from .protocol import (
    Cancel,
    ErrorEvent,
    EventSink,
    HealthRequest,
    Speak,
    StatusReply,
    StatusRequest,
    error_event,
    parse_line,
    parse_request,
    to_dict,
)
from .scheduler import Item
from .socket_server import (
    SocketServer,
    check_socket_path,
    inherited_socket,
    listen_socket,
)
from .sound import AudioOutput
from .worker import Worker

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
"""Worker heartbeat period, s (systemd's WatchdogSec should be several times this)."""

DRAIN_TIMEOUT_S = 600.0
"""Longest wait for the running request to finish and play out at stop, s."""


@dataclass
class Hooks:
    """Callbacks for systemd notify and spooling (see the module docstring for when each fires)."""

    on_loading: Optional[Callable[[str], None]] = None
    on_ready: Optional[Callable[[], None]] = None
    on_status: Optional[Callable[[StatusReply], None]] = None
    on_heartbeat: Optional[Callable[[], None]] = None
    on_reload: Optional[Callable[[], None]] = None
    on_reloaded: Optional[Callable[[str], None]] = None   # status line after the reload
    on_stopping: Optional[Callable[[], None]] = None
    on_unfinished: Optional[Callable[[list], None]] = None


class _StopDuringStart(Exception):
    pass


def _call(hook: Optional[Callable], *args: Any) -> None:
    if hook is not None:
        try:
            hook(*args)
        except Exception:
            log.exception("hook %s failed", getattr(hook, "__name__", hook))


class Daemon:
    """The service: pipeline + audio + worker + socket.

    Args:
        cfg: validated configuration.
        hooks: systemd / spool callbacks.
        pipeline_factory: ``cfg -> pipeline`` (default ``Pipeline.from_config``); the pipeline
            needs ``prepare(speak)``, ``engine`` (a :class:`~appliance.synth.batch.BatchEngine`),
            ``run(job, cancel)`` (health check), ``warmup()`` and ``info``.
        config_path: the file SIGHUP re-reads (:meth:`reload_config`).
    """

    def __init__(self, cfg: Config, hooks: Optional[Hooks] = None,
                 pipeline_factory: Optional[Callable[[Config], Any]] = None,
                 config_path: Optional[str] = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.hooks = hooks or Hooks()
        self.pipeline_factory = pipeline_factory
        self.state = "starting"
        self.pipeline: Any = None
        self.audio = AudioOutput(cfg)
        self.worker: Optional[Worker] = None
        self.server: Optional[SocketServer] = None
        self.channels = [c.name for c in cfg.service.channels]
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._signals = 0
        self._pending_signals: list[int] = []
        self._prep = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare")
        self._socket_path: Optional[Path] = None
        self.last_health: Any = None
        self.throttle: Any = None  # throttle.Monitor (telemetry -> level -> scheduler limits)
        self.mqtt: Any = None      # MQTTBridge when mqtt.enabled (built in _load, started at ready)

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
                if not os.environ.get("LISTEN_FDS"):       # fail fast if another daemon has the socket
                    check_socket_path(self.cfg.resolve(self.cfg.service.socket))
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
            self._prep.shutdown(wait=False)
        log.info("stopped")
        return 0

    def _load(self) -> None:
        t0 = time.monotonic()
        if self.cfg.mqtt.enabled:      # built first: a bad mqtt.ca_file fails before the model loads
            from .mqtt import MQTTBridge
            self.mqtt = MQTTBridge(self.cfg, self.handle_line_threadsafe, self.status)
        _call(self.hooks.on_loading, "loading the model")
        if self.pipeline_factory is not None:
            self.pipeline = self.pipeline_factory(self.cfg)
        else:
            from ..synth.pipeline import Pipeline
            self.pipeline = Pipeline.from_config(self.cfg)
        info = getattr(self.pipeline, "info", None)
        log.info("pipeline loaded in %.1f s (backend %s)", time.monotonic() - t0, getattr(info, "backend", "?"))
        if self.cfg.service.warmup:
            _call(self.hooks.on_loading, "warming up")
            t1 = time.monotonic()
            self.pipeline.warmup()
            log.info("warm-up took %.1f s", time.monotonic() - t1)
        if self.cfg.health.at_start:
            _call(self.hooks.on_loading, "health check")
            self._health_check()
        _call(self.hooks.on_loading, "opening audio outputs")
        self.audio.start()
        self.throttle = self._open_throttle()
        self.worker = Worker(
            self.pipeline, self.audio,
            queue_len={c.name: c.queue_len for c in self.cfg.service.channels},
            heartbeat_s=HEARTBEAT_S, on_heartbeat=self.hooks.on_heartbeat, on_finished=self._on_finished,
            audio_format=self.cfg.stream.sample_format,
            on_preempt={c.name: c.on_preempt for c in self.cfg.service.channels},
            memory_budget_mb=self.cfg.service.memory_budget_mb, throttle=self.throttle,
        )
        self.worker.start()

    def _open_throttle(self) -> Any:
        """Start the throttle monitor; None (logged) if telemetry cannot be opened."""
        from .throttle import Monitor

        try:
            mon = Monitor(self.cfg, on_change=self._on_throttle)
            mon.start()
        except ApplianceError as e:
            log.warning("throttle off: %s", e)
            return None
        return mon

    def _on_throttle(self, change: Any) -> None:
        if self.worker is not None:
            self.worker.poke()
        _call(self.hooks.on_status, self.status())

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._stop = asyncio.Event()
        for s in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(s, self.request_stop, s)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        sock = inherited_socket()
        if sock is None:
            self._socket_path = self.cfg.resolve(self.cfg.service.socket)
            sock = listen_socket(self._socket_path, self.cfg.service.socket_mode)
        self.server = SocketServer(sock, self.handle_line, self.cfg.service.max_line_bytes)
        await self.server.start()
        self.state = "ready"
        log.info("ready: channels %s, audio %s", ", ".join(self.channels), self.audio.mode)
        if self.mqtt is not None:
            self.mqtt.start()
        _call(self.hooks.on_ready)
        await self._replay_spool()
        _call(self.hooks.on_status, self.status())
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
            _call(self.hooks.on_stopping)
            if self._stop is not None:
                self._stop.set()
        elif self.worker is not None:
            cur = self.worker.status()
            ids = [c["active"] for c in cur.values() if c["active"]]
            log.warning("second %s: cancelling %s", signal.Signals(signum).name, ", ".join(ids) or "nothing")
            for i in ids:
                self.worker.cancel(request_id=i)

    def _on_sighup(self) -> None:
        _call(self.hooks.on_reload)
        _call(self.hooks.on_reloaded, self.reload_config())

    #: Config sections applied by a reload (SIGHUP) without a restart: the sampling defaults and
    #: the health thresholds. Everything else (model, engines, audio devices, socket, channels,
    #: MQTT, telemetry) is bound at start-up: a change there is reported as needing a restart.
    LIVE_SECTIONS = ("synthesis", "health")

    def reload_config(self) -> str:
        """Re-read the config file (SIGHUP): apply :attr:`LIVE_SECTIONS`, report the rest.

        Returns:
            the status line for systemd (``READY=1`` follows). A config that no longer validates
            is logged and the running one is kept; the daemon never stops on a bad reload.
        """
        if not self.config_path:
            return "ready (no config file to re-read)"
        try:
            new = load_config(self.config_path)
        except ApplianceError as e:
            log.error("SIGHUP: %s is not valid, keeping the running configuration: %s", self.config_path, e)
            return f"ready (reload failed, running config kept: {e})"
        changed = [f.name for f in dataclasses.fields(Config)
                   if f.name not in ("base_dir", "source") and getattr(new, f.name) != getattr(self.cfg, f.name)]
        live = {n: getattr(new, n) for n in changed if n in self.LIVE_SECTIONS}
        restart = [n for n in changed if n not in self.LIVE_SECTIONS]
        runner = getattr(self.pipeline, "runner", None)
        if ("synthesis" in live and new.synthesis.refine_text and runner is not None
                and not getattr(runner, "supports_text_mode", False)):
            log.error("SIGHUP: synthesis.refine_text needs a backend with a text mode; %s has none: "
                      "keeping the running synthesis section", runner.info.backend)
            del live["synthesis"]
            restart.append("synthesis (refine_text unsupported by this backend)")
        if "synthesis" in live and new.synthesis.max_new_tokens > self.cfg.synthesis.max_new_tokens:
            restart.append("synthesis.max_new_tokens above its start-up value")
        if live:
            self.cfg = dataclasses.replace(self.cfg, **live)
            if getattr(self.pipeline, "cfg", None) is not None:
                self.pipeline.cfg = dataclasses.replace(self.pipeline.cfg, **live)
        parts = []
        if live:
            parts.append("applied " + ", ".join(live))
        if restart:
            parts.append("restart needed for " + ", ".join(restart))
        msg = "; ".join(parts) or "no change"
        (log.warning if restart else log.info)("SIGHUP: reloaded %s: %s", self.config_path, msg)
        return f"ready (config reloaded: {msg})"

    async def _shutdown(self) -> None:
        loop = asyncio.get_running_loop()
        assert self.server is not None and self.worker is not None
        self.server.stop_accepting()
        left = await loop.run_in_executor(None, self.worker.stop)
        if left:
            if self.hooks.on_unfinished is not None:
                _call(self.hooks.on_unfinished, left)
            else:
                self._spool(left)
        if not await loop.run_in_executor(None, self.worker.wait_idle, DRAIN_TIMEOUT_S):
            log.warning("drain timed out after %.0f s", DRAIN_TIMEOUT_S)
        await loop.run_in_executor(None, self.audio.close)
        if self.throttle is not None:
            self.throttle.close()
        _call(self.hooks.on_status, self.status())
        if self.mqtt is not None:      # after the drain: the last events, then 'offline'
            await loop.run_in_executor(None, self.mqtt.stop)
        await self.server.close()
        if self._socket_path is not None:
            try:
                self._socket_path.unlink()
            except OSError:
                pass

    # ------------------------------------------------------------------ spool

    def _spool(self, items: list) -> None:
        """Keep accepted requests that never started across the stop: each is written as its
        ``speak`` JSON to ``service.spool_dir`` and its client gets an ``error`` with code
        ``spooled``; :meth:`_replay_spool` speaks them after the next start. If the spool cannot be
        written the request is reported ``cancelled`` instead (never silently lost)."""
        d = self.cfg.resolve(self.cfg.service.spool_dir)
        for n, it in enumerate(items):
            try:
                d.mkdir(parents=True, exist_ok=True)
                obj = to_dict(it.speak)
                obj["channel"] = it.channel
                name = f"{time.time_ns()}-{n:03d}-{''.join(c for c in it.id if c.isalnum() or c in '-_')[:64]}.json"
                tmp = d / (name + ".tmp")
                tmp.write_text(json.dumps(obj, ensure_ascii=False), encoding="utf-8")
                tmp.replace(d / name)
            except OSError as e:
                log.error("cannot spool request %s to %s: %s", it.id, d, e)
                it.sink(ErrorEvent(code=CancelledError.code, id=it.id,
                                   message=f"request {it.id} was not started: the daemon is stopping and the spool "
                                           f"is not writable ({e.strerror or e}); send it again"), None)
                continue
            it.sink(ErrorEvent(code="spooled", id=it.id,
                               message=f"request {it.id} was not started before the daemon stopped; it is kept in "
                                       f"the spool and will be spoken after the restart"), None)
        log.info("spooled %d queued request(s) to %s", len(items), d)

    async def _replay_spool(self) -> None:
        """Submit the requests spooled at the last stop (oldest first); each file is removed once
        its request is accepted or refused (the refusal is logged)."""
        d = self.cfg.resolve(self.cfg.service.spool_dir)
        files = sorted(d.glob("*.json")) if d.is_dir() else []
        for f in files:
            def sink(ev: Any, payload: Optional[bytes], name: str = f.name) -> None:
                if getattr(ev, "type", "") in ("done", "error"):
                    log.info("spooled request %s: %s %s", getattr(ev, "id", name), ev.type,
                             getattr(ev, "message", getattr(ev, "output", "")))
            try:
                req = parse_request(json.loads(f.read_text(encoding="utf-8")))
            except (OSError, ValueError, ApplianceError) as e:
                log.error("dropping unreadable spool file %s: %s", f, e)
            else:
                await self.handle_request(req, sink)
            f.unlink(missing_ok=True)
        if files:
            log.info("replayed %d spooled request(s) from %s", len(files), d)

    def _health_check(self) -> Any:
        """Run the field health check (on the thread that owns the pipeline); returns its
        HealthReply and keeps it as :attr:`last_health`."""
        from .health import run_health_check

        self.last_health = run_health_check(self.pipeline, self.cfg)
        if not self.last_health.healthy:
            log.warning("health check: UNHEALTHY: %s", "; ".join(self.last_health.reasons))
        return self.last_health

    def _on_finished(self, item: Item, event: Any) -> None:
        _call(self.hooks.on_status, self.status())

    # ------------------------------------------------------------------ requests

    async def handle_line(self, line: bytes, sink: EventSink) -> None:
        """Handle one request line from any transport; every failure becomes an ``error`` event."""
        try:
            req = parse_line(line, self.cfg.service.max_line_bytes)
        except ApplianceError as e:
            log.info("bad request line: %s", e)
            sink(error_event(e), None)
            return
        await self.handle_request(req, sink)

    def handle_line_threadsafe(self, line: bytes, sink: EventSink) -> concurrent.futures.Future:
        """:meth:`handle_line` for inputs living on other threads (e.g. paho-mqtt's network
        thread): schedules it on the event loop and returns at once.

        Raises:
            BusyError: the daemon is not serving (before ready or after stop).
        """
        loop = self._loop
        if loop is None or loop.is_closed() or self.state != "ready":
            raise BusyError(f"the daemon is {self.state}; send the request again later")
        return asyncio.run_coroutine_threadsafe(self.handle_line(line, sink), loop)

    async def handle_request(self, req: Any, sink: EventSink) -> None:
        """Handle a parsed request (Speak, Cancel, StatusRequest, HealthRequest)."""
        rid = getattr(req, "id", None)
        try:
            if isinstance(req, Speak):
                await self._speak(req, sink)
            elif isinstance(req, StatusRequest):
                sink(self.status(), None)
            elif isinstance(req, Cancel):
                self._cancel(req, sink)
            elif isinstance(req, HealthRequest):
                if self.state != "ready" or self.worker is None:
                    raise BusyError(f"the daemon is {self.state}; ask again later")
                self.worker.run_task(self._health_check, sink)
            else:
                raise RequestError(f"unsupported request {type(req).__name__}")
        except ApplianceError as e:
            log.info("request %s refused: %s (%s)", rid or "-", e.code, e)
            sink(error_event(e, rid), None)
        except Exception as e:
            log.exception("request %s failed", rid or "-")
            sink(error_event(e, rid), None)

    async def _speak(self, req: Speak, sink: EventSink) -> None:
        if self.state != "ready" or self.worker is None:
            raise BusyError(f"the daemon is {self.state}; send the request again later")
        n = len(req.text)
        limit = self.cfg.service.max_text_chars
        if n > limit:
            raise TextError(f"text of {n} characters is over the limit of {limit} (service.max_text_chars); split it")
        if not req.text.strip():
            raise TextError("text is empty; send something to say")
        channel = req.channel if req.channel is not None else self.channels[0]
        if channel not in self.channels:
            raise UnknownChannelError(f"unknown channel {channel!r}; configured channels: {', '.join(self.channels)}")
        loop = asyncio.get_running_loop()
        job = await loop.run_in_executor(self._prep, self.pipeline.prepare, req.synthesis_request())
        self.worker.submit(Item(speak=req, job=job, channel=channel, sink=sink))

    def _cancel(self, req: Cancel, sink: EventSink) -> None:
        assert self.worker is not None
        if req.channel is not None and req.channel not in self.channels:
            raise UnknownChannelError(f"unknown channel {req.channel!r}; configured channels: {', '.join(self.channels)}")
        items = self.worker.cancel(request_id=req.id, channel=req.channel)
        if not items:
            what = f"has id {req.id!r}" if req.id is not None else f"is on channel {req.channel!r}"
            raise RequestError(f"nothing to cancel: no queued, running or playing request {what}")
        for it in items:   # the request's own client got its event; tell a different canceller too
            if it.sink != sink:
                sink(ErrorEvent(code=CancelledError.code, message=f"request {it.id} was cancelled", id=it.id), None)

    def status(self) -> StatusReply:
        """Current :class:`StatusReply` (thread-safe)."""
        chans = {}
        wst = self.worker.status() if self.worker is not None else {}
        for name in self.channels:
            c = dict(wst.get(name, {"queued": 0, "active": None}))
            c.update(self.audio.status(name))
            chans[name] = c
        info = getattr(self.pipeline, "info", None)
        return StatusReply(
            state=self.state, backend=getattr(info, "backend", "") or "", channels=chans,
            last_rtf=self.worker.last_rtf if self.worker else None,
            last_ttfb_ms=round(self.worker.last_ttfb_ms, 1) if self.worker and self.worker.last_ttfb_ms is not None else None,
            throttle=self.throttle.level if self.throttle is not None else "normal",
            temperature_c=self.throttle.temperature_c if self.throttle is not None else None,
        )


def build_hooks(cfg: Config) -> Hooks:
    """The hooks ``serve`` runs with: sd_notify through
    :class:`~appliance.service.notify.SystemdBridge` (every call is a no-op outside systemd)."""
    from .notify import SystemdBridge

    bridge = SystemdBridge()
    return Hooks(**bridge.hooks(), on_reloaded=bridge.reloaded)


def cli_main(args: Any) -> int:
    """``chattts-appliance serve --config PATH``: exit 0 after a clean stop, 2 on a start-up error."""
    cfg = load_config(args.config)
    log.info("config %s: model %s, backend %s, socket %s, audio %s",
             os.path.abspath(args.config), cfg.resolve(cfg.model.path), cfg.model.backend,
             cfg.resolve(cfg.service.socket), cfg.audio.output)
    return Daemon(cfg, hooks=build_hooks(cfg), config_path=os.path.abspath(args.config)).run()
