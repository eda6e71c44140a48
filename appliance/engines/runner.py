"""The one interface every inference backend implements.

A :class:`Runner` owns the model's weights on its device, a static KV cache of
``max_batch`` slots x ``max_seq_len`` positions allocated once at load, and its own
pre-allocated I/O buffers. Everything crossing this boundary is numpy (host) data, so the
pipeline, the scheduler and the service layer never import torch. Backends:

* ``torch``        – :mod:`appliance.engines.torch_runner` (our PyTorch model, CPU or CUDA)
* ``onnxruntime``  – :mod:`appliance.engines.onnx_runner` (CPU default, no torch)
* ``tensorrt``     – :mod:`appliance.engines.tensorrt_runner` (Jetson / RTX plans)

The backend is chosen once at load by :func:`appliance.engines.select.open_runner`.

Shapes (D = hidden size, 768 full; V = 626 audio tokens; Q = 4 codebooks):

* ``prefill(slot, ids, spk_emb)``: ``ids`` int64 ``[T]`` text token ids of the prompt,
  ``spk_emb`` float32 ``[D]`` or None. Writes KV positions ``0..T-1`` of ``slot``.
  Returns ``(logits float32 [Q, V], hidden float32 [D])`` of the last prompt position.
* ``decode(slots, codes, pos)``: ``slots`` int64 ``[B]``, ``codes`` int64 ``[B, Q]`` the codes
  sampled at the previous step, ``pos`` int64 ``[B]`` the position each code is written at.
  Returns ``(logits [B, Q, V], hidden [B, D])``.
* ``decoder(hidden)``: float32 ``[T, D]`` -> mel float32 ``[100, 2T]`` (log-mel x coef).
* ``vocos(mel)``: float32 ``[100, F]`` -> complex STFT float32 ``(real [F, 513], imag [F, 513])``;
  the inverse STFT runs on the host (:mod:`appliance.synth.istft`).

Returned arrays may be views of the runner's buffers, valid until its next call: copy what you
keep. Errors from the foreign runtime are raised as :class:`~appliance.errors.EngineError`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RunnerInfo:
    """What a runner is and what it can hold.

    Attributes:
        backend: ``torch-cpu``, ``torch-cuda``, ``onnxruntime``, ``tensorrt``.
        precision: ``fp32``, ``fp16``, ``bf16``, ``int8``, ``fp8``.
        hidden_size: D.
        num_vq: Q (4).
        num_audio_tokens: V (626).
        max_batch: KV-cache slots.
        max_seq_len: KV-cache positions per slot.
        max_prompt_tokens: longest prompt one prefill accepts.
        weight_bytes: bytes of weights held by the runner (for the memory budget).
        kv_bytes_per_token: KV-cache bytes per position per slot.
        reason: why this backend was chosen (logged at load).
        decoder_rf: receptive field of the Decoder, in mel frames on each side
            (``2 + 6 * n_layer + 1``: conv_in 2 x k3, n_layer dilated k7 blocks, out_conv k3).
        vocos_rf: receptive field of the Vocos backbone, in mel frames on each side
            (``3 * (1 + num_layers)``: embed k7 and one k7 depthwise conv per block).
    """

    backend: str
    precision: str
    hidden_size: int
    num_vq: int
    num_audio_tokens: int
    max_batch: int
    max_seq_len: int
    max_prompt_tokens: int
    weight_bytes: int
    kv_bytes_per_token: int
    reason: str = ""
    decoder_rf: int = 75
    vocos_rf: int = 27


def receptive_fields(dec_layers: int, voc_layers: int) -> dict[str, int]:
    """``decoder_rf`` / ``vocos_rf`` of :class:`RunnerInfo` (mel frames each side) for a Decoder of
    ``dec_layers`` dilated (2) k7 ConvNeXt blocks between two k3 convs and a k3 out_conv, and a
    Vocos backbone of ``voc_layers`` k7 blocks after a k7 embedding conv."""
    return {"decoder_rf": 2 + 6 * dec_layers + 1, "vocos_rf": 3 * (1 + voc_layers)}


class Runner(abc.ABC):
    """Backend-neutral access to GPT prefill / decode step, Decoder and Vocos (see module doc)."""

    info: RunnerInfo

    @abc.abstractmethod
    def prefill(self, slot: int, ids: np.ndarray, spk_emb: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Prompt -> KV slot; returns (logits [Q, V], hidden [D]) at the last prompt position.

        Raises:
            CapacityError: ``len(ids)`` exceeds ``info.max_prompt_tokens`` or ``slot`` is out of range.
            EngineError: the backend failed.
        """

    @abc.abstractmethod
    def decode(self, slots: np.ndarray, codes: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One decode step for the rows ``slots``; returns (logits [B, Q, V], hidden [B, D]).

        Raises:
            CapacityError: a position reaches ``info.max_seq_len``.
            EngineError: the backend failed.
        """

    @abc.abstractmethod
    def decoder(self, hidden: np.ndarray) -> np.ndarray:
        """GPT hidden states [T, D] -> mel [100, 2T] (float32)."""

    @abc.abstractmethod
    def vocos(self, mel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """mel [100, F] -> complex spectrum (real [F, 513], imag [F, 513]) before the inverse STFT."""

    def check_decode_args(self, slots: np.ndarray, codes: np.ndarray, pos: np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Validate the arguments of :meth:`decode` for every backend (one copy of the rules).

        Returns:
            ``(slots int64 [B], codes int64 [B, Q], pos int64 [B])``.

        Raises:
            CapacityError: B outside 1..max_batch, slots not distinct or out of range, a position
                at or past ``max_seq_len`` (the sentence is too long).
            EngineError: wrong shapes, or a code outside the audio vocabulary.
        """
        from ..errors import CapacityError, EngineError

        info = self.info
        slots = np.asarray(slots, np.int64).reshape(-1)
        pos = np.asarray(pos, np.int64).reshape(-1)
        codes = np.asarray(codes, np.int64)
        b = slots.shape[0]
        if not 1 <= b <= info.max_batch:
            raise CapacityError(f"decode batch of {b} rows: must be 1..{info.max_batch} (model.max_batch)")
        if codes.shape != (b, info.num_vq) or pos.shape != (b,):
            raise EngineError(f"decode shapes: slots [{b}], codes {list(codes.shape)}, pos {list(pos.shape)}; "
                              f"expected codes [{b}, {info.num_vq}] and pos [{b}]")
        if slots.min() < 0 or slots.max() >= info.max_batch or len(set(slots.tolist())) != b:
            raise CapacityError(f"decode slots {slots.tolist()} must be distinct and in 0..{info.max_batch - 1}")
        if pos.min() < 0 or pos.max() >= info.max_seq_len:
            raise CapacityError(f"position {int(pos.max())} reaches the KV-cache length model.max_seq_len "
                                f"{info.max_seq_len}: the sentence is too long, split it or raise max_seq_len")
        if codes.min() < 0 or codes.max() >= info.num_audio_tokens:
            raise EngineError(f"audio code out of range [0, {info.num_audio_tokens}): {codes.tolist()}")
        return slots, codes, pos

    def close(self) -> None:
        """Release device memory. Idempotent."""
