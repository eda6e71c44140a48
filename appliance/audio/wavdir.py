"""Health's view of the WAV directory (``audio.wav_dir``): why WAV files cannot be written there now.

:class:`WavDirHealth` answers :meth:`~WavDirHealth.problem` from two looks, both on the caller's
thread (health's watch every second, each ``status``):

* the file system, at every call (``statvfs`` and ``access``, no write): the directory (or, while
  it does not exist yet, the nearest directory above it, where
  :class:`~appliance.audio.wav.WavWriter` creates it) is on a read-only file system, is not
  writable by the daemon's user, is not a directory, or has less than :data:`MIN_FREE_BYTES` free
  (what root may use, reserved blocks included, when the daemon runs as root);
* what the last WAV file met: a :class:`~appliance.audio.wav.WavWriter` that could not be created,
  written or completed reports it (:meth:`~WavDirHealth.failed`: a quota, an I/O error, a disk
  that filled in the middle of a file). That holds until a WAV file is written there again
  (:meth:`~WavDirHealth.wrote`) or a probe succeeds: while it holds, at most every :data:`PROBE_S`
  (monotonic), and at once when the file system looks right again after it did not, a probe file
  of :data:`MIN_FREE_BYTES` (``.write-check.<hex>.wav.part``, a name
  :func:`~appliance.audio.wav.remove_partials` deletes at start should a crash leave it) is
  written, ``fsync``\\ ed and removed. The probe writes only while something already failed, so an
  SD card is not written every second on a healthy box.

So the condition clears by itself once the cause is fixed (space freed, the file system remounted
read-write), without a request having to fail or succeed first.
:class:`~appliance.audio.output.AudioOutput` turns it into health's ``wav_unwritable`` condition
(unhealthy where WAV files are the output, degraded where they are a sound device's fallback).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from ..core import Condition
from ..files import create_temp, discard, space_problem, write_all

log = logging.getLogger(__name__)

NAME = "wav_unwritable"
"""The health condition's name."""
MIN_FREE_BYTES = 64 * 1024
"""Below this much free space (bytes: 1.4 s of 24 kHz int16 audio) the directory counts as full."""
PROBE_S = 5.0
"""Seconds (monotonic) between two probe writes while a WAV file's failure holds."""
PROBE_STEM = "write-check"
"""The probe file's stem: it is written as ``.write-check.<8 hex digits>.wav.part``."""


def fs_problem(wav_dir: Path) -> Optional[str]:
    """What the file system says about writing into ``wav_dir`` (None: nothing against it):
    :func:`appliance.files.space_problem` with :data:`MIN_FREE_BYTES`. Never raises."""
    return space_problem(wav_dir, MIN_FREE_BYTES)


def probe(wav_dir: Path) -> Optional[str]:
    """Write, ``fsync`` and remove :data:`MIN_FREE_BYTES` in ``wav_dir`` (created if missing), in
    a private file of a fresh name (``.write-check.<hex>.wav.part``: created ``O_EXCL |
    O_NOFOLLOW``, so a planted link is never written through); None when that worked, else the
    OS error. Never raises."""
    d = Path(wav_dir)
    fd, p = None, None
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, p = create_temp(d / PROBE_STEM, suffix=".wav.part")
        write_all(fd, bytes(MIN_FREE_BYTES))
        os.fsync(fd)
    except OSError as e:
        return f"a test write in {d} failed: {e.strerror or e}"
    finally:
        if p is not None:
            discard(fd, p)
    return None


class WavDirHealth:
    """Why WAV files cannot be written in ``wav_dir`` now (module docstring). Thread-safe.

    Args:
        wav_dir: ``audio.wav_dir``, resolved.
        clock: monotonic clock, s (tests).
    """

    def __init__(self, wav_dir: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.dir = Path(wav_dir)
        self._clock = clock
        self._lock = threading.Lock()
        self._probing = threading.Lock()     # held from the decision to probe until its result is kept
        self._failed: Optional[str] = None   # the last WAV file's failure, until a write succeeds
        self._probe_at = 0.0                 # clock() before which no probe is written
        self._since: Optional[float] = None  # when the current problem began
        self._fs_bad = False                 # the last look at the file system found a problem

    def failed(self, err: BaseException) -> None:
        """A WAV file could not be created, written or completed (``err`` says why; any thread)."""
        with self._lock:
            self._failed = str(err)
            self._probe_at = self._clock() + PROBE_S

    def wrote(self) -> None:
        """A WAV file was completed in the directory."""
        with self._lock:
            if self._failed is not None:
                log.info("WAV files are written in %s again", self.dir)
            self._failed = None

    def problem(self) -> Optional[str]:
        """Why WAV files cannot be written there now, or None (module docstring). Quick: one
        ``statvfs``; a probe write at most every :data:`PROBE_S` while a failure holds."""
        why = fs_problem(self.dir)
        if why is not None:
            with self._lock:
                self._fs_bad = True          # once the file system looks right again, probe at once
        else:
            with self._probing:              # a reader during another's probe waits for its result
                with self._lock:
                    if self._failed is None or (self._clock() < self._probe_at and not self._fs_bad):
                        self._fs_bad = False
                        why = self._failed
                    else:
                        self._probe_at, self._fs_bad = self._clock() + PROBE_S, False
                        why = "probe"
                if why == "probe":
                    why = probe(self.dir)
                    with self._lock:
                        if why is None and self._failed is not None:
                            log.info("WAV files can be written in %s again (a test write succeeded)", self.dir)
                        self._failed = why if self._failed is not None else None
                        why = self._failed
        return why

    def condition(self, severity: str, consequence: str) -> Optional[Condition]:
        """Health's ``wav_unwritable`` while :meth:`problem` holds, with ``severity`` and the
        ``consequence`` for requests in its reason; None otherwise. ``since`` is kept while it holds."""
        why = self.problem()
        with self._lock:
            if why is None:
                self._since = None
                return None
            if self._since is None:
                self._since = self._clock()
            return Condition(NAME, f"WAV files cannot be written in {self.dir}: {why}; {consequence}",
                             self._since, severity)
