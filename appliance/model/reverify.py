"""Re-verify the weight files a backend maps, a little at a time, while the box runs.

A file verified at load can rot later: pages of a mapped file (ONNX Runtime maps external data)
are dropped under memory pressure and read again from storage, and a restart reads the file anew.
:class:`Reverifier` re-hashes the ``(file, sha256)`` pairs a runner verified at load
(``runner.weight_files``) in bounded steps: each :meth:`Reverifier.step` reads at most
``budget_bytes`` (in chunks of :data:`CHUNK`), continuing where the last step stopped, and when a
file is complete compares its digest. The first mismatch (or a file gone missing) is returned as
an :class:`~appliance.errors.IntegrityError` naming the file, and returned again by every later
step until :meth:`Reverifier.reset`: a box whose weights rotted stays unhealthy.

The caller sets the pace, e.g. ``step(budget_bytes(mib_per_s=8, seconds=60))`` once a minute from
the health timer: at 8 MiB/s a 1.2 GB checkpoint is covered every 2.5 minutes and costs ~1 % of a
core (sha256 runs at ~1.5 GB/s here). After each chunk the file's pages are dropped from the page
cache (``POSIX_FADV_DONTNEED``): the next round reads from storage, which is what a restart or a
re-fault would read, and the page cache does not grow by the whole model (on a Jetson it is the
same RAM as the GPU's). Pages a runtime has mapped stay resident (the kernel keeps mapped pages).

What this does not cover: weights already copied into process or device memory (the torch
backends) are not re-read; those are what the health check's audio checks
(:mod:`appliance.synth.audio_check`) watch. Pure and single-threaded; no torch.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional, Sequence

from ..errors import IntegrityError
from .integrity import mismatch

#: Bytes read per chunk.
CHUNK = 1 << 20


def budget_bytes(mib_per_s: float, seconds: float) -> int:
    """Bytes one :meth:`Reverifier.step` may read to keep ``mib_per_s`` over ``seconds`` between steps."""
    return max(0, int(mib_per_s * seconds * 2**20))


class Reverifier:
    """Round-robin re-hashing of ``files`` (see module doc).

    Args:
        files: ``(path, expected hex sha256)`` pairs (e.g. ``runner.weight_files``).
        todo: what the error message tells the operator to do.

    Attributes:
        rounds: complete passes over all files so far. failure: the first error found (or None).
    """

    def __init__(self, files: Sequence[tuple[Path, str]],
                 todo: str = "restart the daemon to load the files again; if it refuses them, copy them again "
                             "from a good source or rebuild the engine"):
        self.files = [(Path(p), s) for p, s in files]
        self.todo = todo
        self.rounds = 0
        self.failure: Optional[IntegrityError] = None
        self._i = 0
        self._off = 0
        self._h = hashlib.sha256()

    def reset(self) -> None:
        """Forget a failure and start a new round from the first file."""
        self.failure, self._i, self._off, self._h = None, 0, 0, hashlib.sha256()

    @property
    def position(self) -> tuple[int, int]:
        """(index of the file being hashed, bytes of it done)."""
        return self._i, self._off

    def step(self, budget_bytes: int) -> Optional[IntegrityError]:
        """Hash at most ``budget_bytes`` more bytes, then return (a whole round at most).

        Returns:
            the first mismatch found so far (this step or an earlier one), else None.
        """
        if self.failure is not None or not self.files:
            return self.failure
        left = budget_bytes
        while left > 0 and self.failure is None:
            path, want = self.files[self._i]
            try:
                with open(path, "rb") as f:
                    f.seek(self._off)
                    while left > 0:
                        b = f.read(min(CHUNK, left))
                        if not b:
                            break
                        self._h.update(b)
                        _drop_cache(f.fileno(), self._off, len(b))
                        self._off += len(b)
                        left -= len(b)
                    else:
                        return None  # budget spent inside this file
            except OSError as e:
                self.failure = IntegrityError(f"{path} cannot be read any more ({e}): {self.todo}")
                break
            got = self._h.hexdigest()
            if got != want:
                self.failure = mismatch(path, got, want, "the digest verified at load", self.todo)
            self._i, self._off, self._h = self._i + 1, 0, hashlib.sha256()
            if self._i == len(self.files):
                self._i = 0
                self.rounds += 1
                if self.failure is None:
                    return None  # at most one round per step
        return self.failure


def _drop_cache(fd: int, off: int, n: int) -> None:
    """Drop the pages just read from the page cache (where the platform can; mapped pages stay)."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
