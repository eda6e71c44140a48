"""The decode loop: prefill, batched decode steps, sampling, join and leave.

Upstream: ``ChatTTS/model/gpt.py`` ``GPT.generate`` (0.2.5). At step ``i`` the GPT output at the
last position gives a hidden state ``h_i`` and 4 x 626 logits; 4 codes ``c_i`` are sampled; if any
codebook emits EOS (625) the sequence ends and ``h_i`` is dropped, otherwise ``h_i`` is the
hidden state paired with ``c_i`` for the Decoder, and ``c_i`` is embedded (sum of the 4 code
tables) and fed at the next position. Step 0 is the prefill of the prompt.

:class:`DecodeLoop` keeps up to ``runner.info.max_batch`` sequences in KV-cache slots and runs
one batched decode step for all of them: a sequence joins between steps (its prefill runs,
then it decodes with the others) and leaves as soon as it ends, without stalling the rest.
Slot, code and position arrays are allocated once; per step the loop only slices them.

Optional device path (GPU runners, :class:`appliance.engines.cuda_runner.CudaRunner`): when the
runner has ``begin(slot, params, seed) -> codes [Q]`` and ``decode_many(slots, k) -> (codes
[k, b, Q], hidden [k, b, D])``, sampling runs on the device: ``join`` samples the first codes with
``begin`` and ``step`` runs ``k = device_chunk`` steps in one call (one host sync), then hands them
out one step per ``step()`` call. A sequence that joins meanwhile starts with the next chunk (at
most ``k - 1`` steps later); codes after a row's EOS are dropped. Without these methods the loop
behaves exactly as before (host :class:`Sampler`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..core import AUDIO_EOS, NUM_VQ, SamplingParams
from ..engines.runner import Runner
from ..engines.sampling import Sampler
from ..errors import BusyError, CapacityError


@dataclass(eq=False)
class Sequence:
    """One utterance being decoded.

    Attributes:
        ids: int64 ``[T]`` prompt token ids (``[Stts][spk_emb]...[Ptts]``).
        spk_emb: float32 ``[D]`` speaker vector or None.
        params: sampling parameters (temperature, top-P/K, repetition penalty, min/max tokens).
        seed: sampling seed (per request; reproducible output).
        slot: KV-cache slot while active, else -1.
        pos: KV position the next code is written at.
        steps: codes produced so far (EOS excluded).
        finished: True once EOS was sampled or ``max_new_tokens`` reached.
        reason: ``eos``, ``max_tokens`` or ``left`` (removed before the end).
    """

    ids: np.ndarray
    spk_emb: Optional[np.ndarray]
    params: SamplingParams
    seed: int
    slot: int = -1
    pos: int = 0
    steps: int = 0
    finished: bool = False
    reason: str = ""
    codes: np.ndarray = field(default_factory=lambda: np.zeros(NUM_VQ, np.int64))


class DecodeLoop:
    """Batched prefill/decode over a runner's static KV cache (see module docstring).

    Args:
        runner: the backend.
        max_batch: slots used (default: all of the runner's).

    The caller drives it: :meth:`join` a sequence (returns the first hidden, or None if the
    very first code is EOS), then :meth:`step` repeatedly; each step returns the rows that
    produced a code as ``(sequences, hidden [n, D])``. Finished sequences leave automatically.
    """

    def __init__(self, runner: Runner, max_batch: int | None = None, device_chunk: int = 8):
        info = runner.info
        self.runner = runner
        self.max_batch = min(max_batch or info.max_batch, info.max_batch)
        self.max_seq_len = info.max_seq_len
        self.active: list[Sequence] = []
        self._free = list(range(self.max_batch - 1, -1, -1))
        self._slots = np.zeros(self.max_batch, np.int64)
        self._codes = np.zeros((self.max_batch, NUM_VQ), np.int64)
        self._pos = np.zeros(self.max_batch, np.int64)
        self.sampler = Sampler(self.max_batch, num_vq=NUM_VQ, num_tokens=info.num_audio_tokens, eos=AUDIO_EOS)
        # optional device path (see module doc)
        self.device_sampling = callable(getattr(runner, "decode_many", None)) and callable(getattr(runner, "begin", None))
        self.device_chunk = max(1, int(device_chunk))
        self._chunk: Optional[tuple] = None  # (seqs, codes [k, b, Q], hidden [k, b, D], next step index)

    @property
    def free_slots(self) -> int:
        """Slots available for :meth:`join`."""
        return len(self._free)

    def join(self, seq: Sequence) -> Optional[np.ndarray]:
        """Prefill ``seq`` into a free slot and sample its first codes.

        Returns:
            float32 ``[D]`` hidden state paired with the first code, or None when the first
            code is already EOS (the sequence is then finished with ``steps == 0``).

        Raises:
            BusyError: no free slot.
            CapacityError: prompt longer than the runner accepts.
        """
        if not self._free:
            raise BusyError(f"all {self.max_batch} decode slots are busy")
        if len(seq.ids) + 1 >= self.max_seq_len:
            raise CapacityError(f"prompt of {len(seq.ids)} tokens does not fit the KV cache of {self.max_seq_len}")
        slot = self._free.pop()
        try:   # whatever fails before the sequence is active gives its slot back
            logits, hidden = self.runner.prefill(slot, seq.ids, seq.spk_emb)
            if self.device_sampling:
                codes = self.runner.begin(slot, seq.params, seq.seed)
            else:
                self.sampler.start(slot, seq.params, seq.seed)
                codes = self.sampler.sample(np.array([slot]), logits[None], np.array([0]))[0]
        except BaseException:
            self._free.append(slot)
            raise
        seq.slot, seq.pos, seq.steps, seq.finished = slot, len(seq.ids), 0, False
        self.active.append(seq)
        if self._accept(seq, codes):
            return np.array(hidden, np.float32, copy=True)
        return None

    def step(self) -> tuple[list[Sequence], np.ndarray]:
        """One batched decode step for every active sequence.

        Returns:
            ``(seqs, hidden)``: the sequences that produced a code this step (same order as the
            rows of ``hidden``, float32 ``[n, D]``). Sequences that sampled EOS or reached
            ``max_new_tokens`` are finished and have left their slot.
        """
        b = len(self.active)
        if b == 0:
            return [], np.zeros((0, self.runner.info.hidden_size), np.float32)
        if self.device_sampling:
            return self._step_device()
        for i, s in enumerate(self.active):
            self._slots[i] = s.slot
            self._codes[i] = s.codes
            self._pos[i] = s.pos
        logits, hidden = self.runner.decode(self._slots[:b], self._codes[:b], self._pos[:b])
        steps = np.fromiter((s.steps for s in self.active), np.int64, b)
        codes = self.sampler.sample(self._slots[:b], logits, steps)
        produced: list[Sequence] = []
        rows: list[int] = []
        for i, s in enumerate(list(self.active)):
            s.pos += 1
            if self._accept(s, codes[i]):
                produced.append(s)
                rows.append(i)
        return produced, np.array(hidden[rows], np.float32)

    def refine(self, ids: np.ndarray, *, eos_id: int, seed: int, temperature: float = 0.7,
               top_p: float = 0.7, top_k: int = 20, max_new_tokens: int = 384) -> np.ndarray:
        """Upstream's refine-text pass: the GPT in text mode rewrites a sentence, adding
        ``[uv_break]`` / ``[laugh]`` / ``[lbreak]`` (``ChatTTS/core.py`` ``_refine_text``, defaults
        of ``RefineTextParams``: temperature 0.7, top-P 0.7, top-K 20, no repetition penalty,
        at most 384 tokens, EOS ``[Ebreak]``).

        Args:
            ids: int64 ``[T]`` text-mode prompt (``[Sbreak]{text}[Pbreak]{prompt}``).
            eos_id: id of ``[Ebreak]``. seed: sampling seed (numpy PCG64).

        Returns:
            int64 ``[N]`` generated text ids, EOS excluded. Runs in a free KV slot, which is
            left free (the next join overwrites it); blocks the batch for up to
            ``max_new_tokens`` steps, which is why refine-text is off by default.

        Raises:
            BusyError: no free slot. ConfigError: the runner has no text mode.
        """
        from ..engines.sampling import apply_top_p_top_k
        from ..errors import ConfigError

        if not getattr(self.runner, "supports_text_mode", False):
            raise ConfigError(f"refine-text needs a backend with a text mode (torch on CPU); "
                              f"{self.runner.info.backend} has none: set synthesis.refine_text to false")
        if not self._free:
            raise BusyError(f"all {self.max_batch} decode slots are busy")
        slot = self._free[-1]
        rng = np.random.default_rng(seed)
        logits = self.runner.prefill_text(slot, ids)
        v = logits.shape[0]
        one_minus_p = np.full((1, 1), np.float32(1.0 - top_p), np.float32)
        k_index = np.full((1, 1), max(0, v - max(top_k, 3)), np.int64)
        srt = np.empty((1, v), np.float32)
        probs = np.empty((1, v), np.float32)
        out = np.zeros(max_new_tokens, np.int64)
        pos = len(ids)
        for i in range(max_new_tokens):
            x = (logits / np.float32(temperature)).astype(np.float32).reshape(1, v)
            apply_top_p_top_k(x, one_minus_p, k_index, srt, probs)
            p = np.exp(x - x.max())
            p /= p.sum()
            tok = int(rng.choice(v, p=p[0].astype(np.float64) / p[0].sum(dtype=np.float64)))
            if tok == eos_id:
                return out[:i].copy()
            out[i] = tok
            if pos + 1 >= self.max_seq_len:
                return out[:i + 1].copy()
            logits = self.runner.decode_text(slot, tok, pos)
            pos += 1
        return out.copy()

    def leave(self, seq: Sequence, reason: str = "left") -> None:
        """Remove ``seq`` before its end (cancel); its slot is free for the next join."""
        if seq in self.active:
            self._finish(seq, reason)

    # ------------------------------------------------------------------ internals

    def _step_device(self) -> tuple[list[Sequence], np.ndarray]:
        """One step from the current device chunk (running ``decode_many`` when it is used up)."""
        if self._chunk is not None and not any(s in self.active for s in self._chunk[0]):
            self._chunk = None  # every row of the chunk has ended: start a new one with the joiners
        if self._chunk is None:
            seqs = list(self.active)
            slots = np.fromiter((s.slot for s in seqs), np.int64, len(seqs))
            left = max(s.params.max_new_tokens - s.steps for s in seqs)
            codes, hidden = self.runner.decode_many(slots, max(1, min(self.device_chunk, left)))
            self._chunk = (seqs, np.array(codes), np.array(hidden, np.float32), 0)
        seqs, codes, hidden, j = self._chunk
        self._chunk = None if j + 1 >= codes.shape[0] else (seqs, codes, hidden, j + 1)
        produced: list[Sequence] = []
        rows: list[int] = []
        for i, s in enumerate(seqs):
            if s.finished or s not in self.active:
                continue
            s.pos += 1
            if self._accept(s, codes[j, i]):
                produced.append(s)
                rows.append(i)
        return produced, np.array(hidden[j, rows], np.float32)

    def _accept(self, seq: Sequence, codes: np.ndarray) -> bool:
        """Record sampled codes; finish on EOS / length. True if the code is kept."""
        if (codes == AUDIO_EOS).any():
            self._finish(seq, "eos")
            return False
        seq.codes[:] = codes
        seq.steps += 1
        if not self.device_sampling:
            self.sampler.record(seq.slot, codes)
        if seq.steps >= seq.params.max_new_tokens or seq.pos + 1 >= self.max_seq_len:
            self._finish(seq, "max_tokens")
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finished, seq.reason = True, reason
        self.active.remove(seq)
        self._free.append(seq.slot)
        seq.slot = -1
