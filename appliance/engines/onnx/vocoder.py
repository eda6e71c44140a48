"""ONNX Runtime on the host: the session options every CPU runner uses, the one error wrapper,
and the stateful Decoder and Vocos passes that both host GPT backends share.

The ``decoder`` and ``vocos`` graphs are the stateful streaming passes, each with a sentence's
first pass in the same graph behind an ``If`` on its input ``first`` over one copy of the weights
(:mod:`appliance.build.stream_graphs`; the first pass gets zero arrays for the caches it does not
read): the caches go in and out as arrays that
:class:`~appliance.engines.host_runner.HostRunner` keeps per slot. Used by
:class:`~appliance.engines.onnx.runner.OnnxRunner` (GPT on ONNX Runtime too) and
:class:`~appliance.engines.llama.runner.LlamaRunner` (GPT on llama.cpp).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from ...errors import CapacityError, EngineError


def session_options(ort: Any, threads: int, spin_wait: bool) -> Any:
    """``ort.SessionOptions`` of the CPU runners: ``threads`` intra-op threads (the one budget,
    :func:`~appliance.engines.threads.thread_budget`), one inter-op thread, sequential execution,
    all graph optimizations; workers spin between the parallel sections of a run and stop when
    it returns (``session.force_spinning_stop``) where ``spin_wait``, else never spin: each
    session has its own pool, and a pool that spins on after its run takes the cores from the
    next stage's (:mod:`appliance.engines.threads`)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = max(1, int(threads))
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    if spin_wait:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    else:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


def open_session(ort: Any, f: Path, so: Any, providers: tuple = ("CPUExecutionProvider",)) -> Any:
    """``ort.InferenceSession`` of graph ``f`` with its external data (``<file>.data``, the name
    our exports give it) read into memory and handed to onnxruntime, which copies it: onnxruntime
    would map the file itself (privately, but its untouched pages are read from the file), so a
    later write to it in place would change the running graph and a truncation kill the process
    with SIGBUS. Nothing of the export stays mapped (docs/guarantees.md, upgrades).

    Raises:
        whatever ``ort.InferenceSession`` raises (wrap the call in :func:`ort_call`); OSError: the
        data file is unreadable.
    """
    data = f.with_name(f.name + ".data")
    if data.is_file() and hasattr(so, "add_external_initializers_from_files_in_memory"):   # onnxruntime >= 1.20
        buf = data.read_bytes()
        so.add_external_initializers_from_files_in_memory([data.name], [buf], [len(buf)])
    return ort.InferenceSession(str(f), sess_options=so, providers=list(providers))


def vocoder_networks(ort: Any) -> tuple[tuple[str, str], ...]:
    """``RunnerInfo.networks`` entries of the Decoder and Vocos on ONNX Runtime's CPU provider,
    with why the CPU: no GPU provider in this onnxruntime, or (one installed) the stateful
    passes keep their caches as host arrays between windows, so a GPU provider would copy them
    both ways on every window."""
    gpu = [p for p in ort.get_available_providers() if p in ("CUDAExecutionProvider", "TensorrtExecutionProvider")]
    why = ("its caches are host arrays between windows (a GPU provider would copy them both ways)" if gpu
           else "this onnxruntime has no GPU provider")
    text = f"onnxruntime {ort.__version__} CPUExecutionProvider, FP32 ({why})"
    return (("decoder", text), ("vocos", text))


def ort_call(what: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn``; any onnxruntime failure becomes :class:`EngineError` naming ``what`` (the one
    wrapper: onnxruntime raises its own pybind types, Fail, InvalidArgument, ...)."""
    try:
        return fn()
    except (CapacityError, EngineError):
        raise
    except Exception as e:
        raise EngineError(f"onnxruntime {what} failed: {type(e).__name__}: {e}") from e


class OrtVocoder:
    """The stateful ``decoder`` and ``vocos`` sessions of one export directory.

    Args:
        ort: the onnxruntime module. d: the export directory. graphs: the manifest's ``graphs``
        (``decoder`` and ``vocos`` entries with their ``file``). so: session options.
        hidden: D. n_mels: mel bins (100). decoder_rf: the Decoder's receptive field in mel frames.

    Raises:
        EngineError: a graph does not load.
    """

    def __init__(self, ort: Any, d: Path, graphs: dict, so: Any, hidden: int, n_mels: int, decoder_rf: int):
        self._sess: dict[str, Any] = {}
        for g in ("decoder", "vocos"):
            f = d / graphs[g]["file"]
            self._sess[g] = ort_call(f"loading {g}", lambda f=f: open_session(ort, f, so))
        self._D, self._n_mels, self._rf = hidden, n_mels, decoder_rf
        # a sentence's first pass reads no cache: zero arrays bound to the unused cache inputs
        self._zero_caches = {g: {i.name: np.zeros(i.shape, np.float32) for i in self._sess[g].get_inputs()
                                 if i.name.startswith("cache.")} for g in ("decoder", "vocos")}
        self._first = np.array(True)
        self._next = np.array(False)
        self._pos_zero = np.zeros(1, np.int64)
        self._reach = [np.zeros(k, np.uint8) for k in range(decoder_rf + 1)]  # the Decoder's reach, by length

    def _run(self, graph: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        sess = self._sess.get(graph)
        if sess is None:
            raise EngineError("the onnxruntime vocoder is closed")
        return ort_call(graph, lambda: sess.run(None, feeds))

    @staticmethod
    def _caches(cache: list) -> dict[str, np.ndarray]:
        return {f"cache.{i}": c for i, c in enumerate(cache)}

    def decoder_stream(self, hidden: np.ndarray, pos0: int, cache: list | None,
                       reach: int | None = None) -> tuple[np.ndarray, list]:
        """Stateful Decoder pass (the ``decoder`` graph, :mod:`appliance.build.stream_graphs`):
        hidden float32 ``[T, D]`` (T >= 1) -> (mel float32 ``[100, R + 2T]``, the graph's
        ``cache_out.i``), ``R`` = ``reach`` (1..rf; None: rf, exact) bound as the length of the
        ``reach`` input. ``cache`` None: a sentence's first pass (``first`` branch, ``pos0`` 0).

        Raises:
            EngineError: wrong shape, or onnxruntime failed.
        """
        hidden = np.ascontiguousarray(hidden, np.float32)
        if hidden.ndim != 2 or hidden.shape[1] != self._D or hidden.shape[0] == 0:
            raise EngineError(f"decoder input must be [T>0, {self._D}], got {list(hidden.shape)}")
        r = self._reach[self._rf if reach is None else max(1, min(self._rf, int(reach)))]
        if cache is None:  # a sentence's first pass
            out = self._run("decoder", {"hidden": hidden, "first": self._first, "pos0": self._pos_zero, "reach": r,
                                        **self._zero_caches["decoder"]})
        else:
            out = self._run("decoder", {"hidden": hidden, "first": self._next, "pos0": np.array([pos0], np.int64),
                                        "reach": r, **self._caches(cache)})
        return out[0], out[1:]

    def vocos_stream(self, mel: np.ndarray, pos0: int, n_final: int,
                     cache: list | None) -> tuple[np.ndarray, np.ndarray, list]:
        """Stateful Vocos pass (the ``vocos`` graph): mel float32 ``[100, F]`` (F >= 1, the first
        ``n_final`` frames final) -> (real, imag float32 ``[rf + F, 513]``, caches).

        Raises:
            EngineError: wrong shape, or onnxruntime failed.
        """
        mel = np.ascontiguousarray(mel, np.float32)
        if mel.ndim != 2 or mel.shape[0] != self._n_mels or mel.shape[1] == 0:
            raise EngineError(f"vocos input must be [{self._n_mels}, F>0], got {list(mel.shape)}")
        nf = np.array([n_final], np.int64)
        if cache is None:
            out = self._run("vocos", {"mel": mel, "first": self._first, "pos0": self._pos_zero, "n_final": nf,
                                      **self._zero_caches["vocos"]})
        else:
            out = self._run("vocos", {"mel": mel, "first": self._next, "pos0": np.array([pos0], np.int64),
                                      "n_final": nf, **self._caches(cache)})
        return out[0], out[1], out[2:]

    def close(self) -> None:
        """Drop the sessions (idempotent)."""
        self._sess = {}
