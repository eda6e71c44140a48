"""The request socket's file: who may reach it, and how it is bound or inherited.

* :func:`check_socket_path` makes the path free (a stale socket file is removed, one that another
  daemon still answers on refused).
* :func:`listen_socket` binds ``service.socket`` with file mode ``service.socket_mode`` (0660 by
  default) and, where ``service.socket_group`` names one, that group: only the daemon's user and
  the group's members can connect (``connect(2)`` needs write permission on the socket file). The
  socket's directory, when the daemon's user owns it, is made ``0750`` (no access for others,
  ``service.socket_group`` as its group where configured), so nobody else can even list it.
* :func:`inherited_socket` takes a listening socket passed by systemd socket activation
  (``LISTEN_PID`` = our pid, ``LISTEN_FDS`` >= 1, fd 3; ``sd_listen_fds(3)``); its file's owner,
  group and mode are the ``.socket`` unit's (``SocketGroup=``, ``SocketMode=``, ``DirectoryMode=``).
"""

from __future__ import annotations

import grp
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Optional

from ..errors import ConfigError

log = logging.getLogger(__name__)

SD_LISTEN_FDS_START = 3
DIR_MODE = 0o750
"""Mode of the socket's directory where the daemon's user owns it."""


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


def group_id(group: Optional[str]) -> Optional[int]:
    """The gid of ``service.socket_group`` (a name or a number; None: None).

    Raises:
        ConfigError: no such group.
    """
    if group is None:
        return None
    if str(group).isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"service.socket_group: no group named {group!r} on this system; create it "
                          f"(groupadd {group}) or set another") from None


def _own(path: Path, mode: int, gid: Optional[int], what: str) -> None:
    """chmod ``path`` to ``mode`` and, with ``gid``, chgrp it (the daemon's user must be a member)."""
    if gid is not None:
        try:
            os.chown(path, -1, gid)
        except PermissionError as e:
            raise ConfigError(f"service.socket_group: cannot give the {what} {path} group {gid}: {e.strerror}; "
                              f"the daemon's user must be a member of that group (SupplementaryGroups= in "
                              f"the unit)") from e
    os.chmod(path, mode)


def _tighten_dir(d: Path, gid: Optional[int]) -> None:
    """Make the socket's directory :data:`DIR_MODE` (group ``gid`` where given) where the daemon's
    user owns it and it is not that user's home directory (logged when it changes anything)."""
    st = d.stat()
    if st.st_uid != os.geteuid() or d.resolve() == Path(os.path.expanduser("~")).resolve():
        return
    mode = stat.S_IMODE(st.st_mode)
    if not mode & 0o027 and (gid is None or st.st_gid == gid):
        return
    _own(d, (mode & 0o7700) | DIR_MODE, gid, "socket directory")
    log.info("service.socket: directory %s made %04o (was %04o): only the daemon's user and its group may reach the "
             "socket", d, (mode & 0o7700) | DIR_MODE, mode)


def listen_socket(path: Path, mode: int, backlog: int = 64, group: Optional[str] = None) -> socket.socket:
    """Bind and listen on a UNIX stream socket at ``path`` with file mode ``mode`` and group
    ``group`` (``service.socket_group``; None: the daemon's), its directory tightened to
    :data:`DIR_MODE` where the daemon owns it (module docstring).

    Raises:
        ConfigError: ``path`` exists and is not a socket, another process listens on it, it
            cannot be bound (too long, no permission), or the group cannot be set – the message
            says what to change.
    """
    path = Path(path)
    gid = group_id(group)
    check_socket_path(path)
    if not path.parent.is_dir():
        raise ConfigError(f"service.socket: directory {path.parent} does not exist; create it or choose another path")
    _tighten_dir(path.parent, gid)
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
    try:
        _own(path, mode, gid, "socket")  # ... then exactly service.socket_mode (and group)
    except ConfigError:
        sock.close()
        path.unlink(missing_ok=True)
        raise
    sock.listen(backlog)
    sock.setblocking(False)
    log.info("listening on %s (mode %04o%s)", path, mode, f", group {group}" if group is not None else "")
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


__all__ = ["check_socket_path", "listen_socket", "inherited_socket", "group_id", "DIR_MODE"]
