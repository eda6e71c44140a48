"""The spool: accepted requests that never started survive a stop.

At stop, each queued request is written as its ``speak`` JSON (plus its resolved ``channel``)
to ``service.spool_dir`` and its client gets an ``error`` with code ``spooled`` (a request
with ``play: false``, whose audio only goes back to its client, gets ``cancelled`` instead)
(:func:`spool_items`); after the next start :func:`replay_spool` submits them again, oldest
first. Files are written to ``<name>.tmp`` and renamed, so a crash mid-write leaves no
half-written request behind.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Awaitable, Callable, Optional

from ..errors import ApplianceError, CancelledError
from .protocol import ErrorEvent, Event, EventSink, Request, parse_request, to_dict
from .scheduler import Item

log = logging.getLogger(__name__)


def spool_items(spool_dir: Path, items: list[Item]) -> None:
    """Write each item to ``spool_dir`` and tell its client (``error`` code ``spooled``). If the
    spool cannot be written the request is reported ``cancelled`` instead (never silently lost)."""
    d = spool_dir
    for n, it in enumerate(items):
        if not it.speak.play:     # its audio goes only to its client, who is gone after the restart
            it.sink(ErrorEvent(code=CancelledError.code, id=it.id,
                               message=f"request {it.id} was not started before the daemon stopped; its audio "
                                       f"would only go back to this connection, so it is not spooled: send it again"), None)
            continue
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


async def replay_spool(spool_dir: Path, handle_request: Callable[[Request, EventSink], Awaitable[None]]) -> None:
    """Hand the requests spooled at the last stop to ``handle_request`` (oldest first); each
    file is removed once its request is accepted or refused (the outcome is logged)."""
    d = spool_dir
    files = sorted(d.glob("*.json")) if d.is_dir() else []
    for f in files:
        def sink(ev: Event, payload: Optional[bytes], name: str = f.name) -> None:
            if ev.type in ("done", "error"):
                log.info("spooled request %s: %s %s", getattr(ev, "id", name), ev.type,
                         getattr(ev, "message", getattr(ev, "output", "")))
        try:
            req = parse_request(json.loads(f.read_text(encoding="utf-8")))
        except (OSError, ValueError, ApplianceError) as e:
            log.error("dropping unreadable spool file %s: %s", f, e)
        else:
            await handle_request(req, sink)
        f.unlink(missing_ok=True)
    if files:
        log.info("replayed %d spooled request(s) from %s", len(files), d)
