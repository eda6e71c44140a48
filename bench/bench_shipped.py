"""The box as shipped, as a new user meets it: ``bench: shipped`` records.

Takes the repository's ``config.yaml`` and changes only what a box must: paths (checkpoint, a
FRESH engine directory, socket, spool, WAV), the Wyoming server on (a free port on 127.0.0.1,
audio only to the client) so that ``wyoming-bench`` can measure it, and, because the checkpoint's
weights are random, the sentence length fixed (``synthesis.min_new_tokens`` = ``max_new_tokens``
= ``--steps``: EOS would come at random). Then:

1. starts the daemon (``python -m appliance serve``) and times READY (the socket appears after
   the load, the warm-up, the memory fit, a first start's look-ahead calibration and the health
   check); reads ``status`` at READY: the throttle level, ``memory_mib`` against
   ``memory_budget_mib``; the channels that may synthesize at once (the runner's slots after the
   memory fit, from the log, limited by the throttle's level); whether the look-ahead was
   calibrated at this start (``<engine_dir>/calibration.json`` and the log's ``calibration took``);
2. sends ``--requests`` requests over the socket, one after another (the box's first real
   requests: 8 different texts in turn), and takes each ``done``'s ``ttfb_ms`` (arrival to the
   first sample written) and ``synthesis_ttfb_ms``; then ``status`` again (memory, throttle);
3. runs ``wyoming-bench tts`` against it (``--rounds`` after one warm-up, one-shot and streaming):
   time to first audio on this fresh box;
4. stops it, starts it again on the same engine directory (now calibrated: nothing is measured at
   this start) and runs ``wyoming-bench`` again: the calibrated box, for the ratio.

Appends one record to ``--out`` (JSON list) and prints it. Usage:
``python bench/bench_shipped.py --checkpoint DIR --out FILE [--requests 100] [--rounds 3]
[--set SECTION.KEY=VALUE ...]`` (``bench/gpu_shipped.sh`` on a GPU machine).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.cli.client import Client  # noqa: E402

TEXTS = ["今天天气很好，我们一起去公园散步吧。", "请注意前方路口右转，然后直行三百米。", "明天早上七点有雨，出门记得带伞。",
         "电量不足，请尽快充电。", "欢迎回家，灯已经打开了。", "导航已开始，全程十二公里。", "前方五百米有测速照相。",
         "您有一条新消息，来自妈妈。"]
WB_LINE = re.compile(r"\[(?P<mode>\w+)\] r(?P<round>\d+) sent=(?P<sent>\d+) ttft=(?P<ttft>\d+)ms "
                     r"total=(?P<total>\d+)ms audio=(?P<audio>[\d.]+)s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shipped_config(ckpt: Path, work: Path, port: int, steps: int) -> dict:
    """``config.yaml`` with the box's paths, a fresh engine dir, Wyoming on ``port`` and fixed-length sentences."""
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["model"].update(path=str(ckpt), engine_dir=str(work / "engines"))
    cfg["service"].update(socket=str(work / "appliance.sock"), spool_dir=str(work / "spool"))
    cfg["audio"].update(wav_dir=str(work / "out"))
    cfg["synthesis"].update(min_new_tokens=steps, max_new_tokens=steps)
    cfg["wyoming"].update(enabled=True, uris=[f"tcp://127.0.0.1:{port}"], play=False)
    return cfg


def _request(sock: Path, obj: dict, until=("done", "error", "status"), timeout_s: float = 300.0) -> dict:
    c = Client(sock, timeout_s)
    try:
        c.send(obj)
        for ev, _ in c.events():
            if ev.get("type") in until:
                return ev
    finally:
        c.close()
    raise RuntimeError(f"no reply to {obj}")


def _start(cfg_path: Path, sock: Path, log: Path, timeout_s: float = 900.0) -> tuple[subprocess.Popen, float]:
    sock.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--config", str(cfg_path)], cwd=str(ROOT),
                             stdout=f, stderr=subprocess.STDOUT)
    while not sock.exists():
        if p.poll() is not None or time.perf_counter() - t0 > timeout_s:
            raise RuntimeError(f"daemon exited before READY:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    return p, time.perf_counter() - t0


def _stop(p: subprocess.Popen) -> int:
    p.terminate()
    return p.wait(120)


def _wyoming(port: int, rounds: int, log_text: str) -> dict:
    cmd = [sys.executable, "-c", "import sys; from wyoming_bench.cli import main; sys.exit(main())", "tts",
           f"127.0.0.1:{port}", "--mode", "both", "--rounds", str(rounds), "--warmup", "1", "--no-unique",
           "--timeout", "300", "-v"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    text = out.stdout + out.stderr
    res = {}
    for mode in ("non_streaming", "streaming"):
        ms = [int(m["ttft"]) for m in WB_LINE.finditer(text) if m["mode"] == mode]
        res[mode] = {"n": len(ms), "ttfa_ms_median": statistics.median(ms) if ms else None,
                     "ttfa_ms_p95": sorted(ms)[max(0, int(0.95 * len(ms)) - 1)] if ms else None, "ttfa_ms": ms}
    if not res["non_streaming"]["n"]:
        res["error"] = text[-2000:]
    return res


def _rows(log_text: str) -> int | None:
    """Slots the runner was opened with (after the memory fit), from its load line."""
    m = re.findall(r"(\d+) (?:rows|slots) x (\d+) positions", log_text)
    return int(m[-1][0]) if m else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", required=True, help="records file (JSON list, appended)")
    ap.add_argument("--work", default=None, help="the box's directory (default: a fresh temporary one)")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3, help="wyoming-bench --rounds per start")
    ap.add_argument("--steps", type=int, default=120, help="decode steps per sentence (random weights)")
    ap.add_argument("--machine", default="h200")
    ap.add_argument("--label", default="")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="change one more setting (YAML value), e.g. for a CPU dry run stream.calibrate_at_start=false")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="shipped-"))
    work.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    cfg = shipped_config(Path(args.checkpoint).resolve(), work, port, args.steps)
    for kv in args.set:
        key, value = kv.split("=", 1)
        section, name = key.split(".", 1)
        cfg.setdefault(section, {})[name] = yaml.safe_load(value)
    cfg_path = work / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    sock = work / "appliance.sock"
    rec: dict = {"bench": "shipped", "date": dt.date.today().isoformat(), "machine": args.machine,
                 "checkpoint": "full", "budget_mib": cfg["service"]["memory_budget_mb"]}
    p, rec["ready_s"] = _start(cfg_path, sock, work / "daemon-1.log")
    try:
        st = _request(sock, {"type": "status"})
        log = (work / "daemon-1.log").read_text()
        rows = _rows(log)
        level = st.get("throttle")
        rec.update(backend=st.get("backend"), throttle_at_ready=level, memory_mib_at_ready=st.get("memory_mib"),
                   memory_kind=st.get("memory_kind"), host_rss_mib_at_ready=st.get("host_rss_mib"),
                   cuda_context_mib=st.get("cuda_context_mib"), memory_note=st.get("memory_note"),
                   channels_at_ready=(rows if level == "normal" else min(rows or 1, cfg["throttle"]["reduced_channels"])),
                   kv=re.findall(r"(\d+ (?:rows|slots) x \d+ positions)", log)[-1:])
        cal = work / "engines" / "calibration.json"
        m = re.search(r"calibration took ([\d.]+) s: look-ahead (.*)", log)
        rec.update(calibrated=bool(m) and cal.is_file(), calibration_s=float(m[1]) if m else None,
                   lookahead=m[2] if m else re.findall(r"look-ahead: (.*)", log)[-1:])
        ttfb, synth = [], []
        for i in range(args.requests):
            ev = _request(sock, {"type": "speak", "text": TEXTS[i % len(TEXTS)], "seed": 100 + i, "id": f"r{i}"})
            if ev.get("type") != "done":
                raise RuntimeError(f"request {i}: {ev}")
            ttfb.append(ev["ttfb_ms"])
            synth.append(ev.get("synthesis_ttfb_ms"))
        steady = statistics.median(ttfb[10:]) if len(ttfb) > 10 else statistics.median(ttfb)
        rec.update(first_request_ms=round(ttfb[0], 1), first_five_ms=[round(x, 1) for x in ttfb[:5]],
                   steady_median_ms=round(steady, 1), first_over_steady=round(ttfb[0] / steady, 3),
                   synthesis_ttfb_first_ms=synth[0], synthesis_ttfb_median_ms=statistics.median(
                       [x for x in synth[10:] if x is not None] or [0.0]), requests=args.requests)
        st = _request(sock, {"type": "status"})
        rec.update(memory_mib_after_100=st.get("memory_mib"), throttle_after_100=st.get("throttle"),
                   host_rss_mib_after_100=st.get("host_rss_mib"))
        fresh = _wyoming(port, args.rounds, log)
    finally:
        rc1 = _stop(p)
    p, rec["ready_s_calibrated"] = _start(cfg_path, sock, work / "daemon-2.log")
    try:
        again = _wyoming(port, args.rounds, "")
    finally:
        rc2 = _stop(p)
    rec.update(ttfa_ms_fresh=fresh["non_streaming"]["ttfa_ms_median"], ttfa_ms_median=again["non_streaming"]["ttfa_ms_median"],
               ttfa_streaming_ms_fresh=fresh["streaming"]["ttfa_ms_median"],
               ttfa_streaming_ms_median=again["streaming"]["ttfa_ms_median"], wyoming_fresh=fresh, wyoming_calibrated=again,
               exit_codes=[rc1, rc2],
               notes=f"{args.label}: config.yaml as shipped, paths changed, a fresh engine dir, Wyoming on, "
                     f"sentences fixed at {args.steps} steps (random weights); ttfa_ms_fresh = wyoming-bench "
                     f"(non-streaming, median) on the box right after its first start, ttfa_ms_median = the same box "
                     f"restarted (calibration read from the record); first_request_ms = the first request's done.ttfb_ms "
                     f"after READY (arrival to first sample written), steady = median of requests 11-{args.requests}")
    if fresh["non_streaming"]["ttfa_ms_median"] and again["non_streaming"]["ttfa_ms_median"]:
        rec["ttfa_fresh_over_calibrated"] = round(fresh["non_streaming"]["ttfa_ms_median"] /
                                                  again["non_streaming"]["ttfa_ms_median"], 3)
    out = Path(args.out)
    recs = json.loads(out.read_text()) if out.is_file() else []
    out.write_text(json.dumps(recs + [rec], indent=1, ensure_ascii=False))
    print(json.dumps({k: v for k, v in rec.items() if not k.startswith("wyoming_")}, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
