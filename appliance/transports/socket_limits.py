"""The request socket's limits on its neighbours: how many connections, how much bad input, and
how much of it reaches the log.

* :class:`Gate`: at most ``service.max_connections`` connections at once and at most
  ``service.max_connections_per_client`` from one client process (``SO_PEERCRED`` pid; one uid
  where the pid is unknown); one more is answered with one ``busy`` error line and closed.
* :class:`BadLines`: a connection's budget of malformed lines (lines that are not a valid
  request): ``service.max_bad_lines_per_min`` per minute, as a token bucket that holds a minute's
  worth. Within it each is answered ``bad_request``; beyond it the first is answered
  ``rate_limited`` and the rest are dropped unanswered until the budget refills.
* What a flood would write to the log is summarised (:class:`~appliance.ops.logsummary.Summary`):
  one line per client (and one for the refused connections) per ``service.bad_input_log_s`` with
  a count. Every single malformed line is logged at DEBUG only.

All of it runs on the event loop's thread (no locks).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable, Optional

log = logging.getLogger(__name__)


class BadLines:
    """One connection's budget of malformed lines (module docstring).

    Args:
        per_min: lines per minute (the bucket holds this many); 0 = no budget (all answered).
        clock: monotonic clock, s (tests).
    """

    def __init__(self, per_min: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_min = per_min
        self._clock = clock
        self._tokens = float(per_min)
        self._t = clock()
        self.told = False          # the current episode over budget was answered rate_limited

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(float(self.per_min), self._tokens + (now - self._t) * self.per_min / 60.0)
        self._t = now
        if self._tokens >= 1.0:
            self.told = False

    def over(self) -> bool:
        """True while the budget is spent (the next malformed line is not answered bad_request)."""
        if self.per_min <= 0:
            return False
        self._refill()
        return self._tokens < 1.0

    def take(self) -> None:
        """Count one malformed line."""
        if self.per_min > 0:
            self._refill()
            self._tokens = max(0.0, self._tokens - 1.0)

    def retry_s(self) -> float:
        """Seconds until the next line would be within the budget."""
        return max(0.0, (1.0 - self._tokens) * 60.0 / self.per_min) if self.per_min > 0 else 0.0


class Gate:
    """How many connections the socket holds (module docstring).

    Args:
        total: ``service.max_connections``. per_client: ``service.max_connections_per_client``.
    """

    def __init__(self, total: int, per_client: int) -> None:
        self.total, self.per_client = total, per_client
        self.open = 0
        self._by: Counter = Counter()

    def admit(self, client: str) -> Optional[str]:
        """Count a new connection of ``client`` (its pid or uid key); None when it may stay, else
        why not (then nothing is counted)."""
        if self.open >= self.total:
            return (f"the box has {self.open} connections open, its limit (service.max_connections "
                    f"{self.total}); close one or retry later")
        if self._by[client] >= self.per_client:
            return (f"this client has {self._by[client]} connections open, its limit "
                    f"(service.max_connections_per_client {self.per_client}); reuse or close one")
        self.open += 1
        self._by[client] += 1
        return None

    def leave(self, client: str) -> None:
        """A connection admitted for ``client`` closed."""
        self.open -= 1
        self._by[client] -= 1
        if self._by[client] <= 0:
            del self._by[client]


__all__ = ["BadLines", "Gate"]
