"""File durability helpers shared by every layer that writes files the daemon must not lose (the
journal, WAV files). A leaf: imports nothing of the package.
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
