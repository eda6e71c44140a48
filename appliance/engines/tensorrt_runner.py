"""The TensorRT backend (Jetson / RTX plans built by ``chattts-appliance engines build``).

**Not executed in this workplace.** There is no GPU here, and the only GPU lent (an H200,
sm_90) is refused by TensorRT-RTX plans, while full TensorRT cannot be installed (DESIGN.md
§3). What the tests run here: the manifest check (:func:`load_manifest`, before any CUDA
call), the buffer plan (:func:`plan_buffers`, from the manifest's I/O list and profile
maxima, since deserializing a plan needs a GPU), the exact windowing of long Decoder/Vocos
inputs (:func:`run_windowed`), and the error paths (no CUDA bindings, no GPU). The CUDA calls,
engine deserialization, ``set_input_shape`` / ``set_tensor_address`` / ``execute_async_v3`` and
the KV-cache copies below have **never run**; they follow NVIDIA's
``samples/python/common_runtime.py`` (TensorRT 8.5+ API, as JetPack 5.1+ ships).

Design (same graphs as ONNX Runtime, :mod:`appliance.build.export`):

* one engine per graph, one execution context per engine created at load, shapes set per
  call with ``set_input_shape``; every device buffer is allocated once at its profile maximum,
  host staging buffers come from one **pinned** pool allocated at start-up
  (:class:`_Cuda`: pycuda where installed, ``cuda-python`` otherwise);
* KV cache: per layer ``k``/``v`` device buffers ``[S, M, H, hd]`` (positions first) bound as the
  decode graph's static ``k_cache.i``/``v_cache.i`` inputs (in place, never copied); the length
  of the ``past`` input says how many positions the graph reads; the step's ``k_new`` /
  ``v_new [L, B, H, hd]`` rows are contiguous ``H x hd`` blocks at ``[pos[b], slots[b]]`` and are
  written with one device-to-device copy each on the same stream (2 x L x B small copies per
  step: a custom scatter kernel would be cheaper, not done); prefill's ``[L, T, H, hd]`` is one
  strided 2-D copy per layer and K/V;
* every CUDA status goes through :meth:`_Cuda.check` (one place) and becomes
  :class:`~appliance.errors.EngineError`;
* Decoder/Vocos inputs longer than the profile are cut into overlapping windows whose
  context covers the receptive field, so the result is exact (:func:`run_windowed`).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..config import Config
from ..errors import CapacityError, ConfigError, EngineError
from . import manifest as mf
from . import trt as trtshim
from .runner import Runner, RunnerInfo, receptive_fields

log = logging.getLogger(__name__)

PRECISIONS = ("fp8", "int8", "fp16")
_NP = {"float": np.float32, "half": np.float16, "int64": np.int64, "int32": np.int32, "bool": np.bool_,
       "uint8": np.uint8, "int8": np.int8}


def find_plans(cfg: Config) -> Path | None:
    """First ``<engine_dir>/trt/<precision>`` (order fp8, int8, fp16) holding a manifest."""
    return mf.find_built(cfg.resolve(cfg.model.engine_dir), "trt", PRECISIONS)


def load_manifest(cfg: Config, plan_dir: Path) -> dict:
    """Read ``plan_dir``'s manifest and refuse it unless TensorRT flavour/version, device
    (compute capability, board, L4T where known), checkpoint and limits match.

    Raises:
        EngineMismatchError: with ``rebuild with: ...``.
    """
    cfg_path = cfg.file_hint
    hint = mf.rebuild_hint(cfg_path, plan_dir.name, tensorrt=True)
    m = mf.read(plan_dir, hint)
    facts = mf.device_facts()
    expect = mf.expect_common(cfg, m, "tensorrt")
    expect["runtime"] = {"name": trtshim.flavor(), "version": trtshim.version()}
    expect["device"] = {k: facts.get(k) for k in ("compute_capability", "board", "l4t")}
    mf.check(m, expect, hint)
    return m


def plan_buffers(m: dict) -> dict[str, dict[str, dict[str, Any]]]:
    """Device buffers to allocate once: ``{graph: {tensor: {shape, dtype, nbytes, mode}}}``.

    Shapes are the profile maxima for dynamic inputs; outputs' dynamic dims are resolved from
    the limits (B = max_batch, T = max_prompt_tokens, window = window_tokens). The decode
    graph's ``k_cache.i`` / ``v_cache.i`` are *not* planned here: they are the KV cache itself
    (``kv`` key: ``[S, M, H, hd]`` per layer and K/V, positions first).

    Raises:
        EngineError: a dtype or dimension the plan cannot resolve.
    """
    lim, s = m["limits"], m["shapes"]
    M, S, T, W = lim["max_batch"], lim["max_seq_len"], lim["max_prompt_tokens"], lim["window_tokens"]
    H, L, D = s["n_heads"], s["n_layers"], s["hidden"]
    hd = D // H
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for g, e in m["graphs"].items():
        plan: dict[str, dict[str, Any]] = {}
        prof: dict[str, list[int]] = {}  # elementwise maximum over the profiles
        for pr in e.get("profiles", []):
            for n, (_, _, mx) in pr.items():
                prof[n] = [max(a, b) for a, b in zip(prof.get(n, mx), mx)]
        for t in e["inputs"]:
            if t["name"].startswith(("k_cache.", "v_cache.")):
                continue
            shape = list(prof[t["name"]]) if t["name"] in prof else list(t["shape"])
            plan[t["name"]] = {"shape": shape, "mode": "input"}
        for t in e["outputs"]:
            shape = list(t["shape"])
            if -1 in shape:
                if g == "gpt":  # decode: B = M, T = 1; prefill: B = 1, T = max_prompt_tokens
                    shape = {"logits": [M, s["num_vq"], s["num_audio_tokens"]], "hidden": [M, D],
                             "k_new": [L, M, T, H, hd], "v_new": [L, M, T, H, hd]}[t["name"]]
                elif g == "decoder":
                    shape = [s["n_mels"], 2 * W]
                elif g == "vocos":
                    shape = [2 * W, s["n_fft"] // 2 + 1]
            plan[t["name"]] = {"shape": shape, "mode": "output"}
        for t in e["inputs"] + e["outputs"]:
            if t["name"] in plan:
                dt = _NP.get(t["dtype"])
                if dt is None:
                    raise EngineError(f"{g}: tensor {t['name']} has dtype {t['dtype']} that the runner cannot stage")
                p = plan[t["name"]]
                if any(int(x) < 0 for x in p["shape"]):
                    raise EngineError(f"{g}: cannot resolve the shape {p['shape']} of {t['name']}")
                p["dtype"] = np.dtype(dt).name
                p["nbytes"] = int(np.prod(p["shape"])) * np.dtype(dt).itemsize
        out[g] = plan
    kv_dt = np.float16 if m.get("kv", {}).get("dtype") == "float16" else np.float32
    out["kv"] = {f"{kv}_cache.{i}": {"shape": [S, M, H, hd], "dtype": np.dtype(kv_dt).name, "mode": "state",
                                     "nbytes": S * M * H * hd * np.dtype(kv_dt).itemsize}
                 for kv in ("k", "v") for i in range(L)}
    return out


def run_windowed(fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray, axis: int, max_len: int, ctx: int,
                 out_axis: int, scale: int) -> np.ndarray:
    """Apply a convolutional ``fn`` to ``x`` in windows of at most ``max_len`` along ``axis``.

    Each window carries ``ctx`` input positions of context on both sides (>= the receptive
    field), so every kept output equals the one-pass result. ``fn``'s output has ``scale``
    positions per input position along ``out_axis``.

    Raises:
        EngineError: ``max_len`` leaves no room beyond the context (``max_len <= 2 * ctx``).
    """
    n = x.shape[axis]
    if n <= max_len:
        return fn(x)
    core = max_len - 2 * ctx
    if core <= 0:
        raise EngineError(f"window of {max_len} cannot hold 2 x {ctx} context positions: rebuild with a larger --window-tokens")
    parts = []
    for a in range(0, n, core):
        b = min(n, a + core)
        w0, w1 = max(0, a - ctx), min(n, b + ctx)
        y = fn(np.take(x, np.arange(w0, w1), axis=axis))
        parts.append(np.take(y, np.arange((a - w0) * scale, (b - w0) * scale), axis=out_axis))
    return np.concatenate(parts, axis=out_axis)


class _Cuda:
    """CUDA through pycuda (Jetson) or cuda-python; every status checked in :meth:`check`.

    Raises:
        ConfigError: neither binding is installed.
    """

    def __init__(self) -> None:
        try:
            import pycuda.autoinit  # noqa: F401  (creates the context)
            import pycuda.driver as drv

            self.kind, self.drv = "pycuda", drv
        except ImportError:
            try:
                from cuda import cudart  # cuda-python
            except ImportError as e:
                raise ConfigError("the tensorrt backend needs CUDA bindings: pip install pycuda (Jetson: "
                                  "'chattts-appliance[jetson]') or pip install cuda-python") from e
            self.kind, self.rt = "cuda-python", cudart
        self.stream = self.check("stream", lambda: self.drv.Stream() if self.kind == "pycuda" else self.rt.cudaStreamCreate())
        self._keep: list[Any] = []

    def check(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run one CUDA call; a failure or a non-success status becomes :class:`EngineError`."""
        try:
            res = fn()
        except Exception as e:  # pycuda raises drv.Error subclasses
            raise EngineError(f"CUDA {what} failed: {e}") from e
        if self.kind == "cuda-python" and isinstance(res, tuple):
            err, rest = res[0], res[1:]
            if int(err) != 0:
                raise EngineError(f"CUDA {what} failed: {err}")
            return rest[0] if len(rest) == 1 else (rest or None)
        return res

    def malloc(self, nbytes: int) -> int:
        if self.kind == "pycuda":
            buf = self.check("malloc", lambda: self.drv.mem_alloc(max(1, nbytes)))
            self._keep.append(buf)
            return int(buf)
        return int(self.check("malloc", lambda: self.rt.cudaMalloc(max(1, nbytes))))

    def pinned(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A page-locked host array (part of the pool allocated at load)."""
        if self.kind == "pycuda":
            return self.check("pagelocked_empty", lambda: self.drv.pagelocked_empty(shape, dtype))
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        ptr = self.check("cudaMallocHost", lambda: self.rt.cudaMallocHost(max(1, n)))
        raw = (ctypes.c_byte * max(1, n)).from_address(int(ptr))
        return np.frombuffer(raw, dtype=dtype, count=int(np.prod(shape))).reshape(shape)

    def h2d(self, dst: int, src: np.ndarray) -> None:
        if self.kind == "pycuda":
            self.check("memcpy_htod_async", lambda: self.drv.memcpy_htod_async(dst, src, self.stream))
        else:
            self.check("cudaMemcpyAsync H2D", lambda: self.rt.cudaMemcpyAsync(
                dst, src.ctypes.data, src.nbytes, self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream))

    def d2h(self, dst: np.ndarray, src: int) -> None:
        if self.kind == "pycuda":
            self.check("memcpy_dtoh_async", lambda: self.drv.memcpy_dtoh_async(dst, src, self.stream))
        else:
            self.check("cudaMemcpyAsync D2H", lambda: self.rt.cudaMemcpyAsync(
                dst.ctypes.data, src, dst.nbytes, self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream))

    def d2d_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        """Strided device-to-device copy (``height`` rows of ``width`` bytes)."""
        if self.kind == "pycuda":
            c = self.drv.Memcpy2D()
            c.set_src_device(src)
            c.set_dst_device(dst)
            c.src_pitch, c.dst_pitch, c.width_in_bytes, c.height = spitch, dpitch, width, height
            self.check("Memcpy2D", lambda: c(self.stream))
        else:
            self.check("cudaMemcpy2DAsync", lambda: self.rt.cudaMemcpy2DAsync(
                dst, dpitch, src, spitch, width, height, self.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.stream))

    @property
    def handle(self) -> int:
        return int(self.stream.handle) if self.kind == "pycuda" else int(self.stream)

    def sync(self) -> None:
        self.check("stream synchronize", lambda: self.stream.synchronize() if self.kind == "pycuda"
                   else self.rt.cudaStreamSynchronize(self.stream))


class TensorRTRunner(Runner):
    """TensorRT runner (**never executed here**: see module doc).

    Args:
        cfg: uses ``model.engine_dir``, ``model.path``, ``model.max_batch``, ``max_seq_len``,
            ``max_prompt_tokens``.
        reason: why this backend was chosen.

    Raises:
        ConfigError: no plans, TensorRT or CUDA bindings missing.
        EngineMismatchError: the manifest does not match (checked before any CUDA call).
        EngineError: deserialization or a CUDA call failed (e.g. no GPU).
    """

    def __init__(self, cfg: Config, reason: str = "", plan_dir: str | Path | None = None):
        d = Path(plan_dir) if plan_dir else find_plans(cfg)
        if d is None:
            raise ConfigError(f"no TensorRT plans under {cfg.resolve(cfg.model.engine_dir) / 'trt'}; build them with: "
                              + mf.rebuild_hint(cfg.file_hint, 'fp16', tensorrt=True))
        m = load_manifest(cfg, d)
        self.manifest, self.dir = m, d
        self.plan = plan_buffers(m)
        trt = trtshim.module()
        self.cuda = _Cuda()
        self._logger = trtshim.capture_logger()
        self._rt = trt.Runtime(self._logger)
        self._eng: dict[str, Any] = {}
        self._ctx: dict[str, Any] = {}
        for g, e in m["graphs"].items():
            blob = (d / e["file"]).read_bytes()
            eng = self._rt.deserialize_cuda_engine(blob)
            if eng is None:
                raise EngineError(f"TensorRT cannot load {d / e['file']}: {'; '.join(self._logger.errors()) or 'unknown error'}")
            names = {eng.get_tensor_name(i) for i in range(eng.num_io_tensors)}
            want = {t["name"] for t in e["inputs"] + e["outputs"]}
            if names != want:
                raise EngineError(f"{e['file']}: engine tensors {sorted(names)} differ from its manifest {sorted(want)}")
            self._eng[g], self._ctx[g] = eng, eng.create_execution_context()
        # the gpt engine has two profiles: 0 = decode step (context "gpt"), 1 = prefill
        self._ctx["gpt_prefill"] = self._eng["gpt"].create_execution_context()
        if not self._ctx["gpt_prefill"].set_optimization_profile_async(1, self.cuda.handle):
            raise EngineError(f"{d}: the gpt plan has no prefill profile (1); rebuild it")
        from .onnx_runner import load_embeddings

        self._emb_text, self._emb_code = load_embeddings(d, m)
        # device buffers (profile maxima) and the pinned host pool, allocated once
        self._dev: dict[str, dict[str, int]] = {}
        self._host: dict[str, dict[str, np.ndarray]] = {}
        for g, tensors in self.plan.items():
            if g == "kv":
                continue
            self._dev[g] = {n: self.cuda.malloc(t["nbytes"]) for n, t in tensors.items()}
            self._host[g] = {n: self.cuda.pinned(tuple(t["shape"]), np.dtype(t["dtype"])) for n, t in tensors.items()}
        self._kv = {n: self.cuda.malloc(t["nbytes"]) for n, t in self.plan["kv"].items()}
        s, lim = m["shapes"], m["limits"]
        self._s = s
        self._el = np.dtype(next(iter(self.plan["kv"].values()))["dtype"]).itemsize
        D, L = s["hidden"], s["n_layers"]
        self.info = RunnerInfo(
            backend="tensorrt", precision=m["precision"], hidden_size=D, num_vq=s["num_vq"],
            num_audio_tokens=s["num_audio_tokens"], max_batch=lim["max_batch"], max_seq_len=lim["max_seq_len"],
            max_prompt_tokens=lim["max_prompt_tokens"], weight_bytes=int(m.get("memory", {}).get("weights_bytes") or 0),
            kv_bytes_per_token=2 * L * D * self._el, reason=reason,
            **receptive_fields(s["dec_layers"], s["voc_layers"]),
        )
        log.info("tensorrt runner: %s (%s %s), %s", d, m["runtime"]["name"], m["runtime"]["version"], m["precision"])

    # ------------------------------------------------------------------ execution
    def _execute(self, g: str, feeds: dict[str, np.ndarray], outs: dict[str, tuple[int, ...]],
                 extra: dict[str, int] | None = None, ctx_name: str | None = None) -> dict[str, np.ndarray]:
        ctx, dev, host = self._ctx[ctx_name or g], self._dev[g], self._host[g]
        for name, arr in feeds.items():
            h = host[name].reshape(-1)[: arr.size].reshape(arr.shape)
            np.copyto(h, arr, casting="unsafe")
            self.cuda.h2d(dev[name], h)
            if not ctx.set_input_shape(name, tuple(arr.shape)):
                raise EngineError(f"{g}: input {name} shape {arr.shape} is outside the engine's profile")
            ctx.set_tensor_address(name, dev[name])
        for name, ptr in (extra or {}).items():
            ctx.set_tensor_address(name, ptr)
        for name in outs:
            ctx.set_tensor_address(name, dev[name])
        if not ctx.execute_async_v3(self.cuda.handle):
            raise EngineError(f"TensorRT {g} failed: {'; '.join(self._logger.errors()) or 'execute_async_v3 returned false'}")
        res = {}
        for name, shape in outs.items():
            h = host[name].reshape(-1)[: int(np.prod(shape))].reshape(shape)
            self.cuda.d2h(h, dev[name])
            res[name] = h
        return res

    def _scatter_kv(self, rows: list[tuple[int, int]], t: int) -> None:
        """Copy the gpt engine's ``k_new``/``v_new [L, B, T, H, hd]`` into the cache ``[S, M, H, hd]``
        per layer: row r (slot, first position) gets ``t`` positions (one strided 2-D copy)."""
        s, el = self._s, self._el
        H, L, M = s["n_heads"], s["n_layers"], self.info.max_batch
        b = len(rows)
        blk = H * (s["hidden"] // H) * el  # one position of one slot: H x hd
        for kv in ("k", "v"):
            src0 = self._dev["gpt"][f"{kv}_new"]
            for i in range(L):
                base = self._kv[f"{kv}_cache.{i}"]
                for r, (slot, p0) in enumerate(rows):
                    src = src0 + (i * b + r) * t * blk
                    dst = base + (p0 * M + slot) * blk
                    self.cuda.d2d_2d(dst, M * blk, src, blk, blk, t)

    def _gpt(self, ctx_name: str, emb: np.ndarray, pos: np.ndarray, slots: np.ndarray, p: int) -> dict[str, np.ndarray]:
        b, t = emb.shape[0], emb.shape[1]
        L, D, H = self._s["n_layers"], self.info.hidden_size, self._s["n_heads"]
        ctx = self._ctx[ctx_name]
        if not ctx.set_input_shape("past", (p,)):  # the graph reads cache positions [:P]
            raise EngineError(f"gpt: cache length {p} is outside the engine's profile")
        ctx.set_tensor_address("past", self._dev["gpt"]["past"])
        r = self._execute("gpt", {"emb": emb, "pos": pos, "slots": slots},
                          {"logits": (b, self.info.num_vq, self.info.num_audio_tokens), "hidden": (b, D),
                           "k_new": (L, b, t, H, D // H), "v_new": (L, b, t, H, D // H)}, extra=self._kv, ctx_name=ctx_name)
        self._scatter_kv([(int(sl), int(q)) for sl, q in zip(slots, pos)], t)
        self.cuda.sync()
        return r

    # ------------------------------------------------------------------ Runner
    def prefill(self, slot: int, ids: np.ndarray, spk_emb: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """See :meth:`Runner.prefill`. Raises CapacityError / EngineError."""
        from .onnx_runner import embed_prompt

        if not 0 <= int(slot) < self.info.max_batch:
            raise CapacityError(f"slot {slot} out of range: the KV cache has {self.info.max_batch} slots (model.max_batch)")
        ids = np.asarray(ids, np.int64).reshape(-1)
        t = ids.shape[0]
        if not 1 <= t <= self.info.max_prompt_tokens:
            raise CapacityError(f"prompt of {t} tokens: the plan takes 1..{self.info.max_prompt_tokens} (model.max_prompt_tokens): split the text")
        spk_id = int(self.manifest.get("special", {}).get("spk_emb_id", -1))
        emb = embed_prompt(self._emb_text, ids, spk_emb, spk_id)[None]
        r = self._gpt("gpt_prefill", emb, np.zeros(1, np.int64), np.array([slot], np.int64), 1)
        return r["logits"][0], r["hidden"][0]

    def decode(self, slots: np.ndarray, codes: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """See :meth:`Runner.decode`. Raises CapacityError / EngineError."""
        slots, codes, pos = self.check_decode_args(slots, codes, pos)
        if pos.min() < 1:   # a decode step follows a prefill of at least one token
            raise CapacityError(f"decode position {int(pos.min())}: must follow a prefill (>= 1)")
        emb = self._emb_code[np.arange(self.info.num_vq)[None, :], codes].sum(1)[:, None]  # [B, 1, D]
        r = self._gpt("gpt", emb.astype(np.float32), pos, slots, max(1, int(pos.max())))
        return r["logits"], r["hidden"]

    def decoder(self, hidden: np.ndarray) -> np.ndarray:
        """See :meth:`Runner.decoder`; inputs beyond the profile are windowed exactly."""
        w = int(self.manifest["limits"]["window_tokens"])
        ctx = (self.info.decoder_rf + 1) // 2 + 1

        def one(h: np.ndarray) -> np.ndarray:
            r = self._execute("decoder", {"hidden": np.ascontiguousarray(h, np.float32)}, {"mel": (self._s["n_mels"], 2 * h.shape[0])})
            self.cuda.sync()
            return r["mel"].copy()

        return run_windowed(one, np.asarray(hidden, np.float32), 0, w, ctx, 1, 2)

    def vocos(self, mel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """See :meth:`Runner.vocos`; inputs beyond the profile are windowed exactly."""
        w = 2 * int(self.manifest["limits"]["window_tokens"])
        nb = self._s["n_fft"] // 2 + 1

        def one(x: np.ndarray) -> np.ndarray:
            r = self._execute("vocos", {"mel": np.ascontiguousarray(x, np.float32)}, {"real": (x.shape[1], nb), "imag": (x.shape[1], nb)})
            self.cuda.sync()
            return np.concatenate([r["real"], r["imag"]], 1)

        y = run_windowed(one, np.asarray(mel, np.float32), 1, w, self.info.vocos_rf + 1, 0, 1)
        return y[:, :nb], y[:, nb:]

    def close(self) -> None:
        """Drop contexts and engines (device memory is released with the CUDA context)."""
        self._ctx, self._eng = {}, {}
