"""The base of the host runners (ONNX Runtime, torch on CPU): the Runner contract over four
network passes, with the numpy sampler and every per-slot buffer in host memory.

A backend implements only the passes (numpy in, numpy out; D = hidden, Q = 4, V = 626):

* ``forward_prefill(slot, ids [T], spk [D] | None) -> (logits [Q, V], hidden [D])`` of the last
  prompt position, KV positions 0..T-1 of ``slot`` written;
* ``forward_decode(slots [B], codes [B, Q], pos [B]) -> (logits [B, Q, V], hidden [B, D])``, the
  codes embedded and written at ``pos`` of each row's slot;
* ``forward_decoder_stream(hidden [T, D], pos0, cache, reach) -> (mel [100, reach + 2T], cache)`` and
  ``forward_vocos_stream(mel [100, F], pos0, n_final, cache) -> (real, imag [rf + F, 513], cache)``:
  the stateful vocoder passes of :mod:`appliance.model.stream` (``cache`` is the backend's own
  object, None at a sentence's start; this base keeps it per slot);
* optionally (``info.text_mode``) ``forward_prefill_text(slot, ids) -> logits [N]`` and
  ``forward_decode_text(slot, token, pos) -> logits [N]`` for refine-text.

This base keeps per slot: the next position, the codes drawn last, the count of codes drawn, the
hidden states ``[max_seq_len, D]`` and the mel frames ``[100, 2 * max_seq_len]`` of the sentence,
the Decoder's and Vocos' caches with how far each has consumed final frames, and drives one :class:`~appliance.engines.sampling.Sampler` (the counter-based stream of
:mod:`appliance.engines.rng`). Buffers are allocated once, in :meth:`HostRunner.setup_host`.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from ..core import SamplingParams
from ..errors import CapacityError, ConfigError
from .runner import Runner, VocodeWindow
from .sampling import Sampler
from .vocoder_state import VocoderCursor


class HostRunner(Runner):
    """Runner contract for backends whose outputs are host (numpy) arrays (see module doc)."""

    # ------------------------------------------------------------------ the backend's passes
    @abc.abstractmethod
    def forward_prefill(self, slot: int, ids: np.ndarray, spk_emb: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Prompt into ``slot``; ``(logits float32 [Q, V], hidden float32 [D])`` of its last position."""

    @abc.abstractmethod
    def forward_decode(self, slots: np.ndarray, codes: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One step for rows ``slots [B]``: ``(logits float32 [B, Q, V], hidden float32 [B, D])``."""

    @abc.abstractmethod
    def forward_decoder_stream(self, hidden: np.ndarray, pos0: int, cache: Any,
                               reach: int | None = None) -> tuple[np.ndarray, Any]:
        """Stateful Decoder pass (:func:`appliance.model.stream.decoder_stream`): new hidden
        states float32 ``[T, D]`` (T >= 1) after ``pos0 / 2`` earlier ones -> (mel float32
        ``[100, R + 2T]`` covering frames ``[pos0 - R, pos0 + 2T)``, the new cache); ``cache``
        None starts a sentence; ``reach`` (``1..rf``; None: ``rf``, exact) = ``R``, the
        provisional frames recomputed per layer, the same for every pass of a sentence."""

    @abc.abstractmethod
    def forward_vocos_stream(self, mel: np.ndarray, pos0: int, n_final: int, cache: Any) -> tuple[np.ndarray, np.ndarray, Any]:
        """Stateful Vocos pass (:func:`appliance.model.stream.vocos_stream`): mel float32
        ``[100, F]`` (frames ``[pos0, pos0 + F)``, the first ``n_final`` final) -> (real, imag
        float32 ``[rf + F, 513]`` covering spectrum frames ``[pos0 - rf, pos0 + F)``, the new cache)."""

    def forward_decoder(self, hidden: np.ndarray) -> np.ndarray:
        """One-shot Decoder: hidden states float32 ``[T, D]`` -> mel float32 ``[100, 2T]``."""
        mel, _ = self.forward_decoder_stream(hidden, 0, None)
        return mel[:, self.info.decoder_rf:]

    def forward_vocos(self, mel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One-shot Vocos: mel float32 ``[100, F]`` -> ``(real, imag)`` float32 ``[F, 513]``."""
        re, im, _ = self.forward_vocos_stream(mel, 0, mel.shape[1], None)
        rf = self.info.vocos_rf
        return re[rf:], im[rf:]

    def forward_prefill_text(self, slot: int, ids: np.ndarray) -> np.ndarray:
        """Text-mode prefill -> text logits float32 ``[N]`` (only where ``info.text_mode``)."""
        raise NotImplementedError

    def forward_decode_text(self, slot: int, token: int, pos: int) -> np.ndarray:
        """Text-mode step -> text logits float32 ``[N]`` (only where ``info.text_mode``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ buffers
    def setup_host(self, n_mels: int = 100, n_fft: int = 1024) -> None:
        """Allocate the per-slot state and the sampler (call at the end of ``__init__``)."""
        info = self.info
        S, L, D, Q, V = info.max_batch, info.max_seq_len, info.hidden_size, info.num_vq, info.num_audio_tokens
        self._sampler = Sampler(S, num_vq=Q, num_tokens=V)
        self._pos = np.zeros(S, np.int64)          # next KV position
        self._drawn = np.zeros(S, np.int64)        # codes drawn since start (= next hidden index)
        self._codes = np.zeros((S, Q), np.int64)   # codes drawn last (the next step's input)
        self._logits0 = np.zeros((S, Q, V), np.float32)
        self._hid = np.zeros((S, L, D), np.float32)
        self._mel = np.zeros((S, n_mels, 2 * L), np.float32)
        self._out = np.zeros((max(16, info.step_chunk), S, Q), np.int64)  # the step ring
        self._cursor = VocoderCursor(S, info.decoder_rf, info.vocos_rf)
        self._text_sampler: Sampler | None = None
        self._no_spec = np.zeros((0, n_fft // 2 + 1), np.float32)

    # ------------------------------------------------------------------ Runner
    def prefill(self, slot: int, ids: np.ndarray, spk_emb: np.ndarray | None) -> None:
        slot = self.check_slot(slot)
        ids = self.check_prompt(ids, spk_emb)
        logits, hidden = self.forward_prefill(slot, ids, spk_emb)
        self._logits0[slot] = logits
        self._hid[slot, 0] = hidden
        self._pos[slot] = ids.shape[0]
        self._drawn[slot] = 0
        self._cursor.reset(slot)

    def start(self, slot: int, params: SamplingParams, seed: int) -> np.ndarray:
        slot = self.check_slot(slot)
        s = self._sampler
        s.start(slot, params, seed)
        codes = s.sample(np.array([slot]), self._logits0[slot][None], np.zeros(1, np.int64))[0]
        s.record(slot, codes)
        self._codes[slot] = codes
        self._drawn[slot] = 1
        return codes.copy()

    def step(self, slots: np.ndarray, k: int) -> np.ndarray:
        slots = self.check_slots(slots)
        top = int(self._pos[slots].max())
        if top >= self.info.max_seq_len:
            raise CapacityError(f"position {top} reaches the KV-cache length model.max_seq_len "
                                f"{self.info.max_seq_len}: the sentence is too long, split it or raise max_seq_len")
        k = max(1, min(int(k), self._out.shape[0], self.info.max_seq_len - top))
        out = self._out[:k, :slots.shape[0]]
        s = self._sampler
        for j in range(k):
            logits, hidden = self.forward_decode(slots, self._codes[slots], self._pos[slots])
            n = self._drawn[slots]
            self._hid[slots, np.minimum(n, self.info.max_seq_len - 1)] = hidden
            codes = s.sample(slots, logits, n)
            for i, sl in enumerate(slots):
                s.record(int(sl), codes[i])
            self._codes[slots] = codes
            self._pos[slots] += 1
            self._drawn[slots] += 1
            out[j] = codes
        return out

    def vocode(self, slot: int, w: VocodeWindow) -> tuple[np.ndarray, np.ndarray]:
        """See :meth:`Runner.vocode`: one stateful pass of each network, planned by
        :class:`~appliance.engines.vocoder_state.VocoderCursor` (``h0`` / ``v0`` unused). The
        Decoder's mel frames, final and provisional, are stored; Vocos reads them."""
        slot = self.check_slot(slot)
        self.check_window(slot, w)
        d = self._cursor.decoder(slot, w)
        if d is not None:
            cur = self._cursor
            mel, cur.dec_cache[slot] = self.forward_decoder_stream(self._hid[slot, d.n0:d.n1], 2 * d.n0, cur.dec_cache[slot],
                                                                   d.reach)
            a = max(0, d.first)
            self._mel[slot, :, a:2 * d.n1] = mel[:, a - d.first:]
        v = self._cursor.vocos(slot, w)
        if v is None:
            return self._no_spec, self._no_spec
        cur = self._cursor
        re, im, cur.voc_cache[slot] = self.forward_vocos_stream(self._mel[slot, :, v.v0:v.v1], v.v0, v.n_final, cur.voc_cache[slot])
        return re[v.lo:v.hi], im[v.lo:v.hi]

    def hidden(self, slot: int, t0: int, t1: int) -> np.ndarray:
        return self._hid[self.check_slot(slot), t0:t1].copy()

    def refine(self, slot: int, ids: np.ndarray, params: SamplingParams, seed: int, eos_id: int) -> np.ndarray:
        """See :meth:`Runner.refine`. The draws use the same sampler and random stream as audio
        codes (one codebook over the text vocabulary, no repetition penalty unless ``params`` set one)."""
        if not self.info.text_mode:
            raise ConfigError(f"refine-text needs a backend with a text mode (torch on CPU); {self.info.backend} "
                              f"has none: set synthesis.refine_text to false")
        slot = self.check_slot(slot)
        ids = np.asarray(ids, np.int64).reshape(-1)
        if not 0 < ids.shape[0] < self.info.max_seq_len:
            raise CapacityError(f"text prompt of {ids.shape[0]} tokens: must be 1..{self.info.max_seq_len - 1}")
        logits = self.forward_prefill_text(slot, ids)
        if self._text_sampler is None:
            self._text_sampler = Sampler(1, num_vq=1, num_tokens=logits.shape[0], eos=eos_id)
        ts = self._text_sampler
        ts.start(0, params, seed)
        out = np.zeros(params.max_new_tokens, np.int64)
        pos = ids.shape[0]
        zero = np.zeros(1, np.int64)
        for i in range(params.max_new_tokens):
            tok = int(ts.sample(zero, logits.reshape(1, 1, -1), np.array([i]))[0, 0])
            ts.record(0, np.array([tok]))
            if tok == eos_id:
                return out[:i].copy()
            out[i] = tok
            if pos + 1 >= self.info.max_seq_len:
                return out[:i + 1].copy()
            logits = self.forward_decode_text(slot, tok, pos)
            pos += 1
        return out.copy()
