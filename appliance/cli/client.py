"""The daemon's UNIX socket as the command-line clients see it: where it is, one blocking
connection (JSON lines out; events, with an ``audio`` event's PCM payload, in), and the exit
statuses every client shares. Used by ``say`` (:mod:`appliance.cli.say`), ``status`` / ``cancel`` /
``normalize --socket`` (:mod:`appliance.cli.control`) and the benches.

The socket path: ``--socket``, else ``service.socket`` of the config every subcommand uses
(``--config``, else ``$CHATTTS_APPLIANCE_CONFIG``, else ``./config.local.yaml``, else
``./config.yaml``), else the built-in default. Only the stdlib is imported, so the clients start
fast.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ..errors import ApplianceError

#: Exit statuses: the request's end reached; an error reply, a timeout or a lost connection;
#: the daemon not reachable (no socket, refused, no permission, bad config).
EXIT_DONE, EXIT_ERROR, EXIT_UNREACHABLE = 0, 1, 2


class Unreachable(Exception):
    """The daemon's socket does not exist or refuses connections."""


def socket_path(config: Optional[str], sock: Optional[str]) -> Path:
    """The daemon's socket: ``--socket``, else ``service.socket`` of the config
    (:func:`~appliance.config.find_config`: ``--config``, ``$CHATTTS_APPLIANCE_CONFIG``,
    ``./config.local.yaml``, ``./config.yaml``), else the built-in default.

    Raises:
        ConfigError: the config file named cannot be read or is invalid.
    """
    if sock:
        return Path(sock)
    from ..config import Config, find_config, load_config
    found = find_config(config)
    cfg = load_config(found) if found is not None else Config()
    return cfg.resolve(cfg.service.socket)


class Client:
    """A blocking connection to the daemon.

    Args:
        path: socket path. timeout_s: overall deadline for connecting and reading, s
            (``socket.timeout`` when it passes).

    Raises:
        Unreachable: no socket file, connection refused, or no permission (message says why).
    """

    def __init__(self, path: str | Path, timeout_s: float = 600.0) -> None:
        self.path = Path(path)
        self.deadline = time.monotonic() + timeout_s
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        try:
            self.sock.connect(str(self.path))
        except FileNotFoundError:
            self.sock.close()
            raise Unreachable(f"no daemon socket at {self.path}") from None
        except ConnectionRefusedError:
            self.sock.close()
            raise Unreachable(f"nobody is listening on {self.path}: the daemon is stopping or not running "
                              f"(a socket file left behind)") from None
        except PermissionError:
            self.sock.close()
            raise Unreachable(f"no permission to connect to {self.path}; join the service's group") from None
        self._buf = bytearray()

    def send(self, obj: dict) -> None:
        """Send one request (a JSON object) as one line."""
        self.sock.sendall(json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n")

    def _recv(self, n: int) -> bytes:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("deadline passed")
        self.sock.settimeout(left)
        return self.sock.recv(n)

    def _read_line(self) -> Optional[bytes]:
        while True:
            i = self._buf.find(b"\n")
            if i >= 0:
                line = bytes(self._buf[:i])
                del self._buf[:i + 1]
                return line
            data = self._recv(65536)
            if not data:
                return None
            self._buf += data

    def _read_exact(self, n: int) -> bytes:
        while len(self._buf) < n:
            data = self._recv(max(65536, n - len(self._buf)))
            if not data:
                raise ConnectionError("the daemon closed the connection inside an audio payload")
            self._buf += data
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def events(self) -> Iterator[tuple[dict, Optional[bytes]]]:
        """Yield (event dict, payload bytes or None) until the daemon closes the connection."""
        while True:
            line = self._read_line()
            if line is None:
                return
            ev = json.loads(line)
            payload = self._read_exact(int(ev["bytes"])) if ev.get("type") == "audio" else None
            yield ev, payload

    def close(self) -> None:
        self.sock.close()


def speak(path: str | Path, request: dict, timeout_s: float = 600.0) -> Iterator[tuple[dict, Optional[bytes]]]:
    """Send ``request`` (a speak object) and yield its events up to its ``done`` or ``error``."""
    c = Client(path, timeout_s)
    try:
        c.send(request)
        for ev, payload in c.events():
            yield ev, payload
            if ev.get("type") in ("done", "error"):
                return
    finally:
        c.close()


def not_utf8(what: str, text: str) -> Optional[str]:
    """Why ``text`` (from the command line) cannot be sent as UTF-8, or None when it can.

    Python decodes a command-line argument that is not valid UTF-8 (in a UTF-8 locale) with
    ``surrogateescape``: each undecodable byte becomes a lone surrogate, which JSON cannot carry.
    The message names the first such byte and how to fix the input."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        raw = text[e.start:e.end].encode("utf-8", "surrogateescape") if 0xDC80 <= ord(text[e.start]) <= 0xDCFF else b""
        byte = f"byte 0x{raw[0]:02x}" if raw else f"character U+{ord(text[e.start]):04X}"
        return (f"{what} is not valid UTF-8 ({byte} at character {e.start + 1}): convert it first, e.g. "
                f"`iconv -f GBK -t UTF-8`, or run in a UTF-8 locale (LANG=C.UTF-8)")


def one_reply(args: Any, request: dict, prog: str,
              wanted: Callable[[dict], bool] = lambda ev: True) -> tuple[int, Optional[dict]]:
    """Send ``request`` on a new connection and return (exit status, the first event ``wanted``
    accepts): ``EXIT_DONE`` with it, ``EXIT_ERROR`` with it when it is an ``error``; (status, None)
    after a message on stderr prefixed ``prog:`` when the daemon is not reachable
    (``EXIT_UNREACHABLE``), does not answer within ``args.timeout`` s or closes the connection
    first (``EXIT_ERROR``). ``args``: ``config``, ``socket``, ``timeout``."""
    try:
        path = socket_path(args.config, args.socket)
        c = Client(path, args.timeout)
    except (ApplianceError, Unreachable) as e:
        print(f"{prog}: the daemon is not reachable: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE, None
    try:
        c.send(request)
        for ev, _ in c.events():
            if wanted(ev):
                return (EXIT_ERROR if ev.get("type") == "error" else EXIT_DONE), ev
    except (socket.timeout, OSError, ValueError) as e:
        print(f"{prog}: no reply from {path}: {e}", file=sys.stderr)
        return EXIT_ERROR, None
    finally:
        c.close()
    print(f"{prog}: the daemon closed the connection without a reply", file=sys.stderr)
    return EXIT_ERROR, None
