"""WAV output: one file per request, written as the PCM arrives.

Format: RIFF/WAVE, PCM **int16** little-endian, mono, at the pipeline's rate (24000 Hz). Int16
because the stdlib :mod:`wave` module writes only integer PCM (format tag 1) and every player
reads it; float32 samples are clipped to [-1, 1] and scaled by 32767 with rounding, so a
round trip through :func:`read_wav` is exact to 1/32767 (≈ 3.1e-5).

Files are named after the request id (``<wav_dir>/<id>.wav``); characters outside
``[A-Za-z0-9._-]`` in the id are replaced by ``_`` so a client-chosen id cannot leave
``wav_dir``.
"""

from __future__ import annotations

import logging
import re
import wave
from pathlib import Path

import numpy as np

from ..errors import AudioDeviceError

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def wav_path(wav_dir: str | Path, request_id: str) -> Path:
    """``<wav_dir>/<sanitized id>.wav`` (the directory is not created here)."""
    name = _UNSAFE.sub("_", request_id) or "request"
    if name.startswith("."):
        name = "_" + name[1:]
    return Path(wav_dir) / f"{name}.wav"


def to_int16(pcm: np.ndarray) -> np.ndarray:
    """float32 ``[n]`` in [-1, 1] -> int16 ``[n]`` (clipped, x 32767, rounded)."""
    return np.round(np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0) * 32767.0).astype("<i2")


def encode_pcm(pcm: np.ndarray, sample_format: str) -> bytes:
    """float32 ``[n]`` -> the bytes of a ``return_audio`` payload: little-endian ``float32``, or
    ``int16`` (:func:`to_int16`) when ``sample_format`` is ``"int16"`` (``stream.sample_format``)."""
    return to_int16(pcm).tobytes() if sample_format == "int16" else pcm.astype("<f4").tobytes()


class WavWriter:
    """Stream float32 mono PCM into a 16-bit WAV file.

    Args:
        path: output file; its parent directory is created.
        rate: sample rate in Hz.

    Raises:
        AudioDeviceError: the file cannot be created (message names the path).
    """

    def __init__(self, path: str | Path, rate: int = 24000) -> None:
        self.path = Path(path)
        self.rate = rate
        self.frames = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # open the file first: a failing wave.open(path) leaves a half-built Wave_write whose
            # __del__ prints an AttributeError
            self._f = open(self.path, "wb")
        except OSError as e:
            raise AudioDeviceError(f"cannot write WAV file {self.path}: {e.strerror or e} "
                                   "(check that directory: audio.wav_dir for the daemon)") from e
        self._w = wave.open(self._f, "wb")
        self._w.setnchannels(1)
        self._w.setsampwidth(2)
        self._w.setframerate(rate)

    def write(self, pcm: np.ndarray) -> None:
        """Append float32 ``[n]`` samples."""
        data = to_int16(pcm)
        self._w.writeframes(data.tobytes())
        self.frames += len(data)

    def close(self) -> Path:
        """Finish the header and close; returns the path. Idempotent."""
        if self._w is not None:
            self._w.close()
            self._f.close()
            self._w = None
            log.debug("wrote %s (%d frames, %.2f s)", self.path, self.frames, self.frames / self.rate)
        return self.path


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
