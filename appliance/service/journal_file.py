"""The journal's file: appends, in-place overwrites and whole rewrites of ``journal.log``, each
saying exactly what failed (:mod:`appliance.service.journal` keeps the entries and the rules).

Writes go through one ``O_RDWR`` descriptor with ``pwrite`` at the known end (an append) or at a
record's mark byte (an overwrite: no new blocks, so it works on a full disk on file systems that
do not copy on write); a failed append is cut away again (``ftruncate``), so the next one starts
on a fresh line. A rewrite (compaction) goes to a private temporary file
(``.journal.log.<hex>.tmp``), is fsynced and renamed over the file, and the directory fsynced
(:mod:`appliance.files`). The file is never opened through a symlink (``O_NOFOLLOW``): a journal
that is a symlink is refused. Not thread-safe: the journal's lock covers every call.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from pathlib import Path
from typing import Optional

from ..errors import JournalError
from ..files import commit, create_temp, discard, fsync_dir, write_all

log = logging.getLogger("appliance.service.journal")

KEEP_CORRUPT = 4
"""Damaged journals kept (``journal.log.<k>.corrupt``): the newest this many."""


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

    def read(self) -> Optional[bytes]:
        """The whole file (None when it does not exist yet); creates its directory.

        Raises:
            JournalError: it cannot be read.
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise JournalError(f"the request journal {self.path} is a symlink: refused (someone who can write "
                                   f"service.spool_dir may have planted it); remove it") from e
            raise JournalError(why("cannot read the request journal", e)) from e
        try:
            with os.fdopen(fd, "rb") as f:
                return f.read()
        except OSError as e:
            raise JournalError(why("cannot read the request journal", e)) from e

    def _open(self) -> int:
        if self._fd is None:
            created = not self.path.exists()
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
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
        """Replace the file with ``body`` (:func:`appliance.files.create_temp` and
        :func:`~appliance.files.commit`: a private temporary file, fsync, rename, directory fsync).

        Raises:
            JournalError: it could not be written (the old file stays as it was).
        """
        try:
            fd, tmp = create_temp(self.path)
            try:
                write_all(fd, body)
            except OSError:
                discard(fd, tmp)
                raise
            commit(fd, tmp, self.path, sync=self.fsync)
        except OSError as e:
            raise JournalError(why(f"cannot compact the request journal {self.path}", e)) from e
        self.close()
        self.size = len(body)

    def set_aside(self) -> Path:
        """Rename the (damaged) file to ``<name>.<k>.corrupt`` beside it, ``k`` one more than the
        newest kept, and keep the newest :data:`KEEP_CORRUPT` of them; returns the new name.

        Raises:
            OSError: it could not be renamed.
        """
        self.close()
        pat = re.compile(re.escape(self.path.name) + r"\.(\d+)\.corrupt")
        kept = sorted(int(m.group(1)) for p in self.path.parent.iterdir() if (m := pat.fullmatch(p.name)))
        dest = self.path.with_name(f"{self.path.name}.{(kept[-1] if kept else 0) + 1}.corrupt")
        os.rename(self.path, dest)
        for k in kept[:max(0, len(kept) + 1 - KEEP_CORRUPT)]:
            try:
                os.unlink(self.path.with_name(f"{self.path.name}.{k}.corrupt"))
            except OSError:
                pass
        if self.fsync:
            fsync_dir(self.path.parent)
        self.size = 0
        return dest

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
