"""Streaming inverse STFT on the host (numpy), equal to ``torch.istft(center=True)``.

Vocos' ISTFT head (vocos 0.1.0 ``vocos/heads.py`` ``ISTFTHead`` with ``padding="center"``,
``vocos/spectral_ops.py`` ``ISTFT``) calls ``torch.istft(S, n_fft=1024, hop_length=256,
win_length=1024, window=hann_window(1024), center=True)``. That is: each frame is
``irfft(S_f, n_fft) * window``, frames are overlap-added at ``f * hop`` into a padded signal,
the sum is divided by the overlap-added squared window (the "envelope"), and ``n_fft // 2``
samples are trimmed from both ends, giving ``hop * (F - 1)`` samples for ``F`` frames.

ISTFT is not an ONNX or TensorRT operator, so every backend returns the complex spectrum and
this class finishes the waveform incrementally: a padded sample is final once no later frame can
overlap it, so after frame ``k`` every output sample below ``hop * (k + 1) - n_fft // 2`` is
emitted. The work per frame is one 1024-point real FFT (O(n) over an utterance), and the
buffers are allocated once per stream.
"""

from __future__ import annotations

import numpy as np


def hann_window(n: int) -> np.ndarray:
    """Periodic Hann window as ``torch.hann_window(n)`` (float64 [n])."""
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n)


class StreamingISTFT:
    """Incremental ``torch.istft(center=True)`` over frames that arrive in order.

    Args:
        n_fft: FFT size (1024 for ChatTTS' Vocos).
        hop: hop length in samples (256).
        max_frames_per_push: the largest number of frames one :meth:`push` may carry.

    Use: ``push(real, imag)`` with float32 ``[F, n_fft // 2 + 1]`` arrays returns the float32
    samples that became final; ``finish()`` returns the rest. Total length is
    ``hop * (frames - 1)`` samples, bit-for-bit the layout of ``torch.istft`` (values equal to
    FP32 rounding).
    """

    def __init__(self, n_fft: int = 1024, hop: int = 256, max_frames_per_push: int = 512):
        if n_fft % hop:
            raise ValueError(f"n_fft {n_fft} must be a multiple of hop {hop}")
        self.n_fft, self.hop = n_fft, hop
        self.window = hann_window(n_fft)
        self._w2 = self.window**2
        cap = n_fft + hop * (max_frames_per_push + 1)
        self._acc = np.zeros(cap, np.float64)   # overlap-added frames, padded coordinates
        self._env = np.zeros(cap, np.float64)   # overlap-added squared window
        self._base = 0       # padded index of _acc[0]
        self._frames = 0     # frames pushed so far
        self._emitted = 0    # output (trimmed) samples emitted so far
        self._max_push = max_frames_per_push

    def reset(self) -> None:
        """Start a new signal, keeping the buffers (only their used part is cleared)."""
        used = (self._frames - 1) * self.hop + self.n_fft - self._base if self._frames else 0
        self._acc[:max(used, 0)] = 0.0
        self._env[:max(used, 0)] = 0.0
        self._base = self._frames = self._emitted = 0

    def push(self, real: np.ndarray, imag: np.ndarray) -> np.ndarray:
        """Add frames ``[F, n_fft//2+1]`` (float32); return the output samples now final (float32)."""
        n = real.shape[0]
        if n > self._max_push:
            raise ValueError(f"push of {n} frames exceeds max_frames_per_push={self._max_push}")
        if n == 0:
            return np.zeros(0, np.float32)
        frames = np.fft.irfft(real.astype(np.float64) + 1j * imag.astype(np.float64), n=self.n_fft, axis=-1)
        frames *= self.window
        for i in range(n):
            start = (self._frames + i) * self.hop - self._base
            self._acc[start:start + self.n_fft] += frames[i]
            self._env[start:start + self.n_fft] += self._w2
        self._frames += n
        # padded samples < hop * frames are final (no later frame reaches them)
        return self._emit(self._frames * self.hop)

    def finish(self) -> np.ndarray:
        """Return the remaining samples; total output is ``hop * (frames - 1)`` samples."""
        if self._frames == 0:
            return np.zeros(0, np.float32)
        return self._emit(self.hop * (self._frames - 1) + self.n_fft // 2, final=True)

    def _emit(self, final_padded: int, final: bool = False) -> np.ndarray:
        half = self.n_fft // 2
        total_out = self.hop * (self._frames - 1) if final else None
        end_out = final_padded - half
        if total_out is not None:
            end_out = total_out
        end_out = max(end_out, self._emitted)
        a = self._emitted + half - self._base
        b = end_out + half - self._base
        env = self._env[a:b]
        if np.any(env <= 1e-11):
            raise ValueError("window envelope vanishes (torch.istft would raise NOLA error)")
        out = (self._acc[a:b] / env).astype(np.float32)
        self._emitted = end_out
        # drop what is fully consumed, keep the tail that later frames still add into
        # (never past the start of the next frame, which later pushes add into)
        keep_from = min(self._emitted + half, self._frames * self.hop) - self._base
        if keep_from > 0:
            rest = max((self._frames - 1) * self.hop + self.n_fft - self._base - keep_from, 0)
            self._acc[:rest] = self._acc[keep_from:keep_from + rest]
            self._env[:rest] = self._env[keep_from:keep_from + rest]
            # past the old used end the buffers are zero already: clear only what was moved
            self._acc[rest:keep_from + rest] = 0.0
            self._env[rest:keep_from + rest] = 0.0
            self._base += keep_from
        return out


def istft(real: np.ndarray, imag: np.ndarray, n_fft: int = 1024, hop: int = 256) -> np.ndarray:
    """Whole-signal inverse STFT (``torch.istft(center=True)`` semantics); float32 ``[hop*(F-1)]``."""
    s = StreamingISTFT(n_fft, hop, max_frames_per_push=max(1, real.shape[0]))
    return np.concatenate([s.push(real, imag), s.finish()])
