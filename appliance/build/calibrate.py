"""``chattts-appliance calibrate``: measure the vocoder look-ahead the configured checkpoint and
backend need (:mod:`appliance.synth.calibration`: the method, the sentences, the record), print
the curve and save it beside the engines (``<model.engine_dir>/calibration.json``, read by the
daemon at its start: :mod:`appliance.engines.lookahead`). ``engines export`` / ``engines build``
and the installers run it after building; ``--if-missing`` only where the daemon would find no
calibration for the engines it opens (a daemon that finds none calibrates itself before it
serves, ``stream.calibrate_at_start``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from typing import Optional

from ..engines.lookahead import Calibration
from ..synth.calibration import calibrate, calibrate_pipeline

log = logging.getLogger(__name__)


def run(cfg, threshold_db: Optional[float] = None, if_missing: bool = False) -> tuple[Optional[Calibration], str]:
    """Open the configured backend, calibrate, record the health check's reference, save beside
    the engines; returns (calibration, path). ``if_missing``: only where the daemon would find no
    calibration for these engines (returns (None, why not) otherwise)."""
    from ..synth.pipeline import Pipeline

    pipe = Pipeline.from_config(cfg)
    try:
        if if_missing and not pipe.lookahead.missing:
            return None, f"the engines are calibrated: {pipe.describe_lookahead()}"
        return calibrate_pipeline(cfg, pipe, threshold_db, measure=calibrate)   # calibrate: tests may narrow it
    finally:
        pipe.close()


def report(cal: Calibration, path: str, setting: str = "auto") -> str:
    """A short table for people, ending with whether and when the daemon uses the result
    (``setting``: ``stream.lookahead``; only ``auto`` reads the record, and only when the
    pipeline is built, at start: a reload (SIGHUP) re-reads the config, not the record)."""
    lines = [f"look-ahead calibration ({cal.backend}, {cal.precision}, threshold {cal.threshold_db:g} dB, "
             f"chunks of {cal.chunk_tokens} steps):", "  steps  worst error"]
    lines += [f"  {c['tokens']:5d}  {c['worst_db']:7.1f} dB" + ("  <- chosen" if c["tokens"] == cal.lookahead_tokens else "")
              for c in cal.curve]
    lines.append(f"  streaming floor of this backend (exact stream vs one window): worst {cal.floor_db:.1f} dB"
                 + (f"; above the threshold, so the bar is {cal.floor_db + 3:.1f} dB" if cal.floor_db + 3 > cal.threshold_db else ""))
    if cal.lookahead_tokens >= cal.exact_lookahead:
        lines.append(f"  no shorter look-ahead met the threshold: exact ({cal.exact_lookahead} steps)")
    if cal.reference:
        r = cal.reference
        lines.append(f"  health reference: {r['steps']} steps, codes {'recorded' if r['codes_sha256'] else 'NOT repeatable (not recorded)'}, "
                     f"spectrum tolerance {r['tolerance_db']:.2f} dB")
    if cal.threads:
        lines.append(f"  the runner computed with {cal.threads} CPU thread{'s' if cal.threads != 1 else ''} ({cal.threads_source})")
    lines.append(f"saved in {path}")
    if setting == "auto":
        lines.append(f"the daemon uses {cal.lookahead_tokens} steps (exact: {cal.exact_lookahead}) from its next start: "
                     f"a running daemon keeps its look-ahead until it is restarted (systemctl restart "
                     f"chattts-appliance); a reload (systemctl reload, SIGHUP) does not read calibrations")
    else:
        lines.append(f"the daemon does not use it: stream.lookahead is {setting!r} in the config; set it to auto "
                     f"(and restart the daemon) to use {cal.lookahead_tokens} steps")
    return "\n".join(lines)


def cli_main(args) -> int:
    """``chattts-appliance calibrate``: returns 0; errors propagate as ApplianceError (exit 2)."""
    from ..config import find_config, load_config

    cfg = load_config(find_config(args.config))
    cal, path = run(cfg, args.threshold_db, if_missing=getattr(args, "if_missing", False))
    if cal is None:
        print(path)
        return 0
    print(json.dumps(asdict(cal), indent=1) if args.json else report(cal, path, cfg.stream.lookahead))
    return 0
