"""Soak: N requests over three channels through the real daemon, checked for loss, duplicates,
corrupt audio and memory growth.

Set-up (all real parts): a random checkpoint (``tiny``/``full``) exported to ONNX (``--precision``),
the daemon on ONNX Runtime, three channels each on its own ALSA ``file`` PCM (paced by
``tests/asound/pacer.py`` at ``--speed`` x real time), the real UNIX socket, the journal on (fsync).
Workload (deterministic from ``--seed``): per channel one connection keeping up to two requests
outstanding, mixed lengths (20-200 steps, some several sentences) and languages (Chinese, English,
mixed, numbers, control tokens); some cancelled after ``started``; alerts from another connection
(they preempt; the interrupted request resumes from its start); bad lines (each must get an
``error`` and nothing else). Every speak asks for ``return_audio``.

Checks: every accepted request that was not cancelled ends ``done`` (else *lost*); its returned
PCM, resampled as the daemon does, appears in full **exactly once** in its channel's played
stream (0: *lost*, >1: *duplicated*); one terminal event per request; ``--spot`` requests
synthesized again here alone (batch 1) and compared with what the daemon returned. Memory: the
daemon's RSS against requests finished, growth from request 200 to the last. TTFB p50/p99 per channel.
Appends one record (``bench: soak``) to ``bench/results/soak.jsonl``::

    python -m bench soak --requests 1000                       # tiny checkpoint, int8 graphs
    python -m bench soak --checkpoint full --requests 50 --speed 1
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from appliance.cli.client import Client
from bench import harness
from tests.fixtures_service import launch_daemon

ROOT = harness.ROOT

ASOUND = ROOT / "tests" / "asound"
CHANNELS = ("a", "b", "c")
RATE = 44100

TEXTS_ZH = ["今天天气很好，我们去公园散步吧。", "请注意，前方路口右转。", "你好，我是语音助手。",
            "明天早上八点有一个会议。", "这是一个测试句子，用来检查声音是否正常。"]
TEXTS_EN = ["hello there, this is the appliance.", "turn left in two hundred meters.",
            "the quick brown fox jumps over the lazy dog.", "please fasten your seat belt."]
TEXTS_MIX = ["今天是2026年12月1日，temperature 21度。", "电话号码是13800138000。", "你好[uv_break]hello world。",
             "速度 120 km/h，请减速。"]
BAD = [b'{"type": "speak", "text": ""}', b'{"type":"speak","text":"hi","colour":"red"}', b'{not json',
       b'\xff\xfe garbage', b'[1,2,3]', b'{"type":"speak","text":"hello","seed":-1}',
       b'{"type":"speak","text":"hello","channel":"nowhere"}', b'{"type":"shout"}']


# ------------------------------------------------------------------ set-up


def asoundrc(home: Path, raws: dict[str, Path], speed: float) -> None:
    """One paced ALSA ``file`` PCM per channel (``pcm.tts_<name>``)."""
    home.mkdir(parents=True, exist_ok=True)
    tmpl = (ASOUND / "asoundrc.tmpl").read_text()
    body = tmpl[tmpl.index("pcm.!default"):]
    text = ""
    for name, raw in raws.items():
        block = body.replace("pcm.!default", f"pcm.tts_{name}")
        for k, v in {"@PYTHON@": sys.executable, "@PACER@": str(ASOUND / "pacer.py"),
                     "@BYTES_PER_S@": str(int(RATE * 4 * speed)), "@RAW@": str(raw)}.items():
            block = block.replace(k, v)
        text += block + "\n"
    (home / ".asoundrc").write_text(text)


def make_config(tmp: Path, ckpt: Path, engines: Path, limits: dict) -> dict:
    return {
        "model": {"path": str(ckpt), "backend": "onnxruntime", "engine_dir": str(engines), "threads": 2, **limits},
        "synthesis": {"max_new_tokens": 300, "voice": "seed:2"},
        "audio": {"output": "device", "wav_dir": str(tmp / "wav"), "latency_ms": 100.0},
        "service": {"socket": str(tmp / "run" / "appliance.sock"), "spool_dir": str(tmp / "spool"),
                    "channels": [{"name": c, "device": f"tts_{c}", "queue_len": 8} for c in CHANNELS],
                    "max_text_chars": 600},
        "safety": {"cache_dir": str(tmp / "cache"), "max_requests_per_s": 0},
        "telemetry": {"source": "none"}, "health": {"at_start": False},
    }


def workload(n: int, seed: int, scale: float) -> list[dict]:
    """The request specs (deterministic): kind speak / alert / bad, channel, text, seed, steps."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = rng.random()
        kind = "bad" if r < 0.03 else "alert" if r < 0.06 else "speak"
        lang = rng.choice(("zh", "zh", "en", "mix"))
        text = rng.choice({"zh": TEXTS_ZH, "en": TEXTS_EN, "mix": TEXTS_MIX}[lang])
        if rng.random() < 0.08:
            text = "".join(rng.choice(TEXTS_ZH) for _ in range(6))       # several sentences
        steps = rng.choice((20, 30, 40, 60, 80, 120, 200))
        steps = max(8, int(steps * scale))
        out.append({"i": i, "id": f"s{i:04d}", "kind": kind, "channel": CHANNELS[i % 3], "text": text,
                    "seed": rng.randrange(1 << 31), "steps": steps, "lang": lang,
                    "cancel": kind == "speak" and rng.random() < 0.05, "bad": rng.choice(BAD)})
    return out



class Conn(Client):
    """The product's client (:class:`appliance.cli.client.Client`), one event at a time, with raw
    lines for the bad requests."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, timeout_s=6 * 3600)
        self._events = self.events()

    def send(self, obj) -> None:
        self.sock.sendall(obj + b"\n") if isinstance(obj, bytes) else super().send(obj)

    def event(self) -> tuple[dict, bytes]:
        ev, payload = next(self._events, (None, None))
        if ev is None:
            raise ConnectionError("daemon closed the connection")
        return ev, payload or b""


class Tracker:
    """Everything the client saw, per request id (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: dict[str, list[dict]] = {}
        self.pcm: dict[str, bytearray] = {}
        self.finished = 0
        self.t0 = time.monotonic()

    def on(self, ev: dict, payload: bytes) -> None:
        rid = ev.get("id")
        with self.lock:
            if rid is None:
                return
            ended = any(e["type"] in ("done", "error") for e in self.events.get(rid, []))
            if ev["type"] == "error" and ev.get("code") == "bad_request" and ended:
                ev = dict(ev, type="cancel_too_late")    # our cancel arrived after it had finished
            self.events.setdefault(rid, []).append({k: v for k, v in ev.items() if k != "message"} | {"t": time.monotonic()})
            if ev["type"] == "audio":
                self.pcm.setdefault(rid, bytearray()).extend(payload)
            elif ev["type"] == "preempted":
                self.pcm[rid] = bytearray()          # it starts again from the beginning
            elif ev["type"] in ("done", "error"):
                self.finished += 1


def speak_obj(spec: dict, priority: str = "normal") -> dict:
    return {"type": "speak", "id": spec["id"], "text": spec["text"], "channel": spec["channel"], "seed": spec["seed"],
            "priority": priority, "return_audio": True,
            "params": {"min_new_tokens": spec["steps"], "max_new_tokens": spec["steps"]}}


def channel_loop(sock: Path, specs: list[dict], tr: Tracker, errors: list) -> None:
    """Closed loop with up to two requests outstanding on one connection; cancels after 'started'."""
    try:
        c = Conn(sock)
        pending: set[str] = set()
        todo = list(specs)
        cancel_ids = {s["id"] for s in specs if s["cancel"]}
        while todo or pending:
            while todo and len(pending) < 2:
                s = todo.pop(0)
                c.send(speak_obj(s))
                pending.add(s["id"])
            ev, payload = c.event()
            tr.on(ev, payload)
            rid = ev.get("id")
            if ev["type"] == "started" and rid in cancel_ids:
                cancel_ids.discard(rid)
                c.send({"type": "cancel", "id": rid})
            if ev["type"] in ("done", "error") and rid in pending:
                pending.discard(rid)
    except Exception as e:  # noqa: BLE001 - reported in the record
        errors.append(f"channel loop: {e!r}")


def side_loop(sock: Path, specs: list[dict], tr: Tracker, errors: list, stop: threading.Event) -> None:
    """Alerts (while the channels speak) and bad request lines, from a second connection."""
    try:
        c = Conn(sock)
        rng = random.Random(7)
        for s in specs:
            if stop.wait(rng.uniform(0.2, 1.5)):
                break
            if s["kind"] == "bad":
                c.send(s["bad"])
                ev, _ = c.event()
                with tr.lock:
                    tr.events[s["id"]] = [ev | {"t": time.monotonic()}]
                    tr.finished += 1
                continue
            c.send(speak_obj(s, priority="alert"))
            while True:
                ev, payload = c.event()
                tr.on(ev, payload)
                if ev.get("id") == s["id"] and ev["type"] in ("done", "error"):
                    break
    except Exception as e:  # noqa: BLE001
        errors.append(f"side loop: {e!r}")


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1])
    return 0



def resample(pcm: np.ndarray) -> np.ndarray:
    import soxr

    rs = soxr.ResampleStream(24000, RATE, 1, dtype="float32", quality="HQ")
    return np.concatenate([rs.resample_chunk(pcm), rs.resample_chunk(np.zeros(0, np.float32), last=True)])


def full_occurrences(stream: bytes, stream_arr: np.ndarray, e: np.ndarray) -> int:
    """How often all of ``e`` (zeros removed) appears, exactly, in ``stream`` (zeros removed)."""
    probe = e[:64].tobytes()
    n, pos = 0, 0
    while True:
        k = stream.find(probe, pos)
        if k < 0:
            return n
        if k % 4 == 0:
            j = k // 4
            if len(stream_arr) - j >= len(e) and np.array_equal(stream_arr[j:j + len(e)], e):
                n += 1
        pos = k + 1


def pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 1) if xs else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--checkpoint", choices=("tiny", "full"), default="tiny")
    ap.add_argument("--precision", choices=("int8", "fp32"), default="int8")
    ap.add_argument("--speed", type=float, default=4.0, help="sound card clock, x real time")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the decode steps per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spot", type=int, default=30, help="requests synthesized again alone and compared")
    ap.add_argument("--workdir", default=None)
    harness.add_common(ap)
    args = ap.parse_args(argv)

    from appliance.build.export import export_all
    from appliance.build.random_ckpt import write_random_checkpoint

    tmp = Path(args.workdir or tempfile.mkdtemp(prefix="soak-"))
    tmp.mkdir(parents=True, exist_ok=True)
    limits = {"max_batch": 3, "max_seq_len": 512 if args.checkpoint == "tiny" else 1024, "max_prompt_tokens": 128}
    ckpt, engines = tmp / "ckpt", tmp / "engines"
    t = time.monotonic()
    if not (ckpt / "asset").is_dir():
        write_random_checkpoint(ckpt, args.checkpoint, seed=0)
    if not (engines / "onnx" / args.precision / "manifest.json").is_file():
        export_all(ckpt, engines, precision=args.precision, **limits)
    prep_s = time.monotonic() - t
    shutil.rmtree(tmp / "spool", ignore_errors=True)   # a fresh journal: the ids below are reused per run
    raws = {c: tmp / f"played-{c}.raw" for c in CHANNELS}
    for r in raws.values():
        r.unlink(missing_ok=True)
    asoundrc(tmp / "home", raws, args.speed)
    cfg = make_config(tmp, ckpt, engines, limits)
    d = launch_daemon(tmp, cfg, env={"HOME": str(tmp / "home"), "PYTHONPATH": str(ROOT)}, timeout_s=600)
    proc, sock = d.proc, d.socket

    specs, tr, stop = workload(args.requests, args.seed, args.scale), Tracker(), threading.Event()
    errors: list[str] = []
    rss: list[tuple[int, int]] = []

    def sample():
        while not stop.wait(0.5):
            try:
                rss.append((tr.finished, rss_kib(proc.pid)))
            except OSError:
                return
    t0 = time.monotonic()
    threads = [threading.Thread(target=channel_loop, args=(
        sock, [s for s in specs if s["kind"] == "speak" and s["channel"] == c], tr, errors)) for c in CHANNELS]
    side = threading.Thread(target=side_loop, args=(sock, [s for s in specs if s["kind"] != "speak"], tr, errors, stop))
    for th in threads + [side, threading.Thread(target=sample, daemon=True)]:
        th.start()
    for th in threads:
        th.join()
    stop.set(), side.join()
    wall = time.monotonic() - t0
    rss.append((tr.finished, rss_kib(proc.pid)))
    time.sleep(2.0 / args.speed + 1.0)                 # the last audio leaves the pacers
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(120)
    lost, dup, notes, streams, done_pcm = [], [], [], {}, {}   # verify
    for c, r in raws.items():
        a = np.fromfile(r, dtype="<f4") if r.exists() else np.zeros(0, np.float32)
        streams[c] = (a[a != 0].tobytes(), a[a != 0])
    ttfb, ttfb_clean = {c: [] for c in CHANNELS}, {c: [] for c in CHANNELS}   # all; not preempted (ms)
    n_cancelled = n_preempted = n_bad_ok = 0
    for s in specs:
        evs = tr.events.get(s["id"], [])
        if s["kind"] == "bad":
            ok = len(evs) == 1 and evs[0]["type"] == "error"
            n_bad_ok, notes = n_bad_ok + ok, notes + ([] if ok else [f"bad line {s['bad']!r}: {evs}"])
            continue
        if not evs and stop.is_set() and s["kind"] == "alert":
            continue                                     # the side loop stopped before sending it
        term = [e for e in evs if e["type"] in ("done", "error")]
        n_preempted += any(e["type"] == "preempted" for e in evs)
        if len(term) != 1:
            (dup if len(term) > 1 else lost).append(s["id"])
            continue
        if term[0]["type"] == "error":
            if term[0].get("code") == "cancelled" and s["cancel"]:
                n_cancelled += 1
                continue
            lost.append(s["id"])
            notes.append(f"{s['id']}: {term[0]}")
            continue
        if s["kind"] == "speak":
            ttfb[s["channel"]].append(term[0]["ttfb_ms"])
            if not any(e["type"] == "preempted" for e in evs):
                ttfb_clean[s["channel"]].append(term[0]["ttfb_ms"])
        pcm = np.frombuffer(bytes(tr.pcm.get(s["id"], b"")), dtype="<f4")
        done_pcm[s["id"]] = pcm
        e = resample(pcm)
        e = e[e != 0]
        n = full_occurrences(*streams[s["channel"]], e) if len(e) else 0
        if n == 0:
            lost.append(s["id"])
        elif n > 1:
            dup.append(s["id"])

    # a sample synthesized again alone (batch 1) vs what the daemon returned
    from appliance.config import config_from_dict
    from appliance.core import SynthesisRequest, SynthParams
    from appliance.synth.pipeline import Pipeline

    pipe = Pipeline.from_config(config_from_dict(cfg, base_dir=str(tmp)))
    spot_err = 0.0
    picked = [s for s in specs if s["id"] in done_pcm][:: max(1, len(done_pcm) // max(1, args.spot))][:args.spot]
    for s in picked:
        job = pipe.prepare(SynthesisRequest(id=s["id"], text=s["text"], seed=s["seed"],
                                            params=SynthParams(min_new_tokens=s["steps"], max_new_tokens=s["steps"])))
        alone = np.concatenate([c.samples for c in pipe.run(job)])
        got = done_pcm[s["id"]]
        if len(alone) != len(got):
            notes, spot_err = notes + [f"{s['id']}: {len(got)} samples returned, {len(alone)} alone"], float("inf")
            continue
        spot_err = max(spot_err, float(np.abs(alone - got).max()))
    pipe.close()

    finished = [x for x in rss if x[0] >= 200]
    growth = slope = None
    if finished:
        r200 = finished[0][1]
        growth = round(100.0 * (rss[-1][1] - r200) / r200, 2)
        if len(finished) > 2:       # least-squares line through every sample after request 200
            k = np.polyfit(np.array([x[0] for x in finished], float), np.array([x[1] for x in finished], float), 1)[0]
            slope = round(100.0 * k * (len(specs) - 200) / r200, 2)
    speaks = [s for s in specs if s["kind"] != "bad"]
    audio_s = sum(len(p) for p in done_pcm.values()) / 24000
    rec = harness.record(
        "soak", checkpoint=args.checkpoint, backend="onnxruntime", machine=args.machine, host_info=harness.host(),
        notes=(f"{args.checkpoint} checkpoint, ONNX Runtime {args.precision}, 3 channels each on its own ALSA file "
               f"PCM paced at {args.speed:g}x real time, journal fsync on; {len(speaks)} speak/alert + "
               f"{len(specs) - len(speaks)} bad lines; rtf = wall s per audio s over all channels; "
               f"ttfb = accept -> first PCM (queue wait incl.); peak_mem_mib = daemon RSS; "
               f"set-up (checkpoint + export) {prep_s:.0f} s") + ("; " + "; ".join(notes[:5]) if notes else ""),
        precision=args.precision, batch=len(CHANNELS), rtf=round(wall / audio_s, 4) if audio_s else None,
        ttfb_ms=pct([x for v in ttfb.values() for x in v], 50),
        peak_mem_mib=round(max(r for _, r in rss) / 1024, 1) if rss else None,
        requests=len(specs), lost=len(lost), duplicated=len(dup), rss_growth_pct=growth,
        ttfb_ms_p50_p99_per_channel={c: [pct(v, 50), pct(v, 99)] for c, v in ttfb.items()},
        done=len(done_pcm), cancelled=n_cancelled, preempted_then_resumed=n_preempted,
        bad_lines_answered=n_bad_ok, bad_lines=sum(1 for s in specs if s["kind"] == "bad"),
        alerts=sum(1 for s in specs if s["kind"] == "alert"),
        audio_s=round(audio_s, 1), wall_s=round(wall, 1), speed=args.speed,
        rss_mib_at_200_and_end=[round(finished[0][1] / 1024, 1), round(rss[-1][1] / 1024, 1)] if finished else None,
        rss_fit_growth_pct_200_to_end=slope,
        rss_mib_by_finished={str(k): round(next(r for f, r in rss if f >= k) / 1024, 1)
                             for k in range(0, len(specs) + 1, 100) if any(f >= k for f, _ in rss)},
        ttfb_ms_p50_p99_per_channel_not_preempted={c: [pct(v, 50), pct(v, 99)] for c, v in ttfb_clean.items()},
        spot_check={"requests": len(picked), "max_abs_diff_vs_alone": spot_err},
        daemon_exit=rc, client_errors=errors, lost_ids=lost[:20], duplicated_ids=dup[:20])
    harness.write([rec], args.out)
    return 0 if not lost and not dup and not errors and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
