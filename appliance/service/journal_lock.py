"""One owner of the spool: an exclusive ``flock(2)`` on ``<service.spool_dir>/spool.lock``, taken
at start before the journal is opened, whatever socket the daemon listens on.

A second daemon on the same spool (another socket path, a careless script, a restart while the
first still drains after ``SIGTERM``) waits for the lock at most ``service.spool_lock_wait_s``
(polling every :data:`POLL_S`; one warning names the owner's pid), then exits with
:class:`~appliance.errors.SpoolBusyError` (status 75) naming the owner's pid and the lock file.
It never opens the journal, so it never replays a request the owner is speaking. The owner holds
the lock until its process exits (the kernel drops it then, whatever way it ends: a crash or a
power cut leaves no stale lock; the pid in the file is only a name for messages).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from pathlib import Path
from typing import Optional

from ..errors import ConfigError, SpoolBusyError

log = logging.getLogger("appliance.service.journal")

FILE = "spool.lock"
POLL_S = 0.1
"""How often a waiting daemon tries the lock again, s."""


class SpoolLock:
    """The lock of ``directory`` (module docstring); :meth:`acquire` it, :meth:`release` at exit."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / FILE
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def owner(self) -> str:
        """The pid the owner wrote into the lock file (``"?"`` where unreadable)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return "?"
        try:
            pid = os.read(fd, 32).decode("ascii", "replace").strip()
        except OSError:
            return "?"
        finally:
            os.close(fd)
        return pid if pid.isdigit() else "?"

    def acquire(self, wait_s: float, clock=time.monotonic) -> bool:
        """Take the lock, waiting at most ``wait_s`` for another daemon to let go; True when
        held, False where the lock file cannot be made (a read-only or foreign spool: logged; the
        journal will say it cannot write there either, and replays nothing).

        Raises:
            SpoolBusyError: another daemon still holds it after ``wait_s`` (names its pid and the file).
            ConfigError: the lock file is a symlink (refused).
        """
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ConfigError(f"service.spool_dir: the lock file {self.path} is a symlink: refused (someone who "
                                  f"can write that directory may have planted it); remove it") from e
            log.error("cannot open the spool lock %s (%s): running without it; a second daemon on this spool "
                      "would not be stopped", self.path, e.strerror or e)
            return False
        deadline = clock() + wait_s
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pid = self.owner()
                if clock() >= deadline:
                    os.close(fd)
                    raise SpoolBusyError(
                        f"another daemon (pid {pid}) owns the spool {self.path.parent} (lock {self.path}) and did "
                        f"not let go within service.spool_lock_wait_s {wait_s:g} s; stop it first, or give this "
                        f"daemon its own service.spool_dir") from None
                if not waited:
                    log.warning("the spool %s is owned by another daemon (pid %s, lock %s): waiting up to %g s for "
                                "it to exit (service.spool_lock_wait_s)", self.path.parent, pid, self.path, wait_s)
                    waited = True
                time.sleep(POLL_S)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        except OSError as e:
            log.debug("cannot write the pid into %s: %s", self.path, e)
        if waited:
            log.info("the spool %s is ours now (the other daemon exited)", self.path.parent)
        self._fd = fd
        return True

    def release(self) -> None:
        """Let go (at exit, after the journal is closed)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
