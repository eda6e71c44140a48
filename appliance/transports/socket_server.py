"""The UNIX socket: framing, connections, and thread-safe event delivery (asyncio).

* :func:`listen_socket` binds ``service.socket`` (its directory must exist: the daemon checks and
  creates it at start, :mod:`appliance.daemon.paths`; a stale socket file is removed, one that
  another daemon still answers on refused), mode ``service.socket_mode``.
* :func:`inherited_socket` takes a listening socket passed by systemd socket activation
  (``LISTEN_PID`` = our pid, ``LISTEN_FDS`` >= 1, fd 3; ``sd_listen_fds(3)``).
* :class:`SocketServer` accepts connections on the event loop. Each line (up to
  ``max_line_bytes``; a longer one is answered with one ``bad_request`` error and skipped up to
  its newline) goes to ``handler(line, sink, peer)`` and is awaited before the next line of the
  same connection, so requests from one client keep their order. ``sink`` is the connection's
  :meth:`Connection.send`: callable from any thread (it hops to the loop with
  ``call_soon_threadsafe``), never blocks, and does nothing once the client is gone; a client
  that stops reading while more than :data:`MAX_PENDING_BYTES` wait is disconnected (its
  requests go on). ``peer`` is the client's :class:`~appliance.service.peers.Peer`
  (``SO_PEERCRED``: pid, uid, gid), logged with its requests.
* A client that *closes* its connection (both directions: the kernel reports ``POLLHUP`` on our
  end, at EOF or later) is gone: ``on_gone(sink, peer)`` runs once (the dispatcher cancels its
  requests on channels with ``on_disconnect: cancel``). One that only half-closes (shuts down
  its write side) and still reads keeps its connection until its requests end.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import select
import socket
import stat
from pathlib import Path
from typing import Awaitable, Callable, Optional

from ..audio.wav import encode_pcm
from ..core import PcmChunk
from ..errors import ConfigError, RequestError
from ..messages.protocol import Event, EventSink, error_event, to_json
from ..service.peers import Peer, peer_of

log = logging.getLogger(__name__)

SD_LISTEN_FDS_START = 3
MAX_PENDING_BYTES = 64 * 1024 * 1024
"""Unsent bytes (events + audio) a connection may hold before it is dropped."""

Handler = Callable[[bytes, EventSink, Peer], Awaitable[None]]
"""``async handler(line, sink, peer)``: one request line, the connection's event sink, the client."""

GoneHook = Callable[[EventSink, Peer], None]
"""``on_gone(sink, peer)``: the client closed its connection (loop thread; must not raise)."""


def check_socket_path(path: Path) -> None:
    """Make ``path`` free for :func:`listen_socket`: remove a stale socket file (nobody answers).

    Called once early (before the model loads, so a second daemon fails fast) and again at bind.

    Raises:
        ConfigError: ``path`` exists and is not a socket, or another process listens on it.
    """
    path = Path(path)
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"service.socket: {path} exists and is not a socket; remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("removing stale socket %s", path)
        path.unlink(missing_ok=True)
    except OSError as e:
        raise ConfigError(f"service.socket: cannot probe existing socket {path}: {e}") from e
    else:
        raise ConfigError(f"service.socket: another daemon is listening on {path}; stop it or choose another path")
    finally:
        probe.close()


def listen_socket(path: Path, mode: int, backlog: int = 64) -> socket.socket:
    """Bind and listen on a UNIX stream socket at ``path`` with file mode ``mode``.

    Raises:
        ConfigError: ``path`` exists and is not a socket, another process listens on it, or
            it cannot be bound (too long, no permission) – the message says what to change.
    """
    path = Path(path)
    check_socket_path(path)
    if not path.parent.is_dir():
        raise ConfigError(f"service.socket: directory {path.parent} does not exist; create it or choose another path")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)            # never visible with wider permissions than 0600 ...
    try:
        sock.bind(str(path))
    except OSError as e:
        sock.close()
        why = "path too long for a UNIX socket (max 107 bytes)" if len(os.fsencode(str(path))) > 107 else e.strerror
        raise ConfigError(f"service.socket: cannot bind {path}: {why}") from e
    finally:
        os.umask(old)
    os.chmod(path, mode)             # ... then exactly service.socket_mode
    sock.listen(backlog)
    sock.setblocking(False)
    log.info("listening on %s (mode %04o)", path, mode)
    return sock


def inherited_socket() -> Optional[socket.socket]:
    """The listening socket systemd passed (socket activation), or None.

    Clears ``LISTEN_PID`` / ``LISTEN_FDS`` / ``LISTEN_FDNAMES`` so children do not inherit them.

    Raises:
        ConfigError: fd 3 is not a listening UNIX stream socket.
    """
    fds, pid = os.environ.get("LISTEN_FDS"), os.environ.get("LISTEN_PID")
    if not fds or pid != str(os.getpid()):
        return None
    for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(k, None)
    try:
        n = int(fds)
    except ValueError:
        return None
    if n < 1:
        return None
    if n > 1:
        log.warning("socket activation passed %d fds; using fd %d only", n, SD_LISTEN_FDS_START)
    try:
        sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    except OSError as e:
        raise ConfigError(f"LISTEN_FDS: fd {SD_LISTEN_FDS_START} is not a socket ({e}); check the .socket unit") from e
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        raise ConfigError("LISTEN_FDS: the inherited socket is not a UNIX stream socket; use ListenStream=<path> in the .socket unit")
    os.set_inheritable(sock.fileno(), False)
    sock.setblocking(False)
    log.info("using the listening socket passed by systemd (%s)", sock.getsockname() or "unnamed")
    return sock


class Connection:
    """One client connection; :meth:`send` is its event sink."""

    def __init__(self, writer: asyncio.StreamWriter, loop: asyncio.AbstractEventLoop, name: str) -> None:
        self.writer = writer
        self.loop = loop
        self.name = name
        self.peer = peer_of(writer.get_extra_info("socket"), name)
        self.closed = False
        self.eof = False                 # the client sent EOF (half-close or gone)
        self.gone = False                # on_gone ran
        self.pending: set[str] = set()   # accepted request ids without their done/error yet

    def send(self, msg: Event, payload: Optional[PcmChunk] = None) -> None:
        """Queue an event (and its PCM, sent as raw bytes after it) for this client; any thread."""
        if self.closed:
            return
        try:
            self.loop.call_soon_threadsafe(self._send, msg, payload)
        except RuntimeError:  # loop closed: the daemon is gone
            self.closed = True

    def _send(self, msg: Event, payload: Optional[PcmChunk]) -> None:
        if self.closed or self.writer.is_closing():
            self.closed = True
            return
        kind = msg.type
        if kind == "accepted":
            self.pending.add(msg.id)
        elif kind in ("done", "error") and getattr(msg, "id", None) in self.pending:
            self.pending.discard(msg.id)
        try:
            self.writer.write(to_json(msg))
            if payload is not None:          # an audio event's PcmChunk, in the format its header names
                self.writer.write(encode_pcm(payload.samples, msg.format))
        except (ConnectionError, RuntimeError):
            self.closed = True
            return
        if self.eof and not self.pending:
            self.close()
            return
        if self.writer.transport.get_write_buffer_size() > MAX_PENDING_BYTES:
            log.warning("client %s is not reading (%d bytes pending); disconnecting it (its requests go on)",
                        self.name, self.writer.transport.get_write_buffer_size())
            self.close()

    def peer_closed(self) -> bool:
        """True when the client closed its end completely (not just its write side)."""
        sock = self.writer.get_extra_info("socket")
        if sock is None or self.writer.is_closing():
            return True
        try:
            p = select.poll()
            p.register(sock.fileno(), select.POLLHUP)
            return any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in p.poll(0))
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        """Close the connection (pending bytes are flushed by the transport)."""
        if not self.closed:
            self.closed = True
            try:
                self.writer.close()
            except Exception:
                pass


class SocketServer:
    """Serve JSON lines on a listening UNIX socket.

    Args:
        sock: a listening socket (:func:`listen_socket` or :func:`inherited_socket`).
        handler: ``async handler(line: bytes, sink, peer)``; must not raise (errors become events).
        max_line_bytes: longest request line (``service.max_line_bytes``).
        on_gone: ``on_gone(sink, peer)`` when a client closed its connection (module docstring).
    """

    def __init__(self, sock: socket.socket, handler: Handler, max_line_bytes: int,
                 on_gone: Optional[GoneHook] = None) -> None:
        self.sock = sock
        self.handler = handler
        self.on_gone = on_gone
        self.max_line_bytes = max_line_bytes
        self._server: Optional[asyncio.base_events.Server] = None
        self._conns: set[Connection] = set()
        self._tasks: set[asyncio.Task] = set()
        self._n = 0

    async def start(self) -> None:
        """Start accepting connections."""
        self._server = await asyncio.start_unix_server(self._on_client, sock=self.sock)

    def stop_accepting(self) -> None:
        """Close the listening socket; open connections stay until :meth:`close`."""
        if self._server is not None:
            self._server.close()

    async def close(self, flush_timeout_s: float = 2.0) -> None:
        """Flush and close every connection."""
        for c in list(self._conns):
            try:
                await asyncio.wait_for(c.writer.drain(), flush_timeout_s)
            except Exception:
                pass
            c.close()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _gone(self, conn: Connection) -> None:
        if self.on_gone is not None and not conn.gone:
            conn.gone = True
            try:
                self.on_gone(conn.send, conn.peer)
            except Exception:  # noqa: BLE001 - a hook must not kill the connection task
                log.exception("client-gone hook")

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._n += 1
        conn = Connection(writer, asyncio.get_running_loop(), f"#{self._n}")
        self._conns.add(conn)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        log.debug("%s connected", conn.peer)
        buf = bytearray()
        skipping = False   # inside an over-long line, waiting for its newline
        try:
            while not conn.closed:
                data = await reader.read(65536)
                if not data:
                    break
                buf += data
                while True:
                    i = buf.find(b"\n")
                    if i < 0:
                        if len(buf) > self.max_line_bytes:
                            if not skipping:
                                conn.send(error_event(RequestError(
                                    f"request line is over the limit of {self.max_line_bytes} bytes "
                                    f"(service.max_line_bytes)")), None)
                                skipping = True
                            buf.clear()
                        break
                    line = bytes(buf[:i])
                    del buf[:i + 1]
                    if skipping:
                        skipping = False
                        continue
                    if line.strip():
                        await self.handler(line, conn.send, conn.peer)
            if buf.strip() and not skipping:   # last line without newline before EOF / half-close
                await self.handler(bytes(buf), conn.send, conn.peer)
            # EOF: a half-closed client still reads; keep the connection until its requests end,
            # unless it closes completely (then it is gone: on_gone)
            conn.eof = True
            await asyncio.sleep(0)               # let already-scheduled events through
            gone = conn.peer_closed()
            while conn.pending and not conn.closed and not writer.is_closing() and not gone:
                await asyncio.sleep(0.05)
                gone = conn.peer_closed()
            if gone:
                self._gone(conn)
            try:
                await writer.drain()
            except Exception:
                pass
        except (ConnectionError, OSError) as e:
            if getattr(e, "errno", None) not in (None, errno.ECONNRESET, errno.EPIPE):
                log.warning("client %s: %s", conn.name, e)
            self._gone(conn)
        except asyncio.CancelledError:
            pass
        finally:
            log.debug("%s gone", conn.peer)
            conn.close()
            self._conns.discard(conn)
            if task is not None:
                self._tasks.discard(task)
