"""The UNIX socket: framing, connections, and thread-safe event delivery (asyncio).

* The socket's file, its mode, group and directory, and socket activation:
  :mod:`.socket_listen` (:func:`listen_socket`, :func:`inherited_socket`, re-exported here).
* :class:`SocketServer` accepts connections on the event loop, within its limits
  (:mod:`.socket_limits`): ``service.max_connections`` at once, ``service.max_connections_per_client``
  per client process (one more gets one ``busy`` error line and is closed); a connection with no
  request in flight that sends nothing for ``service.idle_timeout_s`` is closed; malformed lines
  beyond ``service.max_bad_lines_per_min`` get one ``rate_limited`` and are then dropped
  unanswered; what a flood of either would log is one summary line per client per
  ``service.bad_input_log_s``. Running out of file descriptors (``EMFILE``) refuses the
  connection that could not be taken with one line (a spare descriptor kept for it), is logged
  once per interval, and never stops the connections already open. Each line (up to
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
import socket
from typing import Awaitable, Callable, Optional

from ..audio.stream import StreamAudio
from ..errors import ApplianceError, BusyError, RateLimitError, RequestError
from ..messages.protocol import EventSink, error_event, parse_line, to_json
from ..ops.logsummary import Summary
from ..service.peers import Peer, peer_of
from .socket_conn import MAX_PENDING_EVENTS, Connection
from .socket_limits import Gate
from .socket_listen import SD_LISTEN_FDS_START, check_socket_path, inherited_socket, listen_socket

log = logging.getLogger(__name__)

AudioFor = Callable[[str], StreamAudio]
"""``audio(request_id)``: a sink for that request's PCM to this connection's client (worker thread)."""

Handler = Callable[[bytes, EventSink, Peer, AudioFor], Awaitable[Optional[ApplianceError]]]
"""``async handler(line, sink, peer, audio)``: one request line, the connection's event sink, the
client, and how a ``return_audio`` request's PCM reaches the client; returns the error a line
was refused with before it became a request (malformed, rate limited: already answered), else None."""

FD_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
"""``accept(2)`` failures that mean the process or system is out of descriptors or memory."""

GoneHook = Callable[[EventSink, Peer], None]
"""``on_gone(sink, peer)``: the client closed its connection (loop thread; must not raise)."""


class SocketServer:
    """Serve JSON lines on a listening UNIX socket, within its limits (module docstring).

    Args:
        sock: a listening socket (:func:`listen_socket` or :func:`inherited_socket`).
        handler: ``async handler(line: bytes, sink, peer, audio)``; must not raise (errors become
            events); returns the error a line was refused with before it became a request.
        max_line_bytes: longest request line (``service.max_line_bytes``).
        on_gone: ``on_gone(sink, peer)`` when a client closed its connection (module docstring).
        max_buffered_ms: ``service.max_buffered_ms``. sample_format: ``stream.sample_format``.
        limits: ``cfg.service`` (its ``max_connections``, ``max_connections_per_client``,
            ``idle_timeout_s``, ``max_bad_lines_per_min``, ``bad_input_log_s``); None: no limits.
    """

    def __init__(self, sock: socket.socket, handler: Handler, max_line_bytes: int,
                 on_gone: Optional[GoneHook] = None, max_buffered_ms: int = 30000,
                 sample_format: str = "float32", limits: object = None) -> None:
        self.max_buffered_ms, self.sample_format = max_buffered_ms, sample_format
        self.sock = sock
        self.handler = handler
        self.on_gone = on_gone
        self.max_line_bytes = max_line_bytes
        get = lambda k, d: getattr(limits, k, d) if limits is not None else d   # noqa: E731
        self.gate = Gate(get("max_connections", 1 << 30), get("max_connections_per_client", 1 << 30))
        self.idle_timeout_s: Optional[float] = get("idle_timeout_s", None) or None
        self.bad_lines_per_min = get("max_bad_lines_per_min", 0)
        self.summary = Summary(get("bad_input_log_s", 60.0), log)
        self._accepting: Optional[asyncio.Task] = None
        self._sweeping: Optional[asyncio.Task] = None
        self._spare: Optional[int] = None
        self._conns: set[Connection] = set()
        self._tasks: set[asyncio.Task] = set()
        self._n = 0

    async def start(self) -> None:
        """Start accepting connections."""
        loop = asyncio.get_running_loop()
        self._spare = _spare_fd()
        self._accepting = loop.create_task(self._accept_loop(), name="socket accept")
        self._sweeping = loop.create_task(self._sweep(), name="socket log summary")

    def stop_accepting(self) -> None:
        """Close the listening socket; open connections stay until :meth:`close`."""
        if self._accepting is not None:
            self._accepting.cancel()
            self._accepting = None
        try:
            self.sock.close()
        except OSError:
            pass

    async def close(self, flush_timeout_s: float = 2.0) -> None:
        """Flush and close every connection."""
        self.stop_accepting()
        for c in list(self._conns):
            try:
                await asyncio.wait_for(c.flushed(), flush_timeout_s)
            except Exception:
                pass
            c.close()
        for t in list(self._tasks) + ([self._sweeping] if self._sweeping else []):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self.summary.flush()
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None

    # -- accepting ----------------------------------------------------------------------------

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                c, _ = await loop.sock_accept(self.sock)
            except asyncio.CancelledError:
                raise
            except OSError as e:
                if e.errno in FD_ERRNOS:
                    if not self._out_of_fds(e):
                        await asyncio.sleep(0.1)    # no spare: the backlog waits (never a busy loop)
                    continue
                if e.errno in (errno.EBADF, errno.EINVAL) or self.sock.fileno() < 0:
                    return                          # the listening socket was closed
                if e.errno not in (errno.ECONNABORTED, errno.EINTR, errno.EAGAIN, errno.EPROTO):
                    self.summary.note("accept", "socket", "accept failures", str(e), logging.WARNING)
                    await asyncio.sleep(0.1)
                continue
            self._admit(c)

    def _admit(self, c: socket.socket) -> None:
        self._n += 1
        name = f"#{self._n}"
        peer = peer_of(c, name)
        client = f"pid:{peer.pid}" if peer.pid else f"uid:{peer.uid}"
        why = self.gate.admit(client)
        if why is not None:
            _refuse(c, BusyError(why))
            self.summary.note("refused", "socket", "connections refused", f"{peer}: {why}", logging.WARNING)
            return
        task = asyncio.get_running_loop().create_task(self._serve(c, name, peer, client), name=f"socket {name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _out_of_fds(self, e: OSError) -> bool:
        """``accept`` failed for want of descriptors: take the waiting connection with the spare
        descriptor and refuse it with one line; True when that worked."""
        self.summary.note("fds", "socket", "connections refused: out of file descriptors",
                          f"{e.strerror}; LimitNOFILE= in the unit bounds it", logging.WARNING)
        if self._spare is None:
            return False
        os.close(self._spare)
        self._spare = None
        try:
            c, _ = self.sock.accept()
        except OSError:
            return False
        finally:
            self._spare = _spare_fd()
        _refuse(c, BusyError("the box is out of file descriptors; retry later"))
        return True

    async def _sweep(self) -> None:
        """Log the summaries whose interval is over, also for clients that went quiet."""
        while True:
            await asyncio.sleep(max(1.0, self.summary.interval_s / 4))
            self.summary.flush(due_only=True)

    # -- one connection -----------------------------------------------------------------------

    def _gone(self, conn: Connection) -> None:
        if self.on_gone is not None and not conn.gone:
            conn.gone = True
            try:
                self.on_gone(conn.send, conn.peer)
            except Exception:  # noqa: BLE001 - a hook must not kill the connection task
                log.exception("client-gone hook")

    async def _read(self, reader: asyncio.StreamReader, conn: Connection) -> Optional[bytes]:
        """The next bytes of ``conn`` (b"" at EOF); None when it stayed idle (nothing in flight,
        nothing sent) for ``idle_timeout_s``."""
        while True:
            if self.idle_timeout_s is None:
                return await reader.read(65536)
            try:
                return await asyncio.wait_for(reader.read(65536), self.idle_timeout_s)
            except asyncio.TimeoutError:
                if not conn.pending and not conn.outbox:
                    return None

    def _bad(self, conn: Connection, e: ApplianceError, answered: bool) -> None:
        """Count one malformed line of ``conn`` (``answered``: its ``bad_request`` went out, and the
        dispatcher logged it at DEBUG)."""
        if answered:
            kind = "malformed lines answered bad_request"
        elif not conn.bad.told:
            conn.bad.told = True
            kind = "malformed lines, the first over the budget answered rate_limited"
            conn.send(error_event(RateLimitError(
                f"too many malformed lines on this connection: at most {conn.bad.per_min} per minute "
                f"(service.max_bad_lines_per_min); the next ones are dropped unanswered for "
                f"{conn.bad.retry_s():.0f} s")))
        else:
            kind = "malformed lines dropped over the budget"
        conn.bad.take()            # a line over the budget is counted in the summary only, never logged alone
        self.summary.note(conn.peer.key, str(conn.peer), kind, str(e)[:160])

    async def _line(self, conn: Connection, line: bytes) -> None:
        """Handle one complete line of ``conn`` within its bad-line budget."""
        if conn.bad.over():             # only classified: a malformed one is not answered again
            try:
                parse_line(line, self.max_line_bytes)
            except ApplianceError as e:
                self._bad(conn, e, answered=False)
                return
        refused = await self.handler(line, conn.send, conn.peer, conn.audio)
        if isinstance(refused, RateLimitError):
            log.debug("request from %s refused: %s", conn.peer, refused)
            self.summary.note(conn.peer.key, str(conn.peer), "requests refused rate_limited", str(refused)[:160])
        elif isinstance(refused, ApplianceError):
            self._bad(conn, refused, answered=True)

    def _too_long(self, conn: Connection) -> None:
        e = RequestError(f"request line is over the limit of {self.max_line_bytes} bytes (service.max_line_bytes)")
        if conn.bad.over():
            self._bad(conn, e, answered=False)
        else:
            conn.send(error_event(e))
            self._bad(conn, e, answered=True)

    async def _serve(self, c: socket.socket, name: str, peer: Peer, client: str) -> None:
        conn = None
        try:
            reader, writer = await asyncio.open_unix_connection(sock=c)
            conn = Connection(writer, asyncio.get_running_loop(), name, self.max_buffered_ms, self.sample_format,
                              peer, self.bad_lines_per_min)
            self._conns.add(conn)
            log.debug("%s connected", conn.peer)
            await self._lines(reader, writer, conn)
        except (ConnectionError, OSError) as e:
            if getattr(e, "errno", None) not in (None, errno.ECONNRESET, errno.EPIPE, *FD_ERRNOS):
                log.warning("client %s: %s", name, e)
            if conn is not None:
                self._gone(conn)
        except asyncio.CancelledError:
            pass
        finally:
            self.gate.leave(client)
            if conn is None:
                c.close()
            else:
                log.debug("%s gone", conn.peer)
                conn.close()
                self._conns.discard(conn)
                self.summary.flush(conn.peer.key)

    async def _lines(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: Connection) -> None:
        buf = bytearray()
        skipping = False   # inside an over-long line, waiting for its newline
        while not conn.closed:
            data = await self._read(reader, conn)
            if data is None:
                log.debug("%s idle for %g s (service.idle_timeout_s): closed", conn.peer, self.idle_timeout_s)
                self.summary.note("idle", "socket", "idle connections closed (service.idle_timeout_s)")
                return
            if not data:
                break
            buf += data
            while True:
                i = buf.find(b"\n")
                if i < 0:
                    if len(buf) > self.max_line_bytes:
                        if not skipping:
                            self._too_long(conn)
                            skipping = True
                        buf.clear()
                    break
                line = bytes(buf[:i])
                del buf[:i + 1]
                if skipping:
                    skipping = False
                    continue
                if line.strip():
                    await self._line(conn, line)
        if buf.strip() and not skipping:   # last line without newline before EOF / half-close
            await self._line(conn, bytes(buf))
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


def _spare_fd() -> Optional[int]:
    """A descriptor kept open to be given up when ``accept`` meets ``EMFILE`` (None: none left)."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _refuse(c: socket.socket, e: ApplianceError) -> None:
    """Send one ``error`` line on a connection that is not taken, then close it (never blocks).
    What the client sent already is read first: a UNIX socket closed with unread data resets the
    connection, and its client would see ``ECONNRESET`` instead of the line."""
    try:
        c.setblocking(False)
        c.send(to_json(error_event(e)))
        c.shutdown(socket.SHUT_WR)
        for _ in range(16):
            if not c.recv(65536):
                break
    except OSError:
        pass
    finally:
        c.close()


__all__ = ["SocketServer", "Connection", "listen_socket", "inherited_socket", "check_socket_path",
           "SD_LISTEN_FDS_START", "MAX_PENDING_EVENTS"]
