"""File durability helpers shared by every layer that writes files the daemon must not lose (the
journal, WAV files, small state files). A leaf: imports nothing of the package.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(d: str | Path) -> None:
    """``fsync`` directory ``d``: makes a file created or renamed in it durable (the journal, WAV
    files).

    Raises:
        OSError: it cannot be opened or synced.
    """
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: bytes) -> None:
    """Replace file ``path`` by ``data`` so that a reader (or a power cut) sees the old content
    or the new one, never a part: write ``.<name>.tmp`` beside it, ``fsync``, rename over it,
    ``fsync`` the directory.

    Raises:
        OSError: the directory is missing or not writable, or the disk is full.
    """
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    fsync_dir(p.parent)
