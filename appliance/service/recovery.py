"""After a restart: speak the journal's unfinished requests again, and let their clients find them.

At start (before the socket accepts), :meth:`Recovery.replay` takes the unfinished requests of
:meth:`Journal.open <appliance.service.journal.Journal.open>` in accept order and submits each
again, from its beginning, with its original id, channel, priority and seed (so the same audio),
except (each logged, and ended in the journal so it is never tried again):

* one accepted more than ``journal.max_age_s`` ago, or an ``alert`` older than
  ``journal.alert_max_age_s`` (a stale warning is worse than none);
* one that was synthesizing or playing during ``journal.max_attempts`` crashes in a row (it may
  be what crashes the daemon; requests that were only waiting at a crash, queued or synthesized
  and not yet sounding, are not counted: :mod:`appliance.service.journal`);
* one whose channel no longer exists or that the daemon now refuses (its error is logged).

Where its events go: a request that came over MQTT publishes ``replayed`` and then its events
on the ``event`` topic as before. A socket client's connection died with the old process, so
the events are kept by a :class:`Replay` track; a client that sends a ``speak`` with the same
``id`` again is *attached* instead of speaking it twice (:meth:`Recovery.attach`): it gets a
``replayed`` event (``state``: ``queued``, ``running``, ``playing``, or ``done``/``error``)
and then the request's remaining events; a request that had already finished before the
restart (the journal remembers the last :data:`~appliance.service.journal.KEEP_FINISHED`) is
answered with ``replayed`` and its terminal event at once, and is not spoken again.

At a clean stop (:func:`tell_stopped`), queued requests stay in the journal and their clients get
``error`` ``spooled`` (spoken after the next start), as the old spool did.
"""

from __future__ import annotations

import logging
import threading
from typing import Awaitable, Callable, Optional

from ..config import Config, JournalConfig
from ..errors import ApplianceError, CancelledError, RequestError
from ..messages.protocol import (
    ErrorEvent,
    Event,
    EventSink,
    Replayed,
    Speak,
    error_event,
    parse_event,
    parse_request,
)
from .journal import Journal
from .records import Entry, Recovered, Stamp, age_s, text_sha
from .request import Request

log = logging.getLogger(__name__)

Resubmit = Callable[[Speak, str, EventSink, int], Awaitable[None]]
"""``await resubmit(speak, channel, sink, journal_n)``: prepare and queue a replayed request
(:meth:`~appliance.service.dispatch.Dispatcher.resubmit`); raises ApplianceError when refused."""

_STATE = {"accepted": "queued", "started": "running", "preempted": "queued"}


class Replay:
    """The events of one replayed request, for clients that come back (module docstring).

    Args:
        entry: its journal entry. origin_sink: where its events go anyway (MQTT), or None.
    """

    def __init__(self, entry: Entry, origin_sink: Optional[EventSink]) -> None:
        self.entry = entry
        self.origin_sink = origin_sink
        self.state = "queued"
        self.terminal: Optional[Event] = None
        self._attached: list[EventSink] = []
        self._lock = threading.Lock()

    @property
    def id(self) -> str:
        return self.entry.id

    def sink(self, event: Event) -> None:
        """The replayed request's :data:`EventSink`: remembers its state, forwards to the origin
        and to every attached client."""
        kind = event.type
        with self._lock:
            if kind in ("done", "error"):
                self.state, self.terminal = kind, event
            elif kind in _STATE:
                self.state = _STATE[kind]
            elif kind == "audio":
                self.state = "running"
            sinks = list(self._attached)
        if kind in ("done", "error"):
            log.info("replayed request %s: %s %s", self.id, kind, getattr(event, "output", "") or getattr(event, "message", ""))
        for s in ([self.origin_sink] if self.origin_sink is not None else []) + sinks:
            s(event)

    def attach(self, sink: EventSink) -> None:
        """Send ``replayed`` (and the terminal event if it is over) to ``sink``, then every later event."""
        with self._lock:
            state, terminal = self.state, self.terminal
            if terminal is None:
                self._attached.append(sink)
        sink(Replayed(id=self.id, channel=str(self.entry.req.get("channel") or ""), state=state))
        if terminal is not None:
            sink(terminal)


class Recovery:
    """Replay at start, attach on return, notices at stop (module docstring).

    Args:
        journal: the open :class:`~appliance.service.journal.Journal`.
        recovered: what :meth:`Journal.open` returned.
        cfg: ``cfg.journal`` (ages, attempts).
    """

    def __init__(self, journal: Journal, recovered: Recovered, cfg: JournalConfig) -> None:
        self.journal = journal
        self.recovered = recovered
        self.cfg = cfg
        self.replays: dict[str, Replay] = {}
        self._finished = dict(recovered.finished)
        self._finished_sha = dict(recovered.finished_sha)
        self._lock = threading.Lock()

    def why_not(self, e: Entry, now: Stamp) -> Optional[str]:
        """Why entry ``e`` is not replayed (``now``: :meth:`Stamp.now`), or None. Its age is
        measured on the boot clock, not the wall clock (:func:`~appliance.service.records.age_s`)."""
        age = age_s(e.at, self.recovered.last_of_boot.get(e.at.boot, e.at), now)
        if e.tries >= self.cfg.max_attempts:
            return (f"it was synthesizing or playing during {e.tries} crash(es) in a row "
                    f"(journal.max_attempts {self.cfg.max_attempts})")
        if e.req.get("priority") == "alert" and age > self.cfg.alert_max_age_s:
            return f"alert accepted {age:.0f} s ago, older than journal.alert_max_age_s {self.cfg.alert_max_age_s:g} s"
        if age > self.cfg.max_age_s:
            return f"accepted {age:.0f} s ago, older than journal.max_age_s {self.cfg.max_age_s:g} s"
        return None

    async def replay(self, resubmit: Resubmit, mqtt_sink: Optional[EventSink] = None,
                     mqtt_seen: Optional[Callable[[str], None]] = None) -> int:
        """Submit the unfinished requests again (accept order); returns how many were. Those that
        came over MQTT publish their events through ``mqtt_sink`` (the MQTT bridge's event sink)
        and their ids go to ``mqtt_seen`` (the bridge's de-dup LRU: a QoS 1 redelivery of one is
        then a duplicate). Both None: no MQTT bridge runs."""
        pending = self.recovered.pending
        if not pending:
            return 0
        now = Stamp.now()
        n = 0
        for e in pending:
            why = self.why_not(e, now)
            if why is None:
                try:
                    speak = parse_request(e.req)
                    if not isinstance(speak, Speak):
                        raise ApplianceError(f"journal entry {e.n} is not a speak request")
                except ApplianceError as err:
                    why = f"unreadable: {err}"
            if why is not None:
                log.warning("journaled request %s is not replayed: %s", e.id, why)
                self.journal.end(e.n, {"type": "error", "id": e.id, "code": CancelledError.code,
                                       "message": f"not replayed after the restart: {why}"})
                continue
            origin = mqtt_sink if e.origin == "mqtt" else None
            if origin is not None and mqtt_seen is not None:
                mqtt_seen(e.id)
            r = Replay(e, origin)
            with self._lock:
                self.replays[e.id] = r
            if origin is not None:
                origin(Replayed(id=e.id, channel=str(e.req.get("channel") or ""), state="queued"))
            try:
                await resubmit(speak, str(e.req.get("channel") or ""), r.sink, e.n)
            except ApplianceError as err:
                log.warning("journaled request %s is not replayed: %s (%s)", e.id, err, err.code)
                ev = error_event(err, e.id)
                self.journal.end(e.n, {"type": "error", "id": e.id, "code": ev.code, "message": ev.message})
                r.sink(ev)
                continue
            n += 1
        log.info("replaying %d journaled request(s) from %s (%d not replayed)", n, self.journal.path, len(pending) - n)
        return n

    def attach(self, speak: Speak, sink: EventSink) -> bool:
        """A ``speak`` whose id is a replayed or journal-finished request: attach ``sink`` to it
        instead of speaking it again. Returns False for any other id, and for a finished request's
        id sent with another text (a client that reuses ids: the new text is spoken, as it would be
        without the restart).

        Raises:
            RequestError: the id is a request being replayed now with another text.
        """
        with self._lock:
            r = self.replays.get(speak.id)
            fin = None if r is not None else self._finished.get(speak.id)
            sha = r.entry.text_sha if r is not None else self._finished_sha.get(speak.id, "")
        if sha and sha != text_sha(speak.text):
            if r is not None and r.terminal is None:
                raise RequestError(f"request id {speak.id!r} is being replayed from before the restart with another "
                                   f"text; give every new request a fresh id")
            log.info("request id %s finished with another text: speaking the new one", speak.id)
            with self._lock:
                self.replays.pop(speak.id, None)
                self._finished.pop(speak.id, None)
                self._finished_sha.pop(speak.id, None)
            return False
        if r is not None:
            log.info("client came back for replayed request %s (%s)", speak.id, r.state)
            r.attach(sink)
            return True
        if fin is None:
            return False
        log.info("client asked again for request %s, which finished before the restart: %s", speak.id, fin.get("type"))
        sink(Replayed(id=speak.id, channel=str(fin.get("channel") or ""), state=str(fin.get("type"))))
        try:
            ev = parse_event(fin)
        except (ApplianceError, TypeError):
            ev = ErrorEvent(code=str(fin.get("code", "cancelled")), message=str(fin.get("message", "")), id=speak.id)
        sink(ev)
        return True


def open_journal(cfg: Config) -> tuple[Optional[Journal], Optional[Recovery]]:
    """Open the journal in ``service.spool_dir`` and read what the last run left (``journal``
    section; ``(None, None)`` when ``journal.enabled`` is false): the journal and its
    :class:`Recovery`, both handed to the worker and the dispatcher when they are built. Never
    fails the start: a journal that cannot be read or written is reported (``Journal.condition``)
    and the box plays requests without it (:mod:`appliance.service.journal`)."""
    if not cfg.journal.enabled:
        log.warning("request journal off (journal.enabled: false): a crash or stop loses accepted requests")
        return None, None
    j = cfg.journal
    journal = Journal(cfg.resolve(cfg.service.spool_dir), j.max_bytes, j.fsync)
    recovery = Recovery(journal, journal.open(), j)
    return journal, recovery


def tell_stopped(items: list[Request], journal_on: bool) -> None:
    """Queued requests left at a clean stop: with the journal they stay there and are spoken
    after the next start (client gets ``error`` ``spooled``); without, or for a ``play: false``
    request (never journaled: its audio only goes back to its client), they are dropped
    (``cancelled``)."""
    kept = 0
    for it in items:
        if journal_on and it.journal is not None:
            kept += 1
            it.sink(ErrorEvent(code="spooled", id=it.id,
                               message=f"request {it.id} was not started before the daemon stopped; it is kept in "
                                       f"the journal and will be spoken after the restart"))
        elif not it.speak.play:   # its audio goes only to its client, who is gone after the restart
            it.sink(ErrorEvent(code=CancelledError.code, id=it.id,
                               message=f"request {it.id} was not started before the daemon stopped; its audio "
                                       f"would only go back to this connection, so it is not kept: send it again"))
        else:
            it.sink(ErrorEvent(code=CancelledError.code, id=it.id,
                               message=f"request {it.id} was not started before the daemon stopped and is dropped "
                                       f"(journal.enabled: false); send it again"))
    if items:
        log.info("%s", stop_summary(len(items), kept, journal_on))


def stop_summary(left: int, kept: int, journal_on: bool) -> str:
    """The log line of :func:`tell_stopped`: how many queued requests were kept in the journal
    and how many dropped, and why (``play: false`` ones, e.g. Wyoming's, are never journaled)."""
    dropped = left - kept
    parts = [f"{kept} kept in the journal (spoken after the next start)"] if kept else []
    if dropped:
        why = ("journal.enabled: false" if not journal_on
               else "play: false, e.g. Wyoming's: their audio goes only to a client that is gone, so they are never journaled")
        parts.append(f"{dropped} dropped ({why})")
    return f"{left} queued request(s) left at stop: " + ", ".join(parts)
