"""Output guard: no NaN or Inf sample ever leaves the synthesis engine.

Corrupted or broken weights (a flipped bit in a safetensors file, an fp16 overflow in a backend)
do not raise: every tensor op happily computes NaN, and a WAV writer turns NaN into silence
while a sound device gets NaN. :func:`check_pcm` is called by
:class:`~appliance.synth.batch.BatchEngine` on every PCM chunk before the task's sink sees it;
a non-finite chunk fails the task with :class:`~appliance.errors.EngineError` (code
``engine_error``), so the request ends with an error, never ``done``, and its audio is dropped.

The message names the stage: when the task's sentence still holds its KV slot, its stored GPT
hidden states are read back (:meth:`Runner.hidden`, only on this failure path) to tell a broken
GPT (non-finite hidden states, hence logits) from a broken Decoder/Vocos.

Cost on the hot path: one float64 sum per chunk (NaN and Inf propagate through a sum; finite
float32 samples cannot overflow a float64 accumulator), no temporary arrays.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from ..errors import EngineError


def finite(x: np.ndarray) -> bool:
    """True when every element of ``x`` is finite (an empty array is)."""
    return not x.size or math.isfinite(float(np.sum(x, dtype=np.float64)))


def _stage(runner: Any, seq: Any) -> str:
    """Which stage produced the non-finite values (best effort; see the module docstring)."""
    slot, steps = getattr(seq, "slot", -1), getattr(seq, "steps", 0)
    if runner is None or slot is None or slot < 0 or steps <= 0:
        return "the vocoder output (PCM)"
    try:
        h = runner.hidden(slot, 0, steps)
    except Exception:  # noqa: BLE001 - diagnosis only; the error is raised either way
        return "the vocoder output (PCM)"
    if not finite(np.asarray(h)):
        return "the GPT (its hidden states, hence its logits)"
    return "the Decoder/Vocos (the GPT hidden states are finite)"


def check_pcm(pcm: np.ndarray, request_id: str, runner: Any = None, seq: Optional[Any] = None) -> None:
    """Refuse a PCM chunk holding NaN or Inf.

    Args:
        pcm: float32 ``[n]`` samples about to be handed to the request's sink.
        request_id: for the message.
        runner, seq: the engine's runner and the task's current :class:`Sequence` (or None),
            used only to name the failing stage.

    Raises:
        EngineError: ``pcm`` holds a non-finite sample (message: how many, which stage, what to do).
    """
    if finite(pcm):
        return
    bad = int(np.count_nonzero(~np.isfinite(pcm)))
    raise EngineError(
        f"request {request_id}: {bad} of {pcm.size} samples of an audio chunk are NaN/Inf, produced by "
        f"{_stage(runner, seq)}; nothing of it was played. The weights or the backend are broken: run "
        f"'chattts-appliance health', check the checkpoint (safety.verify_checkpoint) and the engines")
