"""The memory budget at start: size the runner so that it fits ``service.memory_budget_mb``.

Every backend allocates its KV cache for all ``model.max_batch`` slots x ``model.max_seq_len``
positions at load, so what the process will hold at worst is known right after the warm-up:

    footprint = RSS + the backend's device memory (``Pipeline.device_memory_bytes``)
                [+ the whole KV cache on a CPU backend]

(the host runners allocate their KV buffers lazily zeroed: pages become resident only as
positions fill, so on a CPU the measured RSS does not yet hold them and they are counted in full
on top; an upper bound). :func:`plan_fit` compares it with the budget. If it does not fit:
``max_seq_len`` is lowered (in steps of 64) to what fits, down to ``max_prompt_tokens`` +
:data:`MIN_DECODE_TOKENS`; then ``max_batch`` (fewer channels synthesize at once; the others
wait); if one slot at that length does not fit either, the daemon refuses to start, naming what
to lower. :func:`fit_pipeline` applies the plan: the torch backends are opened again with the
smaller sizes; engines built ahead of time for fixed sizes (exported ONNX graphs, TensorRT plans:
:data:`FIXED_SIZE_BACKENDS`) cannot be, so the daemon starts as built, says in the log and STATUS
what to rebuild them for, and relies on the run-time throttle (on a CPU their KV pages fill only
as far as the longest sentence reaches, so the full figure is a worst case).

At run time the throttle watches the same sum (RSS + NvMap on Jetson / NVML on desktop GPUs, else
the backend's own device memory) and lowers the channels before the kernel's OOM killer acts;
STATUS and the health check report it (:func:`current_mib`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from ..config import Config
from ..errors import ApplianceError, ConfigError
from ..ops.telemetry import process_memory_mib

if TYPE_CHECKING:
    from ..synth.pipeline import Pipeline

log = logging.getLogger(__name__)

MIB = 1024 * 1024
MIN_DECODE_TOKENS = 256
"""Decode positions a slot must hold beyond the longest prompt to be useful (5.5 s of audio)."""
SEQ_STEP = 64
"""``max_seq_len`` is lowered in steps of this many positions."""
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
    """

    action: str
    max_seq_len: int
    max_batch: int
    footprint_mib: float
    budget_mib: float
    text: str


def device_mib(pipeline: Pipeline) -> float:
    """The backend's device memory, MiB (0 on a CPU backend or when the probe fails)."""
    try:
        return pipeline.device_memory_bytes() / MIB
    except Exception as e:  # noqa: BLE001 - a probe must not stop the daemon
        log.debug("device memory probe failed: %s", e)
        return 0.0


def current_mib(pipeline: Optional[Pipeline]) -> Optional[float]:
    """RSS + the backend's device memory now, MiB (None when /proc is unreadable)."""
    rss = process_memory_mib()
    if rss is None:
        return None
    return round(rss + (device_mib(pipeline) if pipeline is not None else 0.0), 1)


def plan_fit(rss_mib: float, dev_mib: float, info, budget_mib: float, max_prompt_tokens: int,
             resizable: bool = True) -> MemoryFit:
    """Decide the sizes (module docstring) from a measurement after warm-up.

    Args:
        rss_mib, dev_mib: measured RSS and device memory, MiB.
        info: the runner's ``RunnerInfo`` (``kv_bytes_per_token``, ``max_seq_len``, ``max_batch``,
            ``weight_bytes``).
        budget_mib: ``service.memory_budget_mb``.
        max_prompt_tokens: ``model.max_prompt_tokens``.
        resizable: the backend can be opened again with other sizes (False for
            :data:`FIXED_SIZE_BACKENDS`: ``shrink`` becomes ``over``).
    """
    kvpt = float(info.kv_bytes_per_token) / MIB
    S, B = int(info.max_seq_len), int(info.max_batch)
    kv = kvpt * S * B
    extra_kv = kv if dev_mib <= 0 else 0.0                # host KV pages are not resident yet
    footprint = rss_mib + dev_mib + extra_kv
    fixed = footprint - kv
    what = (f"measured {rss_mib:.0f} MiB RSS + {dev_mib:.0f} MiB device memory after warm-up "
            f"(weights {info.weight_bytes / MIB:.0f} MiB, KV cache {kv:.0f} MiB for {B} slot(s) x {S} positions"
            f"{', counted in full on a CPU' if extra_kv else ''})")
    if footprint <= budget_mib:
        return MemoryFit("fits", S, B, footprint, budget_mib,
                         f"memory: {footprint:.0f} of {budget_mib:g} MiB (service.memory_budget_mb): {what}")
    floor = max_prompt_tokens + MIN_DECODE_TOKENS
    room = budget_mib - fixed
    for b in range(B, 0, -1):
        s = min(S, int(room / (kvpt * b)) // SEQ_STEP * SEQ_STEP) if room > 0 else 0
        if s >= floor:
            est = fixed + kvpt * s * b
            changes = [f"model.max_seq_len {S} -> {s}"] + ([f"model.max_batch {B} -> {b}"] if b != B else [])
            if not resizable:
                return MemoryFit("over", S, B, footprint, budget_mib,
                                 f"memory: at worst {footprint:.0f} MiB, over service.memory_budget_mb {budget_mib:g} "
                                 f"MiB ({what}); the {info.backend} engines are built for these sizes: to fit, set "
                                 f"{' and '.join(changes)} and rebuild them (chattts-appliance engines export / "
                                 f"build); until then the throttle limits the channels at run time")
            return MemoryFit("shrink", s, b, est, budget_mib,
                             f"memory: {', '.join(changes)} to fit service.memory_budget_mb {budget_mib:g} MiB "
                             f"({what}; now {est:.0f} MiB)")
    need = fixed + kvpt * floor
    return MemoryFit("refuse", S, B, footprint, budget_mib,
                     f"service.memory_budget_mb {budget_mib:g} MiB cannot hold this model: {what}; even one slot of "
                     f"{floor} positions (model.max_prompt_tokens + {MIN_DECODE_TOKENS}) needs {need:.0f} MiB. Raise "
                     f"service.memory_budget_mb to at least {need:.0f}, lower model.max_prompt_tokens, or use "
                     f"smaller weights (int8 engines: chattts-appliance engines export --precision int8; "
                     f"model.dtype float16 or model.quant int8 on a GPU)")


def fit_pipeline(cfg: Config, pipeline: Pipeline, factory: Callable[[Config], Pipeline],
                 warmup: bool) -> tuple[Pipeline, MemoryFit]:
    """Measure ``pipeline`` after its warm-up and make it fit ``service.memory_budget_mb``:
    returns the pipeline to run (reopened with smaller sizes when needed) and the decision.

    Raises:
        ConfigError: it cannot fit (the message names what to lower), or the backend refuses
            the smaller sizes (fixed-size engines: the message names the export to redo).
    """
    info = pipeline.info
    fit = plan_fit(process_memory_mib() or 0.0, device_mib(pipeline), info, float(cfg.service.memory_budget_mb),
                   cfg.model.max_prompt_tokens, resizable=info.backend not in FIXED_SIZE_BACKENDS)
    if fit.action in ("fits", "over"):
        (log.info if fit.action == "fits" else log.warning)("%s", fit.text)
        return pipeline, fit
    if fit.action == "refuse":
        raise ConfigError(fit.text)
    log.warning("%s", fit.text)
    pipeline.close()
    small = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, max_seq_len=fit.max_seq_len,
                                                               max_batch=fit.max_batch))
    try:
        pipeline = factory(small)
    except ApplianceError as e:
        raise ConfigError(f"{fit.text}; but the backend cannot run at that size: {e}. Set model.max_seq_len "
                          f"{fit.max_seq_len} and model.max_batch {fit.max_batch} in {cfg.file_hint}") from e
    if warmup:
        pipeline.warmup()
    log.info("memory after resizing: %.0f MiB RSS + %.0f MiB device memory", process_memory_mib() or 0.0,
             device_mib(pipeline))
    return pipeline, fit
