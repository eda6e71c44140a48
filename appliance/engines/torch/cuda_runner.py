"""The GPU fast path: the model's own decode step with on-device sampling, replayed as CUDA graphs.

:class:`CudaRunner` runs :class:`appliance.model.gpt.GPT` — the same module every backend uses —
in the style of gpt-fast (pytorch-labs/gpt-fast ``generate.py``: static KV cache, the decode step
captured once and replayed, optionally compiled):

* GPT weights in FP16/BF16 (or FP32), q/k/v and gate/up fused by the model itself; optionally INT8
  or FP8 weight-only (:mod:`appliance.model.quant`; ``model.quant``). The text head is dropped (no
  text mode on this runner). The Decoder and Vocos run in FP32 (in FP16 the calibrated
  look-ahead on the H200 was 40 of 53 steps, in FP32 16), as the stateful passes of
  :mod:`appliance.model.stream` with their caches on the device.
* The static KV cache is the model's (``GPT.setup_cache``: one K and one V tensor
  ``[S, H, Lmax, hd]`` per layer). Rows are *physical*: before a step for logical slots
  ``[s0, s1, ...]`` the runner permutes rows so that slot ``s_i`` sits in row ``i``
  (:meth:`CudaRunner._ensure_rows`, a copy only when the batch membership changes), so the step
  for ``b`` rows attends over the views ``k[:b, :, :L]`` (:class:`appliance.model.kv.DecodeRows`).
* The step for ``(b, L)`` — ``b`` rows, attention over ``L`` positions (a bucket above the longest
  position) — embeds the previous codes, runs the GPT, the 4 audio heads and the
  :class:`~appliance.engines.torch.sampler.DeviceSampler`, stores the hidden state of each row in
  the slot's hidden buffer, writes the codes into a device ring and advances the positions, all on
  the device. It is captured once per ``(b, L)`` at start-up (:class:`~appliance.engines.torch.cuda_graphs.GraphSeam`:
  CUDA graphs on a GPU, eager calls on a CPU so tests run the same logic). The step's inductor
  fusion (norms, RoPE, K/V writes, residuals, most of the sampler) comes ahead of time from an
  AOTInductor package per ``(b, L)`` (``compile="aot"``, :mod:`~appliance.engines.torch.aot_step`, built by
  ``chattts-appliance engines compile``) or from ``torch.compile`` at start; building either needs
  Triton (not in JetPack's PyTorch). Modes: :mod:`~appliance.engines.torch.step_modes`.
* The prefill pads the embedded prompt to a length bucket and runs as one captured graph per
  bucket; the first draw (:meth:`CudaRunner.start`) is a captured graph per row.
* :meth:`CudaRunner.step` replays ``k`` steps and copies the codes ``[k, b, 4]`` into pinned host
  memory with ONE host sync; hidden states never leave the device, only the spectrum of the new
  frames comes back from :meth:`CudaRunner.vocode`.

H200 (bench/HISTORY.md): 1.6 ms per step at B=1 with plain graphs, 0.82 ms compiled.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np
import torch

from ...config import Config
from ...core import SamplingParams
from ...errors import CapacityError, ConfigError, EngineError
from ...model.checkpoint import load_model, release_host_memory
from ...model.kv import DecodeRows, PrefillSlot
from .aot_step import open_steps
from .cuda_graphs import GraphSeam, bucket, kv_buckets
from .cuda_vocoder import DeviceVocoder
from ..runner import Runner, RunnerInfo, VocodeWindow, receptive_fields
from .sampler import DeviceSampler
from .step_modes import COMPILE_MODES, compile_mode, jit_compile  # noqa: F401 (compile_mode: select, tests)
from .cpu_runner import _DTYPES, pick_device

log = logging.getLogger(__name__)

QUANT_MODES = (None, "int8", "fp8")


class CudaRunner(Runner):
    """The torch runner for CUDA: captured decode step, on-device sampling and vocoder (module doc).

    Args:
        cfg: configuration (``model.*``; ``model.device`` may be ``cpu`` for tests: the graph seam
            then runs eagerly).
        reason: why this backend was chosen.
        quant: None, ``int8`` or ``fp8`` (weight-only; fp8 needs sm >= 8.9 on CUDA); ``auto``: as None
            (the daemon's memory fit resolves ``model.quant: auto`` before the load).
        graphs: capture CUDA graphs (default: on CUDA).
        compile: the step mode (:mod:`appliance.engines.torch.step_modes`): False (plain graphs),
            ``"aot"`` (packages from ``aot_dir``, else plain graphs, the reason in ``step_source``),
            or ``torch.compile`` at start: ``True``/``"default"`` or ``"max-autotune-no-cudagraphs"``
            (each ``(b, L)`` one compilation, static shapes).
        buckets: attention spans to capture (default :func:`kv_buckets`).
        step_chunk: steps one :meth:`step` call should run (``info.step_chunk``; ring size 2x).
        capture_batches: batch sizes captured at start-up (default ``1..max_batch``; others lazily).
        prefill_buckets: prompt-length buckets (default powers of two from 32, then max_prompt_tokens).
        compile_cache: directory for inductor's compiled kernels and graphs (``TORCHINDUCTOR_CACHE_DIR``,
            set here: torch fills that variable with its default as soon as inductor is imported),
            so that a restart reuses them; None: inductor's default (``/tmp/torchinductor_<user>``).
        aot_dir: ``<model.engine_dir>/aot``, where ``engines compile`` put the packages (``compile="aot"``).

    Raises:
        CheckpointError, CapacityError: bad checkpoint, max_seq_len past the model's positions.
        ConfigError: unknown ``quant``/``compile``; fp8 below sm 8.9; cuda requested without a GPU.
        EngineError: loading on the device failed.
    """

    def __init__(self, cfg: Config, reason: str = "", *, quant: Optional[str] = None, graphs: Optional[bool] = None,
                 compile: bool | str = False, buckets: Optional[list[int]] = None, step_chunk: int = 8,
                 capture_batches: Optional[list[int]] = None, prefill_buckets: Optional[list[int]] = None,
                 compile_cache: Optional[str] = None, aot_dir: Optional[str] = None):
        quant = None if quant in (None, "none", "auto") else quant   # auto: the daemon's memory fit decided
        mode = COMPILE_MODES.get(compile, compile) if isinstance(compile, (bool, str)) else compile
        if mode not in COMPILE_MODES.values():
            raise ConfigError(f"compile mode {compile!r}: use one of {sorted(set(COMPILE_MODES.values()) - {None})}")
        if quant not in QUANT_MODES:
            raise ConfigError(f"quantization {quant!r}: use one of int8, fp8 or none")
        mc = cfg.model
        self.device = dev = pick_device(mc.device)
        cuda = dev.type == "cuda"
        if quant == "fp8" and cuda and torch.cuda.get_device_capability(dev) < (8, 9):
            cc = torch.cuda.get_device_capability(dev)
            raise ConfigError(f"fp8 weights need compute capability >= 8.9, this GPU is sm {cc[0]}.{cc[1]}: use int8 or fp16")
        self.dtype, precision = _DTYPES[mc.torch_dtype(gpu=True)]
        dt = self.dtype
        path = cfg.resolve(mc.path)
        context_bytes = 0
        if dev.type == "cuda":   # the bare CUDA context, before anything of ours (the GPU's only user assumed)
            torch.zeros(1, device=dev)
            free, total = torch.cuda.mem_get_info(dev)
            context_bytes = int(total - free)
        try:  # tensor by tensor onto the device in the final dtype; Decoder and Vocos FP32 (module doc)
            self.model = load_model(path, dev, dt, vocoder_dtype=torch.float32, quant=quant, text_head=False,
                                    verify=cfg.safety.verify_checkpoint)  # no text mode here: no text head
        except (RuntimeError, OSError) as e:
            raise EngineError(f"loading {path} on {dev} failed: {e}") from e
        self.weight_files = list(self.model.verified_files)
        s = self.shapes = self.model.shapes
        if mc.max_seq_len > s.max_pos:
            raise CapacityError(f"model.max_seq_len {mc.max_seq_len} exceeds the checkpoint's max_position_embeddings {s.max_pos}")
        S, Lmax, D, Q, V = mc.max_batch, mc.max_seq_len, s.hidden, s.num_vq, s.num_audio_tokens
        g = self.model.gpt
        g.setup_cache(S, Lmax, dt, dev)
        self.kv_bytes = sum(t.numel() * t.element_size() for t in g.k_cache + g.v_cache)
        # ---- device state, allocated once
        self.sampler = DeviceSampler(S, Q, V, dev)
        self.codes_in = torch.zeros(S, Q, dtype=torch.int64, device=dev)   # per physical row
        self.pos = torch.zeros(S, dtype=torch.int64, device=dev)
        self.last_logits = torch.zeros(S, Q, V, device=dev)
        self.row_slot = torch.arange(S, device=dev)                          # physical row -> logical slot
        self.hid = torch.zeros(S, Lmax, D, dtype=dt, device=dev)            # per logical slot
        self.step_chunk = max(1, int(step_chunk))
        self.ring = 2 * self.step_chunk
        self.codes_ring = torch.zeros(self.ring, S, Q, dtype=torch.int64, device=dev)
        self.t = torch.zeros(1, dtype=torch.int64, device=dev)
        self._ar = torch.arange(S, device=dev)
        Tmax = min(mc.max_prompt_tokens, Lmax - 1)
        self.prefill_buckets = sorted({t for t in (prefill_buckets or kv_buckets(Tmax, 32)) if t <= Tmax} | {Tmax})
        self.pf_emb = torch.zeros(1, Tmax, D, dtype=dt, device=dev)
        self.pf_pos = torch.arange(Tmax, device=dev).unsqueeze(0)
        self.pf_row = torch.zeros(1, dtype=torch.int64, device=dev)
        self.pf_slot = torch.zeros(1, dtype=torch.int64, device=dev)
        self.pf_last = torch.zeros(1, dtype=torch.int64, device=dev)
        self.first_codes = torch.zeros(Q, dtype=torch.int64, device=dev)
        # ---- pinned host buffers (the only device -> host traffic: codes and spectra)
        pin = dict(pin_memory=cuda)
        self._h_codes = torch.zeros(self.ring, S, Q, dtype=torch.int64, **pin)
        self._h_first = torch.zeros(Q, dtype=torch.int64, **pin)
        self.row_of = list(range(S))                # logical slot -> physical row
        self.pos_host = np.zeros(S, np.int64)       # next position per logical slot
        self.buckets = sorted(set(buckets or kv_buckets(Lmax)) | {Lmax})
        self.seam = GraphSeam(cuda=cuda if graphs is None else bool(graphs and cuda), warmup=3 if mode else 2)
        self._body = self._step_body if mode in (None, "aot") else jit_compile(self._step_body, mode, compile_cache)
        self.compiled = mode
        self._event = torch.cuda.Event() if cuda else None
        rf = receptive_fields(s.dec_layers, s.voc_layers)
        self.voc = DeviceVocoder(self.model, self.hid, rf["decoder_rf"], rf["vocos_rf"], self._sync)
        weight_bytes = sum(t.numel() * t.element_size() for t in list(self.model.parameters()) + [
            b for n, b in self.model.named_buffers() if "rope" not in n])
        self.info = RunnerInfo(
            backend=f"torch-{dev.type}", precision=quant or precision, hidden_size=D, num_vq=Q, num_audio_tokens=V,
            max_batch=S, max_seq_len=Lmax, max_prompt_tokens=Tmax, weight_bytes=int(weight_bytes),
            kv_bytes_per_token=g.kv_bytes_per_token(), reason=reason, num_text_tokens=s.num_text_tokens,
            text_mode=False, step_chunk=self.step_chunk, device=str(dev), context_bytes=context_bytes,
            engine_id=f"torch {torch.__version__} {quant or precision}",  # not the compile mode: windows are not compiled
            **rf)
        batches = list(capture_batches if capture_batches is not None else range(1, S + 1))
        self._aot, self.step_source = None, "plain CUDA graphs" if mode is None else f"compiled ({mode}) at start"
        if mode == "aot":
            self._aot, self.step_source = open_steps(self, aot_dir, path, [(b, L) for b in batches for L in self.buckets])
            self.buckets = (self._aot and self._aot.spans(batches, Lmax)) or self.buckets   # the set's spans
            self.compiled = "aot" if self._aot is not None else None
        try:
            self._capture_all(batches)
        except (RuntimeError, EngineError) as e:   # a package that loads but fails to run: the plain step
            if self._aot is None:
                raise
            self._aot, self.compiled, self.step_source = None, None, f"plain CUDA graphs: the ahead-of-time step failed ({e})"
            log.warning("decode step: %s", self.step_source)
            self.seam.clear()
            self._capture_all(batches)
        release_host_memory()  # what the captures and compilation freed on the host, before ready
        log.info("cuda runner: %s %s, %d rows x %d positions, weights %.1f MiB, KV %.1f MiB, graphs %s, buckets %s; step: %s",
                 dev, self.info.precision, S, Lmax, weight_bytes / 2**20, self.kv_bytes / 2**20, self.seam.cuda,
                 self.buckets, self.step_source)

    def _capture_all(self, batches: list[int]) -> None:
        with torch.inference_mode():
            for b in batches:
                for L in self.buckets:
                    self._graph(b, L)
            for T in self.prefill_buckets:
                self._prefill_graph(T)
            for row in range(self.info.max_batch):
                self._begin_graph(row)
            self._reset_state()

    # ------------------------------------------------------------------ captured bodies
    def _step_body(self, b: int, L: int) -> None:
        """One decode step for physical rows ``0..b-1`` over ``L`` cache positions; all on device."""
        m, sl = self.model, slice(0, b)
        pos, rows = self.pos[sl], self._ar[sl]
        x = m.embed.embed_codes(self.codes_in[sl]).unsqueeze(1)  # [b, 1, D]
        g = m.gpt
        h = g(x, pos.unsqueeze(1), DecodeRows(g.k_cache, g.v_cache, b, pos, L, rows, g.kpos))[:, 0]  # [b, D]
        self.hid.index_put_((self.row_slot[sl], self.sampler.steps[sl]), h)  # hidden n of each row's sentence
        new = self.sampler.sample(m.embed.audio_logits(h).float(), sl)
        self.codes_ring.index_put_((self.t.expand(b), rows), new)
        self.t.add_(1).remainder_(self.ring)
        self.codes_in[sl] = new
        self.pos[sl] += 1

    def _prefill_body(self, T: int) -> None:
        """Prompt of ``T`` (bucket) positions from ``pf_emb`` into physical row ``pf_row``: K/V at
        0..T-1, the logits of position ``pf_last`` into ``last_logits[pf_row]`` and its hidden state
        into ``hid[pf_slot, 0]``. Padded positions are zero embeddings after the real prompt:
        causal attention keeps them out of the real positions, and the K/V they leave behind lie
        at positions that decode steps overwrite before they read them."""
        m = self.model
        g = m.gpt
        h = g(self.pf_emb[:, :T], self.pf_pos[:, :T], PrefillSlot(g.k_cache, g.v_cache, self.pf_row))[0]  # [T, D]
        last = h.index_select(0, self.pf_last)  # [1, D]
        self.last_logits.index_copy_(0, self.pf_row, m.embed.audio_logits(last).float())
        self.hid[:, 0].index_copy_(0, self.pf_slot, last)

    def _begin_body(self, row: int) -> None:
        sl = slice(row, row + 1)
        codes = self.sampler.sample(self.last_logits[sl], sl)
        self.codes_in[sl] = codes
        self.first_codes.copy_(codes[0])

    def _graph(self, b: int, L: int) -> Callable[[], None]:
        """The replayable step for ``(b, L)``. A capture's warm-up runs write KV only at position
        ``L - 1`` of rows ``0..b-1`` (a future position, rewritten before it is read) and the
        small per-row state is saved and restored, so a lazy capture mid-request is safe."""
        if (b, L) in self.seam.graphs:
            return self.seam.graphs[(b, L)]
        fn = self._aot.fn(b, L) if self._aot is not None else None
        return self._capture((b, L), fn or (lambda: self._body(b, L)), lambda: (self.t.zero_(), self.pos.fill_(L - 1)),
                             self.sampler.state() + [self.codes_in, self.pos, self.t])

    def _prefill_graph(self, T: int) -> Callable[[], None]:
        return self._capture(("prefill", T), lambda: self._prefill_body(T), lambda: self.pf_row.zero_(),
                             [self.last_logits])

    def _begin_graph(self, row: int) -> Callable[[], None]:
        return self._capture(("begin", row), lambda: self._begin_body(row), lambda: None,
                             self.sampler.state() + [self.codes_in])

    def _capture(self, key, fn: Callable[[], None], before: Callable, keep: list[torch.Tensor]) -> Callable[[], None]:
        if key in self.seam.graphs:
            return self.seam.graphs[key]
        saved = [x.clone() for x in keep]
        try:
            return self.seam.get(key, fn, before)
        finally:
            for x, y in zip(keep, saved):
                x.copy_(y)

    # ------------------------------------------------------------------ helpers
    def _reset_state(self) -> None:
        self.sampler.reset()
        for t in (self.codes_in, self.pos, self.t, self.codes_ring):
            t.zero_()
        self.pos_host[:] = 0

    def _ensure_rows(self, slots: list[int]) -> None:
        """Permute physical rows so that ``slots[i]`` lives in row ``i`` (copies only on change)."""
        if all(self.row_of[s] == i for i, s in enumerate(slots)):
            return
        rest = sorted((s for s in range(self.info.max_batch) if s not in slots), key=lambda s: self.row_of[s])
        order = list(slots) + rest  # new row j holds slot order[j]
        src = torch.tensor([self.row_of[s] for s in order], device=self.device)
        g = self.model.gpt
        for t in g.k_cache + g.v_cache + self.sampler.state() + [self.codes_in, self.pos, self.last_logits]:
            t.copy_(t.index_select(0, src))
        self.row_slot.copy_(torch.tensor(order, device=self.device))
        for j, s in enumerate(order):
            self.row_of[s] = j

    def _sync(self) -> None:
        if self._event is not None:
            self._event.record()
            self._event.synchronize()

    # ------------------------------------------------------------------ Runner
    def prefill(self, slot: int, ids: np.ndarray, spk_emb: np.ndarray | None) -> None:
        """As :meth:`Runner.prefill`: the prompt is embedded, padded to a length bucket and run as
        one captured graph; nothing comes back to the host (no sync)."""
        slot = self.check_slot(slot)
        ids = self.check_prompt(ids, spk_emb)
        t = ids.shape[0]
        try:
            T = bucket(self.prefill_buckets, t)
            with torch.inference_mode():
                m = self.model
                spk = None if spk_emb is None else torch.from_numpy(np.asarray(spk_emb, np.float32)).to(self.device)
                emb = m.embed_prompt(torch.from_numpy(ids).to(self.device), spk)  # [1, t, D]
                run = self._prefill_graph(T)
                self.pf_emb[:, :t] = emb
                self.pf_emb[:, t:T] = 0
                self.pf_row.fill_(self.row_of[slot])
                self.pf_slot.fill_(slot)
                self.pf_last.fill_(t - 1)
                run()
        except RuntimeError as e:
            raise EngineError(f"torch prefill failed: {e}") from e
        self.pos_host[slot] = t
        self.voc.reset(slot)

    def start(self, slot: int, params: SamplingParams, seed: int) -> np.ndarray:
        slot = self.check_slot(slot)
        row = self.row_of[slot]
        with torch.inference_mode():
            self.sampler.configure(row, params, seed)
            self.pos[row] = int(self.pos_host[slot])
            self._begin_graph(row)()
            self._h_first.copy_(self.first_codes, non_blocking=True)
            self._sync()
        return self._h_first.numpy().copy()

    def step(self, slots: np.ndarray, k: int) -> np.ndarray:
        slots_l = self.check_slots(slots).tolist()
        b = len(slots_l)
        top = int(self.pos_host[slots_l].max())
        if top >= self.info.max_seq_len:
            raise CapacityError(f"position {top} reaches the KV-cache length model.max_seq_len {self.info.max_seq_len}: "
                                f"the sentence is too long, split it or raise max_seq_len")
        k = max(1, min(int(k), self.ring, self.info.max_seq_len - top))
        try:
            with torch.inference_mode():
                self._ensure_rows(slots_l)
                run = self._graph(b, bucket(self.buckets, top + k))
                self.t.zero_()
                for _ in range(k):
                    run()
                self._h_codes[:k].copy_(self.codes_ring[:k], non_blocking=True)
                self._sync()
        except RuntimeError as e:
            raise EngineError(f"torch decode step failed: {e}") from e
        self.pos_host[slots_l] += k
        return self._h_codes[:k, :b].numpy()

    def vocode(self, slot: int, w: VocodeWindow) -> tuple[np.ndarray, np.ndarray]:
        """See :meth:`Runner.vocode`: the stateful passes on the device
        (:class:`~appliance.engines.torch.cuda_vocoder.DeviceVocoder`, cuDNN off: its module doc)."""
        slot = self.check_slot(slot)
        self.check_window(slot, w)
        try:
            return self.voc(slot, w)
        except RuntimeError as e:
            raise EngineError(f"torch vocoder failed: {e}") from e

    def hidden(self, slot: int, t0: int, t1: int) -> np.ndarray:
        with torch.inference_mode():
            return self.hid[self.check_slot(slot), t0:t1].float().cpu().numpy()

    def device_memory_bytes(self) -> int:
        """Bytes the CUDA caching allocator holds for this process (weights, KV, graph pools)."""
        return int(torch.cuda.memory_reserved(self.device)) if self.device.type == "cuda" else 0

    def close(self) -> None:
        """Drop graphs, weights and caches (idempotent)."""
        self.seam.clear()
        if getattr(self, "model", None) is not None:
            self.model = None
            self.hid = self.voc = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
