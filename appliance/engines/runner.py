"""The Runner contract: the one interface every inference backend implements.

A runner owns, on its device, the model's weights, a static KV cache of ``max_batch`` slots x
``max_seq_len`` positions, the sampler state of every slot, and per slot the GPT hidden states
of the sentence being spoken and the mel frames made from them. All of it is allocated once at
load. The synthesis layer drives it with small host values (slot numbers, token counts, window
bounds) and gets back only what leaves the device anyway: sampled codes and the spectrum of a
finished vocoder window. Backends (chosen once at load, :func:`appliance.engines.select.open_runner`):

* ``onnxruntime`` – :class:`~appliance.engines.onnx.runner.OnnxRunner` (no torch, no compiler)
* ``llama``       – :class:`~appliance.engines.llama.runner.LlamaRunner` (CPU default: the GPT on
  llama.cpp from a GGUF, on the GPU with a CUDA build; the vocoder on ONNX Runtime)
* ``torch-cpu``   – :class:`~appliance.engines.torch.cpu_runner.TorchRunner`
* ``torch-cuda``  – :class:`~appliance.engines.torch.cuda_runner.CudaRunner` (captured graphs)
* ``tensorrt``    – :class:`~appliance.engines.tensorrt.runner.TensorRTRunner` (Jetson/RTX plans)

The first three are *host runners* (:class:`~appliance.engines.host_runner.HostRunner`: one base
drives the numpy sampler over the backend's logits); the last two sample on the device
(:mod:`appliance.engines.torch.sampler`). Both draw from the same counter-based random stream
(:mod:`appliance.engines.rng`), so a seed gives the same codes on every backend up to rounding
at near-ties.

One sentence in one slot (D = hidden size, Q = 4 codebooks, V = 626 codes per codebook)::

    prefill(slot, ids, spk)     prompt int64 [T] (+ speaker float32 [D]) -> KV positions 0..T-1,
                                hidden state 0 and the logits of the first draw stay in the runner
    start(slot, params, seed)   configure the slot's sampler, draw code 0 -> int64 [Q]
    step(slots, k)              k decode steps for the rows ``slots [B]``: each embeds the row's
                                last codes, runs the GPT, stores hidden state n and draws code n
                                -> int64 [k, B, Q] (rows keep going after an EOS: drop the rest)
    vocode(slot, window)        Decoder over stored hidden states, Vocos over stored mel frames
                                -> complex spectrum float32 (real [F, 513], imag [F, 513])

Hidden state ``n`` is the GPT output that code ``n`` was drawn from (0 = the prefill's last
position), as upstream pairs them; the inverse STFT of the spectrum runs on the host
(:mod:`appliance.synth.istft`). Returned arrays may be views of the runner's buffers, valid until
its next call. Errors of the foreign runtime are raised as :class:`~appliance.errors.EngineError`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..core import SamplingParams
from ..errors import CapacityError, EngineError


NETWORKS = ("gpt", "decoder", "vocos")
"""The three networks a runner runs (the GPT, the Decoder, Vocos)."""


@dataclass(frozen=True)
class RunnerInfo:
    """What a runner is and can do (fixed at load).

    Attributes:
        backend: ``torch-cpu``, ``torch-cuda``, ``onnxruntime``, ``llama.cpp``, ``tensorrt``.
        precision: ``fp32``, ``fp16``, ``bf16``, ``int8``, ``fp8``; a GGUF type for llama.cpp
            (``q8_0``, ``q4_k_m``, ``q4_0``, ``f16``, ``f32``).
        hidden_size: D. num_vq: Q (4). num_audio_tokens: V (626). num_text_tokens: text vocabulary.
        max_batch: KV-cache slots. max_seq_len: KV-cache positions per slot (prompt + codes).
        max_prompt_tokens: longest prompt one prefill accepts.
        weight_bytes: bytes of weights held by the runner (for the memory budget).
        kv_bytes_per_token: KV-cache bytes per position per slot.
        reason: why this backend was chosen (logged at load).
        decoder_rf: receptive field of the Decoder, in mel frames on each side
            (``2 + 6 * n_layer + 1``: conv_in 2 x k3, n_layer dilated k7 blocks, out_conv k3).
        vocos_rf: receptive field of the Vocos backbone, in mel frames on each side
            (``3 * (1 + num_layers)``: embed k7 and one k7 depthwise conv per block).
        text_mode: the runner can run refine-text (:meth:`Runner.refine`).
        step_chunk: decode steps one :meth:`Runner.step` call should run (1 on a host; a device
            runner runs several per host sync).
        device: ``cpu``, ``cuda:0``, ...
        window_quantum: vocoder windows are widened (with more left context, which changes
            nothing) to a multiple of this many tokens: a GPU backend then meets few distinct
            shapes (each new one costs cuDNN/TensorRT set-up time); 1 = no widening (host).
        engine_id: what identifies the built engines (sha256 of their manifest; the torch version
            and dtype for torch): a look-ahead calibration holds only for the same engines.
        context_bytes: device memory the bare CUDA context took before the runner allocated
            anything, bytes (0 on a host): a property of the card and driver (621 MiB on an H200),
            which the memory budget leaves out on a desktop GPU (appliance.ops.footprint).
        threads: CPU threads the runner computes with (0: not a CPU runner), and
        threads_source: where that number came from (:mod:`appliance.engines.threads`).
        fallback: set when the runner loaded a slower way than configured (llama.cpp's GPU build
            failed its load check: the GPT on the CPU), saying why; health reports it as
            ``engine_fallback`` (:mod:`appliance.engines.recover`). Empty otherwise.
        networks: which runtime runs each network (``gpt``, ``decoder``, ``vocos``) where, and why,
            as ``(network, sentence)`` pairs; empty: all three on ``backend`` on ``device``.
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
    num_text_tokens: int = 21178
    text_mode: bool = False
    step_chunk: int = 1
    device: str = "cpu"
    window_quantum: int = 1
    engine_id: str = ""
    context_bytes: int = 0
    threads: int = 0
    threads_source: str = ""
    fallback: str = ""
    networks: tuple[tuple[str, str], ...] = ()

    def network_fields(self) -> dict:
        """``status``'s ``networks`` (network -> which runtime runs it where, and why) and
        ``backend_reason`` (why this backend was chosen)."""
        nets = dict(self.networks) or {n: f"{self.backend} on {self.device}" for n in NETWORKS}
        return {"networks": nets, "backend_reason": self.reason or None}

    def thread_fields(self) -> dict:
        """``status``'s ``threads`` and ``threads_source`` (None for a runner that is not on a CPU)."""
        return {"threads": self.threads or None, "threads_source": self.threads_source or None}


def receptive_fields(dec_layers: int, voc_layers: int) -> dict[str, int]:
    """``decoder_rf`` / ``vocos_rf`` of :class:`RunnerInfo` (mel frames each side) for a Decoder of
    ``dec_layers`` dilated (2) k7 ConvNeXt blocks between two k3 convs and a k3 out_conv, and a
    Vocos backbone of ``voc_layers`` k7 blocks after a k7 embedding conv."""
    return {"decoder_rf": 2 + 6 * dec_layers + 1, "vocos_rf": 3 * (1 + voc_layers)}


@dataclass(frozen=True)
class VocodeWindow:
    """One vocoder window of a slot, in absolute indices of the sentence (half-open ranges).

    Attributes:
        h0, h1: hidden states fed to the Decoder (``h0 == h1``: no Decoder pass).
        m0, m1: mel frames of that pass stored as final (``2*h0 <= m0 <= m1 <= 2*h1``).
        v0, v1: stored mel frames fed to Vocos.
        s0, s1: spectrum frames returned (``v0 <= s0 <= s1 <= v1``; ``s0 == s1``: no Vocos pass,
            the window only stores new mel frames).
        reach: mel frames of right context after which the Decoder's frames are frozen (0, or at
            least ``RunnerInfo.decoder_rf``: its receptive field, exact): the stateful runners
            recompute at most this many provisional frames per layer and pass
            (:func:`appliance.model.stream.decoder_stream`); the same for every window of a sentence.
    """

    h0: int
    h1: int
    m0: int
    m1: int
    v0: int
    v1: int
    s0: int
    s1: int
    reach: int = 0


class Runner(abc.ABC):
    """The backend-neutral contract (see module docstring). Subclasses set :attr:`info` and, when
    ``safety.verify_checkpoint`` is on, :attr:`weight_files`: ``(file, sha256)`` of every weight
    file the backend read or maps, each verified at load; what a background re-verification
    (:class:`appliance.model.reverify.Reverifier`) re-hashes."""

    info: RunnerInfo
    weight_files: Sequence[tuple[Path, str]] = ()

    @abc.abstractmethod
    def prefill(self, slot: int, ids: np.ndarray, spk_emb: np.ndarray | None) -> None:
        """Prompt ``ids`` int64 ``[T]`` (+ speaker float32 ``[D]`` or None) into ``slot``.

        Raises:
            CapacityError: empty prompt, ``T > info.max_prompt_tokens``, slot out of range.
            EngineError: an id outside the text vocabulary, a misshaped speaker, or the backend failed.
        """

    @abc.abstractmethod
    def start(self, slot: int, params: SamplingParams, seed: int) -> np.ndarray:
        """Start sampling ``slot`` after its :meth:`prefill`: parameters, seed, empty penalty
        window; draws code 0 from the prefill logits. Returns int64 ``[Q]`` (a copy); an EOS in
        any codebook means the sentence is already over."""

    @abc.abstractmethod
    def step(self, slots: np.ndarray, k: int) -> np.ndarray:
        """``k`` decode steps for the started slots ``slots`` int64 ``[B]`` (distinct).

        ``k`` is clipped to the room left in the KV cache and to the runner's ring of codes (at
        least ``2 * info.step_chunk``, 16 on a host); at least one step runs.

        Returns:
            int64 ``[k', B, Q]``: step ``j``, row ``i`` are the codes drawn for ``slots[i]``.

        Raises:
            CapacityError: B outside 1..max_batch, slots not distinct / out of range, or a row's
                position at ``max_seq_len`` (the sentence is too long).
            EngineError: the backend failed.
        """

    @abc.abstractmethod
    def vocode(self, slot: int, w: VocodeWindow) -> tuple[np.ndarray, np.ndarray]:
        """Run one vocoder window of ``slot``'s stored hidden states (see :class:`VocodeWindow`).

        The returned frames must equal a one-shot pass over hidden states ``[0, h1)`` and mel
        frames ``[0, v1)`` (zero padding at the start and past ``h1`` / ``v1``): ``h0`` and
        ``v0`` carry the left context a stateless window needs; a runner that keeps the
        convolutions' state between windows (the host runners) does not read them.

        Returns:
            ``(real, imag)`` float32 ``[s1 - s0, n_fft/2 + 1]`` (zero rows when ``s0 == s1``).

        Raises:
            EngineError: a window outside the buffers, or the backend failed.
        """

    @abc.abstractmethod
    def hidden(self, slot: int, t0: int, t1: int) -> np.ndarray:
        """A copy of ``slot``'s stored hidden states ``[t0, t1)`` as float32 ``[t1 - t0, D]``
        (inspection: tests, calibration; not on the hot path)."""

    def refine(self, slot: int, ids: np.ndarray, params: SamplingParams, seed: int, eos_id: int) -> np.ndarray:
        """Refine-text: the GPT in text mode continues the text prompt ``ids [T]`` in ``slot``
        (upstream ``core.py`` ``_refine_text``) until ``eos_id`` or ``params.max_new_tokens``.

        Returns:
            int64 ``[N]`` generated text ids, EOS excluded. The slot's KV is overwritten.

        Raises:
            ConfigError: the runner has no text mode (``info.text_mode`` is False).
        """
        from ..errors import ConfigError

        raise ConfigError(f"refine-text needs a backend with a text mode (torch on CPU); {self.info.backend} "
                          f"has none: set synthesis.refine_text to false")

    def device_memory_bytes(self) -> int:
        """Accelerator memory this runner holds now (0 for host runners)."""
        return 0

    def release(self, slot: int) -> None:
        """``slot``'s sentence is over (its hidden states were vocoded): a runner whose KV cache
        keeps per-sequence state drops it here (llama.cpp: ``llama_memory_seq_rm``). The next
        :meth:`prefill` of the slot overwrites it either way; no-op by default."""

    def close(self) -> None:
        """Release memory. Idempotent."""

    # ------------------------------------------------------------------ shared checks
    def check_slot(self, slot: int) -> int:
        """``slot`` as an int. Raises :class:`CapacityError` when out of range."""
        if not 0 <= int(slot) < self.info.max_batch:
            raise CapacityError(f"slot {slot} out of range: the KV cache has {self.info.max_batch} slots (model.max_batch)")
        return int(slot)

    def check_prompt(self, ids: np.ndarray, spk_emb: np.ndarray | None) -> np.ndarray:
        """Validate a prefill prompt; returns ``ids`` as a flat int64 array (one copy of the rules).

        Raises:
            CapacityError: empty, or longer than ``info.max_prompt_tokens``.
            EngineError: an id outside the text vocabulary, or ``spk_emb`` not ``[D]``.
        """
        ids = np.asarray(ids, np.int64).reshape(-1)
        t, info = ids.shape[0], self.info
        if t == 0:
            raise CapacityError("empty prompt: prefill needs at least one token")
        if t > info.max_prompt_tokens:
            raise CapacityError(f"prompt of {t} tokens exceeds model.max_prompt_tokens {info.max_prompt_tokens}: split the text")
        if ids.min() < 0 or ids.max() >= info.num_text_tokens:
            raise EngineError(f"text id out of range [0, {info.num_text_tokens}): {int(ids.min())}..{int(ids.max())}")
        if spk_emb is not None and np.shape(spk_emb) != (info.hidden_size,):
            raise EngineError(f"spk_emb must have shape [{info.hidden_size}], got {list(np.shape(spk_emb))}")
        return ids

    def check_slots(self, slots: np.ndarray) -> np.ndarray:
        """``slots`` as distinct int64 ``[B]``, 1 <= B <= max_batch. Raises :class:`CapacityError`."""
        slots = np.asarray(slots, np.int64).reshape(-1)
        b, m = slots.shape[0], self.info.max_batch
        if not 1 <= b <= m:
            raise CapacityError(f"decode batch of {b} rows: must be 1..{m} (model.max_batch)")
        if slots.min() < 0 or slots.max() >= m or len(set(slots.tolist())) != b:
            raise CapacityError(f"decode slots {slots.tolist()} must be distinct and in 0..{m - 1}")
        return slots

    def check_window(self, slot: int, w: VocodeWindow) -> None:
        """Raise :class:`EngineError` for a window that is empty, inverted or past the buffers."""
        cap = self.info.max_seq_len
        ok = (0 <= w.h0 <= w.h1 <= cap and 2 * w.h0 <= w.m0 <= w.m1 <= 2 * w.h1 and 0 <= w.v0 <= w.s0 <= w.s1 <= w.v1
              <= 2 * cap)
        if not ok:
            raise EngineError(f"bad vocoder window for slot {slot}: {w}")
