"""The GPU fast path: prefill, first draw and decode step with on-device sampling, replayed as CUDA graphs.

:class:`CudaRunner` is a :class:`~appliance.engines.torch_runner.TorchRunner` (same ``decoder``,
``vocos``, same checks) whose prefill and decode step are rebuilt for the GPU, in the style of
gpt-fast (pytorch-labs/gpt-fast ``generate.py``: static KV cache, ``decode_one_token`` captured,
optionally compiled):

* Weights in FP16/BF16 (or FP32), fused per layer: one QKV matrix ``[3D, D]`` and one gate/up
  matrix ``[2F, D]`` (the model's ``q_proj``... become views of them, so no copy is kept);
  optionally INT8 or FP8 (e4m3, sm >= 8.9) weight-only with one scale per output row
  (:class:`QuantLinear`; ``model.quant``).
* A static KV cache of one K and one V tensor ``[S, H, Lmax, hd]`` per layer for
  ``S = model.max_batch`` channels, allocated once (per-layer tensors, not views of one big one,
  so that a compiled step updates them in place). Rows are *physical*: before a step for logical
  slots ``[s0, s1, ...]`` the runner permutes rows so that slot ``s_i`` sits in row ``i``
  (:meth:`CudaRunner._ensure_rows`, a copy only when the batch membership changes), so the step
  for ``b`` rows reads the views ``kc[i][:b, :, :L]`` with no gather.
* The step for ``(b, L)`` — ``b`` rows, attention over ``L`` cache positions (a bucket >= the
  longest position) — embeds the previous codes, runs the 20 layers, the 4 audio heads and
  :class:`DeviceSampler`, writes codes/hidden into device rings and advances the positions, all
  on device. It is captured once per ``(b, L)`` at start-up (:class:`GraphSeam`: CUDA graphs on
  a GPU, eager calls on a CPU so that tests run the same logic) and replayed. With
  ``compile=...`` the step body goes through ``torch.compile`` (inductor fuses the norms, RoPE,
  K/V writes, residuals and most of the sampler) before it is captured in our graph.
* The prefill pads the embedded prompt to a length bucket and runs the layers as one captured
  graph per bucket (:meth:`CudaRunner._prefill_body`); the first draw (:meth:`CudaRunner.begin`)
  is a captured graph per row.
* :meth:`CudaRunner.decode_many` replays ``k`` steps and copies codes ``[k, b, 4]`` and hidden
  ``[k, b, D]`` into a pinned host pool (:mod:`appliance.engines.pinned`) with ONE host sync:
  the optional capability used by :class:`appliance.synth.decode_loop.DecodeLoop` (``begin`` +
  ``decode_many``); the plain per-step :meth:`decode` still works (host sampling).

Measured on an H200 (bench/RESULTS.md): 1.59 ms per step at B=1 with plain graphs, 0.83 ms compiled.

Sampling on the device (:class:`DeviceSampler`) follows upstream ChatTTS 0.2.5 exactly as the host
:class:`appliance.engines.sampling.Sampler` does (temperature, repetition penalty over the last 16
codes, HF top-P then top-K keeping >= 3, EOS masked before ``min_new_tokens``); the draw is an
inverse-CDF draw with one uniform per (row, codebook) from a counter-based SplitMix64 hash of
(request seed, step, codebook) (Steele et al. 2014), so a request's codes do not depend on what
else is in the batch. Same seed on the host sampler gives other codes (other random stream).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import Config
from ..core import AUDIO_EOS, SamplingParams
from ..errors import CapacityError, ConfigError, EngineError
from ..model.checkpoint import load_model
from .pinned import PinnedPool
from .runner import RunnerInfo, receptive_fields
from .sampling import MIN_KEEP, PENALTY_WINDOW
from .torch_runner import _DTYPES, TorchRunner

log = logging.getLogger(__name__)

QUANT_MODES = (None, "int8", "fp8")
# CudaRunner(compile=...) -> torch.compile mode ("default" = inductor's default; None = not compiled)
COMPILE_MODES = {False: None, True: "default", "none": None, "default": "default",
                 "max-autotune-no-cudagraphs": "max-autotune-no-cudagraphs"}


def torch_pinned_allocator(nbytes: int) -> np.ndarray:
    """CUDA page-locked host memory as ``uint8 [nbytes]`` (plain memory without CUDA)."""
    t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    a = t.numpy()
    torch_pinned_allocator._keep.append(t)  # the numpy view does not own the storage
    return a


torch_pinned_allocator._keep = []  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------------- weights

class QuantLinear(nn.Module):
    """Weight-only quantized linear: ``y = (x @ dequant(Wq).T) * scale`` with one scale per output row.

    Args:
        w: float weight ``[out, in]`` (quantized here, from float32).
        mode: ``int8`` (symmetric, +-127) or ``fp8`` (``float8_e4m3fn``, +-448).
        dtype: compute dtype (float16 / bfloat16 / float32).

    The dequantize (``Wq.to(dtype)``) runs per call: this saves memory and weight bytes at rest,
    not time, unless a compiler fuses the cast into the matmul.
    """

    def __init__(self, w: torch.Tensor, mode: str, dtype: torch.dtype):
        super().__init__()
        w32 = w.detach().float()
        amax = w32.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
        if mode == "int8":
            scale = amax / 127.0
            q = torch.round(w32 / scale).clamp_(-127, 127).to(torch.int8)
        elif mode == "fp8":
            scale = amax / 448.0
            q = (w32 / scale).to(torch.float8_e4m3fn)
        else:
            raise ConfigError(f"quantization {mode!r}: use int8 or fp8")
        self.mode, self.dtype = mode, dtype
        self.register_buffer("wq", q)
        self.register_buffer("scale", scale.view(-1).to(dtype))

    @property
    def weight(self) -> torch.Tensor:
        """Dequantized weight ``[out, in]`` in the compute dtype (a new tensor)."""
        return self.wq.to(self.dtype) * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.wq.to(x.dtype)) * self.scale.to(x.dtype)

    def rows(self, a: int, b: int) -> "QuantLinear":
        """A QuantLinear sharing rows ``a:b`` of this one (views, no copy)."""
        r = QuantLinear.__new__(QuantLinear)
        nn.Module.__init__(r)
        r.mode, r.dtype = self.mode, self.dtype
        r.register_buffer("wq", self.wq[a:b])
        r.register_buffer("scale", self.scale[a:b])
        return r


class _Lin(nn.Module):
    """Plain bias-free linear over a given weight tensor (possibly a view)."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(w, requires_grad=False)

    def forward(self, x):
        return F.linear(x, self.weight)

    def rows(self, a: int, b: int) -> "_Lin":
        return _Lin(self.weight.data[a:b])


def fuse_weights(model, quant: Optional[str], dtype: torch.dtype, device=None) -> list[dict]:
    """Fuse each layer's q/k/v and gate/up projections; return per-layer fused modules.

    The model's own ``q_proj``, ``k_proj``, ... are replaced by row views of the fused weights
    (prefill keeps working, no second copy). With ``quant`` the GPT linears become
    :class:`QuantLinear` (quantized from the float32 weights). Returns
    ``[{"qkv", "o", "gu", "down", "ln1", "ln2"}]``. The fused weights are built from the (float32)
    model weights and moved to ``device`` one at a time (no float32 copy on the device).
    """
    out = []
    for blk in model.gpt.layers:
        a, m = blk.self_attn, blk.mlp
        d, f = a.q_proj.weight.shape[0], m.gate_proj.weight.shape[0]

        def mk(w):
            lin = QuantLinear(w, quant, dtype) if quant else _Lin(w.to(dtype).contiguous())
            return lin.to(device) if device is not None else lin

        qkv = mk(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0).detach())
        gu = mk(torch.cat([m.gate_proj.weight, m.up_proj.weight], 0).detach())
        o, down = mk(a.o_proj.weight.detach()), mk(m.down_proj.weight.detach())
        a.q_proj, a.k_proj, a.v_proj, a.o_proj = qkv.rows(0, d), qkv.rows(d, 2 * d), qkv.rows(2 * d, 3 * d), o
        m.gate_proj, m.up_proj, m.down_proj = gu.rows(0, f), gu.rows(f, 2 * f), down
        out.append({"qkv": qkv, "o": o, "gu": gu, "down": down,
                    "ln1": blk.input_layernorm, "ln2": blk.post_attention_layernorm})
    return out


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    # HF LlamaRMSNorm numerics: normalised in float32, cast, then times the weight in the model
    # dtype. F.rms_norm is one fused kernel on CUDA where torch has one (else the same ops).
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.eps).to(x.dtype)


def _rotate(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


# ----------------------------------------------------------------------------------------- sampler

_M64 = (1 << 64) - 1


def _s64(c: int) -> int:
    """An unsigned 64-bit constant as the signed int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix_uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Uniform float64 in [0, 1) from SplitMix64 of ``seed + (counter + 1) * golden`` (int64 tensors,
    broadcast); the same bits on CPU and CUDA (wrapping int64 arithmetic)."""
    z = seed + (counter + 1) * _s64(0x9E3779B97F4A7C15)
    z = (z ^ _shr(z, 30)) * _s64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _s64(0x94D049BB133111EB)
    z = z ^ _shr(z, 31)
    return _shr(z, 11).double() * (1.0 / (1 << 53))


def splitmix_uniform_ref(seed: int, counter: int) -> float:
    """Pure-Python reference of :func:`splitmix_uniform` (tests)."""
    z = (seed + (counter + 1) * 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z = z ^ (z >> 31)
    return (z >> 11) / float(1 << 53)


class DeviceSampler:
    """Upstream ChatTTS sampling for rows of a batch, all state on ``device`` (graph-capturable).

    Per row (= physical KV row): temperature ``[R, Q, 1]``, penalty, ``1 - top_p`` (-1 = off),
    top-K index ``V - max(top_k, 3)``, ``min_new_tokens``, greedy flag, seed, ``steps`` (codes
    produced), penalty window ring ``hist [R, Q, 16]`` with counts ``[R, Q, V]``.
    :meth:`sample` works on the row range ``sl`` (a slice) without any host sync.
    """

    def __init__(self, rows: int, num_vq: int, vocab: int, device, eos: int = AUDIO_EOS,
                 window: int = PENALTY_WINDOW):
        R, Q, V = rows, num_vq, vocab
        self.rows, self.num_vq, self.vocab, self.eos, self.window = R, Q, V, eos, window
        kw = dict(device=device)
        self.temp = torch.ones(R, Q, 1, **kw)
        self.penalty = torch.ones(R, Q, 1, **kw)
        self.omp = torch.full((R, Q, 1), -1.0, **kw)
        self.kidx = torch.zeros(R, Q, 1, dtype=torch.int64, **kw)
        self.min_new = torch.zeros(R, dtype=torch.int64, **kw)
        self.greedy = torch.zeros(R, dtype=torch.bool, **kw)
        self.seed = torch.zeros(R, dtype=torch.int64, **kw)
        self.steps = torch.zeros(R, dtype=torch.int64, **kw)
        self.recorded = torch.zeros(R, dtype=torch.int64, **kw)
        self.hist = torch.zeros(R, Q, window, dtype=torch.int64, **kw)
        self.counts = torch.zeros(R, Q, V, **kw)
        self._tail = torch.zeros(V, dtype=torch.bool, **kw)
        self._tail[: V - MIN_KEEP] = True  # positions of the ascending order top-P may remove
        self._q = torch.arange(Q, dtype=torch.int64, **kw)

    def state(self) -> list[torch.Tensor]:
        """Per-row state tensors (first dim = row), for row permutations."""
        return [self.temp, self.penalty, self.omp, self.kidx, self.min_new, self.greedy, self.seed,
                self.steps, self.recorded, self.hist, self.counts]

    def configure(self, row: int, params: SamplingParams, seed: int) -> None:
        """Start a request in ``row``: parameters, empty window, ``steps = 0``."""
        Q, V = self.num_vq, self.vocab
        t = params.temperature if isinstance(params.temperature, tuple) else (params.temperature,) * Q
        self.temp[row, :, 0] = torch.tensor(t, dtype=torch.float32)
        self.penalty[row] = float(params.repetition_penalty)
        self.omp[row] = -1.0 if params.top_p is None else float(np.float32(1.0 - params.top_p))
        k = V if params.top_k is None else min(max(params.top_k, MIN_KEEP), V)
        self.kidx[row] = V - k
        self.min_new[row] = int(params.min_new_tokens)
        self.greedy[row] = bool(params.greedy)
        self.seed[row] = int(np.int64(np.uint64(int(seed) & _M64)))
        self.steps[row] = 0
        self.recorded[row] = 0
        self.hist[row] = 0
        self.counts[row] = 0

    def process(self, logits: torch.Tensor, sl: slice) -> torch.Tensor:
        """Scores before the draw: ``logits float32 [b, Q, V]`` for rows ``sl`` -> ``[b, Q, V]``
        (temperature, penalty, top-P, top-K, EOS mask; ``-inf`` = removed)."""
        x = logits / self.temp[sl]
        alpha = torch.pow(self.penalty[sl], self.counts[sl])
        x = torch.where(x < 0, x * alpha, x / alpha)
        srt, idx = torch.sort(x, dim=-1, stable=True)
        cum = srt.softmax(-1).cumsum(-1)
        srt = srt.masked_fill((cum <= self.omp[sl]) & self._tail, float("-inf"))
        thr = srt.gather(-1, self.kidx[sl])
        x = torch.empty_like(x).scatter_(-1, idx, srt)
        x = x.masked_fill(x < thr, float("-inf"))
        eos_masked = (self.steps[sl] < self.min_new[sl])[:, None]
        x[:, :, self.eos] = torch.where(eos_masked, float("-inf"), x[:, :, self.eos])
        return x

    def sample(self, logits: torch.Tensor, sl: slice) -> torch.Tensor:
        """Process, draw and record one step for rows ``sl``; returns codes ``int64 [b, Q]``."""
        x = self.process(logits, sl)
        V, Q = self.vocab, self.num_vq
        probs = x.softmax(-1)
        cum = probs.cumsum(-1)
        u = splitmix_uniform(self.seed[sl][:, None], self.steps[sl][:, None] * Q + self._q).float()  # [b, Q]
        drawn = (cum <= (u[..., None] * cum[..., -1:])).sum(-1).clamp_max(V - 1)
        codes = torch.where(self.greedy[sl][:, None], x.argmax(-1), drawn)
        self._record(codes, sl)
        return codes

    def _record(self, codes: torch.Tensor, sl: slice) -> None:
        W = self.window
        rec = self.recorded[sl]
        j = (rec % W)[:, None, None].expand(-1, self.num_vq, 1)
        hist, counts = self.hist[sl], self.counts[sl]
        old = hist.gather(2, j)
        counts.scatter_add_(2, old, -(rec >= W).float()[:, None, None].expand(-1, self.num_vq, 1).contiguous())
        hist.scatter_(2, j, codes[..., None])
        counts.scatter_add_(2, codes[..., None], torch.ones_like(codes[..., None], dtype=counts.dtype))
        self.recorded[sl] += 1
        self.steps[sl] += 1


# ----------------------------------------------------------------------------------------- graph seam

class GraphSeam:
    """Turns ``fn`` (a step for one ``(b, L)``) into a replayable callable, once per key.

    ``cuda=True``: warm up ``fn`` on a side stream, capture it into a ``torch.cuda.CUDAGraph``
    (all graphs share one memory pool: nothing in it is live between replays) and return
    ``graph.replay``. ``cuda=False``: return ``fn`` itself (CPU tests run the same logic).
    ``before_capture()`` runs before each warm-up (resets state the warm-up mutates).
    ``captures`` counts captures per key.
    """

    def __init__(self, cuda: bool, warmup: int = 2):
        self.cuda, self.warmup = cuda, warmup
        self.graphs: dict = {}
        self.captures: dict = {}
        self._pool = None
        self._stream = None  # ONE warm-up stream: cuBLAS keeps a workspace per stream (tens of MiB each)

    def get(self, key, fn: Callable[[], None], before_capture: Callable[[], None] = lambda: None) -> Callable[[], None]:
        """The replay callable for ``key`` (captured on first use)."""
        g = self.graphs.get(key)
        if g is not None:
            return g
        self.captures[key] = self.captures.get(key, 0) + 1
        if not self.cuda:
            self.graphs[key] = fn
            return fn
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        s = self._stream
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(self.warmup):
                before_capture()
                fn()
        torch.cuda.current_stream().wait_stream(s)
        before_capture()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            fn()
        if self._pool is None:
            self._pool = graph.pool()
        self.graphs[key] = graph.replay
        return graph.replay


def kv_buckets(max_seq: int, smallest: int = 256) -> list[int]:
    """Attention spans captured: powers of two from ``smallest`` below ``max_seq``, then ``max_seq``."""
    out, L = [], smallest
    while L < max_seq:
        out.append(L)
        L *= 2
    return out + [max_seq]


# ----------------------------------------------------------------------------------------- runner

class CudaRunner(TorchRunner):
    """PyTorch runner with a graph-captured decode step and on-device sampling (module doc).

    Args:
        cfg: configuration (``model.*`` as :class:`TorchRunner`; ``model.device`` may be ``cpu``
            for tests: then the graph seam runs eagerly).
        reason: why this backend was chosen.
        quant: None, ``int8`` or ``fp8`` (weight-only; fp8 needs sm >= 8.9 on CUDA).
        graphs: capture CUDA graphs (default: on CUDA).
        compile: ``torch.compile`` the step body (inductor fusion) before capturing it into our own
            CUDA graph: ``True``/``"default"`` (inductor default mode) or an inductor mode name such
            as ``"max-autotune-no-cudagraphs"`` (Triton GEMV templates, autotuned at start-up; slow
            start). Each captured ``(b, L)`` is one compilation (static shapes) unless
            ``compile_dynamic``.
        compile_dynamic: let dynamo make ``b`` and ``L`` symbolic after they first change (a few
            compilations cover every ``(b, L)``; each is still captured in its own graph). Checked
            for equality on the CPU only; on the H200 its start-up for 12 graphs exceeded 75 s
            and its step time is not measured (bench/RESULTS.md).
        buckets: attention spans to capture (default :func:`kv_buckets`).
        max_chunk: most steps one :meth:`decode_many` runs (device ring size).
        capture_batches: batch sizes captured at start-up (default ``1..max_batch``; others lazily).
        prefill_graphs: run the prefill and the first draw (:meth:`begin`) as captured graphs too
            (prompt padded to a length bucket; False = the eager :class:`TorchRunner` prefill).
        prefill_buckets: prompt-length buckets (default powers of two from 32, then
            ``max_prompt_tokens``).

    Raises:
        CheckpointError, CapacityError: as :class:`TorchRunner`.
        ConfigError: unknown ``quant``; fp8 on a GPU below sm 8.9; cuda requested without a GPU.
    """

    def __init__(self, cfg: Config, reason: str = "", *, quant: Optional[str] = None, graphs: Optional[bool] = None,
                 compile: bool | str = False, buckets: Optional[list[int]] = None, max_chunk: int = 16,
                 capture_batches: Optional[list[int]] = None, prefill_graphs: bool = True,
                 prefill_buckets: Optional[list[int]] = None, compile_dynamic: bool = False):
        from .torch_runner import pick_device

        if quant is None:
            quant = getattr(cfg.model, "quant", None)
        if quant == "none":
            quant = None
        mode = COMPILE_MODES.get(compile, compile) if isinstance(compile, (bool, str)) else compile
        if mode not in COMPILE_MODES.values():
            raise ConfigError(f"compile mode {compile!r}: use one of {sorted(set(COMPILE_MODES.values()) - {None})}")
        if quant not in QUANT_MODES:
            raise ConfigError(f"quantization {quant!r}: use one of int8, fp8 or none")
        mc = cfg.model
        self.device = pick_device(mc.device)
        cuda = self.device.type == "cuda"
        if quant == "fp8" and cuda and torch.cuda.get_device_capability(self.device) < (8, 9):
            cc = torch.cuda.get_device_capability(self.device)
            raise ConfigError(f"fp8 weights need compute capability >= 8.9, this GPU is sm {cc[0]}.{cc[1]}: use int8 or fp16")
        self.dtype, precision = _DTYPES[mc.dtype]
        if quant:
            precision = quant
        path = cfg.resolve(mc.path)
        try:
            m = load_model(path, "cpu", torch.float32)  # fp32 on the host; converted before the copy
            m.embed.head_text = nn.Identity()  # the text head is unused for audio (saves 32 MB)
            self.layers = fuse_weights(m, quant, self.dtype, self.device)
            for blk in m.gpt.layers:  # the linears are done (views of fused device tensors)
                blk.input_layernorm.to(dtype=self.dtype)
                blk.post_attention_layernorm.to(dtype=self.dtype)
            for mod in (m.gpt.norm, m.embed, m.decoder, m.vocos):
                mod.to(dtype=self.dtype)
            self.model = m.to(self.device)  # moves what is left; the fused views stay as they are
        except (RuntimeError, OSError) as e:
            raise EngineError(f"loading {path} on {self.device} failed: {e}") from e
        s = self.model.shapes
        if mc.max_seq_len > s.max_pos:
            raise CapacityError(f"model.max_seq_len {mc.max_seq_len} exceeds the checkpoint's max_position_embeddings {s.max_pos}")
        self.shapes = s
        S, Lmax, H, hd, D, Q, V = mc.max_batch, mc.max_seq_len, s.n_heads, s.head_dim, s.hidden, s.num_vq, s.num_audio_tokens
        dev, dt = self.device, self.dtype
        # ---- static state, allocated once
        # one K and one V tensor per layer (not views of one big tensor: a compiled step then
        # updates them in place, as gpt-fast's per-layer caches, instead of copying a base)
        self.kc = [torch.zeros(S, H, Lmax, hd, dtype=dt, device=dev) for _ in range(s.n_layers)]
        self.vc = [torch.zeros(S, H, Lmax, hd, dtype=dt, device=dev) for _ in range(s.n_layers)]
        self.kv_bytes = sum(t.numel() * t.element_size() for t in self.kc + self.vc)
        g = self.model.gpt
        g.k_cache, g.v_cache = self.kc, self.vc
        g.max_batch, g.max_seq = S, Lmax
        e = self.model.embed
        self.code_table = torch.cat([t.weight for t in e.emb_code], 0).contiguous()  # [Q*V, D]
        for i, t in enumerate(e.emb_code):
            t.weight.data = self.code_table[i * V:(i + 1) * V]
        self.head = torch.cat([h.weight for h in e.head_code], 0).contiguous()  # [Q*V, D]
        for i, h in enumerate(e.head_code):
            h.weight.data = self.head[i * V:(i + 1) * V]
        self.code_off = (torch.arange(Q, device=dev) * V).view(1, Q)
        self.sampler = DeviceSampler(S, Q, V, dev)
        self.codes_in = torch.zeros(S, Q, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(S, dtype=torch.int64, device=dev)
        self.last_logits = torch.zeros(S, Q, V, device=dev)
        self.logits_out = torch.zeros(S, Q, V, device=dev)
        self.hid_out = torch.zeros(S, D, device=dev)
        self.max_chunk = int(max_chunk)
        self._pf_logits = np.zeros((Q, V), np.float32)
        self._pf_hidden = np.zeros((D,), np.float32)
        self.codes_ring = torch.zeros(self.max_chunk, S, Q, dtype=torch.int64, device=dev)
        self.hid_ring = torch.zeros(self.max_chunk, S, D, device=dev)
        self.t = torch.zeros(1, dtype=torch.int64, device=dev)
        self._ar = torch.arange(S, device=dev)
        self._kpos = torch.arange(Lmax, device=dev)
        # captured prefill: the prompt embedding padded to a length bucket, its row and last index
        Tmax = min(mc.max_prompt_tokens, Lmax - 1)
        self.prefill_buckets = sorted({t for t in (prefill_buckets or kv_buckets(Tmax, 32)) if t <= Tmax} | {Tmax})
        self.pf_emb = torch.zeros(Tmax, D, dtype=dt, device=dev)
        self.pf_row = torch.zeros(1, dtype=torch.int64, device=dev)
        self.pf_last = torch.zeros(1, dtype=torch.int64, device=dev)
        self.pf_hidden = torch.zeros(1, D, device=dev)
        self.first_codes = torch.zeros(Q, dtype=torch.int64, device=dev)
        nf = s.n_fft // 2 + 1
        self.pool = PinnedPool({"codes": ((self.max_chunk, S, Q), "int64"), "hidden": ((self.max_chunk, S, D), "float32"),
                                "logits": ((S, Q, V), "float32"), "hid1": ((S, D), "float32"),
                                "pf_logits": ((Q, V), "float32"), "pf_hidden": ((D,), "float32"),
                                "first": ((Q,), "int64"),
                                # Decoder / Vocos windows up to max_seq_len tokens (2 mel frames each)
                                "dec_in": ((Lmax, D), "float32"), "mel": ((s.n_mels, 2 * Lmax), "float32"),
                                "voc_in": ((s.n_mels, 2 * Lmax), "float32"),
                                "re": ((2 * Lmax, nf), "float32"), "im": ((2 * Lmax, nf), "float32")},
                               allocator=torch_pinned_allocator if cuda else None)
        self._pt = {k: torch.from_numpy(self.pool[k]) for k in ("dec_in", "mel", "voc_in", "re", "im")}
        self._h_codes = torch.from_numpy(self.pool["codes"])
        self._h_hidden = torch.from_numpy(self.pool["hidden"])
        self._h_logits = torch.from_numpy(self.pool["logits"])
        self._h_hid1 = torch.from_numpy(self.pool["hid1"])
        self.row_of = list(range(S))  # logical slot -> physical row
        self.pos_host = np.zeros(S, np.int64)  # next write position per physical row
        self.buckets = sorted(set(buckets or kv_buckets(Lmax)))
        if self.buckets[-1] < Lmax:
            self.buckets.append(Lmax)
        self.seam = GraphSeam(cuda=cuda if graphs is None else bool(graphs and cuda), warmup=3 if mode else 2)
        self._body = self._step_body
        if mode is not None:
            import torch._dynamo as dyn

            for k in ("cache_size_limit", "recompile_limit"):
                if hasattr(dyn.config, k):
                    setattr(dyn.config, k, max(getattr(dyn.config, k), 64))
            # our own graph captures the compiled step: inductor must not add its own CUDA graphs
            # compile_dynamic: sizes that change between captures (b, L) become symbolic after the
            # first change, so all (b, L) share ~3 compilations instead of one each
            self._body = torch.compile(self._step_body, dynamic=None if compile_dynamic else False, fullgraph=True,
                                       mode=None if mode == "default" else mode)
        self.compiled = mode
        self.mem_before_capture = torch.cuda.memory_allocated(self.device) if cuda else 0
        self._event = torch.cuda.Event() if cuda else None
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters()) + \
            sum(b.numel() * b.element_size() for n, b in self.model.named_buffers() if "rope" not in n)
        self.step_weight_bytes = int(sum(
            sum(t.numel() * t.element_size() for t in (l[k].wq if isinstance(l[k], QuantLinear) else l[k].weight,))
            for l in self.layers for k in ("qkv", "o", "gu", "down")) + self.head.numel() * self.head.element_size())
        self.info = RunnerInfo(
            backend=f"torch-{self.device.type}", precision=precision, hidden_size=D, num_vq=Q, num_audio_tokens=V,
            max_batch=S, max_seq_len=Lmax, max_prompt_tokens=min(mc.max_prompt_tokens, Lmax - 1),
            weight_bytes=int(weight_bytes), kv_bytes_per_token=2 * s.n_layers * D * self.kc[0].element_size(),
            reason=reason, **receptive_fields(s.dec_layers, s.voc_layers))
        self._pf_graphs = bool(prefill_graphs)
        with torch.inference_mode():
            for b in (capture_batches if capture_batches is not None else range(1, S + 1)):
                for L in self.buckets:
                    self._graph(b, L)
            if self._pf_graphs:
                for T in self.prefill_buckets:
                    self._prefill_graph(T)
                for row in range(S):
                    self._begin_graph(row)
            self._reset_state()
        log.info("cuda runner: %s %s%s, %d rows x %d positions, weights %.1f MiB, KV %.1f MiB, graphs %s, buckets %s",
                 self.device, precision, f" compiled ({mode})" if mode else "", S, Lmax, weight_bytes / 2**20,
                 self.kv_bytes / 2**20, self.seam.cuda, self.buckets)

    # ------------------------------------------------------------------ the step
    def _step_body(self, b: int, L: int) -> None:
        """One decode step for rows ``0..b-1`` over ``L`` cache positions; all results stay on device."""
        sl = slice(0, b)
        dt = self.dtype
        s = self.shapes
        H, hd = s.n_heads, s.head_dim
        codes, pos, rows = self.codes_in[sl], self.pos[sl], self._ar[sl]
        x = self.code_table[(codes + self.code_off).view(-1)].view(b, s.num_vq, -1).sum(1)  # [b, D]
        cos = self.model.gpt.rope_cos[pos].to(dt)[:, None, None]  # [b, 1, 1, hd]
        sin = self.model.gpt.rope_sin[pos].to(dt)[:, None, None]
        mask = torch.zeros(b, 1, 1, L, dtype=dt, device=x.device).masked_fill_(
            (self._kpos[:L][None] > pos[:, None]).view(b, 1, 1, L), float("-inf"))
        for i, lw in enumerate(self.layers):
            qkv = lw["qkv"](_rms(x, lw["ln1"])).view(b, 3, H, hd)
            qk = _rotate(qkv[:, :2], cos, sin)  # q and k rotated together: [b, 2, H, hd]
            q, k = qk[:, 0], qk[:, 1]
            kc, vc = self.kc[i], self.vc[i]
            kc[rows, :, pos] = k
            vc[rows, :, pos] = qkv[:, 2]
            y = F.scaled_dot_product_attention(q[:, :, None], kc[sl, :, :L], vc[sl, :, :L], attn_mask=mask)
            x = x + lw["o"](y.reshape(b, H * hd))
            gu = lw["gu"](_rms(x, lw["ln2"]))
            f = gu.shape[-1] // 2
            x = x + lw["down"](F.silu(gu[:, :f]) * gu[:, f:])
        h = _rms(x, self.model.gpt.norm)  # [b, D]
        logits = F.linear(h, self.head).view(b, s.num_vq, -1).float()  # [b, Q, V]
        new = self.sampler.sample(logits, sl)
        self.logits_out[sl] = logits
        self.hid_out[sl] = h.float()
        t = self.t.expand(b)
        self.codes_ring.index_put_((t, rows), new)
        self.hid_ring.index_put_((t, rows), h.float())
        self.t.add_(1).remainder_(self.max_chunk)
        self.codes_in[sl] = new
        self.pos[sl] += 1

    def _graph(self, b: int, L: int) -> Callable[[], None]:
        """The replayable step for ``(b, L)``. A capture's warm-up runs write KV only at position
        ``L - 1`` of rows ``0..b-1`` (a future position, rewritten before it is read) and the
        small per-row state is saved and restored, so a lazy capture mid-request is safe."""
        if (b, L) in self.seam.graphs:
            return self.seam.graphs[(b, L)]
        small = self.sampler.state() + [self.codes_in, self.pos, self.t]
        saved = [x.clone() for x in small]

        def before():
            self.t.zero_()
            self.pos.fill_(L - 1)
        try:
            return self.seam.get((b, L), lambda: self._body(b, L), before)
        finally:
            for x, y in zip(small, saved):
                x.copy_(y)

    def _prefill_body(self, T: int) -> None:
        """Prompt of ``T`` (bucket) positions from ``pf_emb`` into row ``pf_row``: K/V at positions
        ``0..T-1`` and, for the position ``pf_last``, the final hidden ``pf_hidden [1, D]`` and the
        logits in ``last_logits[pf_row]``. Positions past the real prompt are zero embeddings: causal
        attention keeps them out of the real positions, and the K/V they leave behind lie at
        positions that decode steps overwrite before they read them (and are finite)."""
        dt, s = self.dtype, self.shapes
        H, hd = s.n_heads, s.head_dim
        x = self.pf_emb[:T]  # [T, D]
        cos = self.model.gpt.rope_cos[:T].to(dt)[:, None, None]  # [T, 1, 1, hd]
        sin = self.model.gpt.rope_sin[:T].to(dt)[:, None, None]
        for i, lw in enumerate(self.layers):
            qkv = lw["qkv"](_rms(x, lw["ln1"])).view(T, 3, H, hd)
            qk = _rotate(qkv[:, :2], cos, sin).permute(1, 2, 0, 3)  # [2, H, T, hd]
            v = qkv[:, 2].transpose(0, 1)  # [H, T, hd]
            self.kc[i][:, :, :T].index_copy_(0, self.pf_row, qk[1:2])
            self.vc[i][:, :, :T].index_copy_(0, self.pf_row, v[None])
            y = F.scaled_dot_product_attention(qk[0:1], qk[1:2], v[None], is_causal=True)  # [1, H, T, hd]
            x = x + lw["o"](y[0].transpose(0, 1).reshape(T, H * hd))
            gu = lw["gu"](_rms(x, lw["ln2"]))
            f = gu.shape[-1] // 2
            x = x + lw["down"](F.silu(gu[:, :f]) * gu[:, f:])
        h = _rms(x.index_select(0, self.pf_last), self.model.gpt.norm)  # [1, D]
        logits = F.linear(h, self.head).view(1, s.num_vq, -1).float()
        self.last_logits.index_copy_(0, self.pf_row, logits)
        self.pf_hidden.copy_(h.float())

    def _prefill_graph(self, T: int) -> Callable[[], None]:
        """The replayable prefill for bucket ``T``; its warm-up writes row 0's K/V (harmless: a
        prefill rewrites them) and ``last_logits[0]`` (restored)."""
        saved = self.last_logits.clone()
        try:
            return self.seam.get(("prefill", T), lambda: self._prefill_body(T), lambda: self.pf_row.zero_())
        finally:
            self.last_logits.copy_(saved)

    def _begin_body(self, row: int) -> None:
        sl = slice(row, row + 1)
        codes = self.sampler.sample(self.last_logits[sl], sl)
        self.codes_in[sl] = codes
        self.first_codes.copy_(codes[0])

    def _begin_graph(self, row: int) -> Callable[[], None]:
        """The replayable first draw (from ``last_logits``) for physical ``row``; sampler state restored."""
        small = self.sampler.state() + [self.codes_in]
        saved = [x.clone() for x in small]
        try:
            return self.seam.get(("begin", row), lambda: self._begin_body(row))
        finally:
            for x, y in zip(small, saved):
                x.copy_(y)

    def _prefill_bucket(self, t: int) -> int:
        for T in self.prefill_buckets:
            if T >= t:
                return T
        raise CapacityError(f"prompt of {t} tokens exceeds model.max_prompt_tokens {self.prefill_buckets[-1]}: split the text")

    def _reset_state(self) -> None:
        for tns in self.sampler.state() + [self.codes_in, self.pos, self.t, self.codes_ring, self.hid_ring]:
            tns.zero_()
        self.sampler.temp.fill_(1.0)
        self.sampler.penalty.fill_(1.0)
        self.sampler.omp.fill_(-1.0)
        self.pos_host[:] = 0

    def _bucket(self, n: int) -> int:
        for L in self.buckets:
            if L >= n:
                return L
        raise CapacityError(f"position {n - 1} reaches the KV-cache length model.max_seq_len {self.buckets[-1]}")

    def _ensure_rows(self, slots: list[int]) -> None:
        """Permute physical rows so that ``slots[i]`` lives in row ``i`` (copies only on change)."""
        S = self.info.max_batch
        if all(self.row_of[s] == i for i, s in enumerate(slots)):
            return
        rest = sorted((s for s in range(S) if s not in slots), key=lambda s: self.row_of[s])
        order = list(slots) + rest  # new row j holds slot order[j]
        src = torch.tensor([self.row_of[s] for s in order], device=self.device)
        for t in self.kc + self.vc:
            t.copy_(t.index_select(0, src))
        for tns in self.sampler.state() + [self.codes_in, self.pos, self.last_logits]:
            tns.copy_(tns.index_select(0, src))
        self.pos_host[:] = self.pos_host[src.cpu().numpy()]
        for j, s in enumerate(order):
            self.row_of[s] = j

    # ------------------------------------------------------------------ Runner
    #: refine-text's text mode is not wired to the physical-row KV layout and graphs of this
    #: runner yet: a pipeline with ``synthesis.refine_text`` refuses it at load.
    supports_text_mode = False

    def prefill(self, slot: int, ids: np.ndarray, spk_emb: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """As :meth:`TorchRunner.prefill` (same checks and errors); also keeps the last logits on
        the device for :meth:`begin`. With ``prefill_graphs`` the embedded prompt is padded to a
        length bucket and the 20 layers run as one captured graph (:meth:`_prefill_body`); the
        returned arrays are views of the pinned pool (valid until the next prefill)."""
        self._check_slot(slot)
        row = self.row_of[int(slot)]
        if not self._pf_graphs:
            logits, hidden = super().prefill(row, ids, spk_emb)
            self.last_logits[row] = torch.from_numpy(logits).to(self.device)
            self.pos_host[row] = len(np.asarray(ids).reshape(-1))
            return logits, hidden
        ids = self._check_prompt(ids, spk_emb)
        t = ids.shape[0]
        T = self._prefill_bucket(t)
        try:
            with torch.inference_mode():
                m = self.model
                spk = None if spk_emb is None else self._t(spk_emb, torch.float32)
                emb = m.embed_prompt(self._t(ids), spk)[0]  # [t, D]
                run = self._prefill_graph(T)  # (captured at start-up; a lazy capture resets pf_row)
                self.pf_emb[:t] = emb
                self.pf_emb[t:T] = 0
                self.pf_row.fill_(row)
                self.pf_last.fill_(t - 1)
                run()
                pt = torch.from_numpy(self.pool["pf_logits"])
                pt.copy_(self.last_logits[row], non_blocking=True)
                torch.from_numpy(self.pool["pf_hidden"]).copy_(self.pf_hidden[0], non_blocking=True)
                self._sync()
        except RuntimeError as e:
            raise EngineError(f"torch prefill failed: {e}") from e
        self.pos_host[row] = t
        return self.pool["pf_logits"], self.pool["pf_hidden"]

    def begin(self, slot: int, params: SamplingParams, seed: int) -> np.ndarray:
        """Start device sampling for ``slot`` after its :meth:`prefill`: configure the row, sample
        the first codes from the prefill logits (step 0) and make them the next step's input.

        Returns:
            int64 ``[Q]`` first codes (EOS in any codebook = the sequence is already over).
        """
        self._check_slot(slot)
        row = self.row_of[int(slot)]
        sl = slice(row, row + 1)
        with torch.inference_mode():
            self.sampler.configure(row, params, seed)
            self.pos[row] = int(self.pos_host[row])
            if not self._pf_graphs:
                codes = self.sampler.sample(self.last_logits[sl], sl)
                self.codes_in[sl] = codes
                return codes[0].cpu().numpy().copy()
            self._begin_graph(row)()  # captured at start-up for every row
            torch.from_numpy(self.pool["first"]).copy_(self.first_codes, non_blocking=True)
            self._sync()
            return self.pool["first"].copy()

    def decode_many(self, slots: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``k`` decode steps with on-device sampling for the logical ``slots [b]``, one host sync.

        Each slot continues from its device state (codes of its last step, next position, sampler
        window) set by :meth:`begin` and earlier calls. ``k`` is clipped to ``max_chunk`` and to the
        room left in the KV cache (at least 1 step is run).

        Returns:
            ``(codes int64 [k', b, Q], hidden float32 [k', b, D])``: step ``j`` row ``i`` are the codes
            sampled for ``slots[i]`` and the hidden state that predicted them (views of the pinned
            pool, valid until the next call). Rows keep decoding after EOS: the caller drops codes
            from a row's first EOS on.

        Raises:
            CapacityError: a slot's position reached ``max_seq_len``.
        """
        slots = [int(s) for s in np.asarray(slots).reshape(-1)]
        b = len(slots)
        if not 0 < b <= self.info.max_batch or len(set(slots)) != b:
            raise CapacityError(f"decode slots {slots} must be 1..{self.info.max_batch} distinct slots")
        with torch.inference_mode():
            self._ensure_rows(slots)
            top = int(self.pos_host[:b].max())
            k = max(1, min(int(k), self.max_chunk, self.info.max_seq_len - top))
            if top >= self.info.max_seq_len:
                raise CapacityError(f"position {top} reaches the KV-cache length model.max_seq_len {self.info.max_seq_len}")
            run = self._graph(b, self._bucket(top + k))
            self.t.zero_()
            for _ in range(k):
                run()
            self._h_codes[:k].copy_(self.codes_ring[:k], non_blocking=True)
            self._h_hidden[:k].copy_(self.hid_ring[:k], non_blocking=True)
            self._sync()
        self.pos_host[:b] += k
        return self.pool["codes"][:k, :b], self.pool["hidden"][:k, :b]

    def decode(self, slots: np.ndarray, codes: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One step (Runner interface, host sampling): replays the captured step for ``b`` rows.

        The device sampler also runs (its state for these rows is then meaningless for
        :meth:`decode_many`: do not mix both on one sequence)."""
        slots_a, codes, pos = self.check_decode_args(slots, codes, pos)
        b = slots_a.shape[0]
        with torch.inference_mode():
            self._ensure_rows(slots_a.tolist())
            self.codes_in[:b] = torch.from_numpy(codes).to(self.device)
            self.pos[:b] = torch.from_numpy(pos).to(self.device)
            self.t.zero_()
            self._graph(b, self._bucket(int(pos.max()) + 1))()
            self._h_logits[:b].copy_(self.logits_out[:b], non_blocking=True)
            self._h_hid1[:b].copy_(self.hid_out[:b], non_blocking=True)
            self._sync()
        self.pos_host[:b] = pos + 1
        return self.pool["logits"][:b], self.pool["hid1"][:b]

    def decoder(self, hidden: np.ndarray) -> np.ndarray:
        """GPT hidden ``[T, D]`` -> mel ``[100, 2T]`` float32, through pinned start-up buffers (a view,
        valid until the next call); windows longer than ``max_seq_len`` take the plain path."""
        hidden = np.asarray(hidden, np.float32)
        t = hidden.shape[0] if hidden.ndim == 2 else 0
        if t == 0 or t > self.info.max_seq_len or hidden.shape[1] != self.shapes.hidden:
            return super().decoder(hidden)
        try:
            with torch.inference_mode():
                self.pool["dec_in"][:t] = hidden
                x = self._pt["dec_in"][:t].to(self.device, non_blocking=True).to(self.dtype).T.unsqueeze(0)  # [1, D, T]
                self._pt["mel"][:, :2 * t].copy_(self.model.decoder(x)[0].float(), non_blocking=True)
                self._sync()
        except RuntimeError as e:
            raise EngineError(f"torch decoder failed: {e}") from e
        return self.pool["mel"][:, :2 * t]

    def vocos(self, mel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """mel ``[100, F]`` -> (real ``[F, 513]``, imag ``[F, 513]``) float32 views of pinned buffers
        (valid until the next call); longer windows take the plain path."""
        mel = np.asarray(mel, np.float32)
        f = mel.shape[1] if mel.ndim == 2 else 0
        if f == 0 or f > 2 * self.info.max_seq_len or mel.shape[0] != self.shapes.n_mels:
            return super().vocos(mel)
        try:
            with torch.inference_mode():
                self.pool["voc_in"][:, :f] = mel
                x = self._pt["voc_in"][:, :f].to(self.device, non_blocking=True).to(self.dtype).unsqueeze(0)
                re, im = self.model.vocos(x)
                self._pt["re"][:f].copy_(re[0].float(), non_blocking=True)
                self._pt["im"][:f].copy_(im[0].float(), non_blocking=True)
                self._sync()
        except RuntimeError as e:
            raise EngineError(f"torch vocos failed: {e}") from e
        return self.pool["re"][:f], self.pool["im"][:f]

    def _sync(self) -> None:
        if self._event is not None:
            self._event.record()
            self._event.synchronize()

    def close(self) -> None:
        """Drop graphs, weights and caches (idempotent)."""
        self.seam.graphs.clear()
        super().close()
