"""The weight files re-verified in the background while the daemon runs.

A thread steps a :class:`~appliance.model.reverify.Reverifier` over the ``(file, sha256)`` pairs
the runner verified at load (``runner.weight_files``: checkpoint files, ONNX graphs and their
external data, TensorRT plans) at ``safety.reverify_mib_per_s`` (8 MiB/s: the 1.2 GB checkpoint
every ~2.5 minutes, about 1 % of a core). The first mismatch is logged once as an error naming the
file, kept in :attr:`IntegrityWatch.failure`, and makes the box unhealthy from then on
(:meth:`IntegrityWatch.conditions`, a source of the one verdict, :mod:`appliance.ops.verdict`), so systemd's health timer and Home Assistant see
it; the box keeps speaking with what it loaded (the weight files are read, not mapped: the
checkpoint through a buffer, the GGUF by llama.cpp into memory, the ONNX data and tables copied, so
an upgrade written in place changes nothing it computes; a restart checks the file again and
refuses one that does not match its recorded sum).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from ..core import UNHEALTHY, Condition
from ..model.reverify import Reverifier, budget_bytes

log = logging.getLogger(__name__)

PERIOD_S = 1.0
"""Seconds between steps (each reads ``reverify_mib_per_s * PERIOD_S`` MiB at most)."""


class IntegrityWatch:
    """Background re-verification (module docstring).

    Args:
        files: ``(path, expected hex sha256)`` pairs; empty: nothing to watch (the thread is not
            started).
        mib_per_s: read rate, MiB/s; 0 = off.
    """

    def __init__(self, files: Sequence[tuple[Path, str]], mib_per_s: float) -> None:
        self.reverifier = Reverifier(files)
        self.mib_per_s = float(mib_per_s)
        self.failure: Optional[str] = None
        self._failed_at = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def rounds(self) -> int:
        """Complete passes over all files so far."""
        return self.reverifier.rounds

    def start(self) -> None:
        """Start the thread (no-op when off or when there are no files)."""
        if self.mib_per_s <= 0 or not self.reverifier.files or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="integrity watch", daemon=True)
        self._thread.start()

    def step(self, budget: int) -> Optional[str]:
        """One bounded step (the thread's body; tests call it directly); returns the failure."""
        if self.failure is None:
            err = self.reverifier.step(budget)
            if err is not None:
                self.failure, self._failed_at = str(err), time.monotonic()
                log.error("weights changed on disk since they were loaded: %s", err)
        return self.failure

    def conditions(self) -> tuple:
        """Health's view: ``integrity`` (unhealthy) once a file failed, naming it."""
        failure = self.failure
        if failure is None:
            return ()
        return (Condition("integrity", f"weights: {failure} (changed on disk since the load; still speaking "
                                       f"with what was loaded; a restart checks the file again and loads it "
                                       f"only if it matches its recorded sum)", self._failed_at, UNHEALTHY),)

    def _run(self) -> None:
        budget = budget_bytes(self.mib_per_s, PERIOD_S)
        while not self._stop.wait(PERIOD_S):
            try:
                if self.step(budget) is not None:
                    return
            except Exception:  # noqa: BLE001 - the watch must never take the daemon down
                log.exception("integrity watch")
                return

    def stop(self) -> None:
        """Stop the thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
