"""The llama.cpp backend (CPU; CUDA where llama-cpp-python was built with it): the GPT from
``gpt.gguf``, the Decoder and Vocos on ONNX Runtime.

Loads ``<model.engine_dir>/llama/<type>/`` (``chattts-appliance engines export --precision
q8_0``, :mod:`appliance.build.gguf_export`): checks its manifest against the config and the
checkpoint, hashes every file it maps (``safety.verify_checkpoint``), loads the GGUF and refuses
one whose dimensions differ from the checkpoint's (:func:`appliance.engines.llama.lib.load_model`),
and implements the network passes of a :class:`~appliance.engines.host_runner.HostRunner`
(sampling, per-slot hidden states and vocoder caches: numpy; the one sampler and random stream).

One context, ``model.max_batch`` sequences of ``model.max_seq_len`` positions each (one KV
stream per sequence): slot ``s`` is sequence ``s``. Every pass is one ``llama_decode`` of a
batch made once by ``llama_batch_init(rows, D, 1)`` whose ``embd`` rows are the input
embeddings, computed on the host from ``embed.safetensors`` (read into the process once, hashed as
it is read, :func:`~appliance.engines.onnx.runner.load_embeddings`:
text rows with the L2-normalised speaker, or the sum of the Q code rows of the last codes): a decode step is one row per slot,
every channel in the same call. The context outputs the final hidden state (``embeddings``,
the GPT's output after its last RMSNorm: the Decoder's input) beside the logits of the output
matrix ``[Q*V, D]`` (every codebook's logits at once). A slot's sequence is removed from the KV
cache (``llama_memory_seq_rm``) when its sentence ends (:meth:`LlamaRunner.release`) and before
each prefill. Refine-text runs the same GPT on text embeddings; its logits are the final hidden
state times the text head (``head_text.npy``, read and checked against its sha256 at the first
refine, kept from then), on the host.

Upgrades in place: nothing this runner uses is mapped from a file (the GGUF is read into memory,
:func:`~appliance.engines.llama.lib.load_model`; the tables are copies), so a file of the export
overwritten or truncated while the daemon runs changes nothing it computes and cannot SIGBUS it;
the integrity watch names the changed file (health: ``integrity``) and the box keeps speaking with
what it loaded until a restart loads (and checks) the new one. Cost, full-size q8_0: the text table
(62 MiB, of which a mapping kept only the rows prompts read) is resident; the GGUF's pages are the
process's own instead of page cache (the same RSS: a step reads every weight).

On a CUDA build of llama.cpp (``llama_supports_gpu_offload``; ``scripts/install_jetson.sh``
builds one where JetPack's nvcc is present) every layer, the output matrix and the KV cache are
offloaded to the GPU (``n_gpu_layers`` = layers + 1) unless ``model.device`` is ``cpu``;
``info.device`` then says ``cuda:0``. The vocoder stays on ONNX Runtime's CPU provider. The
offloaded load is tried in a child process first (:mod:`appliance.engines.llama.canary`); when
it fails the GPT runs on the CPU and ``info.fallback`` says why (health: ``engine_fallback``).

Threads: the one budget (:func:`~appliance.engines.threads.thread_budget`) is the most; the
decode step (and the prompts) run at the count that measures fastest within it, probed while it
runs (:class:`~appliance.engines.threads.StepThreads`: two threads on a quiet 2-core host, one
when other processes contend for the cores); the vocoder's ONNX Runtime sessions use the budget
and run after the decode, never beside it. The KV cache is ``model.llama_kv_cache``: ``auto`` (the
default) takes q8_0 where the GPT is offloaded to a GPU (half the bytes; its error against f16:
hidden states -45 dB, PCM -41 dB) and f16 on the CPU (llama.cpp's attention over a q8_0 cache is
slower on x86); with an offloaded GPT the GGUF is read, not mapped, so no host copy of the
offloaded weights stays resident. Sized from the config's
``max_batch`` x ``max_seq_len`` at load (the export fixes neither: the daemon's memory fit may open it smaller,
:mod:`appliance.daemon.memory`). Every llama.cpp failure is :class:`~appliance.errors.EngineError`.
"""

from __future__ import annotations

import ctypes
import logging
import time
from pathlib import Path

import numpy as np

from ...config import Config
from ...errors import ConfigError, EngineError
from . import canary as llama_canary, lib as llama_lib
from .. import manifest as mf
from ..host_runner import HostRunner
from ..onnx.runner import embed_prompt, load_embeddings
from ..onnx.vocoder import OrtVocoder, session_options, vocoder_networks
from ..runner import RunnerInfo, receptive_fields
from ..threads import StepThreads, thread_budget

log = logging.getLogger(__name__)

#: GGUF types tried in order under ``<engine_dir>/llama/`` when ``model.llama_precision`` is ``auto``.
TYPES = tuple(llama_lib.FTYPES)


def find_llama_export(cfg: Config) -> Path | None:
    """The ``<engine_dir>/llama/<type>`` holding a manifest: ``model.llama_precision``, or with
    ``auto`` the first of :data:`TYPES`."""
    want = cfg.model.llama_precision
    return mf.find_built(cfg.resolve(cfg.model.engine_dir), "llama", TYPES if want == "auto" else (want,))


def step_threads(threads: int, offloaded: bool) -> StepThreads:
    """The decode step's thread chooser: measured within the budget ``threads`` on the CPU; on an
    offloaded GPT the CPU computes almost nothing of the step, so its time says nothing about
    threads (on an H100 the probe moved 1 -> 8 -> 16 threads every 4-5 s, about 30 changes a run):
    the budget's count, never probed."""
    if not offloaded:
        return StepThreads(threads)
    return StepThreads(threads, probe_every=1 << 62, first_probe=1 << 62, collapse=float("inf"))


class LlamaRunner(HostRunner):
    """llama.cpp GPT + ONNX Runtime vocoder (see module doc and :class:`~appliance.engines.runner.Runner`).

    Args:
        cfg: uses ``model.engine_dir``, ``model.llama_precision``, ``model.path`` (checkpoint
            identity), ``model.threads``, ``model.spin_wait`` (the vocoder's threads),
            ``model.max_batch`` / ``max_seq_len`` / ``max_prompt_tokens``, ``safety.verify_checkpoint``.
        reason: why this backend was chosen (``info.reason``).
        export_dir: a specific ``llama/<type>`` directory (default: :func:`find_llama_export`).

    Raises:
        ConfigError: llama-cpp-python or onnxruntime missing, or nothing exported (says how).
        EngineMismatchError: the manifest or the GGUF does not match the config or checkpoint.
        IntegrityError: a file's sha256 differs from the manifest's.
        EngineError: a graph does not load.
    """

    def __init__(self, cfg: Config, reason: str = "", export_dir: str | Path | None = None):
        lc = llama_lib.lib()
        try:
            import onnxruntime as ort
        except ImportError as e:
            raise ConfigError(f"model.backend=llama runs the vocoder on onnxruntime: pip install onnxruntime ({e})") from e
        mc = cfg.model
        d = Path(export_dir) if export_dir else find_llama_export(cfg)
        if d is None:
            raise ConfigError(f"no llama.cpp export under {cfg.resolve(mc.engine_dir) / 'llama'}; export it with: "
                              f"{mf.rebuild_hint(cfg.file_hint, 'q8_0', tensorrt=False)}")
        qtype = d.name
        hint = mf.rebuild_hint(cfg.file_hint, qtype, tensorrt=False)
        m = mf.read(d, hint)
        expect = mf.expect_common(cfg, m, "llama")
        expect.pop("limits")    # the GGUF holds no cache: the context is sized here, from the config
        mf.check(m, expect, hint)
        self.manifest, self.dir = m, d
        verify = cfg.safety.verify_checkpoint
        emb_name = m["embed"]["file"]   # hashed as it is read, below
        self.weight_files = mf.verify_files(d, m, hint, [n for n in mf.weight_files(d, m) if n != emb_name]) \
            if verify else []
        self._verify = verify
        s = m["shapes"]
        D, L, Q, V = s["hidden"], s["n_layers"], s["num_vq"], s["num_audio_tokens"]
        self._D, self._Q, self._V, self._n_text = D, Q, V, s["num_text_tokens"]
        self._spk_id = int(m.get("special", {}).get("spk_emb_id", -1))
        M, S = mc.max_batch, mc.max_seq_len
        if S > s["max_pos"]:
            raise ConfigError(f"model.max_seq_len {S} is over the GPT's {s['max_pos']} positions")
        max_prompt = min(mc.max_prompt_tokens, S - 1)
        budget = thread_budget(mc.threads)
        threads = budget.threads

        # a CUDA build of llama.cpp (scripts/install_jetson.sh) holds every layer and the KV cache on
        # the GPU unless model.device is cpu; the CPU build ignores the count
        gguf = d / m["graphs"]["gpt"]["file"]
        gpu, fallback = llama_lib.offloads(mc.device), ""
        why_gpu = ("model.device is cpu" if mc.device == "cpu" else
                   "this llama.cpp build has no GPU backend" if not gpu else f"a CUDA build, model.device {mc.device}")
        if gpu:   # tried in a child first: a GPU build that faults at load must not crash-loop the daemon
            v = llama_canary.check(gguf, str(m.get("files", {}).get(gguf.name, "")), str(lc.__version__))
            if not v.ok:
                gpu, fallback = False, f"the GPT runs on the CPU: {v.reason}"
                why_gpu = fallback
                log.warning("llama.cpp: %s", fallback)
        kv = llama_lib.kv_type(llama_lib.kv_wanted(mc.llama_kv_cache, gpu), D // s["n_heads"])
        self._lc = lc
        self._model = llama_lib.load_model(lc, gguf, s, gpu_layers=L + 1 if gpu else 0)
        self._rows = max(max_prompt, M)
        self._ctx = llama_lib.new_context(lc, self._model, seqs=M, seq_len=S, batch=self._rows, threads=threads,
                                          kv_type=kv)
        self._step_threads = step_threads(threads, gpu)
        self._n_threads = threads
        self._mem = lc.llama_get_memory(self._ctx)
        self._batch = lc.llama_batch_init(self._rows, D, 1)
        b = self._batch
        self._embd = np.ctypeslib.as_array(b.embd, shape=(self._rows, D))  # the batch's input rows, written in place
        for i in range(self._rows):
            b.n_seq_id[i] = 1
            b.logits[i] = 1
        self._out_ptr = (0, 0, 0)
        self._logits_view = self._hidden_view = np.zeros((0,), np.float32)

        self._emb_text, self._emb_code, emb_sha = load_embeddings(d, m, hint, verify)
        if emb_sha is not None:
            self.weight_files.append((d / emb_name, emb_sha))
        self._head_text_file = d / m["head_text"]["file"]
        self._head_text: np.ndarray | None = None
        self._voc = OrtVocoder(ort, d, m["graphs"], session_options(ort, threads, mc.spin_wait), D, s["n_mels"],
                               receptive_fields(s["dec_layers"], s["voc_layers"])["decoder_rf"])
        weight_bytes = sum(f.stat().st_size for f in d.iterdir() if f.suffix in (".gguf", ".onnx", ".data", ".safetensors"))
        kv_el = llama_lib.KV_BYTES[kv]
        self._gpu_bytes = gguf.stat().st_size + M * S * int(2 * L * D * kv_el) if gpu else 0
        self.info = RunnerInfo(
            backend="llama.cpp", precision=qtype, hidden_size=D, num_vq=Q, num_audio_tokens=V, max_batch=M,
            max_seq_len=S, max_prompt_tokens=max_prompt, weight_bytes=int(weight_bytes),
            kv_bytes_per_token=int(2 * L * D * kv_el), reason=reason, num_text_tokens=self._n_text, text_mode=True,
            engine_id=mf.file_sha256(d / mf.MANIFEST), threads=threads, threads_source=budget.source,
            device="cuda:0" if gpu else "cpu", fallback=fallback,
            networks=(("gpt", f"llama.cpp {lc.__version__} {'CUDA: ' + str(L) + ' layers + output on the GPU' if gpu else 'CPU'}, "
                              f"{qtype}, KV cache {kv} ({why_gpu})"), *vocoder_networks(ort)),
            **receptive_fields(s["dec_layers"], s["voc_layers"]),
        )
        log.info("llama.cpp runner: %s (%s), %s, %d sequences x %d positions, weights %.1f MiB, KV %.1f MiB (%s)%s",
                 d, qtype, budget.describe(), M, S, weight_bytes / 2**20, M * S * self.info.kv_bytes_per_token / 2**20, kv,
                 f", the GPT's {L} layers and KV cache on the GPU" if gpu else "")
        self.setup_host(s["n_mels"])

    # -------------------------------------------------------------- one llama_decode
    def _decode(self, n: int, what: str) -> tuple[np.ndarray, np.ndarray]:
        """Decode the batch's first ``n`` rows (``embd``, ``pos``, ``seq_id`` set by the caller).
        Returns (logits float32 ``[n, Q*V]``, hidden float32 ``[n, D]``): views of llama.cpp's
        output buffers, valid until the next decode.

        Raises:
            EngineError: the runner is closed or ``llama_decode`` failed (its return code and log).
        """
        if self._ctx is None:
            raise EngineError("the llama.cpp runner is closed")
        lc = self._lc
        self._batch.n_tokens = n
        rc = lc.llama_decode(self._ctx, self._batch)
        if rc != 0:
            raise EngineError(f"llama_decode ({what}, {n} rows) returned {rc} ({llama_lib.recent_log()})")
        lp, hp = lc.llama_get_logits(self._ctx), lc.llama_get_embeddings(self._ctx)
        key = (ctypes.addressof(lp.contents), ctypes.addressof(hp.contents), n)
        if key != self._out_ptr:  # another row count, or llama.cpp grew its output buffers: view them anew
            self._logits_view = np.ctypeslib.as_array(lp, shape=(n, self._Q * self._V))
            self._hidden_view = np.ctypeslib.as_array(hp, shape=(n, self._D))
            self._out_ptr = key
        return self._logits_view, self._hidden_view

    def _run_prompt(self, slot: int, emb: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
        """Clear ``slot``'s sequence and run ``emb [T, D]`` at positions 0..T-1 (in batches of the
        context's size); returns the last position's (logits [Q*V], hidden [D]) views."""
        lc, b = self._lc, self._batch
        lc.llama_memory_seq_rm(self._mem, slot, -1, -1)
        t = emb.shape[0]
        for a in range(0, t, self._rows):
            n = min(self._rows, t - a)
            self._embd[:n] = emb[a:a + n]
            for i in range(n):
                b.pos[i] = a + i
                b.seq_id[i][0] = slot
            logits, hidden = self._decode(n, what)
        return logits[n - 1], hidden[n - 1]

    # -------------------------------------------------------------- the passes (HostRunner)
    def forward_prefill(self, slot: int, ids: np.ndarray, spk_emb: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Prompt ``ids [T]`` (+ ``spk_emb [D]``) into ``slot`` (positions 0..T-1, the slot's old
        positions removed first). Returns (logits float32 [Q, V], hidden float32 [D]) of the last
        position (views of llama.cpp's buffers). Raises EngineError."""
        logits, hidden = self._run_prompt(slot, embed_prompt(self._emb_text, ids, spk_emb, self._spk_id), "prefill")
        return logits.reshape(self._Q, self._V), hidden

    def forward_decode(self, slots: np.ndarray, codes: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One step for rows ``slots [B]``: the sum of ``codes [B, Q]``'s embeddings at ``pos [B]``
        of each row's sequence, all rows in one ``llama_decode``. Returns (logits float32
        [B, Q, V], hidden float32 [B, D]), views of llama.cpp's buffers. Raises EngineError."""
        n, b = slots.shape[0], self._batch
        e = self._embd[:n]
        np.take(self._emb_code[0], codes[:, 0], axis=0, out=e)
        for q in range(1, self._Q):
            e += self._emb_code[q][codes[:, q]]
        for i in range(n):
            b.pos[i] = int(pos[i])
            b.seq_id[i][0] = int(slots[i])
        st = self._step_threads
        self._set_threads(st.next(n))
        t = time.perf_counter()
        logits, hidden = self._decode(n, "decode")
        moved = st.observe(n, self._n_threads, time.perf_counter() - t)
        self._set_threads(st.current)              # prompts too run at the chosen count
        if moved:
            log.info("llama.cpp: %s", moved)
        return logits.reshape(n, self._Q, self._V), hidden

    def device_memory_bytes(self) -> int:
        """GPU bytes of a CUDA build's offloaded GPT (the GGUF's weights and the KV cache, as
        planned at load; llama.cpp's compute buffers not counted); 0 on the CPU."""
        return self._gpu_bytes if self._ctx is not None else 0

    def _set_threads(self, k: int) -> None:
        if k != self._n_threads:
            self._lc.llama_set_n_threads(self._ctx, k, k)
            self._n_threads = k

    def forward_decoder_stream(self, hidden: np.ndarray, pos0: int, cache: list | None,
                               reach: int | None = None) -> tuple[np.ndarray, list]:
        """See :meth:`OrtVocoder.decoder_stream`."""
        return self._voc.decoder_stream(hidden, pos0, cache, reach)

    def forward_vocos_stream(self, mel: np.ndarray, pos0: int, n_final: int,
                             cache: list | None) -> tuple[np.ndarray, np.ndarray, list]:
        """See :meth:`OrtVocoder.vocos_stream`."""
        return self._voc.vocos_stream(mel, pos0, n_final, cache)

    # -------------------------------------------------------------- refine-text (text mode)
    def _text_logits(self, hidden: np.ndarray) -> np.ndarray:
        if self._head_text is None:  # read at the first refine (62 MiB at full size), then kept
            self._head_text = self._read_head_text()
        return self._head_text @ hidden

    def _read_head_text(self) -> np.ndarray:
        """``head_text.npy`` read into memory, its bytes checked against the manifest's sha256.

        Raises:
            EngineError: unreadable, or changed since the export (an upgrade in place: restart).
        """
        import hashlib
        import io

        f = self._head_text_file
        try:
            raw = f.read_bytes()
            want = self.manifest.get("files", {}).get(f.name)
            if self._verify and want and hashlib.sha256(raw).hexdigest() != want:
                raise EngineError(f"{f} changed since the engine was loaded: restart the daemon to load the new export")
            return np.load(io.BytesIO(raw))
        except (OSError, ValueError) as e:
            raise EngineError(f"cannot read the text head {f}: {e}") from e

    def forward_prefill_text(self, slot: int, ids: np.ndarray) -> np.ndarray:
        """Text prompt ``ids [T]`` into ``slot`` -> text logits float32 ``[N]`` of its last position."""
        _, hidden = self._run_prompt(slot, self._emb_text[ids], "refine prefill")
        return self._text_logits(hidden)

    def forward_decode_text(self, slot: int, token: int, pos: int) -> np.ndarray:
        """Text token ``token`` at ``pos`` of ``slot`` -> text logits float32 ``[N]``."""
        b = self._batch
        self._embd[0] = self._emb_text[token]
        b.pos[0] = pos
        b.seq_id[0][0] = slot
        _, hidden = self._decode(1, "refine step")
        return self._text_logits(hidden[0])

    # -------------------------------------------------------------- lifetime
    def release(self, slot: int) -> None:
        """Remove ``slot``'s sequence from the KV cache (its sentence ended)."""
        if self._ctx is not None:
            self._lc.llama_memory_seq_rm(self._mem, self.check_slot(slot), -1, -1)

    def close(self) -> None:
        """Free the batch, the context and the model; drop the vocoder sessions (idempotent)."""
        lc = self._lc
        if self._ctx is not None:
            lc.llama_batch_free(self._batch)
            lc.llama_free(self._ctx)
            lc.llama_model_free(self._model)
            self._ctx = self._model = self._mem = None
            self._embd = self._logits_view = self._hidden_view = np.zeros((0,), np.float32)
        self._voc.close()
