"""The calibrated look-ahead record, kept beside the engines: ``<model.engine_dir>/calibration.json``.

``chattts-appliance calibrate`` (:mod:`appliance.build.calibrate`) measures how many decode steps
of right context the vocoder windows need on *this* checkpoint, backend and precision for their
PCM to stay within ``stream.lookahead_threshold_db`` of the exact stream, and writes one entry
per (checkpoint sha256, backend, precision)::

    {"entries": [{"checkpoint": {"sha256": ..., "files": {name: [size, mtime]}},
                  "backend": "onnxruntime", "precision": "int8", "lookahead_tokens": 16,
                  "exact_lookahead": 53, "threshold_db": -60.0, "chunk_tokens": 2,
                  "curve": [{"tokens": 8, "worst_db": -35.1, "mean_db": -41.0}, ...],
                  "sentences": [...], "date": "...",
                  "reference": {...the health check's, see appliance.synth.reference}}]}

The daemon (:meth:`appliance.synth.pipeline.Pipeline.from_config`) uses the entry that matches
its checkpoint (hashed again only when a file's size or mtime changed), backend and precision,
with a threshold at least as strict as the configured one; otherwise the exact look-ahead, and
it says which (log, STATUS, health).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Union

from ..errors import EngineError
from ..files import read_json, write_json
from . import manifest as mf

log = logging.getLogger(__name__)

FILE = "calibration.json"


@dataclass(frozen=True)
class Calibration:
    """One measured look-ahead (see module doc for the fields)."""

    backend: str
    precision: str
    lookahead_tokens: int
    exact_lookahead: int
    threshold_db: float
    chunk_tokens: int
    floor_db: float = -200.0
    engine_id: str = ""
    curve: list = field(default_factory=list)
    sentences: list = field(default_factory=list)
    date: str = ""
    checkpoint: dict = field(default_factory=dict)
    reference: dict = field(default_factory=dict)   #: the health check's (appliance.synth.reference)
    threads: int = 0            #: CPU threads the runner computed with (0: not a CPU runner)
    threads_source: str = ""    #: where that number came from (appliance.engines.threads)


@dataclass(frozen=True)
class LookaheadChoice:
    """What the daemon uses: ``tokens`` (None = exact) and why (``source``, one line);
    ``missing``: ``auto`` found no calibration usable for these engines (the daemon then
    calibrates at its start, ``stream.calibrate_at_start``)."""

    tokens: Optional[int]
    source: str
    missing: bool = False

    def describe(self, exact: int) -> str:
        """``"16 steps (calibrated ...)"`` or ``"exact (53 steps): ..."``."""
        return f"{self.tokens} steps ({self.source})" if self.tokens is not None else f"exact ({exact} steps): {self.source}"


def read(engine_dir: str | os.PathLike) -> list[dict]:
    """The entries of ``engine_dir/calibration.json`` ([] when there is none).

    Raises:
        EngineError: the file exists but is not valid JSON of that shape.
    """
    p = Path(engine_dir) / FILE
    try:
        data = read_json(p, "calibration record")     # empty, NUL-filled, unparsable: absent, one warning
    except OSError as e:
        raise EngineError(f"{p}: unreadable calibration record ({e}); run 'chattts-appliance calibrate' again") from e
    if data is None:
        return []
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise EngineError(f"{p}: unreadable calibration record (entries is not a list); "
                          f"run 'chattts-appliance calibrate' again")
    return entries


def save(engine_dir: str | os.PathLike, cal: Calibration) -> Path:
    """Add ``cal`` to the record (replacing the entry of the same checkpoint, backend, precision)."""
    d = Path(engine_dir)
    d.mkdir(parents=True, exist_ok=True)
    try:
        entries = read(d)
    except EngineError:
        entries = []
    key = (cal.checkpoint.get("sha256"), cal.backend, cal.precision)
    entries = [e for e in entries if (e.get("checkpoint", {}).get("sha256"), e.get("backend"), e.get("precision")) != key]
    entries.append(asdict(cal))
    write_json(d / FILE, {"entries": entries}, 0o644)
    return d / FILE


def choose(setting: Union[str, int], engine_dir: str | os.PathLike, ckpt_dir: str | os.PathLike, backend: str, precision: str,
           threshold_db: float, engine_id: str = "") -> LookaheadChoice:
    """The look-ahead for ``stream.lookahead = setting`` (``auto``, ``exact`` or a number).

    ``auto`` takes the record's entry for this checkpoint/backend/precision when its threshold is
    at least as strict as ``threshold_db``; an unreadable record or no match means exact.
    """
    if setting == "exact":
        return LookaheadChoice(None, "stream.lookahead: exact")
    if isinstance(setting, int):
        return LookaheadChoice(setting, "stream.lookahead set in config")
    try:
        entries = [e for e in read(engine_dir) if e.get("backend") == backend and e.get("precision") == precision]
    except EngineError as e:
        return LookaheadChoice(None, str(e), True)
    if not entries:
        return LookaheadChoice(None, f"not calibrated for {backend}/{precision}: run 'chattts-appliance calibrate'", True)
    entries = [e for e in entries if e.get("engine_id", "") == engine_id]
    if not entries:
        return LookaheadChoice(None, f"the engines were rebuilt since the calibration of {backend}/{precision}: "
                                     f"run 'chattts-appliance calibrate'", True)
    ident = None
    for e in entries:
        known = e.get("checkpoint") or {}
        if ident is None or known.get("files") != ident.get("files"):
            try:
                ident = mf.checkpoint_identity(ckpt_dir, known)
            except OSError as err:
                return LookaheadChoice(None, f"cannot identify the checkpoint: {err}")   # the load will say more
        if ident["sha256"] != known.get("sha256"):
            continue
        if float(e.get("threshold_db", 0.0)) > threshold_db:
            return LookaheadChoice(None, f"calibrated at {e['threshold_db']} dB, looser than stream.lookahead_threshold_db "
                                         f"{threshold_db}: run 'chattts-appliance calibrate' again", True)
        return LookaheadChoice(int(e["lookahead_tokens"]), f"calibrated {e.get('date', '')[:10]} for {backend}/{precision}, "
                                                           f"worst error <= {e['threshold_db']} dB")
    return LookaheadChoice(None, "the calibration was made for another checkpoint: run 'chattts-appliance calibrate'", True)
