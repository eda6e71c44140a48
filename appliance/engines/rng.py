"""The one random stream every sampler draws from: a counter-based SplitMix64 hash.

A draw never depends on generator state, only on ``(seed, counter)``: the uniform for request
seed ``s``, draw ``i`` (0 = the code sampled from the prefill logits) and codebook ``q`` of ``Q`` is
``uniform(s, i * Q + q)``. So the numpy sampler of the host runners (:mod:`.sampling`) and the
device sampler of the GPU runners (:mod:`.sampler_torch`, same bits in wrapping int64 arithmetic)
give a request the same codes whatever else is in its batch and whichever backend runs it; only
logits that differ by rounding at a near-tie can make two backends differ.

Algorithm: SplitMix64 (Steele, Lea, Flood: "Fast splittable pseudorandom number generators",
OOPSLA 2014), finalizer of ``seed + (counter + 1) * 0x9E3779B97F4A7C15``; the top 53 bits make
a float64 in [0, 1).
"""

from __future__ import annotations

import numpy as np

GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
_M64 = (1 << 64) - 1


def seed_bits(seed: int) -> int:
    """A seed (any int, reduced mod 2**64) as the signed int64 with the same 64 bits."""
    s = int(seed) & _M64
    return s - (1 << 64) if s >= 1 << 63 else s


def uniform(seed: np.ndarray, counter: np.ndarray) -> np.ndarray:
    """Uniform float64 in [0, 1) for each ``(seed, counter)`` pair (int64 / uint64 arrays,
    broadcast). Wrapping uint64 arithmetic; bit-identical to the torch twin."""
    with np.errstate(over="ignore"):
        z = np.asarray(seed).astype(np.uint64) + (np.asarray(counter).astype(np.uint64) + np.uint64(1)) * np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def uniform_ref(seed: int, counter: int) -> float:
    """Pure-Python reference of :func:`uniform` for one pair (tests)."""
    z = (seed + (counter + 1) * GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * MIX1) & _M64
    z = ((z ^ (z >> 27)) * MIX2) & _M64
    z = z ^ (z >> 31)
    return (z >> 11) / float(1 << 53)
