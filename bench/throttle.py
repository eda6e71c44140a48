"""How soon a box that cooled down speaks what it deferred: the throttle's recovery, measured on
the real daemon.

Starts ``python -m appliance serve`` (a random tiny checkpoint: the model does not matter here,
the scheduling does) whose telemetry reads a fixture ``/sys`` + ``/proc`` tree
(``telemetry.root``, the sysfs source at its default ``interval_s``: 2 s), makes the board hot
(86 C against a 90 C passive trip: ``queue_low_priority``, background requests wait), sends a
``background`` request over the socket (accepted, held), then cools the board and measures, per
run:

* ``started_s``: from the moment the fixture temperature file is rewritten to the request's
  ``started`` event (what a user hears as "the deferred message plays");
* ``healthy_s``: to the first ``status`` whose ``health`` is ``healthy`` again (polled every 50 ms).

Modes (``--dwells``, default ``3 30``): ``throttle.min_dwell_s`` = 3 s (the default: every signal
below the level for 3 s, then straight down) and 30 s (the hold-off as long as the old default's
wait for ONE level: before this change the ladder stepped down one level per 30 s, so a box at
``alerts_only`` needed 60 s to let background requests through). Runs of the modes interleave.
Appends one JSON record (``bench: throttle``) to ``bench/results/throttle.jsonl``::

    python -m bench throttle --runs 1 --dwells 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import harness
from tests.fixtures_service import launch_daemon, service_config  # noqa: E402
from tests.test_ops_verdict import board, set_board  # noqa: E402


def run_once(ckpt: Path, tmp: Path, dwell: float, interval: float) -> dict:
    root = board(tmp / "board", temp_c=86.0)
    cfg = service_config(ckpt, tmp, telemetry={"source": "sysfs", "interval_s": interval, "root": str(root)},
                         throttle={"min_dwell_s": dwell}, service={"max_hold_s": 600.0})
    d = launch_daemon(tmp / "d", cfg)
    try:
        deadline = time.monotonic() + 30
        while d.request({"type": "status"})[0]["throttle"] != "queue_low_priority":
            if time.monotonic() > deadline:
                raise RuntimeError("the board never throttled")
            time.sleep(0.05)
        c = d.connect(300.0)
        c.send({"type": "speak", "text": "Deferred.", "id": "later", "priority": "background"})
        (acc,) = c.events(("accepted",))
        t0 = time.monotonic()
        set_board(root, 50.0)
        healthy = None
        c.sock.settimeout(0.05)
        started = None
        while started is None or healthy is None:
            if healthy is None and d.request({"type": "status"})[0]["health"] == "healthy":
                healthy = time.monotonic() - t0
            if started is None:
                try:
                    evs = c.events(("started", "error"))
                except TimeoutError:
                    evs = []
                if evs and evs[-1]["type"] == "started":
                    started = time.monotonic() - t0
                elif evs:
                    raise RuntimeError(f"request failed: {evs}")
            if time.monotonic() - t0 > 300:
                raise RuntimeError("no recovery within 300 s")
        c.sock.settimeout(300.0)
        c.events(("done", "error"))
        c.close()
        return {"started_s": round(started, 2), "healthy_s": round(healthy, 2), "waiting": acc.get("waiting")}
    finally:
        d.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench throttle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dwells", type=float, nargs="+", default=[3.0, 30.0])
    ap.add_argument("--interval", type=float, default=2.0, help="telemetry.interval_s (the default)")
    harness.add_common(ap)
    args = ap.parse_args(argv)
    from appliance.build.random_ckpt import write_random_checkpoint

    load0 = os.getloadavg()[0]
    res: dict = {str(dw): [] for dw in args.dwells}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        write_random_checkpoint(ckpt, "tiny", seed=0)
        for i in range(args.runs):
            for dw in args.dwells:
                r = run_once(ckpt, Path(tmp) / f"r{i}-{dw}", dw, args.interval)
                res[str(dw)].append(r)
                print(f"min_dwell_s {dw:g}: started {r['started_s']:.2f} s, healthy {r['healthy_s']:.2f} s "
                      f"after the board cooled", flush=True)
    rec = harness.record(
        "throttle", checkpoint="tiny", backend=None, machine=args.machine, host_info=harness.host(),
        notes="the real daemon, a fixture board cooled from 86 C", telemetry_interval_s=args.interval,
        runs=args.runs, load_start=round(load0, 2), load_end=round(os.getloadavg()[0], 2),
        modes={dw: {"started_s": [r["started_s"] for r in rs], "healthy_s": [r["healthy_s"] for r in rs],
                    "started_median_s": statistics.median(r["started_s"] for r in rs),
                    "healthy_median_s": statistics.median(r["healthy_s"] for r in rs)}
               for dw, rs in res.items()})
    harness.write([rec], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
