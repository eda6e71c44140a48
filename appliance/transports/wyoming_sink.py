"""A Wyoming connection's kernel send buffer, kept small so that the bound on the audio its client
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


__all__ = ["SNDBUF_BYTES", "limit_send_buffer"]
