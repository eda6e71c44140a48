"""How a request ends: play-out, resume after an alert, failure, and its one terminal event.

:class:`Ending` is the half of :class:`~appliance.service.worker.Worker` that decides what
happens when a request leaves the batch engine (or is cancelled, preempted, stalled), so that
every way out goes through ONE method, :meth:`Ending._settle`::

    synthesis done   -> PLAYING -> audio.finish(...) -> _settle(Done)        (played / written)
    failed           -> _fail -> _settle(ErrorEvent)
    cancelled        -> _settle(ErrorEvent cancelled)
    alert            -> _after_preempt -> requeue (resume: Preempted, QUEUED again)
                                      or _settle(ErrorEvent preempted)     (drop)

:meth:`Ending._settle` is idempotent (:meth:`Request.end <appliance.service.request.Request.end>`):
it journals the outcome (durable before the client hears it), sends the event, and calls the
``on_finished`` hook. The attributes it uses are the worker's (``_cv``, ``sched``, ``journal``,
``throttle``, ``starts``, counters).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ..errors import ApplianceError, CancelledError, PreemptedError
from ..messages.protocol import Done, ErrorEvent, Preempted, error_event, to_dict
from .journal import mark
from .request import Request, State

log = logging.getLogger("appliance.service.worker")


class Ending:
    """The ending paths of the worker (module docstring); a base class of the Worker."""

    def _complete(self, item: Request) -> None:
        """A running item left the engine (or never entered it): play out, resume, or settle."""
        t = item.task
        if item.preempted_by is not None:
            if item.audio is not None:
                item.audio.abort()
            self._after_preempt(item)
            return
        if t is None:
            return                                    # _start failed and settled it
        if t.state == "done" and not item.cancel.is_set():
            with self._cv:
                item.move(State.PLAYING)
            mark(self.journal, item.journal, "synthesized")     # waits to sound, unless it already does
            done = self._done_event(item)
            item.audio.finish(lambda out: self._settle(item, error_event(out, item.id) if isinstance(out, ApplianceError)
                                                       else dataclasses.replace(done, output=out, ttfb_ms=item.ttfb_ms(),
                                                                                **self.starts.fields(item))))
            return
        if t.state == "failed" and not item.cancel.is_set():
            self._fail(item, t.error)
            return
        if item.audio is not None:
            item.audio.abort()
        self._settle(item, ErrorEvent(code=CancelledError.code, message=f"request {item.id} was cancelled", id=item.id))

    def _after_preempt(self, item: Request) -> None:
        """Resume (re-queue from the start) or drop an item an alert interrupted."""
        policy = self.sched.on_preempt.get(item.channel, "resume")
        with self._cv:
            by = item.preempted_by
            if by is None or item.state in (State.ENDED, State.QUEUED):
                return                      # already handled (worker and submit may both get here)
            item.preempted_by = None
            resume = policy == "resume" and not self._stopping
            if resume:
                self.sched.requeue(item)
                self._cv.notify_all()
        item.sink(Preempted(id=item.id, channel=item.channel, by=by, action="resume" if resume else "drop"), None)
        if resume:
            mark(self.journal, item.journal, "requeued")
            log.info("%s resumes on %s after alert %s (from the start)", item.id, item.channel, by)
            return
        err = PreemptedError(f"request {item.id} was dropped: alert {by} preempted it on channel {item.channel!r} "
                             f"(service.channels[].on_preempt: drop)" if policy == "drop" else
                             f"request {item.id} was preempted by alert {by} while the daemon stops")
        self._settle(item, error_event(err, item.id))

    def _fail(self, item: Request, e: BaseException) -> None:
        if item.audio is not None:
            item.audio.abort()
        if not isinstance(e, ApplianceError):
            log.error("request %s failed: %s", item.id, e, exc_info=e)
        self._settle(item, error_event(e, item.id))

    def _done_event(self, item: Request) -> Done:
        done = item.done_event()
        self.last_rtf, self.last_ttfb_ms = done.rtf, done.ttfb_ms
        if self.throttle is not None:
            try:
                self.throttle.observe_rtf(float(done.rtf))
            except Exception:  # noqa: BLE001
                log.exception("throttle observe_rtf")
        return done

    def _settle(self, item: Request, event: Any) -> None:
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
        item.sink(event, None)
        if isinstance(event, Done):
            log.info("done %s -> %s", item.id, event.output)
        else:
            log.info("request %s ended with %s: %s", item.id, event.code, event.message)
        if self.on_finished is not None:
            try:
                self.on_finished(item, event)
            except Exception:
                log.exception("on_finished hook")
