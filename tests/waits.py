"""Waiting in tests without sleeping a guessed time.

Prefer an event the code sends (a socket reply, an MQTT message, an ``sd_notify`` datagram): read
it with a timeout. Where the code leaves no event but changes something observable (a file it
writes, a line it logs, a status field), :func:`wait_for` polls that condition until it holds,
so a test waits exactly as long as the code needs and fails with a message naming what never
happened, instead of asserting after a ``time.sleep`` that is too short on a loaded machine and
too long everywhere else.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional, TypeVar

T = TypeVar("T")


def wait_for(pred: Callable[[], T], timeout_s: float = 30.0, what: str = "the condition",
             poll_s: float = 0.02, show: Optional[Callable[[], object]] = None) -> T:
    """Call ``pred()`` every ``poll_s`` s until it returns something truthy, and return that.

    Raises:
        AssertionError: ``timeout_s`` passed first (the message names ``what`` and the last value,
            or ``show()`` when given).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s:g} s "
                                 f"(last: {show() if show is not None else got!r})")
        time.sleep(poll_s)


def wait_log(log: Callable[[], str], text: str, timeout_s: float = 30.0, count: int = 1,
             alive: Optional[Callable[[], bool]] = None) -> str:
    """Wait until ``log()`` (e.g. ``DaemonProc.log``: the daemon's log file, re-read every poll)
    holds ``text`` at least ``count`` times; returns the log.

    Raises:
        AssertionError: ``timeout_s`` passed first, or ``alive()`` (e.g. ``DaemonProc.alive``)
            turned false first (the process exited and will never log it); the message shows the
            log's tail.
    """
    def logged() -> str:
        s = log()
        if s.count(text) >= count:
            return s
        if alive is not None and not alive():
            raise AssertionError(f"the process exited before logging {text!r} x{count}:\n{s[-2000:]}")
        return ""

    return wait_for(logged, timeout_s, f"{text!r} x{count} in the log", show=lambda: "\n" + log()[-2000:])


def journal_states(spool: Path) -> dict[str, Optional[str]]:
    """Request id -> its state in the journal of ``spool`` (its accept record's mark, or an
    older journal's last state record: ``s`` started, ``w`` waiting, ``p`` playing, ``e`` ended;
    None: accepted only), as the daemon wrote it so far (read-only: unlike ``Journal.open`` this
    neither compacts nor counts)."""
    from appliance.service.journal import FILE
    from appliance.service.records import decode

    path = Path(spool) / FILE
    ids: dict[int, str] = {}
    out: dict[str, Optional[str]] = {}
    data = path.read_bytes() if path.exists() else b""
    for line in data.split(b"\n"):
        r = decode(line)
        if r is None:
            continue
        if r["k"] in ("a", "f"):
            rid = str((r.get("req") or {}).get("id", r.get("id", "")))
            ids[r["n"]] = rid
            mark = r.get("mark", "s" if r.get("run") else "-")
            out[rid] = ({"-": None, "D": "e", "X": "e"}.get(mark, mark)) if r["k"] == "a" else "e"
        elif r.get("n") in ids:
            out[ids[r["n"]]] = r["k"]
    return out
