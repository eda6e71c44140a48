"""The decode loop: sentences join and leave one batched stream of decode steps over a runner.

Upstream: ``ChatTTS/model/gpt.py`` ``GPT.generate`` (0.2.5). Code ``n`` of a sentence is drawn
from the GPT output at the previous position (code 0 from the prompt's last position); if any
codebook draws EOS (625) the sentence ends there, otherwise the hidden state that code ``n`` was
drawn from is the Decoder's input ``n``. The runner keeps those hidden states and does the
sampling (:mod:`appliance.engines.runner`); this loop only decides who runs and when.

:class:`DecodeLoop` keeps up to ``runner.info.max_batch`` sentences in KV-cache slots. One
:meth:`DecodeLoop.step` hands out one step of codes to every active sentence. The runner is
asked for ``info.step_chunk`` steps at a time (1 on a host, several on a device: one host sync
per chunk); a sentence that joins meanwhile starts with the next chunk (at most ``chunk - 1``
steps later), and codes after a row's EOS are dropped. A sentence that ended keeps its slot
(the vocoder still reads its hidden states) until :meth:`DecodeLoop.release`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..core import AUDIO_EOS, NUM_VQ, SamplingParams
from ..engines.runner import Runner
from ..errors import BusyError, CapacityError


@dataclass(eq=False)
class Sequence:
    """One sentence being decoded.

    Attributes:
        ids: int64 ``[T]`` prompt token ids (``[Stts][spk_emb]...[Ptts]``).
        spk_emb: float32 ``[D]`` speaker vector or None.
        params: sampling parameters (temperature, top-P/K, repetition penalty, min/max tokens).
        seed: sampling seed (reproducible output).
        slot: KV-cache slot while it holds one, else -1.
        steps: codes kept so far (EOS excluded) = hidden states the vocoder may read.
        finished: True once EOS was drawn or ``max_new_tokens`` reached.
        reason: ``eos``, ``max_tokens`` or ``left`` (removed before the end).
        codes: int64 ``[Q]`` the codes kept last.
        trace: a list that receives a copy of every kept ``codes`` (int64 ``[Q]``), or None (the
            default: nothing kept). The health check and its reference (:mod:`appliance.synth.reference`)
            digest a job's codes this way.
    """

    ids: np.ndarray
    spk_emb: Optional[np.ndarray]
    params: SamplingParams
    seed: int
    slot: int = -1
    steps: int = 0
    finished: bool = False
    reason: str = ""
    codes: np.ndarray = field(default_factory=lambda: np.zeros(NUM_VQ, np.int64))
    trace: Optional[list] = None


class DecodeLoop:
    """Batched prefill/decode over a runner's KV slots (see module docstring).

    Args:
        runner: the backend.
        max_batch: slots used (default: all of the runner's).

    The caller drives it: :meth:`join` a sentence, then :meth:`step` repeatedly; each step
    returns the sentences that kept a code. A finished sentence leaves the batch at once and
    gives its slot back at :meth:`release`.
    """

    def __init__(self, runner: Runner, max_batch: int | None = None):
        info = runner.info
        self.runner = runner
        self.max_batch = min(max_batch or info.max_batch, info.max_batch)
        self.max_seq_len = info.max_seq_len
        self.chunk = max(1, info.step_chunk)
        self.active: list[Sequence] = []
        self._free = list(range(self.max_batch - 1, -1, -1))
        self._slots = np.zeros(self.max_batch, np.int64)
        self._chunk: Optional[tuple[list[Sequence], np.ndarray, int]] = None  # (seqs, codes [k, b, Q], next step)

    @property
    def free_slots(self) -> int:
        """Slots available for :meth:`join`."""
        return len(self._free)

    def join(self, seq: Sequence) -> bool:
        """Prefill ``seq`` into a free slot and draw its first codes.

        Returns:
            True when code 0 is kept (``seq.steps == 1``); False when it is already EOS (the
            sentence is then finished with ``steps == 0``; its slot is held until :meth:`release`).

        Raises:
            BusyError: no free slot.
            CapacityError: prompt longer than the runner accepts.
        """
        if not self._free:
            raise BusyError(f"all {self.max_batch} decode slots are busy")
        if len(seq.ids) + 1 >= self.max_seq_len:
            raise CapacityError(f"prompt of {len(seq.ids)} tokens does not fit the KV cache of {self.max_seq_len}")
        slot = self._free.pop()
        try:   # whatever fails before the sentence is active gives its slot back
            self.runner.prefill(slot, seq.ids, seq.spk_emb)
            codes = self.runner.start(slot, seq.params, seq.seed)
        except BaseException:
            self._free.append(slot)
            raise
        seq.slot, seq.steps, seq.finished = slot, 0, False
        self.active.append(seq)
        return self._accept(seq, codes)

    def step(self, due: Optional[int] = None) -> list[Sequence]:
        """One step for every active sentence; returns those that kept a code (in batch order).

        ``due``: steps until some caller needs audio (the next chunk of a task): a new runner chunk
        then runs no further, so the first audio does not wait for a whole ``step_chunk``.
        Sentences that drew EOS or reached ``max_new_tokens`` are finished and have left the batch.
        """
        if not self.active:
            return []
        if self._chunk is not None and not any(s in self.active for s in self._chunk[0]):
            self._chunk = None  # every row of the chunk has ended: start a new one with the joiners
        if self._chunk is None:
            seqs = list(self.active)
            b = len(seqs)
            for i, s in enumerate(seqs):
                self._slots[i] = s.slot
            left = max(s.params.max_new_tokens - s.steps for s in seqs)
            codes = self.runner.step(self._slots[:b], max(1, min(self.chunk, left, due or self.chunk)))
            self._chunk = (seqs, codes, 0)
        seqs, codes, j = self._chunk
        self._chunk = None if j + 1 >= codes.shape[0] else (seqs, codes, j + 1)
        produced: list[Sequence] = []
        for i, s in enumerate(seqs):
            if s.finished or s not in self.active:
                continue
            if self._accept(s, codes[j, i]):
                produced.append(s)
        return produced

    def refine(self, ids: np.ndarray, *, eos_id: int, seed: int, params: SamplingParams) -> np.ndarray:
        """Upstream's refine-text pass in a free slot (left free): see :meth:`Runner.refine`.

        Raises:
            BusyError: no free slot. ConfigError: the runner has no text mode.
        """
        if not self._free:
            raise BusyError(f"all {self.max_batch} decode slots are busy")
        return self.runner.refine(self._free[-1], ids, params, seed, eos_id)

    def leave(self, seq: Sequence, reason: str = "left") -> None:
        """Remove ``seq`` before its end (cancel) and free its slot."""
        if seq in self.active:
            self._finish(seq, reason)
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        """Give the slot of a finished (or left) sentence back for the next join."""
        if seq.slot >= 0 and seq not in self.active:
            self.runner.release(seq.slot)
            self._free.append(seq.slot)
            seq.slot = -1

    # ------------------------------------------------------------------ internals

    def _accept(self, seq: Sequence, codes: np.ndarray) -> bool:
        """Record drawn codes; finish on EOS / length. True if the code is kept."""
        if (codes == AUDIO_EOS).any():
            self._finish(seq, "eos")
            return False
        seq.codes[:] = codes
        if seq.trace is not None:
            seq.trace.append(seq.codes.copy())
        seq.steps += 1
        if seq.steps >= seq.params.max_new_tokens or len(seq.ids) + seq.steps >= self.max_seq_len:
            self._finish(seq, "max_tokens")
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finished, seq.reason = True, reason
        self.active.remove(seq)
