"""WAV output: one file per request, written as the PCM arrives.

Format: RIFF/WAVE, PCM **int16** little-endian, mono, at the pipeline's rate (24000 Hz). Int16
because the stdlib :mod:`wave` module writes only integer PCM (format tag 1) and every player
reads it; float32 samples are clipped to [-1, 1] and scaled by 32767 with rounding, so a
round trip through :func:`read_wav` is exact to 1/32767 (≈ 3.1e-5).

Files are named after the request id (:func:`wav_path`, one-to-one): an id made only of
``[A-Za-z0-9._-]`` (not starting with a dot) is the file's stem as it is (``<id>.wav``); any
other id (``门铃``, ``a/b/c``, ``.x``) has those characters replaced by ``_`` and ``+`` and 12
hex digits of its SHA-256 appended (``__+3f2a....wav``), a character an unchanged id cannot
hold: two ids never share a file, and a client-chosen id cannot leave ``wav_dir``.

Durability: a file is written into a private temporary file beside its final name
(``.<name>.<8 hex digits>.part``, created ``O_EXCL | O_NOFOLLOW`` by
:func:`appliance.files.create_temp`: a symlink planted there or at the final name is never
followed), ``fsync``\\ ed, renamed over the final name and the directory ``fsync``\\ ed
(:func:`appliance.files.commit`), all in :meth:`WavWriter.close`, before the caller reports the
request done (and before the journal records it finished). A reader never sees a partial
``<id>.wav``; a crash leaves at most a ``.part``, which :func:`remove_partials` deletes at the
next start.

Retention (:class:`WavRetention`, ``service.wav_keep_files`` / ``service.wav_max_mib``): after
each file is written the oldest ``<id>.wav`` files of the directory beyond those limits are
deleted; only names :func:`wav_path` can produce are considered. A writer's prune deletes only
files older than its own: channels finishing at once each see the other's new file, and neither
may delete it (with ``wav_keep_files: 1`` both files were deleted before), so the directory can
hold one file per channel more than the limit until the next prune. Files dated in the future
(a clock that was stepped back) count as the oldest, so they do not stay for ever.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import time
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np

from ..errors import ApplianceError, AudioDeviceError, NoSpaceError
from ..files import commit, create_temp, discard

if TYPE_CHECKING:
    from .wavdir import WavDirHealth

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_SAFE_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
#: what :func:`wav_path` names (never a dot file), and the partial files of :class:`WavWriter`
_OURS = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*(\+[0-9a-f]{12})?\.wav")
_PART = re.compile(r"\.[A-Za-z0-9_-][A-Za-z0-9._+-]*\.wav(\.[0-9a-f]{8})?\.part")
HASH_HEX = 12
"""Hex digits of the id's SHA-256 in the name of a file whose id had to be changed."""
MIB = 1 << 20
#: seconds ahead of the clock beyond which a file's mtime is taken for a stepped-back clock
FUTURE_S = 60.0


def wav_path(wav_dir: str | Path, request_id: str) -> Path:
    """``<wav_dir>/<stem>.wav`` for ``request_id``, one file per id (module docstring); the
    directory is not created here."""
    if _SAFE_ID.fullmatch(request_id):
        return Path(wav_dir) / f"{request_id}.wav"
    stem = _UNSAFE.sub("_", request_id) or "request"
    if stem.startswith("."):
        stem = "_" + stem[1:]
    h = hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()[:HASH_HEX]
    return Path(wav_dir) / f"{stem}+{h}.wav"


def remove_partials(wav_dir: str | Path) -> list[Path]:
    """Delete the ``.<id>.wav.part`` files a crash left in ``wav_dir`` (at start, before any
    request writes); returns them. A missing directory has none; failures are logged."""
    gone = []
    try:
        names = [e.name for e in os.scandir(wav_dir) if e.is_file(follow_symlinks=False) and _PART.fullmatch(e.name)]
    except OSError:
        return gone
    for n in names:
        p = Path(wav_dir) / n
        try:
            p.unlink()
            gone.append(p)
        except OSError as e:
            log.warning("cannot remove the partial WAV file %s: %s", p, e.strerror or e)
    if gone:
        log.info("removed %d partial WAV file(s) left by an earlier run in %s", len(gone), wav_dir)
    return gone


@dataclass(frozen=True)
class WavRetention:
    """How many finished WAV files the daemon keeps in its WAV directory.

    Attributes:
        keep_files: most ``<id>.wav`` files kept (``service.wav_keep_files``); 0 = unlimited.
        max_bytes: most bytes they may take together (``service.wav_max_mib`` x 2**20); 0 = unlimited.
    """

    keep_files: int = 0
    max_bytes: int = 0

    def prune(self, wav_dir: str | Path, keep: Optional[Path] = None) -> list[Path]:
        """Delete the oldest (by mtime, then name) ``<id>.wav`` files in ``wav_dir`` beyond the
        limits; ``keep`` (the file just written) always stays and counts, and files newer than
        it (another channel's, just written) count but stay: they are that writer's to prune.
        A file dated more than :data:`FUTURE_S` ahead of the clock counts as the oldest. Only
        names that :func:`wav_path` can produce are considered: no dot files, ``.part`` files,
        other extensions or directories. Returns the deleted paths; never raises (failures are
        logged)."""
        if not self.keep_files and not self.max_bytes:
            return []
        files = []
        future = time.time_ns() + int(FUTURE_S * 1e9)
        try:
            for e in os.scandir(wav_dir):
                if _OURS.fullmatch(e.name) and e.is_file(follow_symlinks=False):
                    st = e.stat(follow_symlinks=False)
                    files.append((st.st_mtime_ns if st.st_mtime_ns <= future else -1, e.name, st.st_size))
        except OSError as e:
            log.warning("WAV retention: cannot list %s: %s", wav_dir, e.strerror or e)
            return []
        files.sort(reverse=True)                 # newest first
        keep_name = keep.name if keep is not None else None
        mine = next((f[:2] for f in files if f[1] == keep_name), None)
        if mine is not None:                     # the file just written is kept whatever its age
            files.sort(key=lambda f: f[1] != keep_name)
        n = total = 0
        cut = False                              # the first file over a limit and all older go
        gone = []
        for t, name, size in files:
            n, total = n + 1, total + size
            cut = cut or bool(self.keep_files and n > self.keep_files) or bool(self.max_bytes and total > self.max_bytes)
            if not cut or name == keep_name or (mine is not None and (t, name) > mine):
                continue
            p = Path(wav_dir) / name
            try:
                p.unlink()
                gone.append(p)
            except FileNotFoundError:
                pass                             # another channel's prune took it
            except OSError as e:
                log.warning("WAV retention: cannot delete %s: %s", p, e.strerror or e)
        if gone:
            log.info("WAV retention: deleted %d old file(s) from %s (service.wav_keep_files %d, "
                     "service.wav_max_mib %g)", len(gone), wav_dir, self.keep_files, self.max_bytes / MIB)
        return gone


def to_int16(pcm: np.ndarray) -> np.ndarray:
    """float32 ``[n]`` in [-1, 1] -> int16 ``[n]`` (clipped, x 32767, rounded)."""
    return np.round(np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0) * 32767.0).astype("<i2")


def encode_pcm(pcm: np.ndarray, sample_format: str) -> bytes:
    """float32 ``[n]`` -> the bytes of a ``return_audio`` payload: little-endian ``float32``, or
    ``int16`` (:func:`to_int16`) when ``sample_format`` is ``"int16"`` (``stream.sample_format``)."""
    return to_int16(pcm).tobytes() if sample_format == "int16" else pcm.astype("<f4").tobytes()


class WavWriter:
    """Stream float32 mono PCM into a 16-bit WAV file, made visible under its name only once
    complete (module docstring: Durability).

    Args:
        path: output file; its parent directory is created.
        rate: sample rate in Hz.
        retention: applied to ``path``'s directory once the file is in place; None = keep all.
        health: told when the file cannot be created, written or completed
            (:meth:`WavDirHealth.failed <appliance.audio.wavdir.WavDirHealth.failed>`) and when it
            is in place (``wrote``); None = nobody.

    Raises:
        NoSpaceError: the disk is full (or the quota exhausted); AudioDeviceError: the file cannot
        be created otherwise (the message names the path).
    """

    def __init__(self, path: str | Path, rate: int = 24000, retention: Optional[WavRetention] = None,
                 health: Optional[WavDirHealth] = None) -> None:
        self.path = Path(path)
        self.rate = rate
        self.retention = retention
        self.health = health
        self.frames = 0
        self._failed: Optional[ApplianceError] = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # open the file first: a failing wave.open(path) leaves a half-built Wave_write whose
            # __del__ prints an AttributeError
            self._fd, self.part = create_temp(self.path, 0o640, suffix=".part")
            self._f = open(self._fd, "wb", closefd=False)
        except OSError as e:
            raise self._report(_write_error(f"cannot write WAV file {self.path}", e)) from e
        self._w = wave.open(self._f, "wb")
        self._w.setnchannels(1)
        self._w.setsampwidth(2)
        self._w.setframerate(rate)

    def write(self, pcm: np.ndarray) -> None:
        """Append float32 ``[n]`` samples (to the ``.part`` file).

        Raises:
            NoSpaceError, AudioDeviceError: the write failed; the ``.part`` file is removed and
                :attr:`path` never appears (later calls raise the same).
        """
        if self._w is None:
            raise self._failed or AudioDeviceError(f"WAV file {self.path} is already closed")
        data = to_int16(pcm)
        try:
            self._w.writeframes(data.tobytes())
        except OSError as e:
            self._failed = self._report(_write_error(f"cannot write WAV file {self.path} "
                                                     f"({self.frames / self.rate:.1f} s written)", e))
            self.discard()
            raise self._failed from e
        self.frames += len(data)

    def close(self) -> Path:
        """Finish the header, ``fsync``, rename the ``.part`` file to :attr:`path`, ``fsync`` the
        directory, then apply the retention; returns the path. Idempotent.

        Raises:
            NoSpaceError: the disk is full; AudioDeviceError: the file could not be completed
                (I/O error; or an earlier :meth:`write` failed); the ``.part`` file is removed and
                :attr:`path` is not created.
        """
        if self._failed is not None:
            raise self._failed
        if self._w is None:
            return self.path
        w, self._w = self._w, None
        try:
            w.close()                     # writes the final header and flushes; our file stays open
            self._f.close()               # flushed; the descriptor stays open (closefd=False)
            fd, self._fd = self._fd, None
            commit(fd, self.part, self.path)
        except OSError as e:
            self._drop()
            self._failed = self._report(_write_error(f"cannot complete WAV file {self.path}", e))
            raise self._failed from e
        log.debug("wrote %s (%d frames, %.2f s)", self.path, self.frames, self.frames / self.rate)
        if self.health is not None:
            self.health.wrote()
        if self.retention is not None:
            self.retention.prune(self.path.parent, keep=self.path)
        return self.path

    def _drop(self) -> None:
        """Close the file and remove the ``.part`` file, ignoring errors (it is being given up)."""
        try:
            self._f.close()
        except OSError:
            pass
        fd, self._fd = self._fd, None
        discard(fd, self.part)

    def _report(self, err: ApplianceError) -> ApplianceError:
        """Tell :attr:`health` of ``err``; returns it."""
        if self.health is not None:
            self.health.failed(err)
        return err

    def discard(self) -> None:
        """Drop an unfinished file (cancel): the ``.part`` file is removed, :attr:`path` never
        appears. Does nothing once :meth:`close` has run."""
        if self._w is None:
            return
        w, self._w = self._w, None
        try:
            w.close()
        except OSError:
            pass
        self._drop()


def _write_error(what: str, e: OSError) -> ApplianceError:
    """``NoSpaceError`` for a full disk or quota, else ``AudioDeviceError``; the message says what
    failed, the OS error and where to look."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpaceError(f"{what}: {e.strerror}; free space there (audio.wav_dir)")
    return AudioDeviceError(f"{what}: {e.strerror or e} (check that directory: audio.wav_dir)")


def write_wav(path: str | Path, pcm: np.ndarray, rate: int = 24000) -> Path:
    """Write float32 ``[n]`` PCM to ``path`` in one go (see :class:`WavWriter`)."""
    w = WavWriter(path, rate)
    w.write(pcm)
    return w.close()


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """Read a mono 16-bit WAV written by :class:`WavWriter`: (float32 ``[n]`` in [-1, 1], rate Hz)."""
    with wave.open(str(path), "rb") as r:
        if r.getsampwidth() != 2 or r.getnchannels() != 1:
            raise AudioDeviceError(f"{path}: expected mono 16-bit PCM, got {r.getnchannels()} ch x {8 * r.getsampwidth()} bit")
        data = np.frombuffer(r.readframes(r.getnframes()), dtype="<i2")
        return data.astype(np.float32) / 32767.0, r.getframerate()
