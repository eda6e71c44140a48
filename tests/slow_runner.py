"""Test fixture: the real daemon on a runner made slower, as on a box that cannot keep up.

Usage (``launch_daemon(..., argv_prefix=slow_runner.argv(...))``)::

    python tests/slow_runner.py STEP_MS HICCUP_AT HICCUP_MS SLOW_FROM -- <python> -m appliance ARGS...

Every decode step of the backend's runner takes ``STEP_MS`` ms longer, and the ``HICCUP_AT``-th
step of every sentence (0 = none) ``HICCUP_MS`` ms longer (one scheduling hiccup of a loaded
machine, placed where it hurts: right after a request's first chunk). With ``SLOW_FROM`` > 0
only sentences whose sampling seed modulo 1000 is at least ``SLOW_FROM`` are slow: sentence ``k``
of a request with seed ``1000 n`` is sampled with seed ``1000 n + k``, so ``SLOW_FROM`` 1 makes
a box that falls behind after a request's first sentence (a busy neighbour starting mid-request).
Everything else is the real daemon. The sleeps model the slow box; the tests assert on what the
daemon does with it.
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def argv(step_ms: float = 0.0, hiccup_at: int = 0, hiccup_ms: float = 0.0, slow_from: int = 0) -> list[str]:
    """The ``argv_prefix`` that runs the daemon through this wrapper."""
    return [sys.executable, str(Path(__file__).resolve()), str(step_ms), str(hiccup_at), str(hiccup_ms),
            str(slow_from), "--"]


def _slow(runner, step_ms: float, hiccup_at: int, hiccup_ms: float, slow_from: int):
    step, start = runner.step, runner.start
    done: dict[int, int] = {}          # slot -> steps of its sentence so far
    slow: dict[int, bool] = {}         # slot -> its sentence is slow

    def slow_start(slot, params, seed):
        done[int(slot)] = 0
        slow[int(slot)] = int(seed) % 1000 >= slow_from
        return start(slot, params, seed)

    def slow_step(slots, k):
        out = step(slots, k)
        extra = out.shape[0] * step_ms if any(slow.get(int(s), True) for s in slots) else 0.0
        for s in slots:
            n = done.get(int(s), 0)
            if hiccup_at and n < hiccup_at <= n + out.shape[0]:
                extra += hiccup_ms
            done[int(s)] = n + out.shape[0]
        time.sleep(extra / 1000.0)
        return out

    runner.step, runner.start = slow_step, slow_start
    return runner


def main() -> None:
    step_ms, hiccup_at, hiccup_ms, slow_from = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    rest = sys.argv[sys.argv.index("--") + 1:]           # [python, -m, appliance, args...]
    sys.path.insert(0, str(ROOT))
    from appliance.engines import recover

    opens = recover.open_runner_recovering          # what Pipeline.from_config opens the runner with

    def slowed(cfg, rebuild=None):
        opened = opens(cfg, rebuild)
        _slow(opened.runner, step_ms, hiccup_at, hiccup_ms, slow_from)
        return opened
    recover.open_runner_recovering = slowed
    sys.argv = ["appliance"] + rest[3:]
    runpy.run_module("appliance", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
