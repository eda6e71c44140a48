"""The UNIX socket: framing, connections, and thread-safe event delivery (asyncio).

* :func:`listen_socket` binds ``service.socket`` (its directory must exist: the daemon checks and
  creates it at start, :mod:`appliance.daemon.paths`; a stale socket file is removed, one that
  another daemon still answers on refused), mode ``service.socket_mode``.
* :func:`inherited_socket` takes a listening socket passed by systemd socket activation
  (``LISTEN_PID`` = our pid, ``LISTEN_FDS`` >= 1, fd 3; ``sd_listen_fds(3)``).
* :class:`SocketServer` accepts connections on the event loop. Each line (up to
  ``max_line_bytes``; a longer one is answered with one ``bad_request`` error and skipped up to
  its newline) goes to ``handler(line, sink, peer, audio)`` and is awaited before the next line of the
  same connection, so requests from one client keep their order. ``sink`` is the connection's
  :meth:`Connection.send`: callable from any thread, never blocks, does nothing once the client
  is gone. ``peer`` is the client's :class:`~appliance.service.peers.Peer` (``SO_PEERCRED``: pid,
  uid, gid), logged with its requests. ``audio`` is :meth:`Connection.audio`: the sink a
  ``return_audio`` request's PCM goes to its client through.
* Everything a connection sends goes through ONE :class:`~appliance.audio.stream.Outbox` on its
  :class:`~appliance.audio.stream.ClientStream` (the events of all its requests and their PCM,
  in the order they happened); the connection's writer task encodes each item (an event: one JSON
  line; PCM: an ``audio`` event and its raw bytes in ``stream.sample_format``), writes it and
  waits for the drain before the next. The audio its client has not read is bounded by
  ``service.max_buffered_ms`` (the one rule for every client, :mod:`appliance.audio.stream`: the
  request that goes over it is cancelled); a client that reads nothing while more than
  :data:`MAX_PENDING_EVENTS` events wait is disconnected (its requests go on).
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

from ..audio.stream import AUDIO, EVENT, ClientStream, Outbox, StreamAudio
from ..audio.wav import encode_pcm
from ..core import SAMPLE_RATE
from ..errors import ConfigError, RequestError
from ..messages.protocol import AudioChunk, Event, EventSink, error_event, to_json
from ..service.peers import Peer, peer_of

log = logging.getLogger(__name__)

SD_LISTEN_FDS_START = 3
MAX_PENDING_EVENTS = 100_000
"""Events a connection may hold unwritten (its client reads nothing) before it is dropped."""

FLUSH = "flush"
"""An outbox item ``(FLUSH, future)`` of :meth:`Connection.flushed`: resolved once written up to it."""

AudioFor = Callable[[str], StreamAudio]
"""``audio(request_id)``: a sink for that request's PCM to this connection's client (worker thread)."""

Handler = Callable[[bytes, EventSink, Peer, AudioFor], Awaitable[None]]
"""``async handler(line, sink, peer, audio)``: one request line, the connection's event sink, the
client, and how a ``return_audio`` request's PCM reaches the client."""

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
    """One client connection: :meth:`send` is its event sink, :meth:`audio` its requests' client
    audio, one outbox for both, written by its own writer task (module docstring).

    Args:
        writer: the connection's stream writer. loop: the event loop. name: ``#N``.
        max_buffered_ms: ``service.max_buffered_ms``. sample_format: ``stream.sample_format``.
    """

    def __init__(self, writer: asyncio.StreamWriter, loop: asyncio.AbstractEventLoop, name: str,
                 max_buffered_ms: int = 30000, sample_format: str = "float32") -> None:
        self.writer = writer
        self.loop = loop
        self.name = name
        self.peer = peer_of(writer.get_extra_info("socket"), name)
        self.format = sample_format
        self.stream = ClientStream(f"socket {name}", "socket client", max_buffered_ms, "service.max_buffered_ms")
        self.outbox = Outbox(loop, self.stream)
        self.closed = False
        self.eof = False                 # the client sent EOF (half-close or gone)
        self.gone = False                # on_gone ran
        self.pending: set[str] = set()   # accepted request ids without their done/error yet
        self.writing = loop.create_task(self._write_loop(), name=f"socket {name} writer")

    def send(self, msg: Event) -> None:
        """Queue an event for this client (any thread; never blocks)."""
        if self.closed:
            return
        self.outbox.put((EVENT, msg))
        if len(self.outbox) > MAX_PENDING_EVENTS:
            log.warning("client %s is not reading (%d events pending); disconnecting it (its requests go on)",
                        self.name, len(self.outbox))
            try:
                self.loop.call_soon_threadsafe(self.close)
            except RuntimeError:  # loop closed: the daemon is gone
                self.closed = True

    def audio(self, request_id: str) -> StreamAudio:
        """The sink of one start of ``request_id``'s PCM for this client (worker thread)."""
        return self.stream.audio(request_id, self.outbox)

    async def _write_loop(self) -> None:
        """Encode and write what the outbox holds, in order, each drained before the next."""
        w = self.writer
        try:
            while not self.closed:
                item = await self.outbox.get()
                if self.closed or w.is_closing():
                    break
                if item[0] == FLUSH:         # flushed(): all before it is written
                    item[1].done() or item[1].set_result(None)
                    continue
                if item[0] == AUDIO:         # a request's PCM: its audio event and raw bytes
                    _, sink, pcm, n = item
                    data = encode_pcm(pcm, self.format)
                    w.write(to_json(AudioChunk(id=sink.request_id, bytes=len(data), rate=SAMPLE_RATE,
                                               format=self.format)) + data)
                    await w.drain()
                    sink.written(n)
                    continue
                _, msg = item
                if msg.type == "accepted":
                    self.pending.add(msg.id)
                elif msg.type in ("done", "error") and getattr(msg, "id", None) in self.pending:
                    self.pending.discard(msg.id)
                w.write(to_json(msg))
                await w.drain()
                if self.eof and not self.pending:
                    break
        except (ConnectionError, RuntimeError, OSError):
            pass
        except asyncio.CancelledError:
            return
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

    async def flushed(self) -> None:
        """Wait until what was queued before this call is written (or the connection closed)."""
        if not self.closed and not self.writing.done():
            mark = self.loop.create_future()
            self.outbox.put((FLUSH, mark))
            await asyncio.wait([mark, self.writing], return_when=asyncio.FIRST_COMPLETED)
        await self.writer.drain()

    def close(self) -> None:
        """Close the connection (loop thread; bytes written so far are flushed by the transport)."""
        if not self.closed:
            self.closed = True
            if self.writing is not asyncio.current_task():
                self.writing.cancel()
            try:
                self.writer.close()
            except Exception:
                pass


class SocketServer:
    """Serve JSON lines on a listening UNIX socket.

    Args:
        sock: a listening socket (:func:`listen_socket` or :func:`inherited_socket`).
        handler: ``async handler(line: bytes, sink, peer, audio)``; must not raise (errors become events).
        max_line_bytes: longest request line (``service.max_line_bytes``).
        on_gone: ``on_gone(sink, peer)`` when a client closed its connection (module docstring).
        max_buffered_ms: ``service.max_buffered_ms``. sample_format: ``stream.sample_format``.
    """

    def __init__(self, sock: socket.socket, handler: Handler, max_line_bytes: int,
                 on_gone: Optional[GoneHook] = None, max_buffered_ms: int = 30000,
                 sample_format: str = "float32") -> None:
        self.max_buffered_ms, self.sample_format = max_buffered_ms, sample_format
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
                await asyncio.wait_for(c.flushed(), flush_timeout_s)
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
        conn = Connection(writer, asyncio.get_running_loop(), f"#{self._n}", self.max_buffered_ms, self.sample_format)
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
                                    f"(service.max_line_bytes)")))
                                skipping = True
                            buf.clear()
                        break
                    line = bytes(buf[:i])
                    del buf[:i + 1]
                    if skipping:
                        skipping = False
                        continue
                    if line.strip():
                        await self.handler(line, conn.send, conn.peer, conn.audio)
            if buf.strip() and not skipping:   # last line without newline before EOF / half-close
                await self.handler(bytes(buf), conn.send, conn.peer, conn.audio)
            # EOF: a half-closed client still reads; keep the connection until its requests end,
            # unless it closes completely (then it is gone: on_gone)
            conn.eof = True
            await conn.flushed()                 # what was queued is written (its accepted ids known)
            gone = conn.peer_closed()
            while conn.pending and not conn.closed and not writer.is_closing() and not gone:
                await asyncio.sleep(0.05)
                gone = conn.peer_closed()
            if gone:
                self._gone(conn)
            try:
                await conn.flushed()
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
