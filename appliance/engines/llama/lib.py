"""llama.cpp through llama-cpp-python's low-level ``llama_cpp`` API: import, log routing, the
model's load and its shape check, the context.

llama-cpp-python has no binary wheel: ``pip install 'chattts-appliance[llama]'`` builds it from
its sdist with CMake and the machine's C/C++ compiler (``scripts/quickstart.sh``; on a Jetson with
CUDA, ``scripts/install_jetson.sh``). llama.cpp's own log lines go to this module's logger at
DEBUG (its errors at WARNING), and the last ones are quoted when a load fails.

Before the library is loaded, this CPU is checked against the build's record
(:mod:`appliance.engines.llama.cpu`): a CPU without an instruction the build needs is refused
with one line instead of SIGILL. A portable build (llama.cpp's CPU variants, one
``libggml-cpu-<level>.so`` per x86 feature level) has its variants loaded from the package's
library directory (``ggml_backend_load_all_from_path``: llama.cpp itself only looks beside the
executable) before ``llama_backend_init``, which then finds them; ggml scores each against the
CPU and keeps the best, and the log names it.

The GGUF is read into the process's own memory (``use_mmap`` off), not mapped: a later write to
the file in place (an upgrade, a copy over it) cannot change the running model, and truncating it
cannot kill the process with SIGBUS (a mapped file's pages are read again from the file). The
resident cost is the same (every weight is read at each step either way); the pages are anonymous
instead of page cache, so they cannot be dropped and read again under memory pressure
(docs/guarantees.md).

A GGUF is refused (:class:`~appliance.errors.EngineMismatchError`, naming the file) when llama.cpp
cannot load it or when its dimensions (width, layers, heads, KV heads, feed-forward width, the
output rows ``Q*V``, RoPE positions and base, RMSNorm epsilon) differ from the manifest's
``shapes``, which were read from the checkpoint at export (the manifest's checkpoint identity is
checked against the configured checkpoint before, :func:`appliance.engines.manifest.check`).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

from ...errors import ConfigError, EngineMismatchError
from . import cpu

log = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict[str, Any] = {}
_recent: collections.deque[str] = collections.deque(maxlen=8)
#: GGUF types offered (``engines export --precision``), in the order ``model.llama_precision: auto``
#: tries them, with llama.cpp's file type (``llama_ftype``) for each.
FTYPES = {"q8_0": 7, "q4_k_m": 15, "q4_0": 2, "f16": 1, "f32": 0}
#: ggml log levels (``ggml_log_level``) -> Python's; CONT (5) continues the previous line.
_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.DEBUG, 4: logging.WARNING}


def lib() -> Any:
    """The ``llama_cpp`` module, its backend initialised and its log routed here (once).

    Raises:
        ConfigError: llama-cpp-python is not installed (says how to build it).
        CpuUnsupportedError: it was built for CPU features this CPU lacks (checked before it loads).
    """
    with _lock:
        if "lc" in _state:
            return _state["lc"]
        rec = cpu.require()
        try:
            import llama_cpp as lc
        except (ImportError, OSError) as e:  # OSError: the shared library did not load
            raise ConfigError(
                f"model.backend=llama needs llama-cpp-python, built from its sdist with a C/C++ compiler: "
                f"pip install 'chattts-appliance[llama]' (scripts/quickstart.sh does it) ({e})") from e

        @lc.llama_log_callback
        def _on_log(level: int, text: bytes, _user: Any) -> None:
            line = text.decode("utf-8", "replace").rstrip()
            if line:
                _recent.append(line)
                log.log(_LEVELS.get(level, logging.DEBUG), "llama.cpp: %s", line)

        lc.llama_log_set(_on_log, ctypes.c_void_p(0))
        variant = _load_cpu_variants()
        lc.llama_backend_init()
        log.info("llama.cpp %s: built for %s%s", lc.__version__, cpu.describe(rec),
                 f"; CPU library {variant}" if variant else "")
        _state.update(lc=lc, cb=_on_log, variant=variant)  # the callback object must outlive every call
        return lc


def cpu_library() -> str:
    """The CPU variant a portable build loaded (``libggml-cpu-haswell.so``), "" for a build
    without variants or before :func:`lib`."""
    return _state.get("variant", "")


def _variant_dirs() -> list[Path]:
    """Directories holding llama.cpp's CPU variants (``libggml-cpu-<level>.so``): the package's
    ``lib``, or ``bin`` beside it in site-packages (where ggml's own install rule puts them)."""
    d = cpu.lib_dir()
    if d is None:
        return []
    return [x for x in (d, d.parent.parent / "bin") if any(x.glob("libggml-cpu-*.so"))]


def _loaded_ggml() -> str:
    """The ``libggml`` file llama.cpp's library was loaded with (``/proc/self/maps``): a wheel
    holds ``libggml.so``, ``.so.0`` and ``.so.0.x.y`` as copies, not links, and opening another
    copy would make a second backend registry that llama.cpp never sees."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.split(maxsplit=5)[-1].strip()
                if re.fullmatch(r"libggml\.so(\.\d+)*", os.path.basename(path)):
                    return path
    except OSError:
        pass
    return str(cpu.lib_dir() / "libggml.so")


def _load_cpu_variants() -> str:
    """Load a portable build's CPU variants (module docstring); returns the file of the one
    ggml chose ("" for a build without variants).

    Raises:
        ConfigError: there are variants but none loads on this CPU.
    """
    dirs = _variant_dirs()
    if not dirs:
        return ""
    ggml = ctypes.CDLL(_loaded_ggml())
    ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    for d in dirs:
        ggml.ggml_backend_load_all_from_path(str(d).encode())
        if ggml.ggml_backend_reg_by_name(b"CPU"):
            break
    else:
        raise ConfigError(f"llama.cpp's CPU libraries in {', '.join(map(str, dirs))} do not load on this CPU "
                          f"({recent_log()})")
    chosen = [ln for ln in _recent if "loaded CPU backend from" in ln]
    return chosen[-1].rsplit("/", 1)[-1] if chosen else "(variant not logged)"


def offloads(device: str) -> bool:
    """Whether the GPT goes to the GPU: this llama.cpp was built with a GPU backend
    (``llama_supports_gpu_offload``: the CUDA variant ``scripts/install_jetson.sh`` builds) and
    ``device`` (``model.device``) is not ``cpu``.

    Raises:
        ConfigError: llama-cpp-python is not installed.
    """
    if device == "cpu" or cpu.problem(cpu.read_record()) is not None:   # unfit: the load refuses it, and recovers
        return False
    return bool(lib().llama_supports_gpu_offload())


def recent_log() -> str:
    """llama.cpp's last log lines, joined (for an error message)."""
    return " | ".join(_recent)


def meta(lc: Any, model: Any, key: str) -> str | None:
    """A GGUF metadata value of a loaded model as a string (None when absent)."""
    buf = ctypes.create_string_buffer(256)
    n = lc.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode() if n >= 0 else None


def load_model(lc: Any, f: Path, shapes: dict, gpu_layers: int = 0) -> Any:
    """Load ``f`` with ``gpu_layers`` layers offloaded (0 on a CPU build; offloaded, the file is read
    rather than mapped, so the host keeps no copy of those weights resident) and check its shapes
    against ``shapes`` (the manifest's). Returns the ``llama_model`` pointer.

    Raises:
        EngineMismatchError: llama.cpp cannot load ``f``, or a dimension differs (names the file,
            each difference and how to export again).
    """
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = gpu_layers
    _read_not_mapped(lc, mp)   # also offloaded: read into the GPU's buffers, no mapped host copy resident
    model = lc.llama_model_load_from_file(str(f).encode(), mp)
    if not model:
        raise EngineMismatchError(f"llama.cpp cannot load {f} ({recent_log()}): export it again "
                                  f"(chattts-appliance engines export --precision <type>)")
    s = shapes
    nv = lc.llama_model_get_vocab(model)
    have = {"hidden": lc.llama_model_n_embd(model), "n_layers": lc.llama_model_n_layer(model),
            "n_heads": lc.llama_model_n_head(model), "n_heads_kv": lc.llama_model_n_head_kv(model),
            "ffn": _int(meta(lc, model, "llama.feed_forward_length")),
            "output_rows": lc.llama_vocab_n_tokens(nv), "max_pos": lc.llama_model_n_ctx_train(model),
            "rope_theta": _float(meta(lc, model, "llama.rope.freq_base")),
            "rms_eps": _float(meta(lc, model, "llama.attention.layer_norm_rms_epsilon"))}
    want = {"hidden": s["hidden"], "n_layers": s["n_layers"], "n_heads": s["n_heads"], "n_heads_kv": s["n_heads"],
            "ffn": s["ffn"], "output_rows": s["num_vq"] * s["num_audio_tokens"], "max_pos": s["max_pos"],
            "rope_theta": float(s["rope_theta"]), "rms_eps": float(s["rms_eps"])}
    diffs = [f"{k} {have[k]!r}, expected {v!r}" for k, v in want.items()
             if not (have[k] == v or (isinstance(v, float) and have[k] is not None and abs(have[k] - v) <= 1e-6 * abs(v)))]
    if diffs:
        lc.llama_model_free(model)
        raise EngineMismatchError(f"{f} does not match the checkpoint it is recorded for: " + "; ".join(diffs)
                                  + "; export it again (chattts-appliance engines export --precision <type>)")
    return model


def _read_not_mapped(lc: Any, mp: Any) -> None:
    """Set model params ``mp`` to read the GGUF into memory instead of mapping it (module
    docstring): ``load_mode`` NONE (llama.cpp since its load modes; ``lazy_mode`` off, which needs
    a mapping), else the older ``use_mmap`` false."""
    fields = {name for name, _ in type(mp)._fields_}
    if "load_mode" in fields:
        mp.load_mode = lc.LLAMA_LOAD_MODE_NONE
        if "lazy_mode" in fields:
            mp.lazy_mode = 0    # LLAMA_LAZY_MODE_OFF
    elif "use_mmap" in fields:
        mp.use_mmap = False
    else:
        log.warning("llama.cpp %s: no load mode nor use_mmap in its model params: the GGUF may be mapped",
                    getattr(lc, "__version__", "?"))


def _int(v: str | None) -> int | None:
    return int(v) if v is not None else None


def _float(v: str | None) -> float | None:
    return float(v) if v is not None else None


def new_context(lc: Any, model: Any, *, seqs: int, seq_len: int, batch: int, threads: int, kv_type: str = "f16") -> Any:
    """A context of ``seqs`` sequences x ``seq_len`` KV positions each (one KV stream per
    sequence), prompts of up to ``batch`` rows per ``llama_decode``, ``threads`` CPU threads, the
    final hidden states output beside the logits (``embeddings``, no pooling), KV cache in
    ``kv_type``: ``f16`` (2 bytes per value) or ``q8_0`` (34 bytes per 32 values: 0.53x; llama.cpp
    keeps a quantized V cache only with flash attention, which is then switched on; otherwise
    llama.cpp decides, ``auto``).

    Raises:
        EngineMismatchError: llama.cpp could not make the context (quotes its log).
    """
    cp = lc.llama_context_default_params()
    cp.n_ctx = seqs * seq_len
    cp.n_seq_max = seqs
    cp.n_batch = cp.n_ubatch = batch
    cp.n_threads = cp.n_threads_batch = threads
    cp.embeddings = True
    cp.pooling_type = lc.LLAMA_POOLING_TYPE_NONE
    cp.kv_unified = False
    cp.no_perf = True
    t = {"f16": lc.GGML_TYPE_F16, "q8_0": lc.GGML_TYPE_Q8_0}[kv_type]
    cp.type_k = cp.type_v = t
    if kv_type != "f16":
        cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
    ctx = lc.llama_init_from_model(model, cp)
    if not ctx:
        raise EngineMismatchError(f"llama.cpp could not create a context of {seqs} x {seq_len} positions "
                                  f"(KV cache {kv_type}) ({recent_log()})")
    return ctx


#: KV-cache bytes per value of each ``model.llama_kv_cache`` type (q8_0: 32 int8 + an F16 scale per 32).
KV_BYTES = {"f16": 2.0, "q8_0": 34 / 32}


def kv_wanted(setting: str, gpu: bool) -> str:
    """``model.llama_kv_cache`` with ``auto`` resolved: ``q8_0`` where the GPT is offloaded to a GPU
    (``gpu``: flash attention on CUDA reads the quantized cache at full speed; half the bytes; its
    error against f16 measured on the CPU build: hidden states -45 dB, PCM -41 dB, engines/README.md),
    ``f16`` on the CPU (llama.cpp's attention over a q8_0 cache is 1.4-1.8x slower on x86)."""
    if setting != "auto":
        return setting
    return "q8_0" if gpu else "f16"


def kv_type(wanted: str, head_dim: int) -> str:
    """The KV-cache type a context gets: ``wanted`` (``model.llama_kv_cache``), except ``q8_0`` with
    a head width that its 32-value blocks do not divide (the tiny test checkpoint's 16), which
    llama.cpp refuses: ``f16`` then."""
    return "f16" if wanted == "q8_0" and head_dim % 32 else wanted
