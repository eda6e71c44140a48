"""Per-slot bookkeeping of the stateful vocoder passes (:mod:`appliance.model.stream`).

A runner keeps, per KV slot, a cursor: the Decoder's and Vocos' convolution caches (the backend's
own objects: numpy arrays, torch tensors), how many hidden states the Decoder has consumed and how
many *final* mel frames Vocos has consumed. :meth:`VocoderCursor.decoder` and
:meth:`VocoderCursor.vocos` turn a :class:`~appliance.engines.runner.VocodeWindow` into the one
pass each network needs:

* Decoder: the hidden states ``[n0, h1)`` after those consumed; it returns mel frames
  ``[2 n0 - R, 2 h1)``, of which those ``< 2 h1 - R`` are final (frozen), ``R`` = the window's
  ``reach`` (``rf_dec`` when exact: see :class:`~appliance.engines.runner.VocodeWindow`);
* Vocos: the stored mel frames ``[v0, v1)`` after the final ones consumed, the first ``n_final``
  of them final (mel frames the Decoder will not change); it returns spectrum frames
  ``[v0 - rf_voc, v1)``.

A window that reaches behind a cache (a one-shot window over a sentence already streamed, a
test's arbitrary window) restarts that cache from the sentence's start: always correct, costly
only for such windows. The streaming planner (:class:`appliance.synth.vocoder.WindowedVocoder`)
never does.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .runner import VocodeWindow


class DecoderPass(NamedTuple):
    """Feed hidden states ``[n0, n1)``; ``fresh``: the caches are empty (None). The output's first
    mel frame is ``first = 2 n0 - reach`` (negative at a sentence's start: drop those); ``reach``:
    the pass's :attr:`VocodeWindow.reach <appliance.engines.runner.VocodeWindow.reach>`, resolved
    (``1 <= reach <= rf_dec``; ``rf_dec``: exact)."""

    n0: int
    n1: int
    fresh: bool
    first: int
    reach: int


class VocosPass(NamedTuple):
    """Feed stored mel frames ``[v0, v1)`` of which ``n_final`` are final; ``fresh``: empty caches (None).
    Take spectrum frames ``[lo, hi)`` of the output."""

    v0: int
    v1: int
    n_final: int
    fresh: bool
    lo: int
    hi: int


class VocoderCursor:
    """Per slot: the caches (``dec_cache[slot]``, ``voc_cache[slot]``: None = empty), hidden
    states the Decoder consumed, final mel frames Vocos consumed.

    Args:
        slots: KV slots of the runner. rf_dec, rf_voc: receptive fields in mel frames
            (``RunnerInfo.decoder_rf``, ``vocos_rf``).
    """

    def __init__(self, slots: int, rf_dec: int, rf_voc: int):
        self.rf_dec, self.rf_voc = rf_dec, rf_voc
        self.dec_n = np.zeros(slots, np.int64)
        self.voc_n = np.zeros(slots, np.int64)
        self.reach = np.full(slots, rf_dec, np.int64)   # of the Decoder's caches
        self.dec_cache: list[Any] = [None] * slots
        self.voc_cache: list[Any] = [None] * slots

    def reset(self, slot: int) -> None:
        """A new sentence in ``slot`` (the runner drops both caches)."""
        self.dec_n[slot] = self.voc_n[slot] = 0
        self.dec_cache[slot] = self.voc_cache[slot] = None

    def resolve(self, reach: int) -> int:
        """A window's ``reach`` in mel frames, ``1..rf_dec`` (0 or more than ``rf_dec``: ``rf_dec``, exact)."""
        return self.rf_dec if reach <= 0 else min(int(reach), self.rf_dec)

    def decoder(self, slot: int, w: VocodeWindow) -> DecoderPass | None:
        """The Decoder pass for ``w`` (None: nothing new to decode). Advances the cursor; a
        ``fresh`` pass also restarts Vocos (its caches were made from the old mel frames), and so
        does a window whose reach differs from the caches' (they froze other frames)."""
        if w.h1 <= w.h0:
            return None
        n0, reach = int(self.dec_n[slot]), self.resolve(w.reach)
        fresh = n0 == 0 or w.h1 < n0 or reach != self.reach[slot] or w.m0 < max(0, 2 * n0 - reach)
        if fresh:
            n0 = 0
            self.reset(slot)
            self.reach[slot] = reach
        if w.h1 == n0:
            return None
        self.dec_n[slot] = w.h1
        return DecoderPass(n0, w.h1, fresh, 2 * n0 - reach, reach)

    def vocos(self, slot: int, w: VocodeWindow) -> VocosPass | None:
        """The Vocos pass for ``w`` (None when ``w`` asks for no spectrum). Advances the cursor."""
        if w.s1 == w.s0:
            return None
        v0 = int(self.voc_n[slot])
        fresh = v0 == 0 or w.v1 <= v0 or w.s0 < v0 - self.rf_voc
        if fresh:
            v0 = 0
            self.voc_cache[slot] = None
        final = max(0, 2 * int(self.dec_n[slot]) - int(self.reach[slot]))  # mel frames no later pass changes
        nf = max(0, min(final, w.v1) - v0)
        self.voc_n[slot] = v0 + nf
        first = v0 - self.rf_voc
        return VocosPass(v0, w.v1, nf, fresh, w.s0 - first, w.s1 - first)
