"""The TensorRT backend (Jetson / RTX plans built by ``chattts-appliance engines build``): no torch.

**TensorRT itself has never run in this workplace**: there is no GPU here, the only GPU lent (an
H100/H200, sm_90) refuses TensorRT-RTX plans, and full TensorRT cannot be installed. What runs:
the manifest check and buffer plan (:mod:`appliance.engines.tensorrt.plan`, before any CUDA
call), the exact windowing, the error paths (no CUDA, no GPU), and this runner's memory, copies
and sampling (:mod:`appliance.engines.tensorrt.io` over :mod:`appliance.engines.tensorrt.cuda`):
on the CPU against a host-memory CUDA fake, and on a GPU with the real CUDA runtime
(``tests/test_trt_cuda_io.py``). Engine deserialization and ``set_input_shape`` /
``set_tensor_address`` / ``execute_async_v3`` follow NVIDIA's ``samples/python/common_runtime.py``
(TensorRT 8.5+ API, as JetPack 5.1+ ships) and have **never run**.

Design. The plans are the ONNX graphs of :mod:`appliance.build.export` (``gpt`` with a static
cache and a ``past`` length input, ``decoder``, ``vocos``). Device memory, pinned host staging and
the stream are ``cuda-python``'s (:class:`~appliance.engines.tensorrt.io.TrtIO`): every I/O
buffer allocated once at its profile maximum, bound by address, the engines run on one
non-blocking stream. The host does what every host runner does (:class:`~appliance.engines.host_runner.HostRunner`):
it embeds the prompt and the last codes from the export's tables (numpy), draws the codes with
the one numpy sampler and random stream from the logits copied back (``[B, Q, V]`` float32, 30
KiB a step at B = 3), and keeps the hidden states and mel frames of each slot. The new keys and
values stay on the device (:meth:`~appliance.engines.tensorrt.io.TrtIO.scatter_kv`).
:meth:`TensorRTRunner.vocode` runs the Decoder and Vocos plans over a window of stored hidden
states / mel frames (exactly, in pieces of the plans' window with their receptive field as
context: :func:`~appliance.engines.tensorrt.plan.run_windowed`) and returns the spectrum. Every
engine failure becomes :class:`~appliance.errors.EngineError`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from ...config import Config
from ...errors import ConfigError, EngineError
from .. import manifest as mf
from ..host_runner import HostRunner
from ..runner import RunnerInfo, VocodeWindow, receptive_fields
from . import trt as trtshim
from .cuda import Cuda
from .io import TrtIO
from .plan import PRECISIONS, find_plans, load_manifest, plan_buffers, run_windowed

log = logging.getLogger(__name__)

__all__ = ["PRECISIONS", "TensorRTRunner", "find_plans", "load_manifest", "plan_buffers", "run_windowed"]


class TensorRTRunner(HostRunner):
    """TensorRT runner (engines **never executed here**: see module doc).

    Args:
        cfg: uses ``model.engine_dir``, ``model.path``, ``model.max_batch``, ``max_seq_len``,
            ``max_prompt_tokens``, ``safety.verify_checkpoint``.
        reason: why this backend was chosen.
        plan_dir: a specific ``trt/<precision>`` directory (default: :func:`find_plans`).
        cuda: the CUDA runtime to use (default: ``cuda-python``'s; tests pass a fake).

    Raises:
        ConfigError: no plans; TensorRT or cuda-python missing.
        EngineMismatchError: the manifest does not match (checked before any CUDA call).
        EngineError: no GPU, an allocation failed, or deserialization failed.
    """

    def __init__(self, cfg: Config, reason: str = "", plan_dir: str | Path | None = None, cuda: Cuda | None = None):
        d = Path(plan_dir) if plan_dir else find_plans(cfg)
        if d is None:
            raise ConfigError(f"no TensorRT plans under {cfg.resolve(cfg.model.engine_dir) / 'trt'}; build them with: "
                              + mf.rebuild_hint(cfg.file_hint, 'fp16', tensorrt=True))
        m = load_manifest(cfg, d)
        self.manifest, self.dir = m, d
        # the plans, hashed before TensorRT reads them (and before any CUDA call); the embedding
        # tables below in the pass that reads them (safety.verify_checkpoint)
        verify = cfg.safety.verify_checkpoint
        hint = mf.rebuild_hint(cfg.file_hint, d.name, tensorrt=True)
        emb_name = m.get("embed", {}).get("file", "embed.safetensors")
        self.weight_files = mf.verify_files(d, m, hint, [n for n in mf.weight_files(d, m) if n != emb_name]) \
            if verify else []
        self.plan = plan_buffers(m)
        from ..onnx.runner import load_embeddings

        trt = trtshim.module()
        self._cu = cuda or Cuda()
        self._io = TrtIO(self._cu, self.plan)
        self._logger = trtshim.capture_logger()
        self._rt = trt.Runtime(self._logger)
        self._eng: dict[str, Any] = {}
        self._ctx: dict[str, Any] = {}
        try:
            for g, e in m["graphs"].items():
                eng = self._rt.deserialize_cuda_engine((d / e["file"]).read_bytes())
                if eng is None:
                    raise EngineError(f"TensorRT cannot load {d / e['file']}: "
                                      f"{'; '.join(self._logger.errors()) or 'unknown error'}")
                self._eng[g], self._ctx[g] = eng, eng.create_execution_context()
            self._ctx["gpt_prefill"] = self._eng["gpt"].create_execution_context()  # profile 1 = prefill
            if not self._ctx["gpt_prefill"].set_optimization_profile_async(1, self._io.stream.handle):
                raise EngineError(f"{d}: the gpt plan has no prefill profile (1); rebuild it")
        except BaseException:
            self.close()
            raise
        s, lim = m["shapes"], m["limits"]
        self._s = s
        L, D, Q, V = s["n_layers"], s["hidden"], s["num_vq"], s["num_audio_tokens"]
        M, S = lim["max_batch"], lim["max_seq_len"]
        et, ec, emb_sha = load_embeddings(d, m, hint, verify)
        if emb_sha is not None:
            self.weight_files.append((d / emb_name, emb_sha))
        self._emb_text, self._emb_code = et, ec.reshape(Q, V, D)
        self._spk_id = int(m.get("special", {}).get("spk_emb_id", -1))
        self._D, self._Q, self._V = D, Q, V
        rt_name = f"{m['runtime']['name']} {m['runtime']['version']}"
        self.info = RunnerInfo(
            backend="tensorrt", precision=m["precision"], hidden_size=D, num_vq=Q, num_audio_tokens=V, max_batch=M,
            max_seq_len=S, max_prompt_tokens=lim["max_prompt_tokens"],
            weight_bytes=int(m.get("memory", {}).get("weights_bytes") or 0),
            kv_bytes_per_token=2 * L * D * self._io.kv_dtype.itemsize, reason=reason,
            num_text_tokens=s["num_text_tokens"], device=f"cuda:{self._cu.device}", window_quantum=16,
            engine_id=mf.file_sha256(d / mf.MANIFEST),
            networks=tuple((g, f"{rt_name} plan {d / m['graphs'][g]['file']} ({m['precision']}; buffers, "
                               f"copies and sampling through cuda-python and numpy, no torch)")
                           for g in ("gpt", "decoder", "vocos")),
            **receptive_fields(s["dec_layers"], s["voc_layers"]))
        self.setup_host(s["n_mels"], s["n_fft"])
        log.info("tensorrt runner: %s (%s), %s, device buffers %.1f MiB", d, rt_name, m["precision"], self._io.nbytes / 2**20)

    # ------------------------------------------------------------------ execution
    def _execute(self, g: str, shapes: dict[str, tuple[int, ...]], ctx_name: str | None = None,
                 extra: dict[str, int] | None = None) -> None:
        """Set ``shapes`` on graph ``g``'s inputs, bind every buffer by address, queue the run."""
        ctx = self._ctx[ctx_name or g]
        for name, shape in shapes.items():
            if not ctx.set_input_shape(name, tuple(int(x) for x in shape)):
                raise EngineError(f"{g}: input {name} shape {tuple(shape)} is outside the engine's profile")
        for name, ptr in {**self._io.addresses(g), **(extra or {})}.items():
            ctx.set_tensor_address(name, ptr)
        if not ctx.execute_async_v3(self._io.stream.handle):
            raise EngineError(f"TensorRT {g} failed: {'; '.join(self._logger.errors()) or 'execute_async_v3 returned false'}")

    def _gpt(self, ctx_name: str, emb: np.ndarray, pos: np.ndarray, slots: np.ndarray,
             past: int) -> tuple[np.ndarray, np.ndarray]:
        """Run the gpt plan over ``emb [b, t, D]`` at ``pos [b]`` of ``slots [b]``, reading cache
        positions ``[:past]``; scatter its new K/V into the cache. Returns (logits float32
        ``[b, Q, V]``, hidden float32 ``[b, D]``) of each row's last position (pinned views)."""
        io, (b, t, D) = self._io, emb.shape
        io.put("gpt", "emb", emb)
        io.put("gpt", "pos", pos)
        io.put("gpt", "slots", slots)
        self._execute("gpt", {"emb": (b, t, D), "pos": (b,), "slots": (b,), "past": (past,)}, ctx_name,
                      io.kv_addresses())
        io.scatter_kv("gpt", b, t, pos, slots)
        out = io.get_many("gpt", {"logits": (b, self._Q, self._V), "hidden": (b, D)})
        return out["logits"], out["hidden"]

    # ------------------------------------------------------------------ the passes (HostRunner)
    def forward_prefill(self, slot: int, ids: np.ndarray, spk_emb: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        from ..onnx.runner import embed_prompt

        emb = embed_prompt(self._emb_text, ids, spk_emb, self._spk_id)
        logits, hidden = self._gpt("gpt_prefill", emb[None], np.zeros(1, np.int64), np.array([slot], np.int64), 1)
        return logits[0], hidden[0]

    def forward_decode(self, slots: np.ndarray, codes: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        e = self._emb_code[0][codes[:, 0]]
        for q in range(1, self._Q):
            e += self._emb_code[q][codes[:, q]]
        return self._gpt("gpt", e[:, None], np.asarray(pos, np.int64), np.asarray(slots, np.int64), int(np.max(pos)))

    def forward_decoder_stream(self, hidden: np.ndarray, pos0: int, cache: Any, reach: int | None = None):
        raise EngineError("the TensorRT plans are one-shot graphs: TensorRTRunner.vocode windows them")

    def forward_vocos_stream(self, mel: np.ndarray, pos0: int, n_final: int, cache: Any):
        raise EngineError("the TensorRT plans are one-shot graphs: TensorRTRunner.vocode windows them")

    def _decoder(self, h: np.ndarray) -> np.ndarray:
        """The decoder plan over ``h [T, D]`` -> mel ``[n_mels, 2T]`` (a copy)."""
        self._io.put("decoder", "hidden", h)
        self._execute("decoder", {"hidden": tuple(h.shape)})
        return self._io.get("decoder", "mel", (self._s["n_mels"], 2 * h.shape[0])).copy()

    def _vocos(self, x: np.ndarray) -> np.ndarray:
        """The vocos plan over ``x [n_mels, F]`` -> ``[F, 2 * bins]`` (real, then imag; a copy)."""
        nb = self._s["n_fft"] // 2 + 1
        self._io.put("vocos", "mel", x)
        self._execute("vocos", {"mel": tuple(x.shape)})
        out = self._io.get_many("vocos", {"real": (x.shape[1], nb), "imag": (x.shape[1], nb)})
        return np.concatenate([out["real"], out["imag"]], 1)

    def vocode(self, slot: int, w: VocodeWindow) -> tuple[np.ndarray, np.ndarray]:
        """See :meth:`Runner.vocode`: the Decoder plan over hidden states ``[h0, h1)`` (mel frames
        ``[m0, m1)`` stored), the Vocos plan over stored mel frames ``[v0, v1)``, the spectrum of
        ``[s0, s1)`` returned; each in exact windows of the plans' size."""
        slot = self.check_slot(slot)
        self.check_window(slot, w)
        win = int(self.manifest["limits"]["window_tokens"])
        nb = self._s["n_fft"] // 2 + 1
        if w.h1 > w.h0:
            mel = run_windowed(self._decoder, self._hid[slot, w.h0:w.h1], 0, win, (self.info.decoder_rf + 1) // 2 + 1, 1, 2)
            self._mel[slot, :, w.m0:w.m1] = mel[:, w.m0 - 2 * w.h0:w.m1 - 2 * w.h0]
        f = w.s1 - w.s0
        if f == 0:
            return self._no_spec, self._no_spec
        y = run_windowed(self._vocos, self._mel[slot, :, w.v0:w.v1], 1, 2 * win, self.info.vocos_rf + 1, 0, 1)
        a = w.s0 - w.v0
        return y[a:a + f, :nb], y[a:a + f, nb:]

    def device_memory_bytes(self) -> int:
        """Engine activations (manifest) plus this runner's buffers and KV cache."""
        return int(self.manifest.get("memory", {}).get("activations_bytes") or 0) + (self._io.nbytes if self._io else 0)

    def close(self) -> None:
        """Drop contexts and engines, free the buffers and the stream (idempotent)."""
        self._ctx, self._eng = {}, {}
        io, self._io = getattr(self, "_io", None), None
        if io is not None:
            io.close()
