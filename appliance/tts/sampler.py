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
6. softmax, then one draw per codebook from the row's own ``numpy.random.Generator``.
   The row is finished when ANY of its 4 codebooks drew EOS.

Greedy mode takes the argmax of the scores after steps 1, 2 and 5 (top-P/top-K never remove
the argmax). Differences from upstream: the random stream (numpy PCG64 per request instead of
torch's ``multinomial`` with one global generator), so the same seed gives different codes than
upstream; and upstream's quirk that leaves flattened rows ``b*4+q >= 625`` unpenalized
(batches over 156 rows) is not reproduced.

The :class:`Sampler` keeps everything in arrays allocated once per batch: work buffers of
``[B, 4, 626]``, the penalty window as a ring buffer ``[B, 4, 16]`` with running counts.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np

from appliance.tts.tokens import AUDIO_EOS, NUM_AUDIO_TOKENS, NUM_VQ

log = logging.getLogger(__name__)

#: Upstream's repetition-penalty window (codes per codebook).
PENALTY_WINDOW = 16
#: Upstream's ``min_tokens_to_keep`` for top-P and top-K.
MIN_KEEP = 3


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request (upstream ``InferCodeParams`` defaults).

    Attributes:
        temperature: one value, or one per codebook (4 values); > 0.
        top_p: nucleus mass kept, in (0, 1]; None = off.
        top_k: codes kept (at least 3 always are); None = off.
        repetition_penalty: >= 1; 1 = off.
        min_new_tokens: EOS is masked for the first this many steps.
        greedy: argmax instead of drawing (seed unused).
        seed: seed of this request's generator; None = a fresh one (see ``Sampler.seeds``).
    """

    temperature: Union[float, tuple[float, ...]] = 0.3
    top_p: Optional[float] = 0.7
    top_k: Optional[int] = 20
    repetition_penalty: float = 1.05
    min_new_tokens: int = 0
    greedy: bool = False
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        t = self.temperature if isinstance(self.temperature, tuple) else (self.temperature,)
        if len(t) not in (1, NUM_VQ) or not all(x > 0 for x in t):
            raise ValueError(f"temperature {self.temperature!r} must be > 0, one value or {NUM_VQ}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p} must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k {self.top_k} must be >= 1")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty {self.repetition_penalty} must be > 0")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens {self.min_new_tokens} must be >= 0")

    @classmethod
    def from_config(cls, syn, **overrides) -> "SamplingParams":
        """Build from ``appliance.config.SynthesisConfig`` (``cfg.synthesis``), then overrides."""
        base = dict(temperature=syn.temperature, top_p=syn.top_p, top_k=syn.top_k,
                    repetition_penalty=syn.repetition_penalty,
                    min_new_tokens=syn.min_new_tokens, seed=syn.seed)
        base.update(overrides)
        if isinstance(base["temperature"], list):
            base["temperature"] = tuple(base["temperature"])
        return cls(**base)


# ---------------------------------------------------------------------------------------------
# Stages. Each works in place on ``x`` of shape [R, V] float32 (R = rows·codebooks) and takes
# per-row parameters as [R, 1] arrays; ``sort_idx`` / ``srt`` are [R, V] work buffers.
# ---------------------------------------------------------------------------------------------

def apply_repetition_penalty(x: np.ndarray, counts: np.ndarray, penalty: np.ndarray,
                             alpha: np.ndarray) -> None:
    """Upstream ``CustomRepetitionPenaltyLogitsProcessorRepeat`` in place.

    Args:
        x: scores ``float32[R, V]``.
        counts: occurrences of each code in the window, ``float32[R, V]``.
        penalty: ``float32[R, 1]``.
        alpha: work buffer ``float32[R, V]``.
    """
    np.power(penalty, counts, out=alpha)
    neg = x < 0
    np.multiply(x, alpha, out=x, where=neg)
    np.divide(x, alpha, out=x, where=~neg)


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


def softmax_rows(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Row softmax of ``float32[R, V]`` (``-inf`` gives 0) into ``out``."""
    np.subtract(x, x.max(axis=1, keepdims=True), out=out)
    np.exp(out, out=out)
    out /= out.sum(axis=1, keepdims=True)
    return out


class Sampler:
    """Samples the 4 audio codes of every row of a batch, step by step.

    One object per batch; rows are (re)assigned to requests with :meth:`reset_row`, so a
    continuous-batching scheduler can reuse it. Work arrays are allocated once.

    Args:
        params: one :class:`SamplingParams` per row (the batch size is ``len(params)``).
        num_vq: codebooks (4). vocab: codes per codebook incl. EOS (626). eos: EOS code (625).
        window: repetition-penalty window (16).

    Attributes:
        seeds: ``list[int]``, the seed each row's generator was started with (report it).
        steps: ``int64[B]``, codes drawn per row since its reset.
    """

    def __init__(self, params: Sequence[SamplingParams], num_vq: int = NUM_VQ,
                 vocab: int = NUM_AUDIO_TOKENS, eos: int = AUDIO_EOS,
                 window: int = PENALTY_WINDOW) -> None:
        b = len(params)
        if b < 1:
            raise ValueError("a Sampler needs at least one row")
        self.batch, self.num_vq, self.vocab, self.eos, self.window = b, num_vq, vocab, eos, window
        r = b * num_vq
        f32 = np.float32
        # per-row parameters, expanded to the flattened [B*4, 1] row layout
        self._temp = np.ones((b, num_vq, 1), f32)
        self._penalty = np.ones((r, 1), f32)
        self._one_minus_p = np.full((r, 1), -1.0, f32)
        self._k_index = np.zeros((r, 1), np.int64)
        self._min_new = np.zeros(b, np.int64)
        self._greedy = np.zeros(b, bool)
        self._use_penalty = False
        # state
        self.steps = np.zeros(b, np.int64)
        self._hist = np.zeros((b, num_vq, window), np.int64)  # ring buffer of codes
        self._counts = np.zeros((b, num_vq, vocab), f32)       # occurrences in the window
        self._rngs: list[np.random.Generator] = [np.random.default_rng(0)] * b
        self.seeds: list[int] = [0] * b
        # work buffers
        self._x = np.empty((b, num_vq, vocab), f32)
        self._alpha = np.empty((r, vocab), f32)
        self._srt = np.empty((r, vocab), f32)
        self._probs = np.empty((r, vocab), f32)
        self._u = np.empty((b, num_vq), np.float64)
        self._codes = np.empty((b, num_vq), np.int64)
        self._rows_q = np.arange(num_vq)
        for i, p in enumerate(params):
            self.reset_row(i, p)

    def reset_row(self, row: int, params: SamplingParams) -> int:
        """Start row ``row`` afresh for a new request. Returns the seed its generator uses."""
        q = self.num_vq
        t = params.temperature if isinstance(params.temperature, tuple) else (params.temperature,) * q
        if len(t) != q:
            raise ValueError(f"temperature needs 1 or {q} values, got {len(t)}")
        self._temp[row, :, 0] = t
        sl = slice(row * q, (row + 1) * q)
        self._penalty[sl] = params.repetition_penalty
        self._one_minus_p[sl] = -1.0 if params.top_p is None else np.float32(1.0 - params.top_p)
        k = self.vocab if params.top_k is None else min(max(params.top_k, MIN_KEEP), self.vocab)
        self._k_index[sl] = self.vocab - k
        self._min_new[row] = params.min_new_tokens
        self._greedy[row] = params.greedy
        self._use_penalty = bool(np.any(self._penalty != 1.0))
        self.steps[row] = 0
        self._hist[row] = 0
        self._counts[row] = 0
        seed = secrets.randbits(63) if params.seed is None else int(params.seed)
        self._rngs[row] = np.random.default_rng(seed)
        self.seeds[row] = seed
        return seed

    def process(self, logits: np.ndarray) -> np.ndarray:
        """Steps 1-5 (temperature, penalty, top-P, top-K, EOS mask) for every row.

        Args:
            logits: ``float32[B, 4, V]`` of this step.

        Returns:
            the processed scores ``float32[B, 4, V]`` (``-inf`` = removed). A view of a work
            buffer: valid until the next call.
        """
        x = self._x
        if logits.shape != x.shape:
            raise ValueError(f"logits shape {logits.shape} != sampler batch {x.shape}")
        np.divide(logits, self._temp, out=x)
        x2 = x.reshape(-1, self.vocab)
        if self._use_penalty:
            apply_repetition_penalty(x2, self._counts.reshape(-1, self.vocab), self._penalty, self._alpha)
        apply_top_p_top_k(x2, self._one_minus_p, self._k_index, self._srt, self._probs)
        masked = self.steps < self._min_new
        if masked.any():
            x[masked, :, self.eos] = -np.inf
        return x

    def step(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Process and draw one step for every row, and record the codes in the history.

        Args:
            logits: ``float32[B, 4, V]``.

        Returns:
            ``(codes, finished)``: ``int64[B, 4]`` (a work buffer, valid until the next call)
            and ``bool[B]``, True where any codebook drew EOS.
        """
        x = self.process(logits)
        codes = self._codes
        if self._greedy.all():
            np.argmax(x, axis=2, out=codes)
        else:
            probs = softmax_rows(x.reshape(-1, self.vocab), self._probs)
            np.cumsum(probs, axis=1, out=probs)
            for b in range(self.batch):
                self._rngs[b].random(out=self._u[b])
            ut = (self._u.reshape(-1, 1) * probs[:, -1:]).astype(np.float32)
            # first index whose cumulative mass exceeds u: never a zero-probability code
            codes.reshape(-1)[:] = np.minimum((probs <= ut).sum(axis=1), self.vocab - 1)
            if self._greedy.any():
                g = self._greedy
                codes[g] = np.argmax(x[g], axis=2)
        self._push(codes)
        return codes, (codes == self.eos).any(axis=1)

    def _push(self, codes: np.ndarray) -> None:
        """Append ``codes [B, 4]`` to each row's penalty window (ring buffer + counts)."""
        slot = self.steps % self.window
        rows = np.arange(self.batch)[:, None]
        qs = self._rows_q[None, :]
        full = (self.steps >= self.window)[:, None]
        old = self._hist[rows, qs, slot[:, None]]
        np.subtract.at(self._counts, (rows, qs, old), full.astype(np.float32))
        self._hist[rows, qs, slot[:, None]] = codes
        np.add.at(self._counts, (rows, qs, codes), 1.0)
        self.steps += 1
