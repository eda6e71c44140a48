"""Field health check: the reference sentence through the loaded engines, not played.

:func:`run_health_check` synthesizes ``health.sentence`` with a fixed seed through
``pipeline.prepare`` / ``pipeline.run`` (the PCM is discarded), and compares what it measured
with the ``health`` section of config:

* RTF (compute s per audio s) against ``health.max_rtf``;
* TTFB (start of ``run`` to the first PCM chunk, ms) against ``health.max_ttfb_ms``;
* decode steps per second against ``health.min_steps_per_s`` (0 = not checked);
* memory, counted as the budget counts it (:mod:`appliance.ops.footprint`: RSS + NvMap on a
  Jetson, the process's device memory on a desktop GPU, RSS on a CPU; MiB) against
  ``health.max_memory_mib`` (default ``service.memory_budget_mb``), and on a desktop GPU the host
  RSS against ``service.host_rss_limit_mb``;
* a run longer than ``health.timeout_s`` is cancelled and unhealthy;
* the audio itself: a NaN/Inf sample is unhealthy (the engine's output guard,
  :mod:`appliance.synth.guard`, fails the run with ``engine_error``), and so is audio whose peak
  stays below :data:`SILENT_PEAK` (broken weights that compute zeros speak silence); the same
  sentence is also synthesized under a second seed and
  :func:`~appliance.synth.audio_check.audio_problems` flags degenerate audio: a periodic buzz,
  or audio that ignores the seed (what one flipped exponent bit in a weight speaks); and, where
  ``calibrate`` recorded a reference for this checkpoint, backend, precision, engines and sentence
  (:mod:`appliance.synth.reference`), the first render against it: identical codes and a band
  log-spectral distance within the tolerance calibrate measured (``reference`` in the reply says
  how it compared, or why there was nothing to compare with: not a failure);
* the weight files on disk: the background re-verification's first mismatch
  (:mod:`appliance.ops.integrity_watch`), naming the file.

Every failed comparison adds a named condition with its reason (``rtf``: ``"rtf 1.32 > max
1.00"``; names ``rtf``, ``ttfb``, ``steps_per_s``, ``memory``, ``host_rss`` are ``degraded``: the
box speaks, slower or bigger than it should; ``audio``, ``audio_reference``, ``integrity``,
``timeout`` and an error's code are ``unhealthy``). An error from the pipeline (e.g.
``empty_result``) is unhealthy with its code as the condition's name. The daemon keeps the last
check's conditions in the one verdict (:mod:`appliance.ops.verdict`) until a check passes.

``chattts-appliance health`` (:func:`cli_main`) loads config and pipeline here, or asks a
running daemon (``--socket PATH``, request ``{"type":"health"}``), prints a table or the
:class:`~appliance.messages.protocol.HealthReply` as JSON, and exits 0 healthy, 1 degraded or
unhealthy, 2 error (config, model or socket unusable), so a systemd timer or a fleet tool can act.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from ..config import Config, load_config
from ..core import DEGRADED, SAMPLE_RATE, UNHEALTHY
from ..errors import ApplianceError, CancelledError, ConfigError
from ..messages.protocol import HealthReply, parse_event, to_json
from ..synth import reference
from ..synth.audio_check import audio_problems
from ..synth.reference import HEALTH_SEED
from .footprint import measure, memory_kind

log = logging.getLogger(__name__)

EXIT_HEALTHY, EXIT_UNHEALTHY, EXIT_ERROR = 0, 1, 2
SILENT_PEAK = 1e-4
"""Peak |sample| below which the reference sentence counts as silence (-80 dBFS)."""


def _device_memory_mib(pipeline: Any) -> Optional[float]:
    """Accelerator memory the backend holds, MiB (``Pipeline.device_memory_bytes``); None on a
    CPU backend (RSS already counts it) or when the probe fails."""
    try:
        b = pipeline.device_memory_bytes()
    except Exception as e:  # noqa: BLE001 - a memory probe must not fail the check
        log.warning("device memory probe failed: %s", e)
        return None
    return b / 2**20 if b else None


#: Most of each render the degeneracy checks analyse, s (its start): a buzz or seed-independent
#: noise shows in any part, and their FFTs stay bounded whatever ``health.sentence`` is (38 s of
#: audio took 1.9 s on a loaded 2-core box, a watchdog interval without a heartbeat).
ANALYSED_S = 15.0


def run_health_check(pipeline: Any, cfg: Config, weights_failure: Optional[str] = None,
                     beat: Callable[[], None] = lambda: None) -> HealthReply:
    """Run the reference sentence through ``pipeline`` without playing it and judge the numbers.

    Must run on the thread that owns the pipeline (the daemon's worker thread; the pipeline
    is not thread-safe).

    Args:
        pipeline: a :class:`~appliance.synth.pipeline.Pipeline` (``prepare``, ``run``, its report's ``stats``).
        cfg: configuration (``health``, ``service.memory_budget_mb``).
        weights_failure: the background re-verification's first mismatch
            (:class:`~appliance.ops.integrity_watch.IntegrityWatch`), reported as a reason.
        beat: the worker's liveness beat, called between the stages after synthesis (the
            engine beats during it), so the watchdog sees a live worker throughout.

    Returns:
        :class:`HealthReply` with ``rtf``, ``ttfb_ms``, ``steps_per_s``, ``memory_mib`` (None when
        the run failed), the ``conditions`` it found (module docstring) and their ``reasons``
        (empty when healthy).
    """
    h = cfg.health
    mem_limit = h.max_memory_mib if h.max_memory_mib is not None else float(cfg.service.memory_budget_mb)
    limits = {"max_rtf": h.max_rtf, "max_ttfb_ms": h.max_ttfb_ms, "min_steps_per_s": h.min_steps_per_s,
              "max_memory_mib": mem_limit}
    cancel = threading.Event()
    timer = threading.Timer(h.timeout_s, cancel.set)
    timer.daemon = True
    t0 = time.perf_counter()
    try:
        timer.start()
        pcm, take = reference.render(pipeline, h.sentence, HEALTH_SEED, cancel, beat)
        samples = pcm.size
        nonfinite = int(np.count_nonzero(~np.isfinite(pcm)))
        peak = float(np.max(np.abs(np.nan_to_num(pcm)))) if samples else 0.0
        other = reference.render(pipeline, h.sentence, HEALTH_SEED + 1, cancel, beat)[0] if not nonfinite and peak >= SILENT_PEAK else None
    except CancelledError:
        return _reply(_Findings().add("timeout", f"timeout: no result within health.timeout_s = {h.timeout_s:g} s"),
                      limits=limits)
    except ApplianceError as e:
        log.warning("health check failed: %s (%s)", e, e.code)
        return _reply(_Findings().add(e.code, f"{e.code}: {e}"), limits=limits)
    finally:
        timer.cancel()
    stats = take.report.stats
    info = pipeline.info
    fp = measure(memory_kind(info.device or "cpu"), _device_memory_mib(pipeline) or 0.0, info.context_bytes / 2**20)
    memory = round(fp.budget_mib, 1) if fp is not None else None          # counted as the budget counts it
    host = round(fp.host_mib, 1) if fp is not None and fp.host_mib is not None else None
    if host is not None:
        limits["max_host_rss_mib"] = cfg.service.host_rss_limit_mb
    found, ref_note = _Findings(), "not compared with a reference: the audio failed an earlier check"
    if nonfinite:
        found.add("audio", f"audio: {nonfinite} of {samples} samples are NaN/Inf")
    elif peak < SILENT_PEAK:
        found.add("audio", f"audio: silent (peak |x| {peak:.1e} < {SILENT_PEAK:g} over {samples} samples)")
    else:   # a flipped weight that saturates a layer speaks a buzz, or the same noise whatever the seed
        n = int(ANALYSED_S * SAMPLE_RATE)
        beat()
        for r in audio_problems(pcm[:n], SAMPLE_RATE, other_seed=None if other is None else other[:n]):
            if not r.startswith(("audio: silent", "audio: constant")):
                found.add("audio", r)
        beat()
        far, ref_note = reference.check(pipeline, cfg, take, pcm)   # the same render, against calibrate's
        for r in far:
            found.add("audio_reference", r)
        beat()
    if weights_failure:
        found.add("integrity", f"weights: {weights_failure}")
    if stats.rtf > h.max_rtf:
        found.add("rtf", f"rtf {stats.rtf:.2f} > max {h.max_rtf:.2f}")
    if stats.ttfb_ms > h.max_ttfb_ms:
        found.add("ttfb", f"ttfb {stats.ttfb_ms:.0f} ms > max {h.max_ttfb_ms:.0f} ms")
    if h.min_steps_per_s > 0 and stats.steps_per_s < h.min_steps_per_s:
        found.add("steps_per_s", f"steps/s {stats.steps_per_s:.1f} < min {h.min_steps_per_s:.1f}")
    if memory is not None and memory > mem_limit:
        found.add("memory", f"memory {memory:.0f} MiB > max {mem_limit:.0f} MiB")
    if host is not None and host > cfg.service.host_rss_limit_mb:
        found.add("host_rss", f"host RSS {host:.0f} MiB > service.host_rss_limit_mb {cfg.service.host_rss_limit_mb} MiB")
    reply = _reply(found, rtf=round(stats.rtf, 4), ttfb_ms=round(stats.ttfb_ms, 1),
                   steps_per_s=round(stats.steps_per_s, 2), memory_mib=memory, host_rss_mib=host,
                   limits=limits, reference=ref_note)
    log.info("health %s: rtf %.3f, ttfb %.0f ms, %.1f steps/s, %.2f s audio in %.2f s, memory %s MiB%s",
             "ok" if reply.healthy else "UNHEALTHY", stats.rtf, stats.ttfb_ms, stats.steps_per_s,
             stats.audio_s, time.perf_counter() - t0, reply.memory_mib,
             "" if reply.healthy else " (" + "; ".join(reply.reasons) + ")",
             extra={"health": reply.healthy, "rtf": stats.rtf, "ttfb_ms": stats.ttfb_ms})
    return reply


#: Findings of the check that leave the box speaking, only slower or bigger than it should.
_DEGRADED = frozenset({"rtf", "ttfb", "steps_per_s", "memory", "host_rss"})


class _Findings(list):
    """The check's findings in order: ``(name, reason)``."""

    def add(self, name: str, reason: str) -> "_Findings":
        self.append((name, reason))
        return self


def _reply(found: _Findings, **fields: Any) -> HealthReply:
    """The check's :class:`HealthReply`: its findings as conditions (``for_s`` 0: just seen)."""
    conds = [{"name": n, "severity": DEGRADED if n in _DEGRADED else UNHEALTHY, "reason": r, "for_s": 0.0}
             for n, r in found]
    verdict = "healthy" if not conds else UNHEALTHY if any(c["severity"] == UNHEALTHY for c in conds) else DEGRADED
    return HealthReply(healthy=not conds, reasons=[r for _, r in found], conditions=conds, verdict=verdict, **fields)


# ------------------------------------------------------------------------------- CLI


def ask_daemon(path: str, timeout_s: float) -> HealthReply:
    """Send ``{"type":"health"}`` to the daemon's socket and return its :class:`HealthReply`.

    Raises:
        ConfigError: the socket cannot be reached, the daemon answered with an ``error`` event,
            or nothing came within ``timeout_s``.
    """
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(path)
            s.sendall(b'{"type":"health"}\n')
            buf = b""
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    ev = json.loads(line)
                    if ev.get("type") == "health":
                        return parse_event(ev)
                    if ev.get("type") == "error":
                        raise ConfigError(f"daemon at {path} refused the health check: {ev.get('code')}: {ev.get('message')}")
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot ask the daemon at {path}: {e}; is chattts-appliance running?") from e
    raise ConfigError(f"daemon at {path} sent no health reply within {timeout_s:g} s")


def _limits(reply: HealthReply, cfg: Optional[Config]) -> dict:
    """The thresholds to show: the daemon's own (``reply.limits``), else the local config's."""
    if reply.limits:
        return reply.limits
    if cfg is None:
        return {}
    h = cfg.health
    return {"max_rtf": h.max_rtf, "max_ttfb_ms": h.max_ttfb_ms, "min_steps_per_s": h.min_steps_per_s,
            "max_memory_mib": h.max_memory_mib if h.max_memory_mib is not None else cfg.service.memory_budget_mb}


def _print_table(reply: HealthReply, cfg: Optional[Config]) -> None:
    lim = _limits(reply, cfg)

    def fmt(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    def bound(key: str, op: str) -> str:
        v = lim.get(key)
        if v is None:
            return ""
        return "not checked" if key == "min_steps_per_s" and not v else f"{op} {v:g}"

    rows = [("RTF", fmt(reply.rtf, ".3f"), bound("max_rtf", "<=")),
            ("TTFB ms", fmt(reply.ttfb_ms, ".0f"), bound("max_ttfb_ms", "<=")),
            ("steps/s", fmt(reply.steps_per_s, ".1f"), bound("min_steps_per_s", ">=")),
            ("memory MiB", fmt(reply.memory_mib, ".0f"), bound("max_memory_mib", "<="))]
    verdict = "healthy" if reply.healthy else (reply.verdict if reply.verdict != "healthy" else "unhealthy").upper()
    lines = [f"  - {c['name']} ({c['severity']}, {c.get('for_s', 0):g} s): {c['reason']}" for c in reply.conditions] \
        or [f"  - {r}" for r in reply.reasons]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is in the dev venv, maybe not on a box
        print(f"{'metric':<12}{'value':>10}  limit")
        for name, val, lim in rows:
            print(f"{name:<12}{val:>10}  {lim}")
        print(verdict)
        for line in lines:
            print(line)
        if reply.reference:
            print(f"reference: {reply.reference}")
        return
    t = Table(title=f"chattts-appliance health: {verdict}")
    for col in ("metric", "value", "limit"):
        t.add_column(col, justify="right" if col == "value" else "left")
    for row in rows:
        t.add_row(*row)
    con = Console(file=sys.stdout)
    con.print(t)
    for line in lines:
        con.print(line, markup=False)
    if reply.reference:
        con.print(f"reference: {reply.reference}", markup=False)


def cli_main(args: Any) -> int:
    """``chattts-appliance health [--config PATH] [--json] [--daemon | --socket PATH]``.

    Without ``--daemon`` / ``--socket``: loads config and the pipeline here, warms up (if
    ``service.warmup``), runs :func:`run_health_check`. With ``--daemon``: asks the running daemon
    at the config's ``service.socket``; ``--socket PATH``: at that socket (the config is then read
    only if the file exists). The limits column shows the daemon's own thresholds
    (``HealthReply.limits``); from a daemon, the conditions are every condition of the box (the
    one verdict, :mod:`appliance.ops.verdict`). Prints a table, or one JSON line with ``--json``.
    Returns 0 healthy, 1 degraded or unhealthy, 2 error (message on stderr).
    """
    try:
        cfg: Optional[Config] = None
        if args.socket or getattr(args, "daemon", False):
            if args.config and os.path.exists(args.config):
                cfg = load_config(args.config)
            path = args.socket or str(cfg.resolve(cfg.service.socket) if cfg is not None
                                      else Config().resolve(Config().service.socket))
            timeout = (cfg.health.timeout_s if cfg is not None else 300.0) + 30.0
            reply = ask_daemon(path, timeout)
        else:
            cfg = load_config(args.config)
            from ..synth.pipeline import Pipeline

            pipeline = Pipeline.from_config(cfg)
            try:
                if cfg.service.warmup:
                    pipeline.warmup()
                reply = run_health_check(pipeline, cfg)
            finally:
                pipeline.close()
    except ApplianceError as e:
        print(f"chattts-appliance health: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        sys.stdout.write(to_json(reply).decode("utf-8"))
    else:
        _print_table(reply, cfg)
    return EXIT_HEALTHY if reply.healthy else EXIT_UNHEALTHY


__all__ = ["run_health_check", "ask_daemon", "cli_main", "EXIT_HEALTHY", "EXIT_UNHEALTHY", "EXIT_ERROR"]
