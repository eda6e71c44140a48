"""Repeated events logged as one line per key and interval, with counts (a flood of bad input
must not flood the log: journald drops a service's messages beyond its burst limit, the box's own
among them).

:class:`Summary` counts what happens per key (a client, the refused connections) by kind and logs
one line per key once its interval is over (at the next event of that key, or at the next
:meth:`Summary.flush` with ``due_only``, which the owner calls now and then, or at a flush when
the key is done, e.g. its connection closed). Not thread-safe: one owner thread (the event loop).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable, Optional

log = logging.getLogger(__name__)


class Summary:
    """Counts what happens per key and logs one line per key per ``interval_s`` (module docstring).

    Args:
        interval_s: seconds a key's summary covers (``service.bad_input_log_s``).
        logger: where the lines go (default: this module's). clock: monotonic clock, s (tests).
    """

    def __init__(self, interval_s: float, logger: Optional[logging.Logger] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.log = logger or log
        self._clock = clock
        self._level: dict[str, int] = {}
        self._counts: dict[str, Counter] = {}
        self._first: dict[str, float] = {}
        self._last: dict[str, str] = {}
        self._what: dict[str, str] = {}

    def note(self, key: str, what: str, kind: str, last: str = "", level: int = logging.INFO) -> None:
        """Count one ``kind`` (e.g. ``malformed lines answered bad_request``) for ``key``; ``what``
        names it in the summary (e.g. the client), ``last`` is the latest detail, ``level`` the
        summary line's log level (the highest noted in the interval). Logs the key's summary when
        its interval is over."""
        now = self._clock()
        self._level[key] = max(level, self._level.get(key, level))
        c = self._counts.setdefault(key, Counter())
        c[kind] += 1
        self._first.setdefault(key, now)
        self._what[key] = what
        if last:
            self._last[key] = last
        if now - self._first[key] >= self.interval_s:
            self.flush(key)

    def flush(self, key: Optional[str] = None, due_only: bool = False) -> int:
        """Log the summary of ``key`` (None: every key; ``due_only``: only those whose interval is
        over); returns the lines logged."""
        now = self._clock()
        n = 0
        for k in ([key] if key is not None else list(self._counts)):
            c = self._counts.get(k)
            if not c or (due_only and now - self._first[k] < self.interval_s):
                continue
            span = max(now - self._first[k], 0.0)
            counts = ", ".join(f"{v} {kind}" for kind, v in c.most_common())
            last = self._last.pop(k, "")
            self.log.log(self._level.pop(k, logging.INFO), "%s: %s in %.0f s%s", self._what.pop(k, k), counts, span,
                    f" (last: {last})" if last else "")
            del self._counts[k], self._first[k]
            n += 1
        return n


__all__ = ["Summary"]
