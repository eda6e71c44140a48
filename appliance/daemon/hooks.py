"""The daemon's lifecycle hooks: the points where systemd (or a test) is told what happens.

Wiring points (:class:`Hooks`, all optional, none may raise or block):

* ``on_loading(text)`` – during start-up stages (send ``EXTEND_TIMEOUT_USEC`` + ``STATUS=``).
* ``on_ready()`` – after warm-up, once the socket accepts (``READY=1``).
* ``on_status(StatusReply)`` – at ready, after every finished request (from the worker or the
  audio watcher thread), at stop (``STATUS=``).
* ``on_heartbeat()`` – from the worker thread, at least every ``heartbeat_s`` while it is
  healthy; a hung synthesis stops it. ``on_loop_beat()`` – from the event loop every
  :data:`LOOP_BEAT_S`. ``WATCHDOG=1`` follows both. ``worker_stage(fn)`` – once the worker is
  built: ``fn()`` says what it does now (named when it is stuck).
* ``on_reload()`` – SIGHUP received (``RELOADING=1``); ``on_reloaded(status)`` once the reload is
  over (``READY=1``, with a status line saying what was applied and what needs a restart; see
  :mod:`appliance.daemon.reload`).
* ``on_stopping()`` – SIGTERM/SIGINT received, before the drain (``STOPPING=1``).
* ``on_unfinished(items)`` – queued requests left at stop (tell their clients).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..config import Config
from ..messages.protocol import StatusReply

if TYPE_CHECKING:
    from ..service.request import Request

log = logging.getLogger(__name__)

LOOP_BEAT_S = 0.5
"""The event loop's heartbeat period, s."""


@dataclass
class Hooks:
    """Callbacks for systemd notify and spooling (see the module docstring for when each fires)."""

    on_loading: Optional[Callable[[str], None]] = None
    on_ready: Optional[Callable[[], None]] = None
    on_status: Optional[Callable[[StatusReply], None]] = None
    on_heartbeat: Optional[Callable[[], None]] = None
    on_loop_beat: Optional[Callable[[], None]] = None
    worker_stage: Optional[Callable[[Callable[[], str]], None]] = None
    on_reload: Optional[Callable[[], None]] = None
    on_reloaded: Optional[Callable[[str], None]] = None   # status line after the reload
    on_stopping: Optional[Callable[[], None]] = None
    on_unfinished: Optional[Callable[[list[Request]], None]] = None


def call_hook(hook: Optional[Callable], *args: Any) -> None:
    """Call ``hook`` if set; an exception it raises is logged, never propagated."""
    if hook is not None:
        try:
            hook(*args)
        except Exception:
            log.exception("hook %s failed", getattr(hook, "__name__", hook))


def build_hooks(cfg: Config) -> Hooks:
    """The hooks ``serve`` runs with: sd_notify through
    :class:`~appliance.ops.bridge.SystemdBridge` (every call is a no-op outside systemd)."""
    from ..ops.bridge import SystemdBridge

    bridge = SystemdBridge(stall_s=cfg.safety.stall_s)
    return Hooks(**bridge.hooks(), on_reloaded=bridge.reloaded)
