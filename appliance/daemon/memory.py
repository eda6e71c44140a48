"""The memory budget at start: size the runner so that it fits ``service.memory_budget_mb``,
counted as the hardware holds memory (:mod:`appliance.ops.footprint`): RSS + NvMap on a Jetson,
the process's device memory (NVML, CUDA context included) on a desktop GPU with host RSS against
``service.host_rss_limit_mb``, RSS on a CPU.

Twice:

1. **Before the load** (:func:`plan_before_load`), from the sizes the backend will have
   (:func:`~appliance.synth.pipeline.Pipeline.planned_sizes`: weight bytes in their final dtype
   from the checkpoint's headers, KV bytes per position) plus the fixed costs of the kind
   (:data:`DEVICE_OTHER_MIB` on a desktop GPU, the CUDA context included; :data:`CUDA_CONTEXT_MIB`,
   :data:`UNIFIED_EXTRA_MIB`, :data:`CUDA_HOST_MIB` on a Jetson): nothing is compiled or captured for sizes
   that cannot fit. A torch backend is opened directly at the sizes that fit.
2. **After the warm-up** (:func:`fit_pipeline`), on the measured footprint: every backend
   allocates its KV cache for all ``model.max_batch`` slots x ``model.max_seq_len`` positions at
   load, so the worst case is known then (the host runners allocate their KV buffers lazily
   zeroed: on a CPU the whole KV cache is counted on top of the RSS; an upper bound).

**The rule.** What the box holds at ready must stay one hysteresis band below the throttle's
first memory threshold: ``footprint <= budget x (throttle.mem_reduce_frac -
throttle.mem_hysteresis_frac)`` (1200 of 1500 MiB by default; the whole budget with the throttle
off), :func:`ceiling_mib`. Every backend allocates its KV cache for all slots at load and the
warm-up allocates what requests use, so the footprint hardly moves with use: at the ceiling a box
starts with every channel (``normal``) and keeps them. Where the configured sizes go over it, in
this order (each step only while the one before does not fit):

1. ``max_seq_len`` is lowered (in steps of 64) down to :data:`COMFORT_SEQ` (1024 positions, 16 s of
   audio after a long prompt), all ``max_batch`` channels kept;
2. with ``model.quant: auto`` on a torch CUDA box, the GPT's block linears become INT8 weight-only
   (about 190 MiB less at full size), at the longest ``max_seq_len`` that then fits;
3. ``max_seq_len`` is lowered further, down to ``max_prompt_tokens`` + :data:`MIN_DECODE_TOKENS`;
4. ``max_batch`` (fewer channels synthesize at once; the others wait);

if one slot at that length does not fit either, the daemon refuses to start, naming what to lower. Engines built ahead of time for fixed sizes (exported ONNX graphs,
TensorRT plans) cannot be resized, so the daemon starts as built, says in the log and STATUS what
to rebuild them for, and relies on the run-time throttle.

At run time the throttle watches the same figure and lowers the channels before the kernel's OOM
killer acts; STATUS and the health check report it (:func:`current`).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..config import Config
from ..errors import ApplianceError, ConfigError
from ..ops.footprint import Footprint, combine, measure, memory_kind
from ..ops.telemetry import process_memory_mib

if TYPE_CHECKING:
    from ..synth.pipeline import Pipeline

log = logging.getLogger(__name__)

MIB = 1024 * 1024
MIN_DECODE_TOKENS = 256
"""Decode positions a slot must hold beyond the longest prompt to be useful (5.5 s of audio)."""
SEQ_STEP = 64
"""``max_seq_len`` is lowered in steps of this many positions."""
COMFORT_SEQ = 1024
"""KV positions per slot the fit keeps before it turns to smaller weights (a 256-token prompt plus
768 codes: 16 s of audio in one sentence)."""
FIXED_SIZE_BACKENDS = ("onnxruntime", "tensorrt")
"""Backends whose engines are built for one ``max_batch`` x ``max_seq_len`` (a rebuild resizes them)."""


@dataclass(frozen=True)
class MemoryFit:
    """The decision of :func:`plan_fit`.

    Attributes:
        action: ``fits``, ``shrink`` (reopen smaller), ``over`` (would shrink, but the engines are
            built for fixed sizes: start as built, warn) or ``refuse``.
        max_seq_len, max_batch: the sizes to run with.
        footprint_mib: the estimated footprint at those sizes, MiB. budget_mib: the budget.
        text: one sentence for the log and STATUS (what was measured, what changed, what to lower).
        ceiling_mib: what the footprint was held to (:func:`ceiling_mib`), MiB.
        quant: ``int8`` where the fit chose INT8 weights (``model.quant: auto``), else None (as configured).
    """

    action: str
    max_seq_len: int
    max_batch: int
    footprint_mib: float
    budget_mib: float
    text: str
    ceiling_mib: float = 0.0
    quant: Optional[str] = None


CUDA_EXTRA_MIB = 384
"""Device memory a torch CUDA process holds beyond its weights, KV cache and bare CUDA context
(cuBLAS/cuDNN workspaces and the kernels they load, the graphs' pool, activations, the
allocator's slack), MiB, for the estimate before the load. Measured on an H200, plain CUDA
graphs, full checkpoint FP16, KV 3 x 2048, after warm-up: NVML 1910 MiB = 621 context + 549
weights + 360 KV + 380 (`gpu_memory_probe.py` (retired; its run in bench/HISTORY.md); bench/HISTORY.md)."""
CUDA_CONTEXT_MIB = 300
"""The bare CUDA context on a Jetson with lazy loading, MiB (published figure, docs/jetson-memory.md):
counted before the load on unified memory, where the budget holds everything."""
DEVICE_OTHER_MIB = {"torch": 621 + CUDA_EXTRA_MIB, "llama.cpp": 457, "tensorrt": 493}
"""Device memory a backend holds on a desktop GPU beyond its weights and KV cache, **CUDA context
included**, MiB, for the estimate before the load (the context is in the budget on every box).
torch: measured on an H200 (621 context + :data:`CUDA_EXTRA_MIB`); llama.cpp: measured on an
H100 with the shipped config (NVML 1,164 MiB = 347 weights q8_0 + 360 KV f16 + 457 context,
cuBLAS and compute buffers); tensorrt: estimated (a context and TensorRT's runtime ~400 + execution
contexts 93, docs/jetson-memory.md)."""
UNIFIED_EXTRA_MIB = {"torch": CUDA_EXTRA_MIB, "llama.cpp": 110, "tensorrt": 93}
"""On a Jetson, what a backend holds beyond its weights, KV cache and :data:`CUDA_CONTEXT_MIB`,
MiB (torch: as on a desktop GPU; llama.cpp: its 457 MiB measured on an H100 less a desktop
context's ~350, estimated; tensorrt: its execution contexts, estimated)."""
RUNTIME_HOST_MIB = {"torch": 210, "onnxruntime": 40, "tensorrt": 40, "llama.cpp": 40}
HOST_WORK_FRACTION = {"torch": 0.3, "onnxruntime": 0.6, "llama.cpp": 0.6}
"""Host memory a CPU backend's warm-up adds, as a fraction of its weights (activations, the
runtime's arenas, the KV pages the warm-up touches). Measured on the 2-core machine with the
full checkpoint: torch FP32 1584 MiB RSS after warm-up for 1009 MiB of weights and 259 MiB before
the load (+316, 0.31); ONNX Runtime INT8 768 MiB loaded, 1074 after warm-up (+307 for 515 MiB of
weights, 0.6) (python -m bench memory, bench/HISTORY.md); llama.cpp (its vocoder runs on ONNX Runtime) taken
as ONNX Runtime's: the daemon on the q4_k_m GGUF export measured 758 MiB RSS after warm-up where the
estimate without these terms was 574 MiB (python -m bench service, 2026-12-04)."""
"""Host RSS a backend's runtime adds when imported, MiB, counted before the load where the RSS is
in the budget (a CPU, a Jetson). Measured on the 2-core x86 machine: ``import torch`` (CPU build
2.13) +208 MiB, ``import onnxruntime`` 1.32 +35 MiB."""
CUDA_HOST_MIB = {"torch": 280, "llama.cpp": 150, "tensorrt": 150}
"""Host RSS a backend's CUDA libraries add once a context is up, MiB, counted in the budget on a
Jetson. torch: H200, 491 MiB after ``import torch``, 767 after a context and one FP16 GEMM;
llama.cpp and TensorRT (cudart, cuBLAS without torch's kernels): estimated."""


def device_mib(pipeline: Optional[Pipeline]) -> float:
    """The backend's own device memory figure, MiB (0 on a CPU backend or when the probe fails)."""
    if pipeline is None:
        return 0.0
    try:
        return pipeline.device_memory_bytes() / MIB
    except Exception as e:  # noqa: BLE001 - a probe must not stop the daemon
        log.debug("device memory probe failed: %s", e)
        return 0.0


def pipeline_kind(pipeline: Pipeline) -> str:
    """The :func:`~appliance.ops.footprint.memory_kind` of a loaded pipeline's backend."""
    return memory_kind(str(pipeline.info.device or "cpu"))


def current(pipeline: Optional[Pipeline]) -> Optional[Footprint]:
    """The footprint now, by the rule of the backend's kind (None when /proc is unreadable)."""
    if pipeline is None:
        return measure("cpu")
    return measure(pipeline_kind(pipeline), device_mib(pipeline), pipeline.info.context_bytes / MIB)


def current_mib(pipeline: Optional[Pipeline]) -> Optional[float]:
    """What counts against ``service.memory_budget_mb`` now, MiB (None when /proc is unreadable)."""
    fp = current(pipeline)
    return None if fp is None else round(fp.budget_mib, 1)


def ceiling_mib(cfg: Config) -> float:
    """What the footprint at ready is held to, MiB: ``service.memory_budget_mb`` x
    (``throttle.mem_reduce_frac`` - ``throttle.mem_hysteresis_frac``), one hysteresis band below
    the throttle's first memory threshold; the whole budget with the throttle off (module doc)."""
    budget, t = float(cfg.service.memory_budget_mb), cfg.throttle
    return budget * (t.mem_reduce_frac - t.mem_hysteresis_frac) if t.enabled else budget


def _longest(room: float, kvpt: float, b: int, S: int) -> int:
    """The longest ``max_seq_len`` (a multiple of :data:`SEQ_STEP`, at most ``S``) whose KV cache for
    ``b`` slots fits in ``room`` MiB (0 when none does)."""
    return min(S, int(room / (kvpt * b)) // SEQ_STEP * SEQ_STEP) if room > 0 else 0


def _fit(fixed: float, kvpt: float, S: int, B: int, budget_mib: float, max_prompt_tokens: int, resizable: bool,
         backend: str, what: str, ceiling: Optional[float] = None, int8_saving_mib: float = 0.0) -> MemoryFit:
    """Sizes whose footprint ``fixed + kvpt * S * B`` (MiB) is at most ``ceiling`` (default: the
    budget), in the order of the module doc; ``int8_saving_mib`` > 0: INT8 weights are an option."""
    top = budget_mib if ceiling is None else ceiling
    rule = (f"{top:.0f} MiB (service.memory_budget_mb {budget_mib:g} x (throttle.mem_reduce_frac - "
            f"mem_hysteresis_frac): one hysteresis band below the throttle's first memory threshold)"
            if top < budget_mib else f"service.memory_budget_mb {budget_mib:g} MiB")
    footprint = fixed + kvpt * S * B
    if footprint <= top:
        return MemoryFit("fits", S, B, footprint, budget_mib, f"memory: {footprint:.0f} of {budget_mib:g} MiB "
                         f"(service.memory_budget_mb), held to {rule}: {what}", top)
    floor = max_prompt_tokens + MIN_DECODE_TOKENS
    comfort = max(floor, min(S, COMFORT_SEQ))
    steps = [(None, fixed, B, comfort)]                         # 1. a shorter KV cache, every channel kept
    if int8_saving_mib > 0:
        steps.append(("int8", fixed - int8_saving_mib, B, comfort))   # 2. INT8 weights
    w = "int8" if int8_saving_mib > 0 else None
    steps += [(w, fixed - (int8_saving_mib if w else 0.0), b, floor) for b in range(B, 0, -1)]   # 3., 4.
    for quant, f, b, least in steps:
        s = _longest(top - f, kvpt, b, S)
        if s < least:
            continue
        est = f + kvpt * s * b
        changes = ([f"model.quant -> {quant} (weight-only)"] if quant else []) + \
            ([f"model.max_seq_len {S} -> {s}"] if s != S else []) + ([f"model.max_batch {B} -> {b}"] if b != B else [])
        if not resizable:
            return MemoryFit("over", S, B, footprint, budget_mib,
                             f"memory: at worst {footprint:.0f} MiB, over {rule} ({what}); the {backend} engines are "
                             f"built for these sizes: to fit, set {' and '.join(changes)} and rebuild them "
                             f"(chattts-appliance engines export / build); until then the throttle limits the channels "
                             f"at run time", top)
        return MemoryFit("shrink", s, b, est, budget_mib, f"memory: {', '.join(changes)} to stay within {rule} "
                         f"({what}; now {est:.0f} MiB)", top, quant)
    need = fixed - int8_saving_mib + kvpt * floor
    least_budget = need * budget_mib / top
    return MemoryFit("refuse", S, B, footprint, budget_mib,
                     f"service.memory_budget_mb {budget_mib:g} MiB cannot hold this model within {rule}: {what}; even "
                     f"one slot of {floor} positions (model.max_prompt_tokens + {MIN_DECODE_TOKENS}) needs {need:.0f} "
                     f"MiB. Raise service.memory_budget_mb to at least {least_budget:.0f}, lower model.max_prompt_tokens, "
                     f"or use smaller weights (int8 engines: chattts-appliance engines export --precision int8; "
                     f"model.quant int8 on a GPU)" + ("; on a GPU, llama.cpp's CUDA build holds about half of torch's "
                                                     "memory (chattts-appliance engines export --precision q8_0; "
                                                     "model.backend auto picks it)" if backend.startswith("torch") else ""), top)


def plan_fit(fp: Footprint, info, budget_mib: float, max_prompt_tokens: int, resizable: bool = True,
             ceiling: Optional[float] = None) -> MemoryFit:
    """Decide the sizes (module docstring) from the footprint measured after warm-up.

    Args:
        fp: the measured :class:`~appliance.ops.footprint.Footprint` (its kind says what counts).
        info: the runner's ``RunnerInfo`` (``kv_bytes_per_token``, ``max_seq_len``, ``max_batch``,
            ``weight_bytes``, ``backend``).
        budget_mib: ``service.memory_budget_mb``.
        max_prompt_tokens: ``model.max_prompt_tokens``.
        resizable: the backend can be opened again with other sizes (False for built engines:
            ``shrink`` becomes ``over``).
        ceiling: what the footprint is held to (:func:`ceiling_mib`; default the budget).
    """
    kvpt = float(info.kv_bytes_per_token) / MIB
    S, B = int(info.max_seq_len), int(info.max_batch)
    kv = kvpt * S * B
    # host KV pages are not resident yet: count them (llama.cpp clears its cache at load: resident, measured)
    host_kv = fp.kind == "cpu" and info.backend != "llama.cpp"
    footprint = fp.budget_mib + (kv if host_kv else 0.0)
    what = (f"measured {fp.describe()} after warm-up (weights {info.weight_bytes / MIB:.0f} MiB, KV cache "
            f"{kv:.0f} MiB for {B} slot(s) x {S} positions{', counted in full on a CPU' if host_kv else ''})")
    return _fit(footprint - kv, kvpt, S, B, budget_mib, max_prompt_tokens, resizable, info.backend, what, ceiling)


def plan_before_load(cfg: Config, sizes, kind: str, rss_now_mib: float) -> MemoryFit:
    """Decide the sizes from what the backend will hold, before it loads (module docstring).

    Args:
        cfg: the config (``model.max_seq_len``, ``model.max_batch``, ``model.max_prompt_tokens``,
            ``service.memory_budget_mb``).
        sizes: the backend's :class:`~appliance.engines.sizes.PlannedSizes`.
        kind: :func:`~appliance.ops.footprint.memory_kind` of its device.
        rss_now_mib: the process's RSS now, before the load (counted, with the runtime's own
            :data:`RUNTIME_HOST_MIB`, on a Jetson and a CPU).
    """
    w = sizes.weight_bytes / MIB
    w_dev = w - sizes.host_weight_bytes / MIB                     # what a desktop GPU holds of them
    b = sizes.backend
    host = rss_now_mib + RUNTIME_HOST_MIB.get(b, 0)
    other = DEVICE_OTHER_MIB.get(b, DEVICE_OTHER_MIB["torch"])
    cuda = CUDA_HOST_MIB.get(b, 150) + CUDA_CONTEXT_MIB + UNIFIED_EXTRA_MIB.get(b, CUDA_EXTRA_MIB)
    fixed = {"discrete": other + w_dev,
             "unified": host + cuda + w,
             "cpu": host + w * (1.0 + HOST_WORK_FRACTION.get(b, 0.0))}[kind]
    what = (f"estimated before the load on a {kind} box: weights {w:.0f} MiB ({sizes.what})"
            + {"discrete": (f"{f', {w_dev:.0f} MiB of them on the GPU' if w_dev != w else ''} + {other} MiB of CUDA "
                            f"context, workspaces and buffers in device memory (estimate, the context included)"),
               "unified": (f" + {host:.0f} MiB RSS with the runtime + {cuda} MiB for CUDA (estimate: "
                           f"{CUDA_CONTEXT_MIB} MiB of it the context)"),
               "cpu": f" + {host:.0f} MiB RSS with the runtime + {w * HOST_WORK_FRACTION.get(b, 0.0):.0f} "
                      f"MiB for the warm-up's work"}[kind]
            + f" + KV {sizes.kv_bytes_per_token * cfg.model.max_seq_len * cfg.model.max_batch / MIB:.0f} MiB")
    return _fit(fixed, sizes.kv_bytes_per_token / MIB, cfg.model.max_seq_len, cfg.model.max_batch,
                float(cfg.service.memory_budget_mb), cfg.model.max_prompt_tokens, sizes.resizable, sizes.backend, what,
                ceiling_mib(cfg), sizes.int8_saving_bytes / MIB)


def resized(cfg: Config, fit: MemoryFit) -> Config:
    """``cfg`` with ``model.max_seq_len`` / ``max_batch`` (and ``model.quant`` where chosen) as ``fit`` decided."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, max_seq_len=fit.max_seq_len,
                                                              max_batch=fit.max_batch, quant=fit.quant or cfg.model.quant))


def fit_before_load(cfg: Config, planned: Callable[[Config], Any]) -> tuple[Config, Optional[MemoryFit]]:
    """Apply :func:`plan_before_load`: returns the config to load with (sizes lowered where
    needed) and the decision (None when the sizes could not be read: the load reports why).

    Raises:
        ConfigError: it cannot fit (the message names what to lower), before anything loads.
    """
    try:
        sizes = planned(cfg)
    except (OSError, KeyError, ValueError) as e:
        log.debug("no estimate before the load: %s", e)
        return cfg, None
    fit = plan_before_load(cfg, sizes, memory_kind(sizes.device), process_memory_mib() or 0.0)
    if fit.action == "refuse":
        raise ConfigError(fit.text)
    (log.info if fit.action == "fits" else log.warning)("%s", fit.text)
    return (resized(cfg, fit) if fit.action == "shrink" else cfg), fit


def check_host(cfg: Config, fp: Optional[Footprint]) -> Optional[str]:
    """On a desktop GPU, a sentence when host RSS is over ``service.host_rss_limit_mb``; else None."""
    if fp is None or fp.host_mib is None or fp.host_mib <= cfg.service.host_rss_limit_mb:
        return None
    return (f"host RSS {fp.host_mib:.0f} MiB is over service.host_rss_limit_mb {cfg.service.host_rss_limit_mb} MiB "
            f"(a desktop GPU's device memory counts against service.memory_budget_mb; host memory against this)")


def fit_pipeline(cfg: Config, pipeline: Pipeline, factory: Callable[[Config], Pipeline],
                 warmup: bool) -> tuple[Pipeline, MemoryFit]:
    """Measure ``pipeline`` after its warm-up and make it fit ``service.memory_budget_mb``:
    returns the pipeline to run (reopened with smaller sizes when needed) and the decision.

    Raises:
        ConfigError: it cannot fit (the message names what to lower), or the backend refuses
            the smaller sizes (fixed-size engines: the message names the export to redo).
    """
    info = pipeline.info
    fp = current(pipeline) or combine("cpu", 0.0, None, None, 0.0)
    host = check_host(cfg, fp)
    if host:
        log.warning("memory: %s", host)
    fit = plan_fit(fp, info, float(cfg.service.memory_budget_mb), cfg.model.max_prompt_tokens,
                   resizable=info.backend not in FIXED_SIZE_BACKENDS, ceiling=ceiling_mib(cfg))
    if fit.action in ("fits", "over"):
        (log.info if fit.action == "fits" else log.warning)("%s", fit.text)
        return pipeline, fit
    if fit.action == "refuse":
        raise ConfigError(fit.text)
    log.warning("%s", fit.text)
    pipeline.close()
    small = resized(cfg, fit)
    try:
        pipeline = factory(small)
    except ApplianceError as e:
        raise ConfigError(f"{fit.text}; but the backend cannot run at that size: {e}. Set model.max_seq_len "
                          f"{fit.max_seq_len} and model.max_batch {fit.max_batch} in {cfg.file_hint}") from e
    if warmup:
        pipeline.warmup()
    fp = current(pipeline)
    log.info("memory after resizing: %s", fp.describe() if fp is not None else "unknown")
    return pipeline, fit


def status_fields(cfg: Config, pipeline: Optional[Pipeline], fit: Optional[MemoryFit]) -> dict:
    """The memory fields of ``status`` (:class:`~appliance.messages.protocol.StatusReply`): what
    counts against the budget now, the all-in figure (host RSS + device memory with the CUDA
    context), whether torch is loaded (``torch_loaded``: the llama.cpp, ONNX Runtime and TensorRT
    paths never import it), the kind of box, host RSS and the CUDA context on a desktop GPU,
    and a note when the runner was sized down at start or host RSS is over its limit."""
    fp = current(pipeline)
    host = fp is not None and fp.host_mib is not None
    return dict(
        memory_mib=round(fp.budget_mib, 1) if fp is not None else None,
        memory_all_in_mib=round(fp.all_in_mib, 1) if fp is not None else None,
        torch_loaded="torch" in sys.modules,
        memory_budget_mib=cfg.service.memory_budget_mb, memory_kind=fp.kind if fp is not None else None,
        host_rss_mib=round(fp.host_mib, 1) if host else None,
        host_rss_limit_mib=cfg.service.host_rss_limit_mb if host else None,
        cuda_context_mib=round(fp.context_mib, 1) if fp is not None and fp.context_mib else None,
        memory_note="; ".join(n for n in (fit.text if fit is not None and fit.action != "fits" else None,
                                          check_host(cfg, fp)) if n) or None)
