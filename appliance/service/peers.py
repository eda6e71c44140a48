"""Who is on the other end of a socket connection, and how fast it may send.

:func:`peer_of` reads the peer's credentials from the kernel (``SO_PEERCRED`` on a UNIX socket:
the pid, uid and gid of the process that connected; they cannot be forged by the client), so
the log names who asked for what. :class:`RateLimiter` is a token bucket per client process
(``safety.max_requests_per_s`` tokens per second, at most ``safety.request_burst`` saved up);
a request without a token is refused with ``rate_limited`` (the client may retry later), and
nothing else is disturbed.
"""

from __future__ import annotations

import collections
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Optional

from ..errors import RateLimitError

MAX_CLIENTS = 4096
"""Buckets kept (least recently used dropped first)."""


@dataclass(frozen=True)
class Peer:
    """A socket client: connection name and its process's credentials (None where unknown)."""

    name: str
    pid: Optional[int] = None
    uid: Optional[int] = None
    gid: Optional[int] = None

    @property
    def key(self) -> str:
        """What the rate limit counts by: the client process (or the connection)."""
        return f"pid:{self.pid}" if self.pid else f"conn:{self.name}"

    def __str__(self) -> str:
        if self.pid is None:
            return f"client {self.name}"
        return f"client {self.name} (pid {self.pid}, uid {self.uid}, gid {self.gid})"


def peer_of(sock: Optional[socket.socket], name: str) -> Peer:
    """The :class:`Peer` of a connected UNIX stream socket (credentials None if unavailable)."""
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return Peer(name)
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", raw)
    except (OSError, struct.error):
        return Peer(name)
    return Peer(name, pid or None, uid, gid)


class RateLimiter:
    """Token bucket per :attr:`Peer.key`.

    Args:
        rate: tokens per second (``safety.max_requests_per_s``); 0 disables the limit.
        burst: bucket size (``safety.request_burst``).
    """

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = float(rate)
        self.burst = max(1, int(burst))
        self.refused = 0
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def check(self, peer: Peer, now: Optional[float] = None) -> None:
        """Take one token for ``peer``.

        Raises:
            RateLimitError: none left (says when to retry).
        """
        if self.rate <= 0:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens, t = self._buckets.pop(peer.key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - t) * self.rate)
            ok = tokens >= 1.0
            self._buckets[peer.key] = (tokens - 1.0 if ok else tokens, now)
            while len(self._buckets) > MAX_CLIENTS:
                self._buckets.popitem(last=False)
            if not ok:
                self.refused += 1
        if not ok:
            wait = (1.0 - tokens) / self.rate
            raise RateLimitError(f"{peer} sends more than {self.rate:g} requests per second "
                                 f"(safety.max_requests_per_s, burst {self.burst}); retry in {wait:.1f} s")
