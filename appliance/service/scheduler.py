"""Scheduling policy: which accepted request synthesizes next, and why the others wait.

No threads here: :class:`Scheduler` is the state and the decisions, and every method is called
by the :class:`~appliance.service.worker.Worker` with its lock held.

* Each channel has its own bounded queue (``service.channels[].queue_len``, then ``busy``),
  ordered ``alert > normal > background``, FIFO within a priority.
* At most ONE request per channel synthesizes at a time; up to ``max_running`` channels
  synthesize *together* (rows of one batched decode step).
* ``max_running = min(engine slots, throttle)``. Memory is not counted here: every KV slot is
  allocated at load, and the daemon sized the runner to ``service.memory_budget_mb`` at start
  (:mod:`appliance.daemon.memory`), so all slots fit; at run time the throttle
  (:class:`~appliance.ops.monitor.Monitor`, fed the process's real memory) lowers
  ``max_running`` and holds back priorities outside ``Limits.run_priorities``. A request that
  cannot start at once says why in its ``accepted`` event and the channel's status.
* A hold is bounded: a request held by the throttle (its priority held back, or the throttle's
  channel limit the binding one) for ``service.max_hold_s`` in all is taken out of the queue by
  :meth:`Scheduler.expired` and ends ``throttled`` naming the level and the resource; time spent
  behind another request on its own channel does not count. When memory holds the level, a
  request of a held-back priority is refused at once with ``insufficient_memory`` (memory may
  not come back soon, and waiting requests take memory too). Hold times are on the monotonic
  clock.
* A request preempts a lower-priority one running or playing on ITS channel: an ``alert`` any
  ``normal`` or ``background`` one, a ``normal`` one a ``background`` one (background waits for
  normal speech, as a listener expects); :meth:`Scheduler.enqueue` names the victims, the worker
  stops them. A victim that resumes (``channels[].on_preempt: resume``) is queued again ahead of
  every request of its priority (:meth:`Scheduler.requeue`): it plays right after the
  request(s) that interrupted it, from its interrupted sentence, before the others queued meanwhile.
* A cancel by channel has a scope (:data:`~appliance.messages.protocol.CANCEL_SCOPES`, :meth:`Scheduler.targets`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from ..errors import BusyError, InsufficientMemoryError, RequestError, ThrottledError
from ..messages.protocol import DEFAULT_CANCEL_SCOPE, PRIORITIES, EventSink
from ..ops.throttle import Limits
from .request import Request, State

log = logging.getLogger(__name__)

class ThrottlePolicy(Protocol):
    """What the scheduler asks of a throttle (:class:`~appliance.ops.monitor.Monitor`
    or :class:`~appliance.ops.throttle.Throttle`)."""

    def limits(self) -> Limits: ...

    def observe_rtf(self, rtf: float) -> None: ...


@dataclass
class Hold:
    """How long one queued request has been held by the throttle: ``total_s`` of holds that
    ended, the current one since ``since`` (monotonic s; None: not held now), and ``why``."""

    total_s: float = 0.0
    since: Optional[float] = None
    why: str = ""

    def held_s(self, now: float) -> float:
        """Held in all until ``now``, s."""
        return self.total_s + (now - self.since if self.since is not None else 0.0)


class Scheduler:
    """Queues, admission and preemption decisions (module docstring); the caller holds the lock.

    Args:
        queue_len: channel name -> most queued requests before :class:`BusyError`, in the order
            of ``service.channels`` (the error names ``service.channels[i].queue_len``).
        slots: synthesis slots of the batch engine (``model.max_batch``).
        throttle: a :class:`ThrottlePolicy`, or None.
        on_preempt: channel name -> ``resume`` or ``drop`` (default ``resume``).
        max_hold_s: longest a request may be held by the throttle (``service.max_hold_s``), s;
            None: unbounded.
        clock: monotonic clock, s (tests).

    Attributes:
        queue: queued items of all channels, priority order, FIFO within one.
        active: queued, running or playing items by id.
        running: channel -> the item synthesizing on it.
        waiting: channel -> why the head of its queue cannot start.
        holds: queued request -> its :class:`Hold` by the throttle.
    """

    def __init__(self, queue_len: dict[str, int], slots: int, throttle: Optional[ThrottlePolicy] = None,
                 on_preempt: Optional[dict[str, str]] = None, max_hold_s: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.queue_len = dict(queue_len)
        self.slots = slots
        self.throttle = throttle
        self.on_preempt = dict(on_preempt or {})
        self.queue: list[Request] = []
        self.active: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self.waiting: dict[str, str] = {}
        self.max_hold_s = max_hold_s
        self.holds: dict[Request, Hold] = {}
        self._clock = clock
        self._begun = 0                  # starts so far (Request.begun: which of a channel's sounds first)

    def check(self, item: Request) -> tuple[int, Optional[str]]:
        """May ``item`` be queued? Returns its queue position on its channel (0 = next) and why
        it would wait (None = it can start now): its channel synthesizes another request
        (``channel 'main' is busy with request X``), requests are queued before it, or the
        memory budget / throttle hold it.

        Raises:
            RequestError: a request with the same id is still queued, running or playing.
            InsufficientMemoryError: memory holds the throttle and ``item``'s priority is held back
                (not for a request already in the journal: a replay after a restart, or one the
                dispatcher journaled after this check passed; it waits, bounded by ``max_hold_s``).
            BusyError: the channel's queue is full.
        """
        if item.id in self.active:
            raise RequestError(f"request id {item.id!r} is already queued or running; use a new id")
        lim = self.limits()
        if (lim is not None and "memory" in lim.resources and item.speak.priority not in lim.run_priorities
                and item.journal is None):      # journaled (a replay, or checked before): it waits instead
            raise InsufficientMemoryError(
                f"not enough memory for a {item.speak.priority} request now: throttle {lim.level.value} {lim.cause}; "
                f"only {', '.join(p for p in ('alert', 'normal', 'background') if p in lim.run_priorities)} "
                f"requests are served until memory frees up; retry later")
        limit = self.queue_len.get(item.channel, 16)
        same = [q for q in self.queue if q.channel == item.channel]
        if len(same) >= limit:
            names = list(self.queue_len)
            key = (f"service.channels[{names.index(item.channel)}].queue_len" if item.channel in names
                   else "service.channels[N].queue_len")
            raise BusyError(f"channel {item.channel!r} is full: {len(same)} requests queued, the limit set by {key} "
                            f"(the entry with name: {item.channel}); retry later or raise that limit")
        pos = sum(1 for q in same if q.rank <= item.rank)
        busy = self.running.get(item.channel)
        if busy is not None:
            waiting: Optional[str] = f"channel {item.channel!r} is busy with request {busy.id}"
            if pos:
                waiting += f" and {pos} queued before it"
        elif pos:
            waiting = f"{pos} request(s) queued before it on channel {item.channel!r}"
        else:
            ahead = set(self.running) | {q.channel for q in self.queue
                                         if q.channel != item.channel and q.rank <= item.rank}
            waiting = self.why_waiting(item, len(ahead), lim)
        return pos, waiting

    def enqueue(self, item: Request) -> list[Request]:
        """Queue a checked ``item``; it marks the lower-priority items running or playing on its
        channel as preempted (``preempted_by``, ``cancel`` set: an ``alert`` preempts ``normal``
        and ``background``, a ``normal`` request ``background``) and returns them."""
        self.insert(item)
        self.active[item.id] = item
        victims = []
        if item.rank < len(PRIORITIES) - 1:
            for v in self.active.values():
                if (v.channel == item.channel and v.state in (State.RUNNING, State.PLAYING) and v.rank > item.rank
                        and v.preempted_by is None):
                    v.preempted_by = item.id
                    v.cancel.set()
                    victims.append(v)
        return victims

    def insert(self, item: Request, first: bool = False) -> None:
        """Into the queue after every request of the same or higher priority (``first``: a resumed
        request, after those of a higher priority and the resumed ones of its own that started
        before it, ahead of the others of its own: interrupted requests resume in the order they
        started)."""
        if first:
            pos = 0
            while pos < len(self.queue) and (self.queue[pos].rank < item.rank or (
                    self.queue[pos].rank == item.rank and 0 < self.queue[pos].begun < item.begun)):
                pos += 1
        else:
            pos = len(self.queue)
            while pos > 0 and self.queue[pos - 1].rank > item.rank:
                pos -= 1
        self.queue.insert(pos, item)

    def limits(self) -> Optional[Limits]:
        """The throttle's limits now; None without a throttle or when it fails (logged)."""
        if self.throttle is None:
            return None
        try:
            return self.throttle.limits()
        except Exception:  # noqa: BLE001 - a telemetry failure must not stop synthesis
            log.exception("throttle limits")
            return None

    def max_running(self, lim: Optional[Limits]) -> tuple[int, str]:
        """Channels that may synthesize at once now, and the binding limit in words."""
        cands = [(self.slots, f"all {self.slots} synthesis slots are busy (model.max_batch)")]
        if lim is not None:
            cands.append((lim.max_channels, f"throttle level {lim.level.value} {lim.cause} "
                                            f"allows {lim.max_channels} channel(s) at once"))
        return min(cands, key=lambda c: c[0])

    def held(self, item: Request, running: int, lim: Optional[Limits]) -> Optional[str]:
        """Why the throttle holds ``item`` with ``running`` channels synthesizing (None: it does
        not): its priority is held back, or the throttle's channel limit is the binding one."""
        if lim is None:
            return None
        if item.speak.priority not in lim.run_priorities:
            return f"throttle level {lim.level.value} {lim.cause}: {item.speak.priority} requests wait"
        if lim.max_channels < self.slots and running >= lim.max_channels:
            return self.max_running(lim)[1]
        return None

    def _bounded(self, why: str) -> str:
        """A hold's reason with its bound, as clients see it."""
        return f"{why} (at most service.max_hold_s = {self.max_hold_s:g} s)" if self.max_hold_s else why

    def why_waiting(self, item: Request, running: int, lim: Optional[Limits]) -> Optional[str]:
        """Why ``item`` cannot start with ``running`` channels synthesizing under throttle
        limits ``lim`` (from :meth:`limits`, fetched once per admission pass); None = it can."""
        held = self.held(item, running, lim)
        if held is not None:
            return self._bounded(held)
        n, why = self.max_running(lim)
        return why if running >= n else None

    def _track(self, item: Request, why: Optional[str], now: float) -> None:
        """Count ``item``'s time held by the throttle (``why``: held now, None: not)."""
        h = self.holds.get(item)
        if why is not None:
            if h is None:
                self.holds[item] = Hold(0.0, now, why)
            else:
                h.since, h.why = (now if h.since is None else h.since), why
        elif h is not None and h.since is not None:
            h.total_s, h.since = h.total_s + now - h.since, None

    def admit(self) -> list[Request]:
        """Move the queued items that may start now to running; remember why others wait and
        how long the throttle has held each (:meth:`expired`)."""
        lim = self.limits()
        now = self._clock()
        start: list[Request] = []
        waiting: dict[str, str] = {}
        busy = set(self.running)
        for it in self.queue:
            if it.channel in busy or it.channel in waiting:     # behind another: held only by its priority
                self._track(it, self.held(it, 0, lim), now)
                continue
            held = self.held(it, len(self.running) + len(start), lim)
            self._track(it, held, now)
            why = self._bounded(held) if held is not None else self.why_waiting(it, len(self.running) + len(start), lim)
            if why is not None:
                waiting[it.channel] = why
                continue
            start.append(it)
            busy.add(it.channel)
        for it in start:
            self.queue.remove(it)
            self.holds.pop(it, None)
            it.move(State.RUNNING)
            self._begun += 1
            it.begun = self._begun
            self.running[it.channel] = it
        for ch, why in waiting.items():
            if self.waiting.get(ch) != why:
                log.info("channel %s: %s waits: %s", ch, next(q.id for q in self.queue if q.channel == ch), why)
        self.waiting = waiting
        return start

    def expired(self) -> list[tuple[Request, ThrottledError]]:
        """Take out of the queue the requests the throttle has held for ``max_hold_s`` (still
        QUEUED: the caller settles each with its error, which names the level and the resource)."""
        if not self.max_hold_s or not self.holds:
            return []
        now = self._clock()
        out = []
        for it, h in list(self.holds.items()):
            held = h.held_s(now)
            if held >= self.max_hold_s and it in self.queue:
                self.queue.remove(it)
                del self.holds[it]
                out.append((it, ThrottledError(
                    f"request {it.id} was held {held:.0f} s by the throttle and did not start: {h.why}; "
                    f"service.max_hold_s is {self.max_hold_s:g} s")))
        return out

    def running_items(self) -> list[Request]:
        """The items synthesizing now."""
        return list(self.running.values())

    def over(self) -> bool:
        """True when a running item's synthesis is over (or never began): :meth:`ended` has work."""
        return any(it.task is None or it.task.finished for it in self.running.values())

    def ended(self) -> list[Request]:
        """Remove and return the running items whose synthesis is over (or never began)."""
        out = [it for it in self.running.values() if it.task is None or it.task.finished]
        for it in out:
            del self.running[it.channel]
        return out

    def requeue(self, item: Request) -> None:
        """Queue a preempted item again (policy ``resume``), from its interrupted sentence
        (``item.resume_from``), ahead of the requests of its priority queued meanwhile: it plays
        right after the request(s) that interrupted it."""
        item.restart()
        self.insert(item, first=True)

    def find(self, request_id: str) -> Optional[Request]:
        """The active request with this id, or None."""
        return self.active.get(request_id)

    def targets(self, request_id: Optional[str], channel: Optional[str], sink: Optional[EventSink] = None,
                scope: str = DEFAULT_CANCEL_SCOPE) -> list[Request]:
        """The active items a cancel by id, by channel (within ``scope``)
        or by client (``sink``) hits (scopes: :class:`~appliance.messages.protocol.Cancel`)."""
        begun = [it for it in self.active.values() if it.channel == channel and it.state in (State.RUNNING, State.PLAYING)]
        current = min(begun, key=lambda it: it.begun) if begun else None    # sounds now (or is the next to)

        def in_scope(it: Request) -> bool:
            if scope == "current":
                return it is current
            return scope == "all" or it.state is not State.QUEUED or it.speak.priority != "alert"

        return [it for it in self.active.values()
                if (request_id and it.id == request_id) or (channel and it.channel == channel and in_scope(it))
                or (sink is not None and it.sink == sink)]

    def remove(self, item: Request) -> bool:
        """Forget an ending item (its state becomes ENDED); False if it had ended already."""
        self.holds.pop(item, None)
        if item.state is State.QUEUED and item in self.queue:
            self.queue.remove(item)
        if not item.end():
            return False
        if self.active.get(item.id) is item:
            del self.active[item.id]
        return True

    def drain_queue(self) -> list[Request]:
        """Remove every queued item (stop) and return them, ENDED (the caller tells them)."""
        left = list(self.queue)
        self.queue.clear()
        self.holds.clear()
        for it in left:
            self.active.pop(it.id, None)
            it.end()
        return left

    def status(self) -> dict:
        """Per channel: ``queued`` (count), ``active`` (synthesizing request id or None),
        ``playing`` (ids whose audio is still playing), ``waiting`` (why the head of its queue
        cannot start, or None), ``batch_rows`` (rows of the decode step its request is in)."""
        blank = {"queued": 0, "active": None, "playing": [], "waiting": None, "batch_rows": 0}
        chans = {name: dict(blank, playing=[]) for name in self.queue_len}
        for it in self.queue:
            chans.setdefault(it.channel, dict(blank, playing=[]))["queued"] += 1
        for ch, it in self.running.items():
            c = chans.setdefault(ch, dict(blank, playing=[]))
            c["active"] = it.id
            c["batch_rows"] = it.task.report.max_rows if it.task is not None else 0
        for it in self.active.values():
            if it.state is State.PLAYING:
                chans.setdefault(it.channel, dict(blank, playing=[]))["playing"].append(it.id)
        for ch, why in self.waiting.items():
            if ch in chans and chans[ch]["queued"]:
                chans[ch]["waiting"] = why
        return chans
