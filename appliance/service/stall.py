"""The per-request watchdog: a synthesis that makes no progress is ended, the worker goes on.

Progress of a running request is a decode step that advanced its task, or a PCM chunk
(:meth:`StallWatch.mark`, called by the worker after every engine step; the worker stamps
``Request.progress_at`` at start and on PCM itself). A thread (``request-watchdog``) looks twice a
second: a request running for ``safety.stall_s`` without progress gets its terminal ``error``
(``engine_error``, naming the limit) at once, its unplayed audio is dropped and its ``cancel``
event set, so the engine frees its slot at its next step and the next request starts.

Two ways a request stalls: the engine never advances it (a scheduling bug, a task that cannot
join) while the others run; or the worker thread itself is stuck in one backend call. In the
second case the client still gets its error within ``stall_s`` (not when the call returns, if
ever); the worker's heartbeat stops meanwhile, so systemd's watchdog restarts a daemon that
stays stuck, and the journal does not replay the request that was ended here.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional

from ..errors import EngineError
from ..messages.protocol import Event, error_event
from ..synth.batch import TaskState
from .request import State

if TYPE_CHECKING:
    from .request import Request

log = logging.getLogger(__name__)

POLL_S = 0.5
"""How often the watchdog thread looks, s."""


class StallWatch:
    """Ends running requests without progress for ``stall_s`` (module docstring).

    Args:
        stall_s: ``safety.stall_s``, s.
        running: ``() -> [Request]``: the items synthesizing now (called with ``lock`` held).
        settle: ``settle(item, event)``: the worker's idempotent terminal-event path.
        lock: the worker's lock.
    """

    def __init__(self, stall_s: float, running: Callable[[], list[Request]],
                 settle: Callable[[Request, Event], None], lock) -> None:
        self.running = running
        self.lock = lock
        self.settle = settle
        self.stall_s = float(stall_s)
        self.ended = 0
        self._marks: dict[Request, int] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="request-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None

    def mark(self, running: list[Request]) -> None:
        """Worker thread, after an engine step: stamp the items whose task advanced."""
        now = time.monotonic()
        for it in running:
            t = it.task
            if t is None:
                continue
            mark = t.progress
            if mark != self._marks.get(it):
                self._marks[it] = mark
                it.progress_at = now
        if len(self._marks) > 4 * max(1, len(running)):       # forget settled items
            live = set(running)
            self._marks = {k: v for k, v in self._marks.items() if k in live}

    def check(self, now: Optional[float] = None) -> list[Request]:
        """End the stalled running items now; returns them."""
        now = time.monotonic() if now is None else now
        with self.lock:
            stalled = [it for it in self.running()
                       if it.state is State.RUNNING and it.progress_at and now - it.progress_at > self.stall_s
                       and not (it.task is not None and it.task.state is TaskState.WAITING)]   # for text: not stuck
        for it in stalled:
            idle = now - it.progress_at
            log.error("request %s on %s made no progress for %.1f s (safety.stall_s %g); ending it",
                      it.id, it.channel, idle, self.stall_s)
            it.cancel.set()
            if it.audio is not None:
                it.audio.abort()
            self.ended += 1
            self.settle(it, error_event(EngineError(
                f"request {it.id} made no progress for {idle:.0f} s (safety.stall_s {self.stall_s:g}): the "
                f"synthesis is stuck; it was ended and its slot freed"), it.id))
        return stalled

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watchdog must outlive a bug
                log.exception("request watchdog")
