"""The ONNX Runtime backend (CPU): the default where there is no GPU; needs no torch.

Loads the graphs (``gpt``, ``decoder``, ``vocos``) that ``chattts-appliance engines export`` wrote to
``<model.engine_dir>/onnx/<precision>/`` (see :mod:`appliance.build.export` for their I/O),
checks their manifest against the config and the checkpoint, and implements the network passes
of a :class:`~appliance.engines.host_runner.HostRunner` (sampling and per-slot buffers: numpy).

KV cache in place (measured: ~10 ms per step for a cache copied in and out):
the cache is two numpy arrays ``[L, S, M, H, hd]`` (S = ``max_seq_len`` positions first,
M = ``max_batch`` slots) allocated once. Positions first makes the filled part of every
layer a contiguous prefix ``[:P]``, so each step binds (IO binding, a pointer and a shape, no
copy) each layer's prefix ``[P, M, H, hd]`` with ``P = max(pos)``: only the filled positions
are read. The graph returns only the new keys/values ``[L, B, H, hd]`` and this runner writes
them at ``[:, pos, slots]`` (``B x 2 x L x D`` values: 120 KiB per row at full size, FP32).
Nothing else is copied per step (the host-side write of the new rows: ~0.02 ms at B=3).

Measured on this shared 2-core CPU (full-size random checkpoint, 2 threads, 2026-11-30,
``bench/results/engines.jsonl``; min of 30 steps, GPT step only):

* a naive graph (cache in and out as tensors): fp32 44.7 ms at 32 cached
  positions, 54.2 ms at 512.
* first in-place graph (cache ``[M, H, S, hd]`` sliced to ``P`` then gathered, K/V
  concatenated with the new row): 38 ms at 32, 72 ms at 512, 128 ms at 1024 (B=1); ORT's
  profiler put 59 of ~95 ms of a 1024-position step in Slice/Gather/Concat/Transpose copies.
* this graph (position-major prefix bound by pointer, scores joined on the score tensor,
  :class:`appliance.build.graphs.GptGraph`), min over 30-40 steps in three runs: fp32
  24.9-27.8 ms at 32, 31.2-35.3 ms at 512 (B=1), 37.3-38.4 ms at B=3 / 512; **int8
  (MatMulNBits) 12.2-13.9 ms at 32, 15.5-18.9 ms at 512 (B=1), 21.5-22.3 ms at B=3 / 512**,
  i.e. faster than real time (21.3 ms of audio per step) for one channel and about real time
  for three. Our torch CPU runner in the same runs: 62-65 ms at B=1. Hence int8 is preferred
  when exported. Peak RSS with 3 x 2048 fp32 KV slots: int8 0.76 GiB, fp32 1.3 GiB.

Precision directory: ``int8`` if it was exported (the GPT's MatMuls 8-bit weight-only
``MatMulNBits``, block 32, int8 activation compute, 2-2.5x faster than FP32 per step; the Decoder
and Vocos FP32, see :mod:`appliance.build.export`), else ``fp32``; the choice is logged. One
``gpt`` graph serves prefill (B=1, T=prompt) and decode (T=1), so the GPT weights are held once;
the embedding tables live on the host (``embed.safetensors``, 69 MiB fp32 at full size) and the
runner computes the graph's input embeddings with numpy. Threads: one budget for the three
sessions (:mod:`appliance.engines.threads`: ``model.threads``, else the CPU quota and affinity
mask), intra-op pools that spin only inside a run, or never (``model.spin_wait``).

The ``decoder`` and ``vocos`` graphs are the stateful streaming passes of
:class:`~appliance.engines.onnx.vocoder.OrtVocoder` (shared with the llama.cpp runner); an older export
(``build.vocoder`` not ``stream-reach``: a first-pass graph holding the weights twice, or a
Decoder without its ``reach`` input) is refused at load with the command that re-exports.

Every onnxruntime exception is turned into :class:`~appliance.errors.EngineError` by
:func:`~appliance.engines.onnx.vocoder.ort_call` (one place). A prompt longer than the exported profile or a
position at the end of the cache raises :class:`~appliance.errors.CapacityError` before the
engine runs (the pipeline splits text).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ...config import Config
from ...errors import (
    CheckpointError,
    ConfigError,
    EngineError,
    EngineMismatchError,
)
from ...model.integrity import mismatch
from .. import manifest as mf
from ..host_runner import HostRunner
from .vocoder import OrtVocoder, open_session, ort_call, session_options, vocoder_networks
from ..runner import RunnerInfo, receptive_fields
from ..threads import thread_budget

log = logging.getLogger(__name__)

#: Precision directories tried in order under ``<engine_dir>/onnx/`` when ``model.onnx_precision``
#: is ``auto`` (int4 only when asked for: its error is larger, see bench/HISTORY.md).
PRECISIONS = ("int8", "fp32")


def find_export(cfg: Config) -> Path | None:
    """The ``<engine_dir>/onnx/<precision>`` holding a manifest: ``model.onnx_precision``, or with
    ``auto`` the first of :data:`PRECISIONS`."""
    want = getattr(cfg.model, "onnx_precision", "auto")
    return mf.find_built(cfg.resolve(cfg.model.engine_dir), "onnx", PRECISIONS if want == "auto" else (want,))


def load_embeddings(d: Path, m: dict, hint: str = "", verify: bool = True) -> tuple[np.ndarray, np.ndarray, Optional[str]]:
    """The host-side embedding tables written by the export: ``emb_text [N, D]``,
    ``emb_code [Q, V, D]`` (float32), read in one pass that also hashes the file
    (:class:`~appliance.model.tensorfile.TensorFile`), and the file's sha256 (None without ``verify``).

    Raises:
        EngineError: the file is missing or malformed (says how to rebuild).
        IntegrityError: ``verify`` and its sha256 differs from the manifest's (``files``, or
            ``embed.sha256`` of older manifests).
    """
    from ...model.tensorfile import TensorFile

    name = m.get("embed", {}).get("file", "embed.safetensors")
    f = d / name
    todo = f"; rebuild with: {hint}" if hint else ""
    try:
        tf = TensorFile(f)
        ent = {e.name: e for e in tf.entries}
        out = {k: np.empty(ent[k].shape, {"F32": np.float32, "F16": np.float16}[ent[k].dtype]) for k in ("emb_text", "emb_code")}
    except (CheckpointError, KeyError) as e:
        raise EngineError(f"cannot read the embedding tables {f}: {e}{todo}") from e

    def sink(e, r0, raw: np.ndarray) -> None:
        a = out[e.name]
        n = raw.nbytes // e.row_bytes
        a[r0:r0 + n] = raw.view(a.dtype).reshape(n, *e.shape[1:])

    try:
        got = tf.stream(sink, lambda k: k in out)
    except CheckpointError as e:
        raise EngineError(f"{e}{todo}") from e
    if not verify:
        return out["emb_text"], out["emb_code"], None
    want = m.get("files", {}).get(name) or m.get("embed", {}).get("sha256")
    if got != want:
        raise mismatch(f, got, str(want), str(d / mf.MANIFEST), f"rebuild the engine{todo or ''}. "
                       "(safety.verify_checkpoint: false skips this check.)")
    return out["emb_text"], out["emb_code"], got


def embed_prompt(emb_text: np.ndarray, ids: np.ndarray, spk_emb: np.ndarray | None, spk_id: int) -> np.ndarray:
    """Prompt embeddings ``[T, D]`` float32: text rows, with the L2-normalised speaker vector at
    every ``[spk_emb]`` position (upstream ``Speaker.apply``: ``F.normalize(eps=1e-12)``).

    Raises:
        EngineError: ``spk_emb`` is not ``[D]``.
    """
    emb = emb_text[ids]
    if spk_emb is not None:
        if np.shape(spk_emb) != (emb_text.shape[1],):
            raise EngineError(f"spk_emb must have shape [{emb_text.shape[1]}], got {list(np.shape(spk_emb))}")
        spk = np.asarray(spk_emb, np.float32)
        emb[ids == spk_id] = spk / max(float(np.linalg.norm(spk)), 1e-12)
    return emb


class OnnxRunner(HostRunner):
    """ONNX Runtime runner (see module doc and :class:`~appliance.engines.runner.Runner`).

    Args:
        cfg: uses ``model.engine_dir``, ``model.path`` (checkpoint identity check),
            ``model.threads``, ``model.max_batch``, ``model.max_seq_len``, ``model.max_prompt_tokens``.
        reason: why this backend was chosen (``info.reason``).
        export_dir: a specific ``onnx/<precision>`` directory (default: :func:`find_export`).

    Raises:
        ConfigError: onnxruntime is not installed, or no exported graphs exist (says how to export).
        EngineMismatchError: the manifest does not match the config or the checkpoint.
        EngineError: a graph does not load.
    """

    def __init__(self, cfg: Config, reason: str = "", export_dir: str | Path | None = None):
        try:
            import onnxruntime as ort
        except ImportError as e:
            raise ConfigError(f"model.backend=onnxruntime needs onnxruntime: pip install onnxruntime ({e})") from e
        self._ort = ort
        mc = cfg.model
        d = Path(export_dir) if export_dir else find_export(cfg)
        cfg_path = cfg.file_hint
        if d is None:
            raise ConfigError(
                f"no exported ONNX graphs under {cfg.resolve(mc.engine_dir) / 'onnx'}; "
                f"export them with: {mf.rebuild_hint(cfg_path, 'fp32', tensorrt=False)}")
        precision = d.name
        hint = mf.rebuild_hint(cfg_path, precision, tensorrt=False)
        m = mf.read(d, hint)
        expect = mf.expect_common(cfg, m, "onnx")
        mf.check(m, expect, hint)
        if m.get("build", {}).get("vocoder") != mf.ONNX_VOCODER:
            raise EngineMismatchError(f"{d} holds vocoder graphs from an older export (stateless windows, a "
                                      f"separate first-pass graph holding the weights twice, or a Decoder without its "
                                      f"reach input); this version runs one stateful graph per network: export again "
                                      f"with: {hint}")
        self.manifest, self.dir = m, d
        # every file that onnxruntime maps, hashed before it is handed over; the tables below in
        # the pass that reads them (safety.verify_checkpoint)
        verify = cfg.safety.verify_checkpoint
        emb_name = m.get("embed", {}).get("file", "embed.safetensors")
        self.weight_files = mf.verify_files(d, m, hint, [n for n in mf.weight_files(d, m) if n != emb_name]) \
            if verify else []
        s = m["shapes"]
        L, H, hd, D = s["n_layers"], s["n_heads"], s["hidden"] // s["n_heads"], s["hidden"]
        self._L, self._D, self._Q, self._V = L, D, s["num_vq"], s["num_audio_tokens"]
        self._n_text, self._n_mels = s["num_text_tokens"], s["n_mels"]
        self._spk_id = int(m.get("special", {}).get("spk_emb_id", -1))
        M, S = mc.max_batch, mc.max_seq_len

        budget = thread_budget(mc.threads)
        so = session_options(ort, budget.threads, mc.spin_wait)
        self._sess: dict[str, Any] = {"gpt": ort_call("loading gpt", lambda: open_session(
            ort, d / m["graphs"]["gpt"]["file"], so))}

        # static KV cache (graph dtype), bound in place once per batch size
        kv_dt = np.float16 if m.get("kv", {}).get("dtype") == "float16" else np.float32
        self._kv_dt = kv_dt
        self._k = np.zeros((L, S, M, H, hd), kv_dt)  # positions first: the filled part is a prefix
        self._v = np.zeros((L, S, M, H, hd), kv_dt)
        self._kv_shape = (M, H, hd)
        self._emb_text, self._emb_code, emb_sha = load_embeddings(d, m, hint, verify)  # host side: the graph takes embeddings
        if emb_sha is not None:
            self.weight_files.append((d / emb_name, emb_sha))
        # per decode batch size: I/O buffers allocated once and bound once (IO binding)
        self._bind: dict[int, tuple[Any, dict[str, np.ndarray]]] = {}
        gpt = self._sess["gpt"]
        for b in range(1, M + 1):
            bufs = {
                "emb": np.zeros((b, 1, D), np.float32), "pos": np.zeros(b, np.int64), "slots": np.zeros(b, np.int64),
                "logits": np.zeros((b, self._Q, self._V), np.float32), "hidden": np.zeros((b, D), np.float32),
                "k_new": np.zeros((L, b, 1, H, hd), kv_dt), "v_new": np.zeros((L, b, 1, H, hd), kv_dt),
            }
            io = gpt.io_binding()
            for name in ("emb", "pos", "slots"):
                io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(bufs[name]))
            for name in ("logits", "hidden", "k_new", "v_new"):
                io.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(bufs[name]))
            self._bind[b] = (io, bufs)
        self._pf_logits = np.zeros((self._Q, self._V), np.float32)
        self._pf_hidden = np.zeros(D, np.float32)
        self._pf_pos = np.zeros(1, np.int64)

        weight_bytes = sum(f.stat().st_size for f in d.iterdir() if f.suffix in (".onnx", ".data"))
        max_prompt = int(m["limits"]["max_prompt_tokens"])
        self.info = RunnerInfo(
            backend="onnxruntime", precision=precision, hidden_size=D, num_vq=self._Q,
            num_audio_tokens=self._V, max_batch=M, max_seq_len=S, max_prompt_tokens=max_prompt,
            weight_bytes=int(weight_bytes), kv_bytes_per_token=2 * L * D * np.dtype(kv_dt).itemsize, reason=reason,
            num_text_tokens=self._n_text,
            engine_id=mf.file_sha256(d / mf.MANIFEST), threads=budget.threads, threads_source=budget.source,
            networks=(("gpt", f"onnxruntime {ort.__version__} CPUExecutionProvider, {precision} ({reason or 'configured'})"),
                      *vocoder_networks(ort)),
            **receptive_fields(s["dec_layers"], s["voc_layers"]),
        )
        self._voc = OrtVocoder(ort, d, m["graphs"], so, D, self._n_mels, self.info.decoder_rf)
        log.info("onnxruntime runner: %s (%s), %s, %s, %d slots x %d positions, weights %.1f MiB, KV %.1f MiB",
                 d, precision, budget.describe(), "spinning inside a run" if mc.spin_wait else "sleeping when idle", M, S,
                 weight_bytes / 2**20, 2 * self._k.nbytes / 2**20)
        self.setup_host(self._n_mels)

    # -------------------------------------------------------------- the passes (HostRunner)
    def forward_prefill(self, slot: int, ids: np.ndarray, spk_emb: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Prompt ``ids [T]`` int64 (+ ``spk_emb [D]``) into KV ``slot`` positions 0..T-1 (checked
        by :meth:`HostRunner.prefill`).

        Returns (logits float32 [Q, V], hidden float32 [D]) of the last prompt position (views of
        this runner's buffers).

        Raises:
            EngineError: onnxruntime failed.
        """
        t = ids.shape[0]
        emb = embed_prompt(self._emb_text, ids, spk_emb, self._spk_id)[None]  # [1, T, D]
        sess = self._sess.get("gpt")
        if sess is None:
            raise EngineError("the onnxruntime runner is closed")
        io = sess.io_binding()
        slots = np.array([slot], np.int64)

        def run() -> list[np.ndarray]:
            io.bind_cpu_input("emb", emb)
            io.bind_cpu_input("pos", self._pf_pos)
            io.bind_cpu_input("slots", slots)
            self._bind_cache(io, 1)  # position 0, masked (pos = 0): the prompt sees only itself
            for name in ("logits", "hidden", "k_new", "v_new"):
                io.bind_output(name, "cpu")
            sess.run_with_iobinding(io)
            return io.copy_outputs_to_cpu()

        logits, hidden, k_new, v_new = ort_call("gpt (prefill)", run)
        self._k[:, :t, slot] = k_new[:, 0]  # [L, T, H, hd]
        self._v[:, :t, slot] = v_new[:, 0]
        self._pf_logits[:] = logits[0]
        self._pf_hidden[:] = hidden[0]
        return self._pf_logits, self._pf_hidden

    def _bind_cache(self, io: Any, p: int) -> None:
        """Bind each layer's cache prefix ``[:p]`` (pointer + shape, no copy)."""
        shape = [p, *self._kv_shape]
        for i in range(self._L):
            io.bind_input(f"k_cache.{i}", "cpu", 0, self._kv_dt, shape, self._k[i].ctypes.data)
            io.bind_input(f"v_cache.{i}", "cpu", 0, self._kv_dt, shape, self._v[i].ctypes.data)

    def forward_decode(self, slots: np.ndarray, codes: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One step for rows ``slots [B]``: ``codes [B, Q]`` are written at ``pos [B]`` (checked by
        :meth:`HostRunner.step`).

        Returns (logits float32 [B, Q, V], hidden float32 [B, D]), views of this runner's buffers.

        Raises:
            EngineError: onnxruntime failed.
        """
        b = slots.shape[0]
        io, bufs = self._bind[b]
        e = bufs["emb"][:, 0]
        np.take(self._emb_code[0], codes[:, 0], axis=0, out=e)  # sum of the Q code embeddings
        for q in range(1, self._Q):
            e += self._emb_code[q][codes[:, q]]
        bufs["pos"][:] = pos
        bufs["slots"][:] = slots
        sess = self._sess.get("gpt")
        if sess is None:
            raise EngineError("the onnxruntime runner is closed")
        ort_call("gpt (decode)", lambda: self._bind_cache(io, max(1, int(pos.max()))))
        ort_call("gpt (decode)", lambda: sess.run_with_iobinding(io))
        # new keys/values [L, B, 1, H, hd] -> cache[:, pos[b], slots[b]] (adjacent advanced indices: [L, B, H, hd])
        self._k[:, pos, slots] = bufs["k_new"][:, :, 0]
        self._v[:, pos, slots] = bufs["v_new"][:, :, 0]
        return bufs["logits"], bufs["hidden"]

    def forward_decoder_stream(self, hidden: np.ndarray, pos0: int, cache: list | None,
                               reach: int | None = None) -> tuple[np.ndarray, list]:
        """See :meth:`OrtVocoder.decoder_stream`."""
        return self._voc.decoder_stream(hidden, pos0, cache, reach)

    def forward_vocos_stream(self, mel: np.ndarray, pos0: int, n_final: int,
                             cache: list | None) -> tuple[np.ndarray, np.ndarray, list]:
        """See :meth:`OrtVocoder.vocos_stream`."""
        return self._voc.vocos_stream(mel, pos0, n_final, cache)

    def close(self) -> None:
        """Drop sessions, bindings and the KV cache (idempotent)."""
        self._bind = {}
        self._sess = {}
        self._voc.close()
        self._k = self._v = None
