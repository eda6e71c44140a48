"""Channels benchmark: 1, 2 and 3 requests synthesized concurrently in ONE decode loop.

For each checkpoint (``tiny``: a random tiny checkpoint written to a temp dir; ``full``: the
random full-size checkpoint given by ``--full``) and backend (``torch`` CPU always;
``onnxruntime`` when ``--engine-dir`` holds exported graphs that
:func:`appliance.engines.select.open_runner` can open) and for ``n`` = 1, 2, 3 channels:

* ``ms_per_step``: one batched GPT decode step with ``n`` rows (``DecodeLoop.step``, host
  sampling included), after a warm-up;
* a whole run of ``n`` requests of ``--steps`` decode steps each (EOS masked, so every request
  has the same length), all added to the :class:`~appliance.synth.batch.BatchEngine` at once and
  driven to the end exactly as the daemon's scheduler does (Decoder/Vocos/ISTFT streaming
  included, PCM discarded): per channel RTF (wall seconds / audio seconds) and TTFB (add ->
  first PCM chunk), the aggregate throughput (audio seconds produced per wall second) and
  ``steps_per_s`` (codes per wall second, all channels);
* ``peak_mem_mib``: peak RSS of the process so far (it only grows: read it per checkpoint).

The machine's 1-minute load average before/after each run goes into ``notes`` (the 2-core
machine is shared). Prints a table, writes the records (the project's record fields plus extra ones)
to ``bench/results/channels-<date>-<machine>.json``.

Usage::

    python bench/bench_channels.py --full models/random-full [--engine-dir engines/build/bench-full]
        [--steps 120] [--machine cpu-2core] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.config import config_from_dict  # noqa: E402
from appliance.core import (
    SynthesisRequest,
    SynthParams,  # noqa: E402
)
from appliance.synth.decode_loop import Sequence  # noqa: E402
from appliance.synth.pipeline import Pipeline  # noqa: E402

TEXTS = ["今天天气很好，我们去公园散步吧。", "前方路口请右转，然后直行五百米。", "厨房的烤箱已经预热好了，可以放进去了。"]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def load(ckpt: Path, backend: str, threads: int, engine_dir: str | None, precision: str | None) -> Pipeline:
    model = {"path": str(ckpt), "backend": backend, "device": "cpu", "threads": threads, "max_batch": 3,
             "max_seq_len": 2048 if engine_dir else 1024, "max_prompt_tokens": 256}
    if engine_dir:
        model["engine_dir"] = engine_dir
    cfg = config_from_dict({"model": model, "synthesis": {"seed": 1},
                            "service": {"channels": [{"name": n} for n in ("a", "b", "c")]}})
    return Pipeline.from_config(cfg)


def jobs(pipe: Pipeline, n: int, steps: int) -> list:
    p = SynthParams(min_new_tokens=steps, max_new_tokens=steps)
    return [pipe.prepare(SynthesisRequest(text=TEXTS[i], id=f"ch{i}", seed=10 + i, params=p)) for i in range(n)]


def decode_ms(pipe: Pipeline, n: int, reps: int) -> float:
    """ms per batched decode step with ``n`` rows."""
    loop = pipe.loop
    seqs = []
    for j in jobs(pipe, n, 10_000):
        s = Sequence(ids=j.prompts[0], spk_emb=j.spk_emb, params=j.params, seed=j.seed)
        loop.join(s)
        seqs.append(s)
    for _ in range(3):
        loop.step()
    t = time.perf_counter()
    for _ in range(reps):
        loop.step()
    ms = 1000 * (time.perf_counter() - t) / reps
    for s in seqs:
        loop.leave(s)
    return ms


def run_channels(pipe: Pipeline, n: int, steps: int) -> dict:
    """n requests at once through the BatchEngine, driven to the end."""
    eng = pipe.engine
    js = jobs(pipe, n, steps)
    samples = [0] * n
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    tasks = [eng.add(j, lambda pcm, i=i: samples.__setitem__(i, samples[i] + pcm.size)) for i, j in enumerate(js)]
    s0 = eng.steps_run
    while not all(t.finished for t in tasks):
        eng.step()
    wall = time.perf_counter() - t0
    assert all(t.state.value == "done" for t in tasks), [(t.state, t.error) for t in tasks]
    audio = [s / 24000 for s in samples]
    return {
        "wall_s": wall, "batched_steps": eng.steps_run - s0,
        "rtf_per_channel": [round(t.report.stats.rtf, 4) for t in tasks],
        "ttfb_ms_per_channel": [round(t.report.stats.ttfb_ms, 1) for t in tasks],
        "audio_s_per_channel": [round(a, 3) for a in audio],
        "throughput_audio_s_per_s": sum(audio) / wall,
        "steps_per_s": n * steps / wall,
        "load_avg_1m": (round(load0, 2), round(os.getloadavg()[0], 2)),
    }


def bench(pipe: Pipeline, name: str, ckpt: str, steps: int, machine: str, reps: int) -> list[dict]:
    info = pipe.info
    pipe.warmup()
    out = []
    base = None
    for n in (1, 2, 3):
        ms = decode_ms(pipe, n, reps)
        r = run_channels(pipe, n, steps)
        if n == 1:
            base = r["throughput_audio_s_per_s"]
        rec = {
            "bench": "channels", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine, "backend": info.backend, "precision": info.precision, "checkpoint": ckpt,
            "batch": n, "ms_per_step": round(ms, 2), "steps_per_s": round(r["steps_per_s"], 1),
            "rtf": round(float(np.mean(r["rtf_per_channel"])), 4),
            "ttfb_ms": round(float(np.mean(r["ttfb_ms_per_channel"])), 1),
            "peak_mem_mib": round(peak_rss_mib(), 1), "baseline_ms_per_step": None,
            "channels": n, "steps_per_request": steps, "threads": pipe.cfg.model.threads,
            "rtf_per_channel": r["rtf_per_channel"], "ttfb_ms_per_channel": r["ttfb_ms_per_channel"],
            "throughput_audio_s_per_s": round(r["throughput_audio_s_per_s"], 3),
            "throughput_vs_1_channel": round(r["throughput_audio_s_per_s"] / base, 2),
            "wall_s": round(r["wall_s"], 2), "load_avg_1m_before_after": list(r["load_avg_1m"]),
            "notes": (f"{name}; {n} request(s) of {steps} steps added at once to one BatchEngine; "
                      f"rtf/ttfb per channel (mean in rtf/ttfb_ms); ms_per_step = one decode step of {n} rows "
                      f"(host sampling incl.); load avg 1m {r['load_avg_1m'][0]:.2f} -> {r['load_avg_1m'][1]:.2f} "
                      f"on a shared 2-core machine; peak_mem_mib = process peak RSS so far"),
        }
        out.append(rec)
        print(f"{name:32s} {n}ch  step {ms:7.2f} ms  thr {rec['throughput_audio_s_per_s']:6.3f} audio-s/s "
              f"(x{rec['throughput_vs_1_channel']:.2f})  RTF/ch {rec['rtf_per_channel']}  "
              f"TTFB/ch {rec['ttfb_ms_per_channel']} ms  load {r['load_avg_1m'][0]:.2f}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", type=Path, default=ROOT / "models" / "random-full")
    ap.add_argument("--engine-dir", default=None, help="exported ONNX graphs for the full checkpoint")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--tiny-steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (1: the 2 cores are shared; 2 threads spin against other load)")
    ap.add_argument("--machine", default="cpu-2core")
    ap.add_argument("--only", default="", help="comma list of tiny-torch, full-torch, full-onnxruntime")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    date = dt.date.today().isoformat()
    out = args.out or ROOT / "bench" / "results" / f"channels-{date}-{args.machine}.json"
    records = json.loads(out.read_text()) if out.exists() else []
    only = set(filter(None, args.only.split(",")))

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(records, indent=1) + "\n")

    if not only or "tiny-torch" in only:
        from appliance.build.random_ckpt import write_random_checkpoint
        tmp = Path(tempfile.mkdtemp(prefix="bench_channels_"))
        write_random_checkpoint(tmp, "tiny", seed=0)
        pipe = load(tmp, "torch", args.threads, None, None)
        records += bench(pipe, "tiny torch-cpu fp32", "tiny", args.tiny_steps, args.machine, 50)
        pipe.close()
        save()
    if not only or "full-torch" in only:
        pipe = load(args.full, "torch", args.threads, None, None)
        records += bench(pipe, "full torch-cpu fp32", "full", args.steps, args.machine, 10)
        pipe.close()
        save()
    if args.engine_dir and (not only or "full-onnxruntime" in only):
        try:
            pipe = load(args.full, "onnxruntime", args.threads, args.engine_dir, None)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"onnxruntime: not measured ({e.__class__.__name__}: {e})")
        else:
            records += bench(pipe, f"full onnxruntime {pipe.info.precision}", "full", args.steps, args.machine, 10)
            pipe.close()
            save()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
