"""The PyTorch host runner: our model (:mod:`appliance.model`) on the CPU behind the Runner contract.

A :class:`~appliance.engines.host_runner.HostRunner`: the four network passes run in torch, the
sampler and per-slot buffers are numpy. The model and its static KV cache (``model.max_batch``
slots x ``model.max_seq_len`` positions) are allocated once at load; all calls run under
``torch.inference_mode``. It is the reference backend (parity with upstream) and the only one with
a text mode (refine-text). On a GPU the fast path is :class:`~appliance.engines.torch.cuda_runner.CudaRunner`.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ...config import Config
from ...errors import CapacityError, CheckpointError, ConfigError, EngineError
from ...model.checkpoint import load_model
from ...model.stream import decoder_stream, vocos_stream
from ..host_runner import HostRunner
from ..runner import RunnerInfo, receptive_fields
from ..threads import thread_budget

log = logging.getLogger(__name__)

_DTYPES = {"float32": (torch.float32, "fp32"), "float16": (torch.float16, "fp16"), "bfloat16": (torch.bfloat16, "bf16")}


def pick_device(name: str) -> torch.device:
    """``auto`` -> cuda if available else cpu; ``cuda`` without a GPU is a :class:`ConfigError`."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device=cuda but torch sees no CUDA GPU: set model.device to cpu or auto")
    return torch.device(name)


class TorchRunner(HostRunner):
    """PyTorch runner (see :mod:`appliance.engines.runner` for the contract).

    Args:
        cfg: the configuration; uses ``model.path`` (resolved with ``cfg.resolve``), ``model.device``,
            ``model.dtype``, ``model.threads``, ``model.max_batch``, ``model.max_seq_len``,
            ``model.max_prompt_tokens``.
        reason: why this backend was chosen (stored in ``info.reason``).

    Raises:
        CheckpointError: the checkpoint is missing or malformed.
        ConfigError: cuda requested without a GPU.
        CapacityError: ``model.max_seq_len`` exceeds the checkpoint's max_position_embeddings.
    """

    def __init__(self, cfg: Config, reason: str = ""):
        mc = cfg.model
        self.device = pick_device(mc.device)
        self.dtype, precision = _DTYPES[mc.torch_dtype(gpu=self.device.type == "cuda")]
        budget = thread_budget(mc.threads) if self.device.type == "cpu" else None
        if budget is not None:    # torch's one intra-op pool (module appliance.engines.threads)
            torch.set_num_threads(budget.threads)
            log.info("torch CPU runner: %s", budget.describe())
        path = cfg.resolve(mc.path)
        try:
            self.model = load_model(path, self.device, self.dtype, verify=cfg.safety.verify_checkpoint)
        except CheckpointError:
            raise
        except (RuntimeError, OSError) as e:
            raise EngineError(f"loading {path} on {self.device} failed: {e}") from e
        self.weight_files = list(self.model.verified_files)
        s = self.model.shapes
        if mc.max_seq_len > s.max_pos:
            raise CapacityError(
                f"model.max_seq_len {mc.max_seq_len} exceeds the checkpoint's max_position_embeddings {s.max_pos}")
        self.model.gpt.setup_cache(mc.max_batch, mc.max_seq_len, self.dtype, self.device)
        self.shapes = s
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.info = RunnerInfo(
            backend=f"torch-{self.device.type}", precision=precision, hidden_size=s.hidden, num_vq=s.num_vq,
            num_audio_tokens=s.num_audio_tokens, max_batch=mc.max_batch, max_seq_len=mc.max_seq_len,
            max_prompt_tokens=min(mc.max_prompt_tokens, mc.max_seq_len - 1), weight_bytes=int(weight_bytes),
            kv_bytes_per_token=self.model.gpt.kv_bytes_per_token(), reason=reason,
            num_text_tokens=s.num_text_tokens, text_mode=True, device=str(self.device),
            engine_id=f"torch {torch.__version__} {precision}",
            threads=budget.threads if budget is not None else 0, threads_source=budget.source if budget is not None else "",
            **receptive_fields(s.dec_layers, s.voc_layers),
        )
        # host output buffers, allocated once
        self._pf_logits = np.zeros((s.num_vq, s.num_audio_tokens), np.float32)
        self._pf_hidden = np.zeros((s.hidden,), np.float32)
        self._dc_logits = np.zeros((mc.max_batch, s.num_vq, s.num_audio_tokens), np.float32)
        self._dc_hidden = np.zeros((mc.max_batch, s.hidden), np.float32)
        log.info("torch runner: %s %s, %d slots x %d positions, weights %.1f MiB, KV %.1f MiB",
                 self.device, precision, mc.max_batch, mc.max_seq_len, weight_bytes / 2**20,
                 self.info.kv_bytes_per_token * mc.max_seq_len * mc.max_batch / 2**20)
        self.setup_host(s.n_mels)

    # -------------------------------------------------------------- helpers
    def _t(self, a: np.ndarray, dtype=torch.int64) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, dtype)

    # -------------------------------------------------------------- the passes (HostRunner)
    def forward_prefill(self, slot: int, ids: np.ndarray, spk_emb: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Prompt ``ids [T]`` (+ ``spk_emb [D]``) into ``slot``; (logits [Q, V], hidden [D]) of the last position."""
        try:
            with torch.inference_mode():
                m = self.model
                spk = None if spk_emb is None else self._t(spk_emb, torch.float32)
                emb = m.embed_prompt(self._t(ids), spk)  # [1, T, D]
                h = m.gpt.prefill(emb, int(slot))[0, -1]  # [D]
                logits = m.audio_logits(h.unsqueeze(0))[0]  # [Q, V]
                self._pf_hidden[:] = h.float().cpu().numpy()
                self._pf_logits[:] = logits.float().cpu().numpy()
        except RuntimeError as e:
            raise EngineError(f"torch prefill failed: {e}") from e
        return self._pf_logits, self._pf_hidden

    def forward_decode(self, slots: np.ndarray, codes: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One step for rows ``slots [B]`` with ``codes [B, Q]`` written at ``pos [B]``; (logits [B,Q,V], hidden [B,D])."""
        b = slots.shape[0]
        try:
            with torch.inference_mode():
                m = self.model
                emb = m.embed_codes(self._t(codes))  # [B, 1, D]
                h = m.gpt.decode_step(emb, self._t(slots), self._t(pos), int(pos.max()) + 1)  # [B, D]
                logits = m.audio_logits(h)  # [B, Q, V]
                self._dc_hidden[:b] = h.float().cpu().numpy()
                self._dc_logits[:b] = logits.float().cpu().numpy()
        except RuntimeError as e:
            raise EngineError(f"torch decode failed: {e}") from e
        return self._dc_logits[:b], self._dc_hidden[:b]

    # -------------------------------------------------------------- text mode (refine-text)
    def forward_prefill_text(self, slot: int, ids: np.ndarray) -> np.ndarray:
        """Text-mode prefill (upstream refine-text): ``ids [T]`` embedded by the text table only,
        written to ``slot``; returns the text-head logits float32 ``[num_text_tokens]`` of the
        last position (upstream ``gpt.py`` ``generate(infer_text=True)``).

        Raises:
            EngineError: torch failed (the caller, :meth:`HostRunner.refine`, checked the prompt).
        """
        try:
            with torch.inference_mode():
                m = self.model
                h = m.gpt.prefill(m.embed.embed_text(self._t(ids)).unsqueeze(0).to(self.dtype), int(slot))[0, -1]
                return m.embed.text_logits(h).float().cpu().numpy()
        except RuntimeError as e:
            raise EngineError(f"torch text prefill failed: {e}") from e

    def forward_decode_text(self, slot: int, token: int, pos: int) -> np.ndarray:
        """One text-mode decode step: ``token`` written at ``pos`` of ``slot``; returns the
        text-head logits float32 ``[num_text_tokens]``.

        Raises:
            CapacityError: ``pos`` at the end of the KV cache. EngineError: torch failed.
        """
        if not 0 <= pos < self.info.max_seq_len:
            raise CapacityError(f"text position {pos} outside the KV cache of {self.info.max_seq_len}")
        try:
            with torch.inference_mode():
                m = self.model
                emb = m.embed.embed_text(self._t(np.array([[token]], np.int64))).to(self.dtype)  # [1, 1, D]
                h = m.gpt.decode_step(emb, self._t(np.array([slot])), self._t(np.array([pos])), pos + 1)
                return m.embed.text_logits(h[0]).float().cpu().numpy()
        except RuntimeError as e:
            raise EngineError(f"torch text decode failed: {e}") from e

    def forward_decoder_stream(self, hidden: np.ndarray, pos0: int, cache: list | None,
                               reach: int | None = None) -> tuple[np.ndarray, list]:
        """Stateful Decoder pass (see :meth:`HostRunner.forward_decoder_stream`): hidden float32
        ``[T, D]`` -> (mel float32 ``[100, reach + 2T]``, caches: torch tensors in the model dtype).

        Raises:
            EngineError: wrong shape, or torch failed.
        """
        hidden = np.asarray(hidden, np.float32)
        if hidden.ndim != 2 or hidden.shape[1] != self.shapes.hidden or hidden.shape[0] == 0:
            raise EngineError(f"decoder input must be [T>0, {self.shapes.hidden}], got {list(hidden.shape)}")
        try:
            with torch.inference_mode():
                dec = self.model.decoder
                x = self._t(hidden.T, self.dtype).unsqueeze(0)  # [1, D, T]
                mel, cache = decoder_stream(dec, x, torch.tensor(pos0, device=self.device), cache,
                                            None if reach is None else int(reach))
                return mel[0].float().cpu().numpy(), cache
        except RuntimeError as e:
            raise EngineError(f"torch decoder failed: {e}") from e

    def forward_vocos_stream(self, mel: np.ndarray, pos0: int, n_final: int,
                             cache: list | None) -> tuple[np.ndarray, np.ndarray, list]:
        """Stateful Vocos pass (see :meth:`HostRunner.forward_vocos_stream`): mel float32
        ``[100, F]`` -> (real, imag float32 ``[rf + F, 513]``, caches).

        Raises:
            EngineError: wrong shape, or torch failed.
        """
        mel = np.asarray(mel, np.float32)
        if mel.ndim != 2 or mel.shape[0] != self.shapes.n_mels or mel.shape[1] == 0:
            raise EngineError(f"vocos input must be [{self.shapes.n_mels}, F>0], got {list(mel.shape)}")
        try:
            with torch.inference_mode():
                voc = self.model.vocos
                re, im, cache = vocos_stream(voc, self._t(mel, self.dtype).unsqueeze(0), torch.tensor(pos0, device=self.device),
                                             torch.tensor(n_final, device=self.device), cache)
                return re[0].float().cpu().numpy(), im[0].float().cpu().numpy(), cache
        except RuntimeError as e:
            raise EngineError(f"torch vocos failed: {e}") from e

    def close(self) -> None:
        """Drop weights and KV cache (idempotent)."""
        if getattr(self, "model", None) is not None:
            self.model = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
