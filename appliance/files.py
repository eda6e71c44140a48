"""The one way the box writes a file it later trusts, and reads one back. A leaf: imports nothing
of the package.

Writing (:func:`write_atomic`, or :func:`create_temp` + :func:`commit` for a file written in
pieces, e.g. a WAV file or a journal compaction): a private temporary file beside the final name
(``.<name>.<8 random hex digits><suffix>``) is created with ``O_CREAT | O_EXCL | O_NOFOLLOW |
O_CLOEXEC`` and mode 0600 (or what the caller asks, e.g. 0640; the process's umask still
applies: the unit's ``UMask=0077`` keeps everything 0600), written, ``fsync``\\ ed, renamed
over the final name and the directory ``fsync``\\ ed. So a reader or a power cut sees the old
content or the new, never a part; and a symlink planted under the temporary or the final name by
someone who can write the directory is never followed (``O_EXCL`` refuses an existing name,
``rename`` replaces a link at the final name instead of writing through it). The pattern is Home
Assistant's ``write_utf8_file_atomic`` and mosquitto's persistence writer.

Reading (:func:`read_json`): an empty, NUL-filled or unparsable file (what a power cut leaves
of a file written without this) is treated as absent, with one warning naming it; the caller
rebuilds, recalibrates or takes its default.

Directories (:func:`fix_dir_mode`): a directory the box writes into that other users may write
to is made private (group/other write bits removed) with a warning, or refused. :func:`space_problem`: the
file system under a directory cannot take ``min_free`` more bytes.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger("appliance.files")

_WARNED: set = set()
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
"""How every new file is opened: never an existing name, never through a symlink."""


def fsync_dir(d: str | Path) -> None:
    """``fsync`` directory ``d``: makes a file created or renamed in it durable.

    Raises:
        OSError: it cannot be opened or synced.
    """
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(final: str | Path, suffix: str = ".tmp") -> Path:
    """A fresh temporary name beside ``final``: ``.<name>.<8 hex digits><suffix>`` (unguessable:
    nobody can plant a link there in advance)."""
    p = Path(final)
    return p.with_name(f".{p.name}.{secrets.token_hex(4)}{suffix}")


def create_temp(final: str | Path, mode: int = 0o600, suffix: str = ".tmp") -> tuple[int, Path]:
    """Create a private temporary file for ``final`` (module docstring); returns ``(fd, path)``.
    Write it, then :func:`commit` or :func:`discard` it.

    Raises:
        OSError: the directory is missing or not writable (the name exists: tried 3 times).
    """
    for i in range(3):
        tmp = temp_name(final, suffix)
        try:
            fd = os.open(tmp, CREATE_FLAGS, mode)
        except FileExistsError:
            if i == 2:
                raise
            continue
        return fd, tmp
    raise AssertionError("unreachable")


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written.

    Raises:
        OSError: the write failed (disk full, I/O error).
    """
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def commit(fd: int, tmp: str | Path, final: str | Path, sync: bool = True) -> None:
    """``fsync`` and close ``fd``, rename ``tmp`` over ``final``, ``fsync`` the directory
    (``sync`` False: no fsyncs, e.g. ``journal.fsync: false``). On an error the temporary file is
    removed and ``final`` stays as it was.

    Raises:
        OSError: a step failed.
    """
    try:
        if sync:
            os.fsync(fd)
    except OSError:
        discard(fd, tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, final)
    except OSError:
        discard(None, tmp)
        raise
    if sync:
        fsync_dir(Path(final).parent)


def discard(fd: Optional[int], tmp: str | Path) -> None:
    """Close ``fd`` (if any) and remove ``tmp``, ignoring errors (the file is given up)."""
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        os.unlink(tmp)
    except OSError:
        pass


def write_atomic(path: str | Path, data: bytes, mode: int = 0o600) -> None:
    """Replace file ``path`` by ``data`` crash-consistently, never through a planted link
    (module docstring); ``mode``: the file's permissions (0600, or 0640 for a file the
    daemon's group reads).

    Raises:
        OSError: the directory is missing or not writable, or the disk is full (``path`` stays
            as it was).
    """
    fd, tmp = create_temp(path, mode)
    try:
        write_all(fd, data)
    except OSError:
        discard(fd, tmp)
        raise
    commit(fd, tmp, path)


def temp_dir(final: str | Path) -> Path:
    """A fresh private directory beside ``final`` (``.<name>.<random>.tmp``, mode 0700, made
    with ``mkdir``: never an existing one) to fill and then :func:`commit_dir`.

    Raises:
        OSError: the parent is missing or not writable.
    """
    p = Path(final)
    return Path(tempfile.mkdtemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent))


def commit_dir(tmp: str | Path, final: str | Path, mode: int = 0o755) -> None:
    """Make directory ``tmp`` (filled by the caller) durable and put it in place of ``final``:
    ``fsync`` every file in it and itself, remove an old ``final``, rename, ``fsync`` the parent.
    ``mode``: the directory's permissions once in place.

    Raises:
        OSError: a step failed (``tmp`` is left for the caller to remove).
    """
    tmp = Path(tmp)
    for f in tmp.rglob("*"):
        if f.is_file() and not f.is_symlink():
            fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    os.chmod(tmp, mode)
    fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(Path(final).parent)


def write_json(path: str | Path, obj: Any, mode: int = 0o600, indent: Optional[int] = 1) -> None:
    """:func:`write_atomic` of ``obj`` as UTF-8 JSON (a final newline).

    Raises:
        OSError: see :func:`write_atomic`. TypeError: ``obj`` is not JSON-serialisable.
    """
    write_atomic(path, (json.dumps(obj, indent=indent, ensure_ascii=False) + "\n").encode("utf-8"), mode)


def read_json(path: str | Path, what: str, expect: type = dict) -> Optional[Any]:
    """The JSON value in ``path``, or None when the file is missing, or empty, NUL-filled,
    unparsable or not an ``expect`` (a file torn by a power cut, or written by something else):
    then one warning names the file and says the box goes on as without it (``what`` names the
    file for a person, e.g. ``"engine manifest"``). A symlink is not followed (logged as
    unreadable).

    Raises:
        OSError: the file exists but cannot be read (permissions, I/O error).
    """
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if os.path.islink(p):
            log.warning("%s %s is a symlink: not followed, treated as absent", what, p)
            return None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        raw = f.read()
    why = None
    if not raw.strip(b"\0 \t\r\n"):
        why = "empty" if not raw else ("all NUL bytes" if not raw.strip(b"\0") else "blank")
    else:
        try:
            value = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            why = f"not valid JSON ({e})" + (" and holds NUL bytes" if b"\0" in raw else "")
        else:
            if isinstance(value, expect):
                return value
            why = f"not a JSON {expect.__name__}"
    seen = (str(p), st.st_ino, st.st_mtime_ns, st.st_size)
    if seen not in _WARNED:              # one warning per damaged file, however many readers meet it
        _WARNED.add(seen)
        log.warning("%s %s is %s (a power cut while it was written?): treated as absent", what, p, why)
    return None


def fix_dir_mode(d: str | Path, key: str) -> Optional[str]:
    """Make directory ``d`` (from config key ``key``) the box's own if other users can write into
    it: a directory this user owns loses its group and other write bits, with a warning that is
    also returned (None: nothing to fix). One owned by another user that is writable by everyone
    is refused; one only its group can write (a shared directory the daemon writes through its
    group) is left as it is, with a warning.

    Raises:
        PermissionError: it is writable by everyone and cannot be made private (the message names
            ``key``, the directory and its mode).
    """
    st = os.stat(d)
    if not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None
    mode = stat.S_IMODE(st.st_mode)
    new = mode & ~(stat.S_IWGRP | stat.S_IWOTH)
    if st.st_uid != os.geteuid() and not st.st_mode & stat.S_IWOTH:
        msg = (f"{key}: directory {d} (mode {mode:04o}) belongs to uid {st.st_uid} and its group can write "
               f"into it: members of that group could plant files the box writes")
        log.warning("%s", msg)
        return msg
    try:
        if st.st_uid != os.geteuid():
            raise PermissionError(os.strerror(1))
        os.chmod(d, new)
    except OSError as e:
        raise PermissionError(f"{key}: directory {d} is writable by every user (mode {mode:04o}) and cannot be "
                              f"made private ({e}): 'chmod go-w' it or choose another path") from e
    msg = (f"{key}: directory {d} was writable by other users (mode {mode:04o}: they could plant or replace "
           f"the box's files); its mode is now {new:04o}")
    log.warning("%s", msg)
    return msg


def space_problem(d: str | Path, min_free: int) -> Optional[str]:
    """Why the file system under directory ``d`` (or, while it does not exist, the nearest
    directory above it) cannot take ``min_free`` more bytes now: not a directory, read-only, not
    writable by this user, or less free space (what root may use, reserved blocks included, when
    running as root). None: nothing against it. One ``statvfs``; never raises."""
    want = Path(d)
    p = want
    while not os.path.lexists(p) and p.parent != p:
        p = p.parent
    where = str(want) if p == want else f"{p} (where {want} is to be created)"
    if not p.is_dir():
        return f"{where} is not a directory"
    try:
        st = os.statvfs(p)
    except OSError as e:
        return f"cannot look at {where}: {e.strerror or e}"
    if st.f_flag & os.ST_RDONLY:
        return f"{where} is on a read-only file system"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{where} is not writable by this user (uid {os.getuid()})"
    free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize
    if free < min_free:
        return f"{where}: the disk is full ({free // 1024} KiB free)"
    return None
