"""The device twin of the numpy sampler: the same algorithm and random stream, in torch, on the
runner's device, with no host sync (it is captured inside the CUDA runner's decode-step graph).

Per row (= physical KV row) it keeps: temperature ``[R, Q, 1]``, repetition penalty, ``1 - top_p``
(-1 = off), top-K index ``V - max(top_k, 3)``, ``min_new_tokens``, greedy flag, seed, ``steps``
(draws made), the penalty window ring ``hist [R, Q, 16]`` and its counts ``[R, Q, V]``. The steps
are those of :mod:`appliance.engines.sampling` (upstream ChatTTS 0.2.5: temperature, penalty over
the last 16 codes, HF top-P then top-K keeping >= 3, EOS masked before ``min_new_tokens``) and
the draw is the same inverse-CDF draw with ``float32(u) * total`` for
``u = uniform(seed, steps * Q + q)`` (:mod:`appliance.engines.rng`, same bits in wrapping int64
arithmetic), so a seed gives the codes the host runners give, up to rounding at near-ties.
"""

from __future__ import annotations

import numpy as np
import torch

from ...core import AUDIO_EOS, SamplingParams
from ..rng import GOLDEN, MIX1, MIX2, seed_bits
from ..sampling import MIN_KEEP, PENALTY_WINDOW


def _s64(c: int) -> int:
    """An unsigned 64-bit constant as the signed int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix_uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Uniform float64 in [0, 1) for int64 tensors ``seed``, ``counter`` (broadcast): the bits of
    :func:`appliance.engines.rng.uniform` on any torch device."""
    z = seed + (counter + 1) * _s64(GOLDEN)
    z = (z ^ _shr(z, 30)) * _s64(MIX1)
    z = (z ^ _shr(z, 27)) * _s64(MIX2)
    z = z ^ _shr(z, 31)
    return _shr(z, 11).double() * (1.0 / (1 << 53))


class DeviceSampler:
    """Sampling state and step for ``rows`` rows on ``device`` (see module doc).

    :meth:`sample` works on the row range ``sl`` (a slice) without any host sync; :meth:`configure`
    (host values in) runs between graph replays.
    """

    def __init__(self, rows: int, num_vq: int, vocab: int, device, eos: int = AUDIO_EOS,
                 window: int = PENALTY_WINDOW):
        R, Q, V = rows, num_vq, vocab
        self.rows, self.num_vq, self.vocab, self.eos, self.window = R, Q, V, eos, window
        kw = dict(device=device)
        self.temp = torch.ones(R, Q, 1, **kw)
        self.penalty = torch.ones(R, Q, 1, **kw)
        self.omp = torch.full((R, Q, 1), -1.0, **kw)
        self.kidx = torch.zeros(R, Q, 1, dtype=torch.int64, **kw)
        self.min_new = torch.zeros(R, dtype=torch.int64, **kw)
        self.greedy = torch.zeros(R, dtype=torch.bool, **kw)
        self.seed = torch.zeros(R, dtype=torch.int64, **kw)
        self.steps = torch.zeros(R, dtype=torch.int64, **kw)
        self.hist = torch.zeros(R, Q, window, dtype=torch.int64, **kw)
        self.counts = torch.zeros(R, Q, V, **kw)
        self._tail = torch.zeros(V, dtype=torch.bool, **kw)
        self._tail[: V - MIN_KEEP] = True  # positions of the ascending order top-P may remove
        self._q = torch.arange(Q, dtype=torch.int64, **kw)

    def state(self) -> list[torch.Tensor]:
        """Per-row state tensors (first dim = row), for row permutations and save/restore."""
        return [self.temp, self.penalty, self.omp, self.kidx, self.min_new, self.greedy, self.seed,
                self.steps, self.hist, self.counts]

    def reset(self) -> None:
        """Neutral state for every row."""
        for t in self.state():
            t.zero_()
        self.temp.fill_(1.0)
        self.penalty.fill_(1.0)
        self.omp.fill_(-1.0)

    def configure(self, row: int, params: SamplingParams, seed: int) -> None:
        """Start a request in ``row``: parameters, empty window, ``steps = 0``.

        Raises:
            ValueError: ``seed`` outside 0..2**64-1.
        """
        if not 0 <= int(seed) < 1 << 64:
            raise ValueError(f"seed {seed} must be in 0..2**64-1")
        Q, V = self.num_vq, self.vocab
        t = params.temperature if isinstance(params.temperature, tuple) else (params.temperature,) * Q
        self.temp[row, :, 0] = torch.tensor(t, dtype=torch.float32)
        self.penalty[row] = float(np.float32(params.repetition_penalty))
        self.omp[row] = -1.0 if params.top_p is None else float(np.float32(1.0 - params.top_p))
        k = V if params.top_k is None else min(max(params.top_k, MIN_KEEP), V)
        self.kidx[row] = V - k
        self.min_new[row] = int(params.min_new_tokens)
        self.greedy[row] = bool(params.greedy)
        self.seed[row] = seed_bits(seed)
        self.steps[row] = 0
        self.hist[row] = 0
        self.counts[row] = 0

    def process(self, logits: torch.Tensor, sl: slice) -> torch.Tensor:
        """Scores before the draw: ``logits float32 [b, Q, V]`` for rows ``sl`` -> ``[b, Q, V]``
        (temperature, penalty, top-P, top-K, EOS mask; ``-inf`` = removed)."""
        x = logits / self.temp[sl]
        alpha = torch.pow(self.penalty[sl], self.counts[sl])
        x = torch.where(x < 0, x * alpha, x / alpha)
        srt, idx = torch.sort(x, dim=-1, stable=True)
        cum = srt.softmax(-1).cumsum(-1)
        srt = srt.masked_fill((cum <= self.omp[sl]) & self._tail, float("-inf"))
        thr = srt.gather(-1, self.kidx[sl])
        x = torch.empty_like(x).scatter_(-1, idx, srt)
        x = x.masked_fill(x < thr, float("-inf"))
        eos_masked = (self.steps[sl] < self.min_new[sl])[:, None]
        x[:, :, self.eos] = torch.where(eos_masked, float("-inf"), x[:, :, self.eos])
        return x

    def sample(self, logits: torch.Tensor, sl: slice) -> torch.Tensor:
        """Process, draw and record one step for rows ``sl``; returns codes ``int64 [b, Q]``."""
        x = self.process(logits, sl)
        V, Q = self.vocab, self.num_vq
        cum = x.softmax(-1).cumsum(-1)
        u = splitmix_uniform(self.seed[sl][:, None], self.steps[sl][:, None] * Q + self._q).float()  # [b, Q]
        drawn = (cum <= (u[..., None] * cum[..., -1:])).sum(-1).clamp_max(V - 1)
        codes = torch.where(self.greedy[sl][:, None], x.argmax(-1), drawn)
        self._record(codes, sl)
        return codes

    def _record(self, codes: torch.Tensor, sl: slice) -> None:
        W = self.window
        rec = self.steps[sl]
        j = (rec % W)[:, None, None].expand(-1, self.num_vq, 1)
        hist, counts = self.hist[sl], self.counts[sl]
        old = hist.gather(2, j)
        counts.scatter_add_(2, old, -(rec >= W).float()[:, None, None].expand(-1, self.num_vq, 1).contiguous())
        hist.scatter_(2, j, codes[..., None])
        counts.scatter_add_(2, codes[..., None], torch.ones_like(codes[..., None], dtype=counts.dtype))
        self.steps[sl] += 1
