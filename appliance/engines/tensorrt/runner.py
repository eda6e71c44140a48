"""The TensorRT backend (Jetson / RTX plans built by ``chattts-appliance engines build``).

**Not executed in this workplace.** There is no GPU here, the only GPU lent (an H200, sm_90) is
refused by TensorRT-RTX plans, and full TensorRT cannot be installed. What the tests run here:
the manifest check and buffer plan (:mod:`appliance.engines.tensorrt.plan`, before any CUDA call), the
exact windowing, and the error paths (no CUDA, no GPU). Engine deserialization,
``set_input_shape`` / ``set_tensor_address`` / ``execute_async_v3`` and the device code below
have **never run**; they follow NVIDIA's ``samples/python/common_runtime.py`` (TensorRT 8.5+
API, as JetPack 5.1+ ships).

Design. The plans are the ONNX graphs of :mod:`appliance.build.export` (``gpt`` with a static
cache and a ``past`` length input, ``decoder``, ``vocos``). Device memory is PyTorch's (JetPack
ships a CUDA PyTorch wheel; no Triton needed): every I/O buffer is a CUDA tensor allocated once at
its profile maximum, bound by ``data_ptr()``, and the engines run on torch's current stream, so
the same :class:`~appliance.engines.torch.sampler.DeviceSampler` as the CUDA runner samples on the
device (one random stream for every backend). Per decode step nothing crosses to the host: the
codes are embedded on the device, the engine's ``k_new``/``v_new [L, B, 1, H, hd]`` are scattered
into the cache ``[L, S, M, H, hd]`` (positions first; layer ``i`` bound as ``k_cache.i``) by one
indexed copy, hidden states go to the slot's buffer; one copy of the codes per ``step`` call.
:meth:`TensorRTRunner.vocode` runs the Decoder and Vocos plans on the stored hidden states / mel
frames and returns only the spectrum. Every engine failure becomes :class:`~appliance.errors.EngineError`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from ...config import Config
from ...core import SamplingParams
from ...errors import CapacityError, ConfigError, EngineError
from .. import manifest as mf
from . import trt as trtshim
from ..runner import Runner, RunnerInfo, VocodeWindow, receptive_fields
from .plan import PRECISIONS, find_plans, load_manifest, plan_buffers, run_windowed

log = logging.getLogger(__name__)

__all__ = ["PRECISIONS", "TensorRTRunner", "find_plans", "load_manifest", "plan_buffers", "run_windowed"]


def _torch_cuda():
    """Import torch and check CUDA (the runner's device memory and sampler are torch's)."""
    try:
        import torch
    except ImportError as e:
        raise ConfigError("the tensorrt backend needs PyTorch with CUDA for its buffers and device sampling "
                          "(JetPack: NVIDIA's torch wheel for your JetPack)") from e
    if not torch.cuda.is_available():
        raise EngineError("the tensorrt backend needs a CUDA GPU, and torch sees none")
    return torch


class TensorRTRunner(Runner):
    """TensorRT runner (**never executed here**: see module doc).

    Args:
        cfg: uses ``model.engine_dir``, ``model.path``, ``model.max_batch``, ``max_seq_len``,
            ``max_prompt_tokens``.
        reason: why this backend was chosen.
        plan_dir: a specific ``trt/<precision>`` directory (default: :func:`find_plans`).

    Raises:
        ConfigError: no plans; TensorRT or a CUDA PyTorch missing.
        EngineMismatchError: the manifest does not match (checked before any CUDA call).
        EngineError: no GPU, or deserialization failed.
    """

    def __init__(self, cfg: Config, reason: str = "", plan_dir: str | Path | None = None):
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
        torch = self._torch = _torch_cuda()
        from ..onnx.runner import load_embeddings
        from ..torch.sampler import DeviceSampler

        trt = trtshim.module()
        dev = self.device = torch.device("cuda")
        self._logger = trtshim.capture_logger()
        self._rt = trt.Runtime(self._logger)
        self._eng: dict[str, Any] = {}
        self._ctx: dict[str, Any] = {}
        for g, e in m["graphs"].items():
            eng = self._rt.deserialize_cuda_engine((d / e["file"]).read_bytes())
            if eng is None:
                raise EngineError(f"TensorRT cannot load {d / e['file']}: {'; '.join(self._logger.errors()) or 'unknown error'}")
            self._eng[g], self._ctx[g] = eng, eng.create_execution_context()
        self._ctx["gpt_prefill"] = self._eng["gpt"].create_execution_context()  # profile 1 = prefill
        if not self._ctx["gpt_prefill"].set_optimization_profile_async(1, self._stream()):
            raise EngineError(f"{d}: the gpt plan has no prefill profile (1); rebuild it")
        tdt = {"float32": torch.float32, "float16": torch.float16, "int64": torch.int64, "int32": torch.int32,
               "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8}
        self._buf = {g: {n: torch.zeros(t["shape"], dtype=tdt[t["dtype"]], device=dev) for n, t in ts.items()}
                     for g, ts in self.plan.items() if g != "kv"}
        s, lim = m["shapes"], m["limits"]
        self._s = s
        L, D, H, Q, V = s["n_layers"], s["hidden"], s["n_heads"], s["num_vq"], s["num_audio_tokens"]
        M, S = lim["max_batch"], lim["max_seq_len"]
        kv_dt = tdt[next(iter(self.plan["kv"].values()))["dtype"]]
        self._k = torch.zeros(L, S, M, H, D // H, dtype=kv_dt, device=dev)  # layer i bound as k_cache.i
        self._v = torch.zeros_like(self._k)
        et, ec, emb_sha = load_embeddings(d, m, hint, verify)
        if emb_sha is not None:
            self.weight_files.append((d / emb_name, emb_sha))
        self._emb_text = torch.from_numpy(et).to(dev)
        self._emb_code = torch.from_numpy(ec).to(dev).reshape(Q * V, D)
        self._code_off = torch.arange(Q, device=dev) * V
        self._spk_id = int(m.get("special", {}).get("spk_emb_id", -1))
        self.sampler = DeviceSampler(M, Q, V, dev)
        self._logits0 = torch.zeros(M, Q, V, device=dev)
        self._logits_all = torch.zeros(M, Q, V, device=dev)
        self._codes = torch.zeros(M, Q, dtype=torch.int64, device=dev)
        self._hid = torch.zeros(M, S, D, device=dev)
        self._mel = torch.zeros(M, s["n_mels"], 2 * S, device=dev)
        self.step_chunk = 8
        self._h_codes = torch.zeros(self.step_chunk, M, Q, dtype=torch.int64, pin_memory=True)
        self._h_spec = torch.zeros(2, 2 * S, s["n_fft"] // 2 + 1, pin_memory=True)
        self._ring = torch.zeros(self.step_chunk, M, Q, dtype=torch.int64, device=dev)
        self.pos_host = np.zeros(M, np.int64)
        self.info = RunnerInfo(
            backend="tensorrt", precision=m["precision"], hidden_size=D, num_vq=Q, num_audio_tokens=V, max_batch=M,
            max_seq_len=S, max_prompt_tokens=lim["max_prompt_tokens"],
            weight_bytes=int(m.get("memory", {}).get("weights_bytes") or 0),
            kv_bytes_per_token=2 * L * D * self._k.element_size(), reason=reason, num_text_tokens=s["num_text_tokens"],
            step_chunk=self.step_chunk, device="cuda", window_quantum=16, engine_id=mf.file_sha256(d / mf.MANIFEST),
            **receptive_fields(s["dec_layers"], s["voc_layers"]))
        log.info("tensorrt runner: %s (%s %s), %s", d, m["runtime"]["name"], m["runtime"]["version"], m["precision"])

    # ------------------------------------------------------------------ execution
    def _stream(self) -> int:
        return self._torch.cuda.current_stream().cuda_stream

    def _execute(self, g: str, shapes: dict[str, tuple[int, ...]], ctx_name: str | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        """Bind every buffer of graph ``g`` (inputs with ``shapes``) and run it on torch's stream."""
        ctx, buf = self._ctx[ctx_name or g], self._buf[g]
        for name, shape in shapes.items():
            if not ctx.set_input_shape(name, tuple(shape)):
                raise EngineError(f"{g}: input {name} shape {tuple(shape)} is outside the engine's profile")
        for name, t in list(buf.items()) + list((extra or {}).items()):
            ctx.set_tensor_address(name, t.data_ptr())
        if not ctx.execute_async_v3(self._stream()):
            raise EngineError(f"TensorRT {g} failed: {'; '.join(self._logger.errors()) or 'execute_async_v3 returned false'}")

    def _gpt(self, ctx_name: str, b: int, t: int, past: int) -> None:
        """Run the gpt plan over ``emb [b, t, D]``, ``pos [b]``, ``slots [b]`` already in its
        buffers, reading cache positions ``[:past]``; scatter the new K/V into the cache."""
        torch, buf, L = self._torch, self._buf["gpt"], self._s["n_layers"]
        kv = {f"{n}_cache.{i}": c[i] for n, c in (("k", self._k), ("v", self._v)) for i in range(L)}
        self._execute("gpt", {"emb": (b, t, self.info.hidden_size), "pos": (b,), "slots": (b,), "past": (past,)},
                      ctx_name, kv)
        pos, slots = buf["pos"][:b], buf["slots"][:b]
        p = (pos[:, None] + torch.arange(t, device=self.device)).reshape(-1)   # [b*t]
        sl = slots[:, None].expand(b, t).reshape(-1)
        n = L * b * t
        kn = buf["k_new"].reshape(-1)[: n * self._k[0, 0, 0].numel()].view(L, b * t, *self._k.shape[3:])
        vn = buf["v_new"].reshape(-1)[: n * self._v[0, 0, 0].numel()].view(L, b * t, *self._v.shape[3:])
        self._k[:, p, sl] = kn.to(self._k.dtype)
        self._v[:, p, sl] = vn.to(self._v.dtype)

    # ------------------------------------------------------------------ Runner
    def prefill(self, slot: int, ids: np.ndarray, spk_emb: np.ndarray | None) -> None:
        torch = self._torch
        slot = self.check_slot(slot)
        ids = self.check_prompt(ids, spk_emb)
        t, buf = ids.shape[0], self._buf["gpt"]
        with torch.inference_mode():
            idx = torch.from_numpy(ids).to(self.device)
            emb = self._emb_text[idx]
            if spk_emb is not None:
                spk = torch.from_numpy(np.asarray(spk_emb, np.float32)).to(self.device)
                emb[idx == self._spk_id] = spk / spk.norm().clamp_min(1e-12)
            buf["emb"].view(-1)[: t * emb.shape[1]].copy_(emb.reshape(-1))
            buf["pos"][:1] = 0
            buf["slots"][:1] = slot
            self._gpt("gpt_prefill", 1, t, 1)
            self._logits0[slot] = buf["logits"].view(-1)[: self._logits0[0].numel()].view_as(self._logits0[0])
            self._hid[slot, 0] = buf["hidden"].view(-1)[: self.info.hidden_size]
        self.pos_host[slot] = t

    def start(self, slot: int, params: SamplingParams, seed: int) -> np.ndarray:
        torch = self._torch
        slot = self.check_slot(slot)
        with torch.inference_mode():
            self.sampler.configure(slot, params, seed)
            sl = slice(slot, slot + 1)
            self._codes[sl] = self.sampler.sample(self._logits0[sl], sl)
            return self._codes[slot].cpu().numpy().copy()

    def step(self, slots: np.ndarray, k: int) -> np.ndarray:
        """See :meth:`Runner.step`. Every row of the sampler draws (rows outside ``slots`` hold no
        live sentence: the decode loop steps all of them together)."""
        torch = self._torch
        slots = self.check_slots(slots)
        b, top = slots.shape[0], int(self.pos_host[slots].max())
        if top >= self.info.max_seq_len:
            raise CapacityError(f"position {top} reaches the KV-cache length model.max_seq_len {self.info.max_seq_len}")
        k = max(1, min(int(k), self.step_chunk, self.info.max_seq_len - top))
        buf, M = self._buf["gpt"], self.info.max_batch
        with torch.inference_mode():
            sd = torch.from_numpy(slots).to(self.device)
            for j in range(k):
                codes = self._codes[sd]
                buf["emb"].view(-1)[: b * self.info.hidden_size].copy_(
                    self._emb_code[(codes + self._code_off).reshape(-1)].view(b, -1, self.info.hidden_size).sum(1).reshape(-1))
                buf["pos"][:b] = torch.from_numpy(self.pos_host[slots] + j).to(self.device)
                buf["slots"][:b] = sd
                self._gpt("gpt", b, 1, top + j)
                hidden = buf["hidden"].view(-1)[: b * self.info.hidden_size].view(b, -1)
                self._hid[sd, self.sampler.steps[sd]] = hidden
                self._logits_all[sd] = buf["logits"].view(-1)[: self._logits0[:b].numel()].view(b, *self._logits0.shape[1:])
                new = self.sampler.sample(self._logits_all, slice(0, M))
                self._codes[sd] = new[sd]
                self._ring[j, :b] = new[sd]
            self._h_codes[:k, :b].copy_(self._ring[:k, :b])
        self.pos_host[slots] += k
        return self._h_codes[:k, :b].numpy()

    def vocode(self, slot: int, w: VocodeWindow) -> tuple[np.ndarray, np.ndarray]:
        torch = self._torch
        slot = self.check_slot(slot)
        self.check_window(slot, w)
        win = int(self.manifest["limits"]["window_tokens"])
        nb = self._s["n_fft"] // 2 + 1
        with torch.inference_mode():
            if w.h1 > w.h0:
                def dec(h):
                    self._buf["decoder"]["hidden"].view(-1)[: h.numel()].copy_(h.reshape(-1))
                    self._execute("decoder", {"hidden": tuple(h.shape)})
                    nm = self._s["n_mels"]
                    return self._buf["decoder"]["mel"].view(-1)[: nm * 2 * h.shape[0]].view(nm, 2 * h.shape[0]).clone()

                mel = run_windowed(dec, self._hid[slot, w.h0:w.h1], 0, win, (self.info.decoder_rf + 1) // 2 + 1, 1, 2,
                                   cat=torch.cat)
                self._mel[slot, :, w.m0:w.m1] = mel[:, w.m0 - 2 * w.h0:w.m1 - 2 * w.h0]
            f = w.s1 - w.s0
            if f == 0:
                return np.zeros((0, nb), np.float32), np.zeros((0, nb), np.float32)

            def voc(x):
                vb = self._buf["vocos"]
                vb["mel"].view(-1)[: x.numel()].copy_(x.reshape(-1))
                self._execute("vocos", {"mel": tuple(x.shape)})
                n = x.shape[1] * nb
                return torch.cat([vb["real"].view(-1)[:n].view(-1, nb), vb["imag"].view(-1)[:n].view(-1, nb)], 1)

            y = run_windowed(voc, self._mel[slot, :, w.v0:w.v1], 1, 2 * win, self.info.vocos_rf + 1, 0, 1, cat=torch.cat)
            a = w.s0 - w.v0
            self._h_spec[0, :f].copy_(y[a:a + f, :nb])
            self._h_spec[1, :f].copy_(y[a:a + f, nb:])
        spec = self._h_spec.numpy()
        return spec[0, :f], spec[1, :f]

    def hidden(self, slot: int, t0: int, t1: int) -> np.ndarray:
        return self._hid[self.check_slot(slot), t0:t1].cpu().numpy()

    def device_memory_bytes(self) -> int:
        """Engine memory (manifest) plus what torch's allocator holds (buffers, KV cache)."""
        return int(self.manifest.get("memory", {}).get("activations_bytes") or 0) + \
            int(self._torch.cuda.memory_reserved(self.device))

    def close(self) -> None:
        """Drop contexts, engines and buffers (idempotent)."""
        self._ctx, self._eng, self._buf = {}, {}, {}
