"""Host memory of a torch backend's load: peak RSS (``ru_maxrss``) and RSS after the load, each
variant in a fresh process, optionally for two source trees in the same run (before / after).

    python bench/load_rss.py CKPT [--tree DIR[=LABEL] ...] [--variant NAME ...] [--json FILE]

Variants (all on this machine's CPU, ``model.max_batch`` 1 x ``max_seq_len`` 256 so that the KV
cache stays small and the numbers are the weights' and the load's):

* ``torch-cpu-fp32``: ``open_runner`` with ``backend: torch``, ``device: cpu``, float32 (the CPU
  torch backend as the daemon opens it, the sha256 check included);
* ``cuda-path-fp16``: :class:`~appliance.engines.torch.cuda_runner.CudaRunner` on the CPU device with
  float16 (the CUDA runner's load sequence: GPT and Embed in FP16, Decoder and Vocos in FP32, no
  text head; no graphs captured beyond one bucket).

Each child prints one JSON line: ``rss0_mib`` (after ``import torch`` and the package),
``load_peak_rss_mib`` (``ru_maxrss``), ``rss_mib`` / ``anon_mib`` (``/proc/self/smaps_rollup``
after the load), ``load_s``. RSS counts file pages mapped by the process too: a checkpoint read
through a memory map is resident while it is mapped.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, time, tempfile
def smaps():
    out = {}
    try:
        for line in open("/proc/self/smaps_rollup"):
            k, _, v = line.partition(":")
            if k in ("Rss", "Anonymous"):
                out[k] = int(v.split()[0]) / 1024
    except OSError:
        pass
    return out
import torch
from appliance.config import config_from_dict
variant, ckpt, cache = sys.argv[1], sys.argv[2], sys.argv[3]
torch.set_num_threads(2)
rss0 = smaps().get("Rss")
dtype = "float32" if variant == "torch-cpu-fp32" else "float16"
cfg = config_from_dict({"model": {"path": ckpt, "backend": "torch", "device": "cpu", "dtype": dtype, "threads": 2,
                                  "max_batch": 1, "max_seq_len": 256, "max_prompt_tokens": 64},
                        "safety": {"cache_dir": cache}}, base_dir=cache)
t0 = time.perf_counter()
if variant == "torch-cpu-fp32":
    from appliance.engines.select import open_runner
    r = open_runner(cfg)
else:
    from appliance.engines.torch.cuda_runner import CudaRunner
    r = CudaRunner(cfg, capture_batches=[], buckets=[256], prefill_buckets=[64])
load_s = time.perf_counter() - t0
s = smaps()
print(json.dumps({"variant": variant, "rss0_mib": round(rss0, 1),
                  "load_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                  "rss_mib": round(s.get("Rss", 0), 1), "anon_mib": round(s.get("Anonymous", 0), 1),
                  "weight_mib": round(r.info.weight_bytes / 2**20, 1), "load_s": round(load_s, 2)}))
"""


def run_child(tree: Path, variant: str, ckpt: str) -> dict:
    """One variant in a fresh interpreter with ``tree`` first on ``PYTHONPATH``."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    with tempfile.TemporaryDirectory() as cache:  # an empty sum cache: every file is hashed
        p = subprocess.run([sys.executable, "-c", CHILD, variant, ckpt, cache], env=env, capture_output=True, cwd=cache,
                           text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"{variant} in {tree} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--tree", action="append", help="source tree DIR[=LABEL] (default: this checkout)")
    ap.add_argument("--variant", action="append", choices=("torch-cpu-fp32", "cuda-path-fp16"))
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", help="append records (bench: memory) to this JSON list")
    ap.add_argument("--machine", default="cpu-2core")
    a = ap.parse_args(argv)
    trees = []
    for t in a.tree or [str(Path(__file__).resolve().parents[1]) + "=this tree"]:
        d, _, label = t.partition("=")
        trees.append((Path(d).resolve(), label or d))
    variants = a.variant or ["torch-cpu-fp32", "cuda-path-fp16"]
    rows = []
    for _ in range(a.repeat):
        for v in variants:
            for d, label in trees:  # interleaved: both trees see the same host load
                r = run_child(d, v, a.ckpt)
                r["tree"] = label
                rows.append(r)
                print(f"{label:>24} {v:>16}: rss0 {r['rss0_mib']:7.1f}  peak {r['load_peak_rss_mib']:7.1f}  "
                      f"after {r['rss_mib']:7.1f} (anon {r['anon_mib']:7.1f})  weights {r['weight_mib']:7.1f} MiB  "
                      f"{r['load_s']:6.2f} s", flush=True)
    if a.json:
        out = Path(a.json)
        recs = json.loads(out.read_text()) if out.is_file() else []
        for r in rows:
            recs.append({"bench": "memory", "date": dt.date.today().isoformat(), "machine": a.machine,
                         "backend": "torch-cpu", "precision": "fp32" if r["variant"] == "torch-cpu-fp32" else "fp16",
                         "checkpoint": "full", "batch": 1, "ms_per_step": None, "steps_per_s": None, "rtf": None,
                         "ttfb_ms": None, "peak_mem_mib": r["load_peak_rss_mib"], "baseline_ms_per_step": None,
                         "load_peak_rss_mib": r["load_peak_rss_mib"], "rss_mib": r["rss_mib"], "anon_mib": r["anon_mib"],
                         "device_mib": None, "ready_s": r["load_s"], "compile": False, "warm_cache": None,
                         "notes": f"{r['variant']} load only (KV 1 x 256), tree: {r['tree']}; rss_mib right after "
                                  f"the load, not after requests"})
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(recs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
