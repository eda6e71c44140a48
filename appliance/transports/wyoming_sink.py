"""A Wyoming connection's socket: TCP keepalive and a bound on unacknowledged data
(:func:`keep_alive`), and its kernel send buffer, kept small so that the bound on the audio its client
has not read (:class:`~appliance.audio.stream.ClientStream`, ``wyoming.max_buffered_ms``) is met:
a client that stops reading fills the kernel's send buffer (:data:`SNDBUF_BYTES`), then asyncio's
write buffer (64 KiB), then the stream's bound, where its request is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import socket

log = logging.getLogger(__name__)


SNDBUF_BYTES = 65536
"""The kernel send buffer each Wyoming connection asks for (Linux doubles it for its bookkeeping:
128 KiB, 2.7 s of audio) instead of TCP's autotuning up to ``net.ipv4.tcp_wmem`` (4 MiB, 87 s of
audio): with autotuning a client that never read took all 30.7 s (1.4 MiB) of a six-sentence
request into the box's kernel and the bound was never met. 128 KiB still moves audio hundreds of
times faster than it plays on a LAN."""


def limit_send_buffer(writer: asyncio.StreamWriter, name: str) -> None:
    """Fix the kernel send buffer of ``writer``'s socket at :data:`SNDBUF_BYTES` (logged, never
    raised, where it cannot be set)."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF_BYTES)
    except OSError as e:
        log.debug("%s: cannot set SO_SNDBUF: %s", name, e)


def keep_alive(writer: asyncio.StreamWriter, name: str, idle_s: float, unacked_s: float) -> None:
    """TCP keepalive on ``writer``'s socket (first probe after ``idle_s`` idle seconds, then every
    third of it, three unanswered probes close it) and ``TCP_USER_TIMEOUT`` (data unacknowledged
    for ``unacked_s`` closes it: a client frozen behind a firewall rule). Not a TCP socket (a UNIX
    one): nothing to do. Logged, never raised, where an option cannot be set."""
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    opts = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name_, value in (("TCP_KEEPIDLE", max(1, int(idle_s))), ("TCP_KEEPINTVL", max(1, int(idle_s / 3))),
                         ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", int(unacked_s * 1000))):
        if hasattr(socket, name_):
            opts.append((socket.IPPROTO_TCP, getattr(socket, name_), value))
    for level, opt, value in opts:
        try:
            sock.setsockopt(level, opt, value)
        except OSError as e:
            log.debug("%s: cannot set socket option %s: %s", name, opt, e)


__all__ = ["SNDBUF_BYTES", "limit_send_buffer", "keep_alive"]
