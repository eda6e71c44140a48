"""The daemon's assembly: every part built complete, in the order its dependencies need.

:func:`check` runs before anything heavy (a wrong ``model.path``, a directory that cannot be
made, a socket another daemon holds: each fails in
milliseconds, not after a model load). :func:`build` then constructs, each part handed what it
needs when it is made, nothing assigned to a part afterwards::

    pipeline        Pipeline.from_config (or the given factory), sized to service.memory_budget_mb
                    before the load and again after the warm-up (appliance.daemon.memory); its
                    look-ahead calibrated where none is recorded for its engines
                    (synth.calibration.calibrate_pipeline, stream.calibrate_at_start); a bad engine
                    rebuilt (appliance.build.rebuild) or replaced (appliance.engines.recover)
    integrity       IntegrityWatch over the weight files the backend verified (started)
    checks          CheckRecord: what the last field health check found (the at-start one first)
    audio           AudioOutput (devices opened, WAV directory pruned)
    journal         Journal + Recovery (journal.enabled)
    throttle        Monitor(cfg, on_change, budget_mib=current_mib(pipeline)) (started), or None
    health          Health: the one verdict from every condition source (throttle, weights,
                    devices, the last check, a failed reload, the journal, an engine fallback,
                    the network services: NetHealth's mqtt, wyoming, mdns)
    worker          Worker(pipeline, audio, throttle, journal, ...) (started)
    dispatch        Dispatcher(pipeline, worker, loop, journal, recovery, ...)
    mqtt            MQTTBridge(cfg, dispatch.handle_request_threadsafe, status, net.mqtt) (mqtt.enabled)

The servers that need the running event loop (the UNIX socket, Wyoming) are made by the daemon
in its loop from these parts. The parts call back into the daemon only through :class:`Ports`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from ..audio.output import AudioOutput
from ..config import Config
from ..core import ConditionFlag
from ..messages.protocol import Event, HealthReply, StatusReply
from ..ops.integrity_watch import IntegrityWatch
from ..ops.monitor import open_monitor
from ..ops.verdict import CheckRecord, Health
from ..service.dispatch import Dispatcher
from ..service.journal import Journal, storage_conditions
from ..service.peers import RateLimiter
from ..service.recovery import Recovery, open_journal
from ..service.request import Request
from ..service.worker import Worker
from ..synth.calibration import calibrate_pipeline
from ..synth.checkpoint_dir import require_checkpoint
from ..transports.socket_server import check_socket_path
from .hooks import Hooks, call_hook
from .memory import MemoryFit, current_mib, fit_before_load, fit_pipeline
from .paths import prepare_dirs

if TYPE_CHECKING:
    from ..ops.monitor import Monitor
    from ..ops.throttle import Change
    from ..synth.pipeline import Pipeline
    from ..transports.mqtt import MQTTBridge

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.25
"""Worker heartbeat period, s: well below the shortest useful WatchdogSec (1 s)."""


@dataclass(frozen=True)
class Ports:
    """What the parts call back into the daemon (each quick, never raising).

    Attributes:
        state: ``() -> str``, the daemon's state (``starting``, ``ready``, ``stopping``).
        status: ``() -> StatusReply``.
        health: ``() -> HealthReply``: the field health check, on the worker thread.
        on_finished: ``(request, terminal event)`` after each request ends (worker or audio thread).
        on_throttle: ``(change)`` when the throttle level changes (telemetry thread).
    """

    state: Callable[[], str]
    status: Callable[[], StatusReply]
    health: Callable[[], HealthReply]
    on_finished: Callable[[Request, Event], None]
    on_throttle: Callable[[Change], None]


@dataclass(frozen=True)
class NetHealth:
    """The network services' health conditions, made before the verdict and raised by the
    transports made later: ``mqtt`` (the link: reconnecting, refused, TLS, a client-id takeover),
    ``wyoming`` (a URI that cannot be listened on), ``mdns`` (the advertisement)."""

    mqtt: ConditionFlag = dataclasses.field(default_factory=lambda: ConditionFlag("mqtt"))
    wyoming: ConditionFlag = dataclasses.field(default_factory=lambda: ConditionFlag("wyoming"))
    mdns: ConditionFlag = dataclasses.field(default_factory=lambda: ConditionFlag("mdns"))

    def sources(self) -> tuple:
        """Each as a condition source of the verdict."""
        return (self.mqtt, self.wyoming, self.mdns)


@dataclass(frozen=True)
class Parts:
    """The daemon's parts, each built complete by :func:`build` (module docstring).

    Attributes:
        cfg: the config the parts were built with (``model.max_seq_len``/``max_batch`` as the
            memory fit left them). memory_fit: that decision (None: the sizes were not known).
        start_health: the health check's reply at start (None without ``health.at_start``).
        checks: what the last field check found. reload_failed: raised while a reload failed.
        throttle: None when telemetry could not be opened (logged). journal, recovery: None with
            ``journal.enabled: false``. mqtt: None unless ``mqtt.enabled``.
        health: the one verdict (:class:`~appliance.ops.verdict.Health`) over every condition source.
        net: the network services' conditions (the Wyoming server is given its two).
    """

    cfg: Config
    pipeline: Pipeline
    memory_fit: Optional[MemoryFit]
    integrity: IntegrityWatch
    start_health: Optional[HealthReply]
    checks: CheckRecord
    reload_failed: ConditionFlag
    audio: AudioOutput
    journal: Optional[Journal]
    recovery: Optional[Recovery]
    throttle: Optional[Monitor]
    health: Health
    worker: Worker
    dispatch: Dispatcher
    mqtt: Optional[MQTTBridge]
    net: NetHealth


def check(cfg: Config, own_model: bool) -> None:
    """What fails fast, before the model loads (``own_model``: the daemon loads ``model.path``
    itself, not a test's factory).

    Raises:
        ApplianceError: no checkpoint at ``model.path``, a directory that cannot be made, the
            socket in use (a Wyoming port in use or a missing ``mqtt.ca_file`` only degrades the box:
            health says so).
    """
    if own_model:                                   # a wrong model.path: before any directory is made
        require_checkpoint(cfg)
    inherited = bool(os.environ.get("LISTEN_FDS"))
    prepare_dirs(cfg, socket_inherited=inherited)
    if not inherited:                               # another daemon has the socket
        check_socket_path(cfg.resolve(cfg.service.socket))


def build(cfg: Config, hooks: Hooks, ports: Ports, loop: asyncio.AbstractEventLoop,
          factory: Optional[Callable[[Config], Pipeline]] = None) -> Parts:
    """Construct every part (module docstring); ``factory``: ``cfg -> Pipeline`` (default
    ``Pipeline.from_config``, sized to the budget before the load).

    Raises:
        ApplianceError: the load failed (integrity, backend, memory budget, journal, ...).
    """
    cfg, pipeline, fit = _load(cfg, hooks, factory)
    integrity = IntegrityWatch(pipeline.runner.weight_files, cfg.safety.reverify_mib_per_s)
    integrity.start()
    checks, reload_failed, start_health = CheckRecord(), ConditionFlag("reload_failed"), None
    if cfg.health.at_start:
        from ..ops.health import run_health_check
        call_hook(hooks.on_loading, "health check")
        start_health = run_health_check(pipeline, cfg)
        checks.record(start_health)   # the weights' state comes from the integrity watch's own source
    call_hook(hooks.on_loading, "opening audio outputs")
    audio = AudioOutput(cfg)
    audio.start()
    journal, recovery = open_journal(cfg)
    throttle = open_monitor(cfg, ports.on_throttle, lambda: current_mib(pipeline))
    channels = cfg.service.channels
    net = NetHealth()
    health = Health((*((throttle.conditions,) if throttle else ()), integrity.conditions,
                     audio.conditions, checks, reload_failed, storage_conditions(journal), pipeline.conditions,
                     *net.sources()))
    worker = Worker(
        pipeline, audio, queue_len={c.name: c.queue_len for c in channels},
        heartbeat_s=HEARTBEAT_S, on_heartbeat=hooks.on_heartbeat, on_finished=ports.on_finished,
        on_preempt={c.name: c.on_preempt for c in channels},
        throttle=throttle, journal=journal, stall_s=cfg.safety.stall_s, max_hold_s=cfg.service.max_hold_s,
    )
    worker.start()
    dispatch = Dispatcher(cfg.service, pipeline, worker, loop, ports.state, ports.status, ports.health,
                          RateLimiter(cfg.safety.max_requests_per_s, cfg.safety.request_burst),
                          journal=journal, recovery=recovery)
    mqtt = None
    if cfg.mqtt.enabled:
        from ..transports.mqtt import MQTTBridge
        mqtt = MQTTBridge(cfg, dispatch.handle_request_threadsafe, ports.status, net.mqtt)
    return Parts(cfg, pipeline, fit, integrity, start_health, checks, reload_failed, audio, journal, recovery,
                 throttle, health, worker, dispatch, mqtt, net)


def _load(cfg: Config, hooks: Hooks,
          factory: Optional[Callable[[Config], Pipeline]]) -> tuple[Config, Pipeline, Optional[MemoryFit]]:
    """Load and warm up the pipeline, sized to ``service.memory_budget_mb`` before the load (own
    model only) and after the warm-up; returns the config it runs with, the pipeline, the fit."""
    t0 = time.monotonic()
    call_hook(hooks.on_loading, "loading the model")
    before = None
    if factory is None:
        from ..build.rebuild import rebuild_engine
        from ..synth.pipeline import Pipeline
        factory = functools.partial(Pipeline.from_config, rebuild=rebuild_engine)   # a bad engine: rebuilt or replaced
        # sized to the budget from the known sizes before anything is compiled or captured
        cfg, before = fit_before_load(cfg, Pipeline.planned_sizes)
    pipeline = factory(cfg)
    log.info("pipeline loaded in %.1f s (backend %s)", time.monotonic() - t0, pipeline.info.backend)
    for net, how in pipeline.info.network_fields()["networks"].items():
        log.info("network %s: %s", net, how)
    if cfg.service.warmup:
        call_hook(hooks.on_loading, "warming up")
        t1 = time.monotonic()
        pipeline.warmup()
        log.info("warm-up took %.1f s", time.monotonic() - t1)
    pipeline, fit = fit_pipeline(cfg, pipeline, factory, cfg.service.warmup)
    if cfg.stream.calibrate_at_start and pipeline.lookahead.missing:   # a fresh box: measured before it serves
        call_hook(hooks.on_loading, "calibrating the look-ahead (none recorded for these engines)")
        calibrate_pipeline(cfg, pipeline)
    if before is not None and before.action == "shrink":   # STATUS keeps saying what was lowered before the load
        fit = before if fit.action == "fits" else dataclasses.replace(
            fit, text=f"before the load: {before.text}; after warm-up: {fit.text}")
    return cfg, pipeline, fit
