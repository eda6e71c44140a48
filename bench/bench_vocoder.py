"""Vocoder cost of a stream: the Decoder + Vocos passes that turn a sentence's hidden states into
PCM, as the streaming planner (``WindowedVocoder``) asks for them, on the production runner.

For one tree (this checkout or ``--tree DIR``, e.g. the commit before a change: run both in turns
for a side-by-side comparison), with ``Pipeline.from_config`` (ONNX Runtime by default) and a
fixed look-ahead (``--lookahead``, the same for both trees so that the same windows are asked for):

* decodes one ``--steps`` sentence (the runner's own decode steps, EOS ignored);
* streams its hidden states through ``WindowedVocoder`` with three chunk plans: the schedule's
  shape (4, 8, 16, 32, then 48 steps), fixed 48-step chunks, fixed 8-step chunks; each
  ``--repeats`` times, the median kept;
* reports per plan: vocoder milliseconds per second of audio (``ms_per_audio_s``; divided by
  1000 it is the vocoder's share of the real-time factor), split into the Decoder's and Vocos'
  passes and the rest (the host ISTFT and bookkeeping; host runners), the first window that
  yields PCM (``first_ms``: part of the TTFB), and the number of vocoder calls.

Appends one record (``bench: vocoder_stream``) to ``--out`` (default
``bench/results/vocoder-<date>-<machine>.json``) with the fields of the project's benchmark records
(``rtf`` = the schedule plan's vocoder seconds per audio second), ``host_read_gbps`` (the host's
read bandwidth with the bench's threads, measured before the run: hosts of this class differ by 2x)
and ``decoder_reach`` (mel frames of right context after which the Decoder freezes a frame, where
the tree has it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import _import_tree, host_read_gbps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: chunk plans: (first chunks, then this size)
PLANS = {"schedule 4-8-16-32-48": ([4, 8, 16, 32], 48), "fixed 48": ([], 48), "fixed 8": ([], 8)}


def _chunks(plan: str, n: int) -> list[int]:
    head, tail = PLANS[plan]
    out, t = [], 0
    for c in head + [tail] * n:
        if t >= n:
            break
        out.append(min(c, n - t))
        t += out[-1]
    return out


def run(args) -> dict:
    from appliance.config import config_from_dict
    from appliance.core import SamplingParams
    from appliance.synth.pipeline import Pipeline
    from appliance.synth.vocoder import WindowedVocoder

    cfg = config_from_dict({
        "model": {"path": args.checkpoint, "backend": args.backend, "engine_dir": args.engine_dir, "threads": args.threads},
        "stream": {"lookahead": str(args.lookahead)}}, base_dir=str(ROOT))
    pipe = Pipeline.from_config(cfg)
    pipe.warmup()
    r = pipe.runner
    ids = pipe.tokenizer.encode("[Stts]今天天气很好，我们去公园散步吧。[Ptts]")
    r.prefill(0, np.asarray(ids, np.int64), None)
    r.start(0, SamplingParams(), 1)
    one = np.array([0])
    for _ in range(args.steps - 1):
        r.step(one, 1)
    spent = {"decoder": 0.0, "vocos": 0.0}

    def timed(name, fn):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t
        return call

    if hasattr(r, "forward_decoder_stream"):  # host runners: split the time by network
        r.forward_decoder_stream = timed("decoder", r.forward_decoder_stream)
        r.forward_vocos_stream = timed("vocos", r.forward_vocos_stream)
    voc = WindowedVocoder(r, args.steps)
    voc.set_lookahead(args.lookahead)
    audio_s = (512 * args.steps - 256) / 24000
    res = {}
    for plan in PLANS:
        totals, firsts, calls = [], [], 0
        split = {"decoder": [], "vocos": []}
        for _ in range(args.repeats):
            spent.update(decoder=0.0, vocos=0.0)
            voc.reset(0)
            n, first, calls = 0, None, 0
            t0 = time.perf_counter()
            for c in _chunks(plan, args.steps):
                n += c
                pcm = voc.push(n)
                calls += 1
                if first is None and pcm.size:
                    first = time.perf_counter() - t0
            voc.finish()
            totals.append(time.perf_counter() - t0)
            firsts.append(first if first is not None else totals[-1])
            for k in split:
                split[k].append(spent[k])
        dec, vcs, tot = (statistics.median(split["decoder"]), statistics.median(split["vocos"]),
                         statistics.median(totals))
        res[plan] = {"ms_per_audio_s": round(1000 * tot / audio_s, 1),
                     "decoder_ms_per_audio_s": round(1000 * dec / audio_s, 1),
                     "vocos_ms_per_audio_s": round(1000 * vcs / audio_s, 1),
                     "istft_and_rest_ms_per_audio_s": round(1000 * max(0.0, tot - dec - vcs) / audio_s, 1),
                     "first_ms": round(1000 * statistics.median(firsts), 1), "calls": calls}
    info = r.info
    reach = getattr(voc, "reach", info.decoder_rf)   # trees before the reach recompute up to rf_dec
    pipe.close()
    return {"backend": info.backend, "precision": info.precision, "audio_s": round(audio_s, 2),
            "decoder_reach": reach, "plans": res}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--engine-dir", required=True)
    ap.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "torch"))
    ap.add_argument("--tree", default=None, help="import appliance from this checkout instead of this one")
    ap.add_argument("--lookahead", type=int, default=10, help="decode steps of right context (the same for every tree)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--machine", default="cpu-2core")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    _import_tree(args.tree)
    gbps = host_read_gbps(args.threads or os.cpu_count() or 1)
    load0 = os.getloadavg()[0]
    r = run(args)
    today = dt.date.today().isoformat()
    sched = r["plans"][next(iter(PLANS))]
    rec = {"bench": "vocoder_stream", "date": today, "machine": args.machine, "label": args.label,
           "tree": args.tree or "this checkout", "lookahead_tokens": args.lookahead, "steps": args.steps,
           "checkpoint": "full" if "full" in args.checkpoint else Path(args.checkpoint).name, "batch": 1,
           "ms_per_step": None, "steps_per_s": None, "rtf": round(sched["ms_per_audio_s"] / 1000, 3),
           "ttfb_ms": None, "peak_mem_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024), "baseline_ms_per_step": None,
           "host_read_gbps": round(gbps, 1), **r,
           "notes": f"1-min load average {load0:.2f} -> {os.getloadavg()[0]:.2f}"}
    print(json.dumps(rec, ensure_ascii=False))
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"vocoder-{today}-{args.machine}.json"
    old = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(old + [rec], indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
