"""End-to-end benchmark of the daemon as a user hears it: first audio at the sound device,
underruns, and a third channel joining two that are speaking.

Starts the real daemon (``python -m appliance serve``) on a checkpoint and its exported engines,
playing into a real-time paced ALSA ``file`` device (the tests' ``.asoundrc``: PortAudio → ALSA
``file`` plugin → a pacer that consumes 44100 float32 frames per second), and talks to it over its
UNIX socket like any client. Per look-ahead mode (``--lookahead auto exact``: calibrated if the
engine directory holds a matching calibration, and the exact receptive field) it measures:

* ``single``: ``--runs`` requests one after another on channel ``a``, each a sentence of ``--steps``
  decode steps (EOS masked): ``done.ttfb_ms`` (the request line's arrival → its first sample
  written to the device, in the PortAudio callback), ``done.synthesis_ttfb_ms`` (the pipeline's
  first chunk), ``done.rtf``, the device's underrun count before and after (a streaming voice
  that ran dry while its request was still being synthesized) and how many requests had one
  (``runs_with_underrun``), and the start decision (``done.predicted_rtf``, ``start_hold_ms``,
  ``start_delay_ms``: :mod:`appliance.service.startpolicy`);
* ``third``: two requests of ``2 * --steps`` on channels ``a`` and ``b`` (mixed on the one device),
  then, once both have played for ``--join-after`` s, a third of ``--steps`` on channel ``c``: its
  ``ttfb_ms`` while joining the running batch, and the underruns of the whole scenario.

* ``busy`` (with ``--burners N``): the box falls behind mid-request. One request of
  ``--busy-sentences`` sentences of ``--steps`` each on channel ``a``; ``--join-after`` s after it
  starts, N busy-loop processes start beside it and run until the end of the scenario (with
  ``--neighbours unit``, the default, as the daemon's unit sees them: the daemon runs with its
  tree's unit's ``CPUWeight=`` (a cpu cgroup of that weight, v2 or v1 ``cpu.shares``) and
  ``Nice=``, the loops in another cgroup of the default weight 100 at the daemon's niceness; the
  record says where each ran, or why not; ``same``: all in this process's cgroup, as nice as it); then the three-channel scenario again beside them. Recorded: the device's
  underruns (a voice ran dry mid-sentence) and sentence holds, ``done.pauses`` / ``pause_ms``
  (where the player paused and why: :mod:`appliance.service.startpolicy`), and the silences the
  paced device really wrote inside the long request (runs of exact zeros of 50 ms or more in
  its file): ``busy_gaps_ms``, and ``busy_stalls_over_300ms``: those longer than 300 ms that are
  not a reported pause at a sentence boundary (a tree without ``done.pauses``: all of them).

Prints a table and appends one JSON record per mode (``bench: service``) to
``bench/results/service.jsonl``; ``--tree DIR`` runs the daemon from another checkout
(e.g. the commit before a change) for a side-by-side run. Needs the test extras (pytest, for the
fixtures' ALSA helpers), PortAudio and alsa-lib. Timings on a shared machine are noisy: compare
the modes of one run, not runs of different days.

    python -m bench service --checkpoint models/random-full --engine-dir engines/build/full --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import harness

ROOT = harness.ROOT

from tests.fixtures_service import DaemonProc, alsa_home, launch_daemon  # noqa: E402

SENTENCES = ["今天天气很好，我们去公园散步吧。", "The next train to the airport leaves at ten forty five.",
             "请注意，列车即将进站。", "Turn left in two hundred metres."]


def _underruns(d: DaemonProc) -> tuple[int, float]:
    """(underruns, underrun_ms) of the sound devices (channels sharing a device report it once)."""
    st = d.request({"type": "status"})[-1]
    devs = {c.get("device"): c for c in st["channels"].values()}
    gaps = [c.get("underrun_ms") for c in devs.values()]
    return (sum(int(c.get("underruns") or 0) for c in devs.values()),
            None if None in gaps else sum(gaps))   # None: a tree before underrun_ms existed


def _memory(pid: int) -> dict:
    """The daemon's resident memory split (MiB) from /proc: all, anonymous (its own), file-backed
    (mapped libraries and files, shared and reclaimable)."""
    text = Path(f"/proc/{pid}/status").read_text()
    kb = {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in text.splitlines() if ":" in ln)
          if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem")}
    return {f"{k.lower()}_mib": round(v / 1024) for k, v in kb.items()}


def _med_opt(xs: list) -> float | None:
    """Median of the values that are not None (None: a tree whose done lacks the field)."""
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def _gap(a: tuple, b: tuple) -> float | None:
    return None if a[1] is None or b[1] is None else round(b[1] - a[1], 1)


def _speak(d: DaemonProc, text: str, channel: str, steps: int, seed: int, out: dict, started: threading.Event | None = None) -> None:
    c = d.connect(300.0)
    try:
        c.send({"type": "speak", "text": text, "channel": channel, "seed": seed,
                "params": {"min_new_tokens": steps, "max_new_tokens": steps}})
        while True:
            evs = c.events(("started", "done", "error"))
            if not evs:
                out["error"] = "connection closed"
                return
            ev = evs[-1]
            if ev["type"] == "started" and started is not None:
                started.set()
                continue
            if ev["type"] in ("done", "error"):
                out.update(ev)
                return
    finally:
        c.close()
        if started is not None:
            started.set()


def _three_channels(d: DaemonProc, args, seed: int, join_s: float) -> dict[str, dict]:
    """Two channels ("a", "b": sentences of ``2 * args.steps`` steps, seeds ``seed``, ``seed + 1``)
    start together; once both have begun and ``args.join_after`` s have passed, a third ("c",
    seed ``seed + 100``) joins. Returns each channel's final event, as :func:`_speak` fills it."""
    res: dict[str, dict] = {"a": {}, "b": {}, "c": {}}
    ev = {k: threading.Event() for k in "ab"}
    th = [threading.Thread(target=_speak, args=(d, SENTENCES[j], k, 2 * args.steps, seed + j, res[k], ev[k]))
          for j, k in enumerate("ab")]
    for t in th:
        t.start()
    for e in ev.values():
        e.wait(300)
    time.sleep(args.join_after)
    _speak(d, SENTENCES[2], "c", args.steps, seed + 100, res["c"])
    for t in th:
        t.join(join_s)
    return res


def _silences(raw, rate: int, shortest_s: float = 0.05) -> list[tuple[float, float]]:
    """(audio played before it, s; its length, s) of each run of exact zeros of at least
    ``shortest_s`` between the first and the last sound in ``raw`` (float32 at ``rate`` Hz: speech
    is never exactly zero, the callback writes zeros)."""
    import numpy as np

    nz = np.flatnonzero(raw)
    if len(nz) == 0:
        return []
    z = (raw[nz[0]:nz[-1] + 1] == 0).astype(np.int8)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], z, [0]])))
    out, silent = [], 0
    for a, b in zip(edges[::2], edges[1::2]):
        if b - a >= shortest_s * rate:
            out.append(((a - silent) / rate, (b - a) / rate))
        silent += b - a
    return out


def _busy(d: DaemonProc, args, alsa) -> dict:
    """The ``busy`` scenario (module docstring)."""
    from tests.fixtures_service import DEFAULT_RATE

    time.sleep(1.0)                  # the paced file lags the device by its pipe: let the last scenario's tail in
    off = alsa.size()
    text = " ".join(SENTENCES[(k % len(SENTENCES))] for k in range(args.busy_sentences))
    r: dict = {}
    started = threading.Event()
    u0 = _underruns(d)
    holds0 = _holds(d)
    th = threading.Thread(target=_speak, args=(d, text, "a", args.steps, 4000, r, started))
    th.start()
    started.wait(300)
    time.sleep(args.join_after)
    burners = harness.burners(args.burners, args.neighbour_where)
    try:
        th.join(600)
        u1, holds1 = _underruns(d), _holds(d)
        time.sleep(0.5)
        gaps = _silences(alsa.read(off - off % 4), DEFAULT_RATE)
        res = _three_channels(d, args, seed=500, join_s=600)
        u2, holds2 = _underruns(d), _holds(d)
    finally:
        harness.stop_all(burners)
    if r.get("type") != "done" or any(res[k].get("type") != "done" for k in "abc"):
        raise RuntimeError(f"busy scenario failed: {r} {res}")
    held = [p for p in r.get("pauses") or [] if p["where"] == "sentence_boundary"]
    stalls = [g for g in gaps if g[1] > 0.3 and not any(abs(g[0] - p["at_s"]) < 0.1 for p in held)]
    return {"busy_rtf": r["rtf"], "busy_audio_s": r["audio_s"], "busy_ttfb_ms": r["ttfb_ms"],
            "busy_underruns": u1[0] - u0[0], "busy_sentence_holds": None if holds0 is None else holds1 - holds0,
            "busy_pauses": r.get("pauses"), "busy_pause_ms": r.get("pause_ms"),
            "busy_gaps_ms": [round(1000 * g[1]) for g in gaps], "busy_stalls_over_300ms": len(stalls),
            "busy_stall_ms": [round(1000 * g[1]) for g in stalls],
            "busy_three_underruns": u2[0] - u1[0], "busy_three_sentence_holds": None if holds0 is None else holds2 - holds1,
            "busy_three_pauses": {k: res[k].get("pauses") for k in "abc"},
            "busy_third_ttfb_ms": res["c"]["ttfb_ms"]}


def _holds(d: DaemonProc) -> int | None:
    """The devices' sentence holds (None: a tree before they existed)."""
    st = d.request({"type": "status"})[-1]
    devs = {c.get("device"): c for c in st["channels"].values()}
    got = [c.get("sentence_holds") for c in devs.values()]
    return None if None in got else sum(got)


def _config(args, tmp: Path, lookahead: str) -> dict:
    chans = [{"name": n, "device": None, "queue_len": 16, "on_preempt": "resume", "on_disconnect": "cancel"}
             for n in ("a", "b", "c")]
    model = {"path": args.checkpoint, "backend": args.backend, "device": args.device, "max_batch": 3,
             "max_seq_len": args.max_seq_len, "threads": args.threads, **json.loads(args.model)}
    if args.device == "cuda":
        model.update(dtype=args.dtype, compile=args.compile)
    if args.engine_dir:
        model["engine_dir"] = args.engine_dir
    return {
        "model": model,
        "synthesis": {"max_new_tokens": 2048, "voice": "seed:2"},
        "stream": {"lookahead": lookahead, **({"start_slack_ms": args.start_slack_ms} if args.start_slack_ms is not None else {})},
        "audio": {"output": "device", "wav_dir": str(tmp / "wav"), "latency_ms": args.latency_ms},
        "service": {"socket": str(tmp / "run" / "appliance.sock"), "warmup": True, "channels": chans,
                    "spool_dir": str(tmp / "spool"), "memory_budget_mb": args.memory_budget_mb},
    }


def run_mode(args, lookahead: str, tmp: Path) -> dict:
    alsa = alsa_home(tmp / "home", tmp / "played.raw")
    t0 = time.perf_counter()
    prefix = ["env", "-C", args.tree] if args.tree else []     # python -m imports from its working directory
    unit = args.unit_cpu
    if args.as_unit:                        # the unit's cgroup weight and niceness (unit_cpu)
        d, how = harness.cpu_cgroup(f"bench-service-{os.getpid()}-daemon", unit["cpu_weight"])
        args.daemon_where = {"cgroup": how if d else None, "why": None if d else how, "nice": unit["nice"]}
        enter = ["sh", "-c", 'echo $$ > "$1" && shift && exec "$@"', "sh", str(d / "cgroup.procs")] if d else []
        prefix = enter + ["nice", "-n", str(unit["nice"])] + prefix
    try:
        return _run_mode(args, lookahead, tmp, alsa, t0, prefix or None)
    finally:
        if args.as_unit:
            harness.rmdir_quiet(Path(f"/sys/fs/cgroup/cpu/bench-service-{os.getpid()}-daemon"))
            harness.rmdir_quiet(Path(f"/sys/fs/cgroup/bench-service-{os.getpid()}-daemon"))


def _run_mode(args, lookahead: str, tmp: Path, alsa, t0: float, prefix: list | None) -> dict:
    d = launch_daemon(tmp, _config(args, tmp, lookahead), alsa=alsa, timeout_s=600.0, argv_prefix=prefix)
    ready_s = time.perf_counter() - t0
    la = next((ln.split("look-ahead", 1)[1].strip(" :") for ln in d.log().splitlines() if "look-ahead" in ln), "?")
    try:
        single = []
        u0 = _underruns(d)
        for i in range(args.runs):
            r: dict = {}
            before = _underruns(d)[0]
            _speak(d, SENTENCES[i % len(SENTENCES)], "a", args.steps, 100 + i, r)
            if r.get("type") != "done":
                raise RuntimeError(f"request failed: {r}")
            r["_underruns"] = _underruns(d)[0] - before      # done comes after play-out: this request's
            single.append(r)
            time.sleep(0.3)
        u1 = _underruns(d)
        res = _three_channels(d, args, seed=200, join_s=300)
        u2 = _underruns(d)
        mem = _memory(d.proc.pid)
        st = d.request({"type": "status"})[-1]
        busy = _busy(d, args, alsa) if args.burners else {}
    finally:
        rc = d.stop()
    if any(res[k].get("type") != "done" for k in "abc"):
        raise RuntimeError(f"third-channel scenario failed: {res}")
    med = lambda xs: round(statistics.median(xs), 1)  # noqa: E731
    return {"lookahead": la, "ready_s": round(ready_s, 1), "daemon_rc": rc,
            "ttfb_ms": med([r["ttfb_ms"] for r in single]),
            "ttfb_runs_ms": [r["ttfb_ms"] for r in single],
            "synthesis_ttfb_ms": med([r["synthesis_ttfb_ms"] for r in single]),
            "rtf": med([r["rtf"] for r in single]), "audio_s": single[0]["audio_s"],
            "underruns_single": u1[0] - u0[0], "underrun_ms_single": _gap(u0, u1),
            "runs_with_underrun": sum(1 for r in single if r.get("_underruns")),
            "underrun_requests": [r.get("id") for r in single if r.get("_underruns")],
            "predicted_rtf": _med_opt([r.get("predicted_rtf") for r in single]),
            "start_hold_ms": _med_opt([r.get("start_hold_ms") for r in single]),
            "start_hold_max_ms": max((r["start_hold_ms"] for r in single if r.get("start_hold_ms") is not None), default=None),
            "start_delay_ms": _med_opt([r.get("start_delay_ms") for r in single]),
            "third_ttfb_ms": res["c"]["ttfb_ms"], "third_synthesis_ttfb_ms": res["c"]["synthesis_ttfb_ms"],
            "third_rtf": res["c"]["rtf"], "underruns_three": u2[0] - u1[0],
            "underrun_ms_three": _gap(u1, u2), **mem, "threads": st.get("threads"),
            "threads_source": st.get("threads_source"), **busy}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench service", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="checkpoint dir (chattts-appliance model random --size full DIR)")
    ap.add_argument("--engine-dir", default=None, help="exported engines (engines export; calibrated or not)")
    ap.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "llama", "torch"))
    ap.add_argument("--lookahead", nargs="+", default=["auto", "exact"], help="stream.lookahead values to compare")
    ap.add_argument("--steps", type=int, default=150, help="decode steps per sentence (EOS masked); 46.875 = 1 s")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--join-after", type=float, default=1.5, help="s the two channels play before the third joins")
    ap.add_argument("--latency-ms", type=float, default=100.0, help="audio.latency_ms (device buffer)")
    ap.add_argument("--start-slack-ms", type=float, default=None, help="stream.start_slack_ms (default: the config's)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--memory-budget-mb", type=int, default=1500, help="service.memory_budget_mb")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="model.device (cuda: --backend torch)")
    ap.add_argument("--dtype", default="float16", help="model.dtype on cuda")
    ap.add_argument("--compile", default="auto", help="model.compile on cuda (auto, off, default)")
    ap.add_argument("--max-seq-len", type=int, default=2048, help="model.max_seq_len (fewer compiled graphs at 512)")
    ap.add_argument("--model", default="{}", help='extra model.* settings as JSON, e.g. \'{"spin_wait": true}\'')
    ap.add_argument("--burners", type=int, default=0, help="busy-loop processes for the busy scenario (0: none)")
    ap.add_argument("--busy-sentences", type=int, default=4, help="sentences of the busy scenario's long request")
    ap.add_argument("--neighbours", default="unit", choices=("unit", "same"),
                    help="unit: the daemon runs with its unit's CPUWeight= (a cpu cgroup) and Nice=, the busy "
                         "loops in another cgroup of the default weight at the daemon's niceness; same: all "
                         "where this process is, as nice as it")
    harness.add_common(ap)
    ap.add_argument("--tree", default=None, help="run the daemon from this checkout (e.g. the commit before a change)")
    ap.add_argument("--keep", default=None, help="keep each mode's daemon directory (log, config) under this dir")
    args = ap.parse_args(argv)
    size = harness.checkpoint_size(args.checkpoint)
    if args.device == "cuda" and args.backend != "torch":
        ap.error("--device cuda needs --backend torch")
    args.as_unit = args.neighbours == "unit"
    args.unit_cpu = harness.unit_cpu(Path(args.tree) if args.tree else ROOT)
    args.daemon_where, args.neighbour_where = None, None
    nb = None
    if args.as_unit and args.burners:
        nb, how = harness.cpu_cgroup(f"bench-service-{os.getpid()}-neighbours", 100)
        args.neighbour_where = {"dir": str(nb) if nb else None, "cgroup": how if nb else None,
                                "why": None if nb else how, "nice": args.unit_cpu["nice"]}
    rows = []
    for mode in args.lookahead:
        load0 = os.getloadavg()[0]
        if args.keep:
            r = run_mode(args, mode, Path(args.keep) / mode)
        else:
            with tempfile.TemporaryDirectory(prefix="bench-service-") as tmp:
                r = run_mode(args, mode, Path(tmp))
        rec = harness.record(
            "service", checkpoint=size, machine=args.machine, host_info=harness.host(gpu=args.device == "cuda"),
            backend=args.backend if args.device == "cpu" else f"torch-cuda {args.dtype} compile={args.compile}",
            tree=args.tree or "this checkout", unit_cpu=args.unit_cpu if args.as_unit else None,
            daemon_placed=args.daemon_where,
            env={k: os.environ[k] for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY") if k in os.environ},
            neighbours=({k: v for k, v in args.neighbour_where.items() if k != "dir"} if args.neighbour_where
                        else {"cgroup": None, "nice": os.getpriority(os.PRIO_PROCESS, 0)} if args.burners else None),
            batch=1, stream_lookahead=mode, **r,
            notes=f"{args.runs} x {args.steps}-step sentences on one channel, then 2 x {2 * args.steps} "
                        f"on a, b and {args.steps} on c after {args.join_after} s"
                        + (f"; busy: {args.busy_sentences} x {args.steps} steps on a, {args.burners} busy loops from "
                           f"{args.join_after} s after its start, then a, b, c again beside them" if args.burners else "")
                        + "; paced ALSA file device "
                        f"44100 Hz, latency_ms {args.latency_ms}, start_slack_ms {args.start_slack_ms or 'default'}; 1-min load {load0:.2f} -> {os.getloadavg()[0]:.2f}")
        rows.append(rec)
        harness.write([rec], args.out)
    print("\n| tree | stream.lookahead | look-ahead used | TTFB at device (median) | pipeline TTFB | RTF "
          "| underruns (silence) single | requests with one | start hold (median, max) | predicted RTF "
          "| third channel TTFB | underruns (silence) 3 channels | ready |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tree']} | {r['stream_lookahead']} | {r['lookahead']} | {r['ttfb_ms']} ms | {r['synthesis_ttfb_ms']} ms | {r['rtf']} "
              f"| {r['underruns_single']} ({r['underrun_ms_single']} ms) | {r['runs_with_underrun']} of {args.runs} "
              f"| {r['start_hold_ms']}, {r['start_hold_max_ms']} ms | {r['predicted_rtf']} | {r['third_ttfb_ms']} ms "
              f"| {r['underruns_three']} ({r['underrun_ms_three']} ms) | {r['ready_s']} s |")
    if args.burners:
        print(f"\nbeside {args.burners} busy loops:\n| tree | RTF | underruns (mid-sentence) | sentence holds | pauses (ms) "
              "| silences >= 50 ms at the device (ms) | stalls > 300 ms | 3 channels: underruns, holds |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['tree']} | {r['busy_rtf']} | {r['busy_underruns']} | {r['busy_sentence_holds']} "
                  f"| {[p['ms'] for p in r['busy_pauses'] or []]} | {r['busy_gaps_ms']} | {r['busy_stalls_over_300ms']} "
                  f"| {r['busy_three_underruns']}, {r['busy_three_sentence_holds']} |")
        print(f"daemon: {args.daemon_where}; neighbours: {rows[-1]['neighbours']}")
    harness.rmdir_quiet(nb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
