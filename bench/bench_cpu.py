"""First CPU benchmark of the main job: full-size random checkpoint, B=1, our pipeline.

Measures, per backend available here (``torch`` CPU always; ``onnxruntime`` when exported graphs
exist in ``--engine-dir``):

* ``ms_per_step`` / ``steps_per_s``: GPT decode steps alone (``DecodeLoop.step`` incl. host
  sampling), after a warm-up, at batch 1;
* ``ttfb_ms``: from ``Pipeline.run`` start to the first PCM chunk (prefill + the decode steps of
  the first chunk and the Decoder/Vocos look-ahead);
* ``rtf``: wall seconds per second of audio for a whole utterance (fixed length: EOS masked);
* ``peak_mem_mib``: peak RSS of the process.

Prints a table and appends records in the DESIGN.md §7 format to
``bench/results/cpu-<date>-<machine>.json``. Upstream ``chattts`` cannot run on this machine
(it imports torchaudio, which has no build for torch 2.13 CPU), so ``baseline_ms_per_step`` is
DESIGN.md's measured upstream GPT loop on this machine (46 ms at B=1), marked in ``notes``.

Usage::

    python bench/bench_cpu.py --checkpoint /path/to/random-full [--steps 200] [--machine cpu-2core]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import resource
import subprocess
import sys
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

UPSTREAM_CPU_MS = 46.0  # DESIGN.md §2, measured 2026-11-30 on this 2-core machine (GPT loop only)
SENTENCE = "今天天气很好，我们去公园散步吧。"


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def bench_backend(ckpt: Path, backend: str, steps: int, engine_dir: str | None) -> dict:
    # KV limits as the engines are exported by default (3 slots x 2048); one slot is used (B=1)
    model = {"path": str(ckpt), "backend": backend, "device": "cpu", "max_batch": 3, "max_seq_len": 2048}
    if engine_dir:
        model["engine_dir"] = engine_dir
    cfg = config_from_dict({"model": model,
                            "synthesis": {"max_new_tokens": steps, "min_new_tokens": steps, "seed": 1},
                            "service": {"channels": [{"name": "main"}]}})
    t = time.perf_counter()
    pipe = Pipeline.from_config(cfg)
    load_s = time.perf_counter() - t
    job = pipe.prepare(SynthesisRequest(text=SENTENCE, id="bench", seed=1, params=SynthParams()))

    # decode steps alone
    loop = pipe.loop
    seq = Sequence(ids=job.prompts[0], spk_emb=job.spk_emb, params=job.params, seed=1)
    loop.join(seq)
    for _ in range(5):
        loop.step()
    n = min(steps - 10, 100)
    t = time.perf_counter()
    for _ in range(n):
        loop.step()
    ms_step = 1000 * (time.perf_counter() - t) / n
    loop.leave(seq)

    # whole utterance: TTFB and RTF
    pcm = [c.samples for c in pipe.run(job)]
    st = job.stats
    info = pipe.info
    pipe.close()
    return {
        "backend": info.backend, "precision": info.precision, "batch": 1,
        "ms_per_step": round(ms_step, 2), "steps_per_s": round(1000 / ms_step, 2),
        "rtf": round(st.rtf, 3), "ttfb_ms": round(st.ttfb_ms, 1), "peak_mem_mib": round(peak_rss_mib(), 1),
        "audio_s": round(sum(p.size for p in pcm) / 24000, 2), "load_s": round(load_s, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="full-size checkpoint dir (chattts-appliance model random --size full DIR)")
    ap.add_argument("--steps", type=int, default=200, help="decode steps per utterance (EOS masked)")
    ap.add_argument("--machine", default="cpu-2core")
    ap.add_argument("--backends", default="torch", help="comma list: torch,onnxruntime")
    ap.add_argument("--engine-dir", default=None, help="exported ONNX graphs for the onnxruntime backend")
    args = ap.parse_args()
    ckpt = Path(args.checkpoint).resolve()
    size = "full" if json.loads((ckpt / "asset/gpt/config.json").read_text())["num_hidden_layers"] == 20 else "tiny"
    today = dt.date.today().isoformat()
    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | cut -d: -f2"], capture_output=True, text=True).stdout.strip()
    records = []
    for backend in args.backends.split(","):
        r = bench_backend(ckpt, backend, args.steps, args.engine_dir)
        records.append({
            "bench": "cpu_pipeline", "date": today, "machine": args.machine, "checkpoint": size,
            **{k: r[k] for k in ("backend", "precision", "batch", "ms_per_step", "steps_per_s", "rtf", "ttfb_ms", "peak_mem_mib")},
            "baseline_ms_per_step": UPSTREAM_CPU_MS,
            "notes": f"{args.steps} decode steps (EOS masked), {r['audio_s']} s audio, load {r['load_s']} s; "
                     f"CPU {cpu}; numpy {np.__version__}; baseline = upstream chattts GPT loop on this machine "
                     f"(DESIGN.md §2), not re-run: upstream needs torchaudio, which has no torch 2.13 CPU build",
        })
    print(f"\n{'backend':<14}{'prec':<6}{'ms/step':>9}{'steps/s':>9}{'RTF':>7}{'TTFB ms':>9}{'RSS MiB':>9}{'upstream ms':>13}")
    for r in records:
        print(f"{r['backend']:<14}{r['precision']:<6}{r['ms_per_step']:>9}{r['steps_per_s']:>9}{r['rtf']:>7}"
              f"{r['ttfb_ms']:>9}{r['peak_mem_mib']:>9}{r['baseline_ms_per_step']:>13}")
    out = ROOT / "bench" / "results" / f"cpu-{today}-{args.machine}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(old + records, indent=1, ensure_ascii=False) + "\n")
    print(f"records appended to {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
