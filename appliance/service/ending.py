"""How a request ends: play-out, resume after an alert, failure, and its one terminal event.

:class:`Endings` owns what happens when a request leaves the batch engine (or is cancelled,
preempted, stalled), so that every way out goes through ONE method, :meth:`Endings.settle`::

    synthesis done   -> PLAYING -> audio.finish(...) -> settle(Done)          (played / written)
    failed           -> fail -> settle(ErrorEvent)
    cancelled        -> settle(ErrorEvent cancelled)
    alert            -> after_preempt -> requeue (resume: Preempted, QUEUED again)
                                      or settle(ErrorEvent preempted)       (drop)

:meth:`Endings.settle` is idempotent (the scheduler removes a request once): it journals the
outcome (durable before the client hears it), sends the event, counts it (``completed``,
``failed``, the last RTF and TTFB) and calls the ``on_finished`` hook. The ended request's
audio is kept for :meth:`take_spent`, so that the worker thread that allocated it frees it.

It is built by the :class:`~appliance.service.worker.Worker` with what it needs, and shares the
worker's lock (``cv``), which guards the scheduler and every request's state.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Callable, Optional, Union

from ..errors import ApplianceError, CancelledError, PreemptedError
from ..messages.protocol import Done, ErrorEvent, Event, Preempted, error_event, to_dict
from ..synth.batch import TaskState
from .journal import mark
from .request import Request, State

if TYPE_CHECKING:
    from ..audio.sink import AudioSink
    from .journal import Journal
    from .scheduler import Scheduler, ThrottlePolicy
    from .startpolicy import StartPolicy

log = logging.getLogger("appliance.service.worker")


class Endings:
    """The ending paths of the worker's requests (module docstring).

    Args:
        sched: the worker's :class:`~appliance.service.scheduler.Scheduler`.
        cv: the worker's condition (its lock guards ``sched`` and the requests' states).
        journal: the request journal, or None. throttle: told every finished request's RTF, or None.
        starts: the :class:`~appliance.service.startpolicy.StartPolicy` (``done``'s start fields), or None.
        on_finished: ``(request, event)`` after each terminal event, or None.
        stopping: ``() -> bool``: the worker stops (an interrupted request is dropped, not resumed).

    Attributes:
        completed, failed: requests ended with ``done`` / with ``error``.
        last_rtf, last_ttfb_ms: of the last ``done``.
    """

    def __init__(self, sched: Scheduler, cv: threading.Condition, journal: Optional[Journal],
                 throttle: Optional[ThrottlePolicy], starts: Optional[StartPolicy],
                 on_finished: Optional[Callable[[Request, Event], None]], stopping: Callable[[], bool]) -> None:
        self.sched, self._cv, self.journal, self.throttle, self.starts = sched, cv, journal, throttle, starts
        self.on_finished, self._stopping = on_finished, stopping
        self.completed = 0
        self.failed = 0
        self.last_rtf: Optional[float] = None
        self.last_ttfb_ms: Optional[float] = None
        self._spent: list[AudioSink] = []      # ended requests' audio, released on the worker thread

    def take_spent(self) -> list[AudioSink]:
        """The audio of the requests ended since the last call (caller holds ``cv``)."""
        spent, self._spent = self._spent, []
        return spent

    def complete(self, item: Request) -> None:
        """A running item left the engine (or never entered it): play out, resume, or settle."""
        t = item.task
        if item.preempted_by is not None:
            if item.audio is not None:
                item.audio.abort()
            self.after_preempt(item)
            return
        if t is None:
            return                                    # its start failed and settled it
        if t.state is TaskState.DONE and not item.cancel.is_set():
            with self._cv:
                item.move(State.PLAYING)
            mark(self.journal, item.journal, "synthesized")     # waits to sound, unless it already does
            done = self._done_event(item)
            item.audio.finish(lambda out: self.settle(item, error_event(out, item.id) if isinstance(out, ApplianceError)
                                                      else dataclasses.replace(done, output=out, ttfb_ms=item.ttfb_ms(),
                                                                               **self._start_fields(item))))   # once played out
            return
        if t.state is TaskState.FAILED and not item.cancel.is_set():
            self.fail(item, t.error)
            return
        if item.audio is not None:
            item.audio.abort()
        self.settle(item, ErrorEvent(code=CancelledError.code, message=f"request {item.id} was cancelled", id=item.id))

    def after_preempt(self, item: Request) -> None:
        """Resume (re-queue from its interrupted sentence, ``item.resume_from``) or drop an item a
        higher-priority request interrupted."""
        policy = self.sched.on_preempt.get(item.channel, "resume")
        with self._cv:
            by = item.preempted_by
            if by is None or item.state in (State.ENDED, State.QUEUED):
                return                      # already handled (worker and submit may both get here)
            item.preempted_by = None
            resume = policy == "resume" and not self._stopping()
            if resume:
                self.sched.requeue(item)
                self._cv.notify_all()
        item.sink(Preempted(id=item.id, channel=item.channel, by=by, action="resume" if resume else "drop"))
        if resume:
            mark(self.journal, item.journal, "requeued")
            log.info("%s resumes on %s right after %s (from sentence %d)", item.id, item.channel, by, item.resume_from)
            return
        err = PreemptedError(f"request {item.id} was dropped: request {by} preempted it on channel {item.channel!r} "
                             f"(service.channels[].on_preempt: drop)" if policy == "drop" else
                             f"request {item.id} was preempted by alert {by} while the daemon stops")
        self.settle(item, error_event(err, item.id))

    def fail(self, item: Request, e: BaseException) -> None:
        """End ``item`` with ``e`` (its unplayed audio dropped)."""
        if item.audio is not None:
            item.audio.abort()
        if not isinstance(e, ApplianceError):
            log.error("request %s failed: %s", item.id, e, exc_info=e)
        self.settle(item, error_event(e, item.id))

    def _start_fields(self, item: Request) -> dict:
        """``done``'s start decision fields (its first sample at the device is known by now)."""
        if self.starts is None or item.task is None:
            return {}
        return self.starts.fields(item)

    def _done_event(self, item: Request) -> Done:
        done = item.done_event()
        self.last_rtf, self.last_ttfb_ms = done.rtf, done.ttfb_ms
        if self.throttle is not None:
            try:
                self.throttle.observe_rtf(float(done.rtf))
            except Exception:  # noqa: BLE001
                log.exception("throttle observe_rtf")
        return done

    def settle(self, item: Request, event: Union[Done, ErrorEvent]) -> None:
        """Emit the request's one terminal event (idempotent)."""
        with self._cv:
            if not self.sched.remove(item):
                return
            if isinstance(event, Done):
                self.completed += 1
            else:
                self.failed += 1
            if item.audio is not None:
                self._spent.append(item.audio)
            self._cv.notify_all()
        if self.journal is not None and item.journal is not None:
            self.journal.end(item.journal, to_dict(event))    # durable before the client hears it
        item.sink(event)
        if isinstance(event, Done):
            log.info("done %s -> %s", item.id, event.output)
        else:
            log.info("request %s ended with %s: %s", item.id, event.code, event.message)
        if self.on_finished is not None:
            try:
                self.on_finished(item, event)
            except Exception:
                log.exception("on_finished hook")
