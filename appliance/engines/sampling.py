"""Audio-code sampling, exactly as upstream ChatTTS 0.2.5 defines it, batched over rows (numpy).

Per decode step and row ``b`` (upstream ``ChatTTS/model/gpt.py`` ``GPT.generate`` and
``ChatTTS/model/processors.py``; the warpers are HF transformers' ``TopPLogitsWarper`` and
``TopKLogitsWarper`` with ``min_tokens_to_keep=3``):

1. ``logits[b, q] / temperature[b, q]`` (one temperature per codebook ``q``).
2. Repetition penalty over the last 16 codes this request generated in codebook ``q``
   (prompt tokens do not count): ``alpha = penalty ** count``; negative scores are multiplied
   by ``alpha``, the others divided.
3. Top-P: sort ascending, cumulative softmax, drop where ``cumprob <= 1 - top_p``, always keep
   the 3 largest.
4. Top-K: drop scores below the ``max(top_k, 3)``-th largest (ties kept).
5. While ``step < min_new_tokens`` the EOS code (625) is set to ``-inf``.
6. softmax, cumulative sum, and one inverse-CDF draw per codebook with the uniform
   ``rng.uniform(seed, draw * Q + q)`` of the counter-based stream (:mod:`.rng`): the first code
   whose cumulative mass exceeds ``float32(u) * total``. The row is finished when ANY of its 4
   codebooks drew EOS.

Greedy mode takes the argmax of the scores after steps 1, 2 and 5 (top-P/top-K never remove
the argmax). Differences from upstream: the random stream (counter-based, per request, the same
on every backend, instead of torch's ``multinomial`` with one global generator), so the same seed
gives different codes than upstream; and upstream's quirk that leaves flattened rows ``b*4+q >= 625`` unpenalized
(batches over 156 rows) is not reproduced.

The :class:`Sampler` keeps its state in arrays allocated once per batch: work buffers of
``[B, 4, 626]``, the penalty window as a ring buffer ``[B, 4, 16]`` with running counts. The
penalty touches only the window's codes; top-P/top-K partial-sort the ``top_k`` largest scores
instead of sorting all 626 (:func:`apply_top_p_top_k_fast`, equal to the full sort except when a
cumulative mass lies within float32 rounding of ``1 - top_p``; ``Sampler(exact=True)`` forces the
full sort). Measured on the 2-core dev box (sample + record, per step): 0.16 ms at B=1,
0.27 ms at B=3, 0.53 ms at B=8 (full sort: 0.40 / 1.18 / 3.38 ms).
"""

from __future__ import annotations

import logging
import secrets
from typing import Optional

import numpy as np

from ..core import AUDIO_EOS, NUM_AUDIO_TOKENS, NUM_VQ, SamplingParams
from .rng import uniform

log = logging.getLogger(__name__)

#: Upstream's repetition-penalty window (codes per codebook).
PENALTY_WINDOW = 16
#: Upstream's ``min_tokens_to_keep`` for top-P and top-K.
MIN_KEEP = 3




# ---------------------------------------------------------------------------------------------
# Stages. Each works in place on ``x`` of shape [R, V] float32 (R = rows·codebooks) and takes
# per-row parameters as [R, 1] arrays; ``alpha`` / ``srt`` / ``probs`` are [R, V] work buffers.
# ---------------------------------------------------------------------------------------------

def apply_top_p_top_k(x: np.ndarray, one_minus_p: np.ndarray, k_index: np.ndarray,
                      srt: np.ndarray, probs: np.ndarray, min_keep: int = MIN_KEEP) -> None:
    """HF ``TopPLogitsWarper`` then ``TopKLogitsWarper`` (both ``min_tokens_to_keep``) in place.

    One ascending sort serves both: top-P removes a prefix of the ascending order, so the
    ``k``-th largest surviving score is ``sorted[V - k]`` with that prefix set to ``-inf``.

    Args:
        x: scores ``float32[R, V]``.
        one_minus_p: ``float32[R, 1]``, ``1 - top_p`` rounded to float32 as torch does
            (``-1`` disables top-P for a row).
        k_index: ``int64[R, 1]``, ``V - max(top_k, min_keep)`` clipped at 0 (0 disables top-K).
        srt, probs: work buffers ``float32[R, V]``.
    """
    v = x.shape[1]
    order = np.argsort(x, axis=1, kind="stable")
    srt[...] = np.take_along_axis(x, order, axis=1)
    # softmax of the sorted scores, then the cumulative sum (float32, like torch)
    np.subtract(srt, srt[:, -1:], out=probs)
    np.exp(probs, out=probs)
    probs /= probs.sum(axis=1, keepdims=True)
    np.cumsum(probs, axis=1, out=probs)
    remove = probs <= one_minus_p
    remove[:, v - min_keep:] = False
    srt[remove] = -np.inf
    # top-K threshold from the masked ascending order
    thr = np.take_along_axis(srt, k_index, axis=1)
    np.put_along_axis(x, order, srt, axis=1)
    x[x < thr] = -np.inf


def apply_repetition_penalty_sparse(x: np.ndarray, hist: np.ndarray, counts_at: np.ndarray,
                                    penalty: np.ndarray) -> None:
    """Upstream ``CustomRepetitionPenaltyLogitsProcessorRepeat`` in place: ``alpha = penalty **
    count``; negative scores times ``alpha``, others divided. Touches only the window's codes.

    Args:
        x: scores ``float32[R, V]``.
        hist: ``int64[R, W]`` the window's codes (unused entries hold any code of the row's
            window or 0: a repeated index is written twice with the same value).
        counts_at: ``float32[R, W]`` the window count of each ``hist`` code.
        penalty: ``float32[R, 1]``.
    """
    alpha = np.power(penalty, counts_at)
    v = np.take_along_axis(x, hist, axis=1)
    np.put_along_axis(x, hist, np.where(v < 0, v * alpha, v / alpha), axis=1)


def apply_top_p_top_k_fast(x: np.ndarray, one_minus_p: np.ndarray, keep_k: np.ndarray,
                           m: int, min_keep: int = MIN_KEEP) -> bool:
    """:func:`apply_top_p_top_k` without the full sort, when every row has a top-K.

    Only the ``m = max(keep_k)`` largest scores can survive top-K, so they are found with
    ``argpartition`` and sorted alone; the ascending cumulative softmax at each of them is
    ``1 - (mass of the larger ones)``. The result equals the full-sort path except when a
    cumulative mass lies within float32 rounding (~1e-7) of ``1 - top_p``.

    Args:
        x: scores ``float32[R, V]`` (modified in place on success).
        one_minus_p: ``float32[R, 1]`` (``-1`` = no top-P).
        keep_k: ``int64[R, 1]``, ``max(top_k, min_keep)`` per row (<= ``m``).
        m: ``max(keep_k)``.

    Returns:
        False (and ``x`` untouched) when a score ties with a row's ``k``-th largest: the caller
        then uses the exact path (HF keeps every tie).
    """
    r, v = x.shape
    part = np.sort(np.argpartition(x, v - m, axis=1)[:, v - m:], axis=1)  # ties: index order, as the full sort
    vals = np.take_along_axis(x, part, axis=1)
    o = np.argsort(vals, axis=1, kind="stable")
    idx = np.take_along_axis(part, o, axis=1)       # [R, m] ascending
    vals = np.take_along_axis(vals, o, axis=1)
    pos = np.arange(m)[None, :]
    kth = np.take_along_axis(vals, m - keep_k, axis=1)  # the k-th largest of each row
    if ((x >= kth).sum(axis=1, keepdims=True) != keep_k).any():
        return False
    mx = vals[:, -1:]
    z = np.exp(x - mx).sum(axis=1, keepdims=True, dtype=np.float32)
    p = np.exp(vals - mx) / z
    above = np.cumsum(p[:, ::-1], axis=1)[:, ::-1] - p  # mass strictly larger than each
    cum = np.float32(1.0) - above
    remove = cum <= one_minus_p
    remove[:, m - min_keep:] = False
    keep = ~remove & (pos >= m - keep_k)
    x.fill(-np.inf)
    np.put_along_axis(x, idx, np.where(keep, vals, -np.inf), axis=1)
    return True


def softmax_rows(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Row softmax of ``float32[R, V]`` (``-inf`` gives 0) into ``out``."""
    np.subtract(x, x.max(axis=1, keepdims=True), out=out)
    np.exp(out, out=out)
    out /= out.sum(axis=1, keepdims=True)
    return out


class Sampler:
    """Samples the 4 audio codes of the active slots of a batch, step by step.

    One object per decode loop, with one slot per KV-cache slot; a slot is (re)assigned to a
    request with :meth:`start`, so a continuous-batching loop reuses it. Work arrays are
    allocated once for ``max_batch`` rows.

    Per step the loop calls :meth:`sample` for the active slots, then :meth:`record` for every
    slot whose codes it keeps (not after EOS). :meth:`process` gives the scores before the draw
    (parity tests).

    Args:
        max_batch: number of slots.
        num_vq: codebooks (4). num_tokens: codes per codebook incl. EOS (626).
        eos: EOS code (625). window: repetition-penalty window (16).
        exact: always use the full-sort top-P (see :func:`apply_top_p_top_k_fast` for the
            default path, which partial-sorts when every row has a top-K <= 64).

    Attributes:
        seeds: ``list[int]``, the seed each slot's generator was started with.
    """

    def __init__(self, max_batch: int, num_vq: int = NUM_VQ, num_tokens: int = NUM_AUDIO_TOKENS,
                 eos: int = AUDIO_EOS, window: int = PENALTY_WINDOW, exact: bool = False) -> None:
        if max_batch < 1:
            raise ValueError("a Sampler needs at least one slot")
        b, q, v = max_batch, num_vq, num_tokens
        self.max_batch, self.num_vq, self.vocab, self.eos, self.window = b, q, v, eos, window
        self.exact = exact
        f32 = np.float32
        # per-slot parameters
        self._temp = np.ones((b, q, 1), f32)
        self._penalty = np.ones((b, q, 1), f32)
        self._one_minus_p = np.full((b, q, 1), -1.0, f32)
        self._k_index = np.zeros((b, q, 1), np.int64)
        self._keep_k = np.full((b, q, 1), v, np.int64)
        self._min_new = np.zeros(b, np.int64)
        self._greedy = np.zeros(b, bool)
        # per-slot state: penalty window as a ring buffer plus running counts
        self._recorded = np.zeros(b, np.int64)
        self._hist = np.zeros((b, q, window), np.int64)
        self._counts = np.zeros((b, q, v), f32)
        self._seed = np.zeros(b, np.uint64)      # the stream of each slot (rng.uniform)
        self._draws = np.zeros(b, np.int64)      # draws made since start (the stream's counter)
        self.seeds: list[int] = [0] * b
        # work buffers (the first n rows are used for n active slots)
        self._x = np.empty((b, q, v), f32)
        self._srt = np.empty((b * q, v), f32)
        self._probs = np.empty((b * q, v), f32)
        self._qs = np.arange(q, dtype=np.int64)
        self._codes = np.empty((b, q), np.int64)
        self._q = np.arange(q)

    def start(self, slot: int, params: SamplingParams, seed: Optional[int] = None) -> int:
        """Assign ``slot`` to a new request: its parameters, an empty penalty window and the
        random stream of ``seed`` (None = a fresh random seed). Returns the seed used.

        Raises:
            ValueError: ``seed`` outside 0..2**64-1, or a temperature list of the wrong length.
        """
        q = self.num_vq
        t = params.temperature if isinstance(params.temperature, tuple) else (params.temperature,) * q
        if len(t) != q:
            raise ValueError(f"temperature needs 1 or {q} values, got {len(t)}")
        self._temp[slot, :, 0] = t
        self._penalty[slot] = params.repetition_penalty
        self._one_minus_p[slot] = -1.0 if params.top_p is None else np.float32(1.0 - params.top_p)
        k = self.vocab if params.top_k is None else min(max(params.top_k, MIN_KEEP), self.vocab)
        self._k_index[slot] = self.vocab - k
        self._keep_k[slot] = k
        self._min_new[slot] = params.min_new_tokens
        self._greedy[slot] = params.greedy
        self._recorded[slot] = 0
        self._hist[slot] = 0
        self._counts[slot] = 0
        seed = secrets.randbits(63) if seed is None else int(seed)
        if not 0 <= seed < 1 << 64:
            raise ValueError(f"seed {seed} must be in 0..2**64-1")
        self._seed[slot] = np.uint64(seed)
        self._draws[slot] = 0
        self.seeds[slot] = seed
        return seed

    def process(self, slots: np.ndarray, logits: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """Steps 1-5 (temperature, penalty, top-P, top-K, EOS mask) for ``n`` active slots.

        Args:
            slots: ``int[n]`` slot of each row.
            logits: ``float32[n, 4, V]`` of this step, row ``i`` for ``slots[i]``.
            steps: ``int[n]`` codes already produced by each row's request (EOS is masked
                while ``steps < min_new_tokens``).

        Returns:
            processed scores ``float32[n, 4, V]`` (``-inf`` = removed): a view of a work
            buffer, valid until the next call.
        """
        n = logits.shape[0]
        if logits.shape[1:] != (self.num_vq, self.vocab) or not 0 < n <= self.max_batch or len(slots) != n:
            raise ValueError(f"logits {logits.shape} / slots {len(slots)} do not fit a sampler of "
                             f"{self.max_batch} x {self.num_vq} x {self.vocab}")
        slots = np.asarray(slots)
        x = self._x[:n]
        np.divide(logits, self._temp[slots], out=x)
        x2 = x.reshape(-1, self.vocab)
        r = n * self.num_vq
        pen = self._penalty[slots].reshape(-1, 1)
        if (pen != 1.0).any():
            hist = self._hist[slots].reshape(r, -1)
            counts_at = np.take_along_axis(self._counts[slots].reshape(r, -1), hist, axis=1)
            apply_repetition_penalty_sparse(x2, hist, counts_at, pen)
        omp = self._one_minus_p[slots].reshape(-1, 1)
        keep_k = self._keep_k[slots].reshape(-1, 1)
        m = int(keep_k.max())
        if self.exact or m > 64 or not apply_top_p_top_k_fast(x2, omp, keep_k, m):
            apply_top_p_top_k(x2, omp, self._k_index[slots].reshape(-1, 1), self._srt[:r], self._probs[:r])
        masked = np.asarray(steps) < self._min_new[slots]
        if masked.any():
            x[masked, :, self.eos] = -np.inf
        return x

    def sample(self, slots: np.ndarray, logits: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """Process and draw one step for ``n`` active slots (see :meth:`process` for the args).

        Returns:
            ``int64[n, 4]`` codes (a work buffer, valid until the next call). A row is finished
            when any of its codes is EOS (``(codes == eos).any(axis=1)``). Nothing is recorded:
            call :meth:`record` for the codes kept.
        """
        slots = np.asarray(slots)
        x = self.process(slots, logits, steps)
        n = x.shape[0]
        codes = self._codes[:n]
        greedy = self._greedy[slots]
        counter = self._draws[slots]
        self._draws[slots] += 1
        if greedy.all():
            np.argmax(x, axis=2, out=codes)
            return codes
        probs = softmax_rows(x.reshape(-1, self.vocab), self._probs[: n * self.num_vq])
        np.cumsum(probs, axis=1, out=probs)
        u = uniform(self._seed[slots][:, None], counter[:, None] * self.num_vq + self._qs).astype(np.float32)
        ut = u.reshape(-1, 1) * probs[:, -1:]
        # count of cumulative masses <= u: the first code past u, never a zero-probability one
        codes.reshape(-1)[:] = np.minimum((probs <= ut).sum(axis=1), self.vocab - 1)
        if greedy.any():
            codes[greedy] = np.argmax(x[greedy], axis=2)
        return codes

    def record(self, slot: int, codes: np.ndarray) -> None:
        """Append one step's ``codes int[4]`` of ``slot`` to its penalty window."""
        j = self._recorded[slot] % self.window
        if self._recorded[slot] >= self.window:
            self._counts[slot, self._q, self._hist[slot, :, j]] -= 1.0
        self._hist[slot, :, j] = codes
        self._counts[slot, self._q, codes] += 1.0
        self._recorded[slot] += 1
