"""The box as shipped, as a new user meets it, per backend in one run: ``bench: shipped`` records.

Takes the repository's ``config.yaml`` and changes only what a box must: paths (checkpoint, a
FRESH engine directory per candidate, socket, spool, WAV), the Wyoming server on (a free port on
127.0.0.1, audio only to the client) so that ``wyoming-bench`` can measure it, and, because the
checkpoint's weights are random, the sentence length fixed (``synthesis.min_new_tokens`` =
``max_new_tokens`` = ``--steps``: EOS would come at random). Candidates (``--candidates``):
``torch`` (``model.backend: torch``: the torch CUDA path on a GPU), ``llama`` (``model.backend:
llama``: the GPT on llama.cpp, CUDA build offloaded where there is a GPU, the Decoder and Vocos on
ONNX Runtime; its GGUF exported first, ``engines export --precision`` ``--gguf-type``, timed
apart), ``auto`` (the config untouched). In turns, each phase for every candidate before the next:

1. fresh start (``python -m appliance serve``): ``ready_s`` until the socket appears (load,
   warm-up, memory fit, the first start's look-ahead calibration, the health check); ``status``
   at READY (``throttle_at_ready``, the budget's ``memory_mib_at_ready``), ``channels_at_ready``
   (the runner's slots after the memory fit, from its load line, limited by the throttle);
   ``torch_imported``: a ``libtorch`` library mapped in ``/proc/PID/maps`` of the daemon or its
   children; ``memory_mib_all_in_at_ready``: host RSS (``VmRSS``) plus GPU memory per process
   (NVML's running processes, the CUDA context included; ``nvidia-smi`` when ``pynvml`` is
   missing) summed over the daemon and its children: one basis for every backend;
2. ``--requests`` requests over the socket one after another (8 texts in turn; ``done.ttfb_ms``),
   then the same memory figures (``..._after_100``); ``wyoming-bench tts`` (``--rounds`` after
   one warm-up): ``ttfa_ms_fresh`` (non-streaming, median); stop;
3. restart on the same engine directory (now calibrated): ``ready_s_calibrated``, wyoming-bench
   again: ``ttfa_ms_median``; stop;
4. ``decode_ms_b1`` / ``decode_ms_b3``: the runner the box opened (``open_runner`` on its config,
   in a fresh process): ``step(slots, k)`` wall per step incl. sampling and the codes copy, median.

    python -m bench shipped --checkpoint /tmp/ckpt_full --candidates torch,llama --requests 100
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from appliance.cli.client import Client
from bench import harness

ROOT = harness.ROOT

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
    m = re.findall(r"(\d+) (?:rows|slots|sequences) x (\d+) positions", log_text)
    return int(m[-1][0]) if m else None


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (``/proc/*/stat`` parent links)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _gpu_mib(pids: list[int]) -> float | None:
    """GPU memory (MiB) NVML charges to ``pids`` (the CUDA context included); None without a GPU."""
    try:
        import pynvml as n

        n.nvmlInit()
        used = 0
        for i in range(n.nvmlDeviceGetCount()):
            for pr in n.nvmlDeviceGetComputeRunningProcesses(n.nvmlDeviceGetHandleByIndex(i)):
                if pr.pid in pids and pr.usedGpuMemory:
                    used += pr.usedGpuMemory
        n.nvmlShutdown()
        return round(used / 2**20, 1)
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - NVML present but no driver: no GPU
        return None
    try:
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if q.returncode != 0:
        return None
    rows = [line.split(",") for line in q.stdout.splitlines() if "," in line]
    return float(sum(float(m) for p, m in rows if int(p) in pids))


def _memory(pid: int) -> dict:
    """All-in memory of the daemon's process tree: host RSS + GPU (MiB), and whether torch is mapped."""
    pids, rss, torch_mapped = _tree(pid), 0.0, False
    for p in pids:
        try:
            rss += next(int(x.split()[1]) for x in Path(f"/proc/{p}/status").read_text().splitlines()
                        if x.startswith("VmRSS:")) / 1024
            torch_mapped = torch_mapped or "libtorch" in Path(f"/proc/{p}/maps").read_text()
        except (OSError, StopIteration):
            continue
    gpu = _gpu_mib(pids)
    return {"host_rss_mib": round(rss, 1), "gpu_mib": gpu, "all_in_mib": round(rss + (gpu or 0.0), 1),
            "torch_imported": torch_mapped, "gpu_device_used_mib": _device_used_mib()}


def _device_used_mib() -> float | None:
    """The whole GPU's used memory (MiB, ``nvidia-smi``): a cross-check of the per-process figure."""
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return float(q.stdout.split()[0]) if q.returncode == 0 and q.stdout.strip() else None


def _step_child(cfg_file: str) -> None:
    """In a fresh process: the box's runner, ms per decode step at B=1 and B=3 (``step`` wall / k)."""
    import numpy as np

    from appliance.config.loader import load_config
    from appliance.core import SamplingParams
    from appliance.engines.select import open_runner

    r = open_runner(load_config(cfg_file))
    rng, out = np.random.default_rng(0), {}
    for b in (1, 3):
        if b > r.info.max_batch:
            continue
        for s in range(b):
            r.prefill(s, rng.integers(0, 400, 24), None)
            r.start(s, SamplingParams(min_new_tokens=4000, max_new_tokens=4000), s)
        k, ts = max(1, r.info.step_chunk), []
        r.step(np.arange(b), k)
        for _ in range(25):
            t = time.perf_counter()
            r.step(np.arange(b), k)
            ts.append((time.perf_counter() - t) / k)
        out[f"decode_ms_b{b}"] = round(1e3 * statistics.median(ts), 3)
    print("STEP " + json.dumps(out), flush=True)


class Box:
    """One candidate: its own work dir, config and engine dir; the phases of the module docstring."""

    SETS = {"torch": {"model.backend": "torch"}, "llama": {"model.backend": "llama"}, "auto": {}}

    def __init__(self, name: str, args, root: Path) -> None:
        self.name, self.args, self.work = name, args, root / name
        self.work.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        cfg = shipped_config(Path(args.checkpoint).resolve(), self.work, self.port, args.steps)
        sets = [f"{k}={v}" for k, v in self.SETS.get(name, {}).items()] + args.set
        for kv in sets:
            key, value = kv.split("=", 1)
            section, key = key.split(".", 1)
            cfg.setdefault(section, {})[key] = yaml.safe_load(value)
        self.cfg, self.cfg_path = cfg, self.work / "config.yaml"
        self.cfg_path.write_text(yaml.safe_dump(cfg, allow_unicode=True))
        self.sock = self.work / "appliance.sock"
        self.rec: dict = {"candidate": name, "sets": sets, "budget_mib": cfg["service"]["memory_budget_mb"]}

    def prepare(self) -> None:
        if self.name != "llama":
            return
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "appliance", "engines", "export", "--config", str(self.cfg_path),
                        "--precision", self.args.gguf_type], cwd=str(ROOT), check=True, capture_output=True)
        self.rec["export_s"] = round(time.perf_counter() - t, 1)

    def _mem(self, p, when: str) -> None:
        m = _memory(p.pid)
        self.rec.update({f"memory_mib_all_in_{when}": m["all_in_mib"], f"host_rss_mib_{when}": m["host_rss_mib"],
                         f"gpu_mib_{when}": m["gpu_mib"], f"gpu_device_used_mib_{when}": m["gpu_device_used_mib"]})
        self.rec["torch_imported"] = self.rec.get("torch_imported", False) or m["torch_imported"]

    def fresh(self) -> None:
        p, self.rec["ready_s"] = _start(self.cfg_path, self.sock, self.work / "daemon-1.log")
        try:
            self._mem(p, "at_ready")
            st = _request(self.sock, {"type": "status"})
            log = (self.work / "daemon-1.log").read_text()
            rows, level = _rows(log), st.get("throttle")
            m = re.search(r"calibration took ([\d.]+) s: look-ahead (.*)", log)
            self.rec.update(backend=st.get("backend"), throttle_at_ready=level, memory_mib_at_ready=st.get("memory_mib"),
                            channels_at_ready=rows if level == "normal" or rows is None
                            else min(rows, self.cfg["throttle"]["reduced_channels"]),
                            calibration_s=float(m[1]) if m else None, lookahead=m[2] if m else None)
            ttfb = []
            for i in range(self.args.requests):
                ev = _request(self.sock, {"type": "speak", "text": TEXTS[i % len(TEXTS)], "seed": 100 + i, "id": f"r{i}"})
                if ev.get("type") != "done":
                    raise RuntimeError(f"{self.name} request {i}: {ev}")
                ttfb.append(ev["ttfb_ms"])
            self._mem(p, "after_100")
            st = _request(self.sock, {"type": "status"})
            self.rec.update(requests=self.args.requests, first_request_ms=round(ttfb[0], 1),
                            steady_median_ms=round(statistics.median(ttfb[10:] or ttfb), 1),
                            memory_mib_after_100=st.get("memory_mib"), throttle_after_100=st.get("throttle"),
                            ttfa_ms_fresh=self._ttfa(log))
        finally:
            self.rec["exit_codes"] = [_stop(p)]

    def _ttfa(self, log: str) -> float | None:
        """wyoming-bench's median time to first audio (non-streaming), ms; its error kept in the record."""
        w = _wyoming(self.port, self.args.rounds, log)
        if "error" in w:
            self.rec["wyoming_error"] = w["error"][-300:]
        return w["non_streaming"]["ttfa_ms_median"]

    def restarted(self) -> None:
        p, self.rec["ready_s_calibrated"] = _start(self.cfg_path, self.sock, self.work / "daemon-2.log")
        try:
            self.rec["ttfa_ms_median"] = self._ttfa("")
        finally:
            self.rec["exit_codes"].append(_stop(p))

    def steps(self) -> None:
        q = subprocess.run([sys.executable, "-m", "bench.shipped", "--step-child", str(self.cfg_path)], cwd=str(ROOT),
                           capture_output=True, text=True, timeout=900)
        line = [x for x in q.stdout.splitlines() if x.startswith("STEP ")]
        self.rec.update(json.loads(line[-1][5:]) if line else {"decode_error": (q.stdout + q.stderr)[-800:]})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench shipped", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=False)
    ap.add_argument("--candidates", default="torch,llama", help="comma-separated: torch, llama, auto")
    ap.add_argument("--work", default=None, help="the boxes' directory (default: a fresh temporary one)")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2, help="wyoming-bench --rounds per start")
    ap.add_argument("--steps", type=int, default=120, help="decode steps per sentence (random weights)")
    ap.add_argument("--gguf-type", default="q8_0", help="the llama candidate's GGUF (engines export --precision)")
    ap.add_argument("--label", default="")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="one more setting for every candidate (YAML value), e.g. stream.calibrate_at_start=false")
    ap.add_argument("--step-child", default=None, help=argparse.SUPPRESS)
    harness.add_common(ap)
    args = ap.parse_args(argv)
    if args.step_child:
        _step_child(args.step_child)
        return 0
    if not args.checkpoint:
        ap.error("--checkpoint is required")
    root = Path(args.work or tempfile.mkdtemp(prefix="shipped-"))
    boxes = [Box(n, args, root) for n in args.candidates.split(",")]
    for phase in ("prepare", "fresh", "restarted", "steps"):   # in turns: every candidate, then the next phase
        for b in boxes:
            getattr(b, phase)()
    hinfo = harness.host(gpu=True)
    recs = [harness.record(
        "shipped", checkpoint=harness.checkpoint_size(args.checkpoint), backend=b.rec.pop("backend", None),
        machine=args.machine, host_info=hinfo,
        notes=f"{args.label}: config.yaml as shipped ({', '.join(b.rec['sets']) or 'unchanged'}), paths changed, a "
              f"fresh engine dir, Wyoming on, sentences fixed at {args.steps} steps (random weights); all-in = host "
              f"RSS + GPU memory per process (NVML) of the daemon and its children; candidates in turns: "
              f"{args.candidates}", **b.rec) for b in boxes]
    harness.write(recs, args.out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
