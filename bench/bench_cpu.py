"""CPU benchmark of the main job through the production path: Pipeline.from_config (the backend
``appliance.engines.select`` picks), its warm-up, decode loop, vocoder windows and chunk schedule.

Measures for one tree (this checkout, or ``--tree DIR``: e.g. a checkout of the commit before a
change, for a side-by-side run; the pre-redesign API is mapped as in bench_gpu.py):

* ``load_s`` / ``warmup_s``: ``Pipeline.from_config`` and ``Pipeline.warmup``;
* ``ms_per_step``: decode steps alone at B=1 (``DecodeLoop.step`` incl. sampling), median of 100;
* ``ttfb_ms``: ``Pipeline.run`` start to the first PCM chunk for a short sentence (prefill,
  look-ahead, first chunk, first vocoder window), median of ``--ttfb-runs`` after warm-up;
  ``first_ttfb_ms``: the first request after the warm-up alone (is anything still cold?);
* ``rtf``: wall / audio seconds for a ``--steps`` utterance (EOS masked); ``peak_mem_mib``: RSS.
* ``host_read_gbps``: the host's read bandwidth measured in the same run with the bench's threads
  (before and after, the larger kept); ``weight_bytes_per_step``: the ``gpt`` graph's initializer
  bytes; ``bandwidth_frac`` = bytes / step / bandwidth; ``baseline_ms_per_step``: ``--baseline-ms``
  (upstream's loop in the same session, ``bench/bench_upstream_cpu.py``).
* ``lookahead``: what the pipeline used (exact or calibrated, from ``--lookahead``).

Appends one record per run (the project's record fields, ``bench: cpu_pipeline``) to ``--out``
(default ``bench/results/cpu-<date>-<machine>.json``); ``bench/cpu_side_by_side.sh`` alternates
trees and runs upstream's GPT loop in the same session (``bench/bench_upstream_cpu.py``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SENTENCE = "今天天气很好，我们去公园散步吧。"


def _import_tree(tree: str | None):
    sys.path.insert(0, tree or str(ROOT))
    if tree:   # an editable install of another tree must not fill in missing modules
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    try:
        from appliance.core import SynthesisRequest  # noqa: F401
        return False
    except ImportError:
        return True


def host_read_gbps(threads: int, mib: int = 512, reps: int = 7) -> float:
    """The host's read bandwidth with ``threads`` threads: the best of ``reps`` numpy reductions
    of a ``mib`` MiB float32 array split over the threads (numpy releases the GIL), GB/s (1e9 B)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    a = np.ones(mib * 2**20 // 4, np.float32)
    parts = np.array_split(a, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(reps):
            t = time.perf_counter()
            list(ex.map(np.add.reduce, parts))
            best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def gpt_weight_bytes(engine_dir: str | None, precision: str) -> int | None:
    """Bytes of the ``gpt`` graph's initializers (what one decode step reads once) in
    ``<engine_dir>/onnx/<precision>/gpt.onnx``; None where there is no such file."""
    f = Path(engine_dir or ROOT / "engines" / "build") / "onnx" / precision / "gpt.onnx"
    if not f.is_file():
        return None
    import onnx

    n = 0
    for t in onnx.load(str(f), load_external_data=False).graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        n += int(ext["length"]) if "length" in ext else len(t.raw_data)
    return n


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run(args, legacy: bool) -> dict:
    from appliance.config import config_from_dict

    if legacy:
        from appliance.tts.generate import Sequence
        from appliance.tts.pipeline import Pipeline

        from appliance.messages.protocol import Speak as Req
        from appliance.messages.protocol import SynthParams
    else:
        from appliance.core import SynthesisRequest as Req
        from appliance.core import SynthParams
        from appliance.synth.decode_loop import Sequence
        from appliance.synth.pipeline import Pipeline
    model = {"path": args.checkpoint, "backend": args.backend, "device": "cpu", "max_batch": 3, "max_seq_len": 2048,
             "threads": args.threads}
    if args.precision != "auto":
        model["onnx_precision"] = args.precision
    if args.engine_dir:
        model["engine_dir"] = args.engine_dir
    model.update(json.loads(args.model))
    data = {"model": model, "synthesis": {"max_new_tokens": max(args.steps, 200)}}
    if not legacy:
        data["stream"] = {"lookahead": args.lookahead}
    cfg = config_from_dict(data)
    t = time.perf_counter()
    pipe = Pipeline.from_config(cfg)
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    pipe.warmup()
    warmup_s = time.perf_counter() - t

    def ttfb_once(i, steps=60):
        t0 = time.perf_counter()
        job = pipe.prepare(Req(text=SENTENCE, id=f"t{i}", seed=i, params=SynthParams(min_new_tokens=steps, max_new_tokens=steps)))
        it = pipe.run(job)
        next(it)
        ms = 1e3 * (time.perf_counter() - t0)
        for _ in it:
            pass
        return ms

    first_ttfb = ttfb_once(0)
    ttfbs = [ttfb_once(i + 1) for i in range(args.ttfb_runs)]
    # decode steps alone, B=1
    job = pipe.prepare(Req(text=SENTENCE, id="steps", seed=1, params=SynthParams(min_new_tokens=400, max_new_tokens=400)))
    loop = pipe.loop
    seq = Sequence(ids=job.prompts[0], spk_emb=job.spk_emb, params=job.params, seed=1)
    loop.join(seq)
    for _ in range(5):
        loop.step()
    ts = []
    for _ in range(100):
        t = time.perf_counter()
        loop.step()
        ts.append(time.perf_counter() - t)
    loop.leave(seq)
    # a whole utterance: RTF
    job = pipe.prepare(Req(text=SENTENCE, id="rtf", seed=2, params=SynthParams(min_new_tokens=args.steps, max_new_tokens=args.steps)))
    run = pipe.run(job)
    samples = sum((c.size if legacy else c.samples.size) for c in run)
    st = job.stats if legacy else run.report.stats      # an older tree's job kept its stats
    info = pipe.info
    la = "exact (pre-redesign)" if legacy else pipe.describe_lookahead()
    pipe.close()
    return {"backend": info.backend, "precision": info.precision, "batch": 1,
            "ms_per_step": round(1e3 * statistics.median(ts), 2), "steps_per_s": round(1 / statistics.median(ts), 2),
            "rtf": round(st.rtf, 3), "ttfb_ms": round(statistics.median(ttfbs), 1), "first_ttfb_ms": round(first_ttfb, 1),
            "ttfb_runs_ms": [round(x, 1) for x in ttfbs], "peak_mem_mib": round(peak_rss_mib(), 1),
            "audio_s": round(samples / 24000, 2), "load_s": round(load_s, 1), "warmup_s": round(warmup_s, 1),
            "lookahead": la}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="checkpoint dir (chattts-appliance model random --size full DIR)")
    ap.add_argument("--engine-dir", default=None, help="exported ONNX graphs (onnxruntime backend)")
    ap.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "torch"))
    ap.add_argument("--tree", default=None, help="import appliance from this checkout instead of this one")
    ap.add_argument("--lookahead", default="auto", help="stream.lookahead: auto (calibrated if recorded), exact or N")
    ap.add_argument("--steps", type=int, default=200, help="decode steps of the RTF utterance (EOS masked)")
    ap.add_argument("--ttfb-runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--precision", default="auto", help="model.onnx_precision (this tree only): auto, int8, int4, fp32")
    ap.add_argument("--model", default="{}", help='extra model.* settings as JSON (this tree), e.g. \'{"spin_wait": true}\'')
    ap.add_argument("--machine", default="cpu-2core")
    ap.add_argument("--label", default="")
    ap.add_argument("--baseline-ms", type=float, default=None,
                    help="upstream's GPT loop, ms per step at B=1, measured in the same session (bench_upstream_cpu.py)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    legacy = _import_tree(args.tree)
    load0 = os.getloadavg()[0]
    threads = args.threads or (os.cpu_count() or 1)
    gbps0 = host_read_gbps(threads)
    r = run(args, legacy)
    gbps = max(gbps0, host_read_gbps(threads))
    wbytes = gpt_weight_bytes(args.engine_dir, r["precision"]) if args.backend == "onnxruntime" else None
    today = dt.date.today().isoformat()
    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | cut -d: -f2"], capture_output=True, text=True).stdout.strip()
    size = "full" if json.loads((Path(args.checkpoint) / "asset/gpt/config.json").read_text())["num_hidden_layers"] == 20 else "tiny"
    rec = {"bench": "cpu_pipeline", "date": today, "machine": args.machine, "checkpoint": size,
           **{k: r[k] for k in ("backend", "precision", "batch", "ms_per_step", "steps_per_s", "rtf", "ttfb_ms",
                                "peak_mem_mib")},
           "baseline_ms_per_step": args.baseline_ms,
           "host_read_gbps": round(gbps, 2), "weight_bytes_per_step": wbytes,
           "bandwidth_frac": round(wbytes / (r["ms_per_step"] / 1e3) / (gbps * 1e9), 3) if wbytes else None,
           "threads": threads,
           "notes": f"{args.label}; look-ahead {r['lookahead']}; first request after warm-up TTFB {r['first_ttfb_ms']} ms; "
                    f"TTFB runs {r['ttfb_runs_ms']}; {args.steps}-step utterance {r['audio_s']} s audio; load {r['load_s']} s, "
                    f"warm-up {r['warmup_s']} s; 1-min load average {load0:.2f} -> {os.getloadavg()[0]:.2f}; CPU {cpu}",
           "tree": args.tree or "this checkout", "lookahead": r["lookahead"], "first_ttfb_ms": r["first_ttfb_ms"]}
    print(json.dumps(rec, ensure_ascii=False))
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"cpu-{today}-{args.machine}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(old + [rec], indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
