"""The journal's file: appends, in-place overwrites and whole rewrites of ``journal.log``, each
saying exactly what failed (:mod:`appliance.service.journal` keeps the entries and the rules).

Writes go through one ``O_RDWR`` descriptor with ``pwrite`` at the known end (an append) or at a
record's mark byte (an overwrite: no new blocks, so it works on a full disk on file systems that
do not copy on write); a failed append is cut away again (``ftruncate``), so the next one starts
on a fresh line. A rewrite (compaction) goes to ``journal.log.tmp``, is fsynced and renamed over
the file, and the directory fsynced. Not thread-safe: the journal's lock covers every call.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Optional

from ..errors import JournalError
from ..files import fsync_dir

log = logging.getLogger("appliance.service.journal")


def why(what: str, e: OSError) -> str:
    """``what`` with the OS error and what to do about it (service.spool_dir)."""
    hint = {errno.ENOSPC: "the file system is full: free space there",
            errno.EDQUOT: "the disk quota is exhausted: free space there",
            errno.EROFS: "the file system is read-only: remount it read-write or move service.spool_dir",
            errno.EACCES: "no permission: the daemon's user must own service.spool_dir",
            errno.EFBIG: "the file grew past the process's file size limit"}.get(e.errno, "check the disk")
    return f"{what} ({e.strerror or e}); {hint} (service.spool_dir)"


class JournalFile:
    """``path`` on disk (module docstring).

    Args:
        path: the journal file. fsync: ``journal.fsync`` (sync writes that ask for it).

    Attributes:
        size: bytes in the file (the next append's offset).
    """

    def __init__(self, path: Path, fsync: bool) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.size = 0
        self._fd: Optional[int] = None

    def read(self) -> bytes:
        """The whole file (b"" when it does not exist yet); creates its directory.

        Raises:
            JournalError: it cannot be read.
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return self.path.read_bytes() if self.path.exists() else b""
        except OSError as e:
            raise JournalError(why("cannot read the request journal", e)) from e

    def _open(self) -> int:
        if self._fd is None:
            created = not self.path.exists()
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self.size = os.fstat(self._fd).st_size
            if created and self.fsync:
                fsync_dir(self.path.parent)
        return self._fd

    def append(self, line: bytes, sync: bool) -> int:
        """Write ``line`` at the end; returns its offset.

        Raises:
            JournalError: the write failed (the partial line is cut away again).
        """
        try:
            fd = self._open()
            at = done = self.size
            while done < at + len(line):
                done += os.pwrite(fd, line[done - at:], done)
            if sync and self.fsync:
                os.fdatasync(fd)
            self.size += len(line)
            return at
        except OSError as e:
            self._cut_back()
            raise JournalError(why(f"cannot write the request journal {self.path}", e)) from e

    def overwrite(self, pos: int, data: bytes, sync: bool) -> bool:
        """Write ``data`` over the bytes at ``pos`` (a mark); False where that failed."""
        try:
            fd = self._open()
            os.pwrite(fd, data, pos)
            if sync and self.fsync:
                os.fdatasync(fd)
            return True
        except OSError as e:
            log.debug("journal overwrite at %d: %s", pos, e)
            return False

    def truncate(self, size: int) -> bool:
        """Cut the file to ``size`` bytes (a torn tail; a shorter file needs no space); False
        where the file cannot even be opened for writing."""
        try:
            fd = self._open()
            if self.size > size:
                os.ftruncate(fd, size)
                self.size = size
            return True
        except OSError:
            return False

    def _cut_back(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, self.size)
        except OSError:
            self.close()                  # reopened (and re-measured) at the next append

    def rewrite(self, body: bytes) -> None:
        """Replace the file with ``body`` (temp file, fsync, rename, directory fsync).

        Raises:
            JournalError: it could not be written (the old file stays as it was).
        """
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                done = 0
                while done < len(body):
                    done += os.write(fd, body[done:])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            if self.fsync:
                fsync_dir(self.path.parent)
        except OSError as e:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise JournalError(why(f"cannot compact the request journal {self.path}", e)) from e
        self.close()
        self.size = len(body)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
