"""Where the host memory of a torch pipeline goes, stage by stage: what the first request adds.

    python bench/gpu_memory_probe.py CKPT [--config FILE] [--modes LAZY,EAGER] [--compile off|auto]
                                          [--text TEXT] [--json OUT]

For each ``CUDA_MODULE_LOADING`` mode (set before CUDA starts, so each runs in a fresh process)
the child prints, after each stage,

* ``Rss`` and ``Anonymous`` of ``/proc/self/smaps_rollup`` (MiB) and ``ru_maxrss``;
* the resident set by mapping, grouped (``anon``, ``[heap]``, each shared library by name, device
  mappings ``/dev/nvidia*``), so that a stage's growth can be named: CUDA kernels loaded lazily
  sit in the ``libcublas*``/``libcudnn*``/``libtorch_cuda`` file pages and in driver ``anon``
  memory, allocator caches in ``anon`` / ``[heap]``;
* on CUDA, ``torch.cuda.memory_allocated`` / ``memory_reserved`` / the device's used memory
  (``mem_get_info``, the CUDA context included) in MiB.

Stages: ``import`` (torch and the package), ``context`` (CUDA initialised: one tensor on the GPU),
``loaded`` (``Pipeline.from_config``: the production load), ``warmup`` (``Pipeline.warmup``),
``request1`` / ``request2`` (one sentence each, played nowhere). The parent prints each stage's
growth over the previous one, per group. Without a GPU the CUDA parts are skipped and the same
stages run on the CPU (``tests/test_gpu_memory_probe.py`` runs it so on the tiny checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, os, re, resource, sys, time
STAGES = []

def groups():
    out, cur = {}, None
    try:
        for line in open("/proc/self/smaps"):
            head = line.split()
            if head and re.match(r"^[0-9a-f]+-[0-9a-f]+$", head[0]):
                path = head[5] if len(head) > 5 else "anon"
                name = os.path.basename(path)
                if path.startswith("/dev/nvidia"):
                    cur = "/dev/nvidia*"
                elif path.startswith("["):
                    cur = path if path in ("[heap]", "[stack]") else "anon"
                elif path == "anon":
                    cur = "anon"
                else:
                    cur = re.sub(r"(\.so)(\.[0-9.]+)?$", r"\1", name) if ".so" in name else ("python-files" if name.endswith((".py", ".pyc")) else "other-files")
            elif head and head[0] == "Rss:" and cur is not None:
                out[cur] = out.get(cur, 0) + int(head[1]) / 1024
    except OSError:
        pass
    return {k: round(v, 1) for k, v in out.items() if v >= 0.05}

from bench.heap_probe_child import rollup  # Rss and Anonymous of /proc/self/smaps_rollup, MiB

def stage(name, torch=None):
    rec = {"stage": name, **rollup(), "maxrss": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
           "groups": groups(), "t": round(time.perf_counter() - T0, 2)}
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        free, total = torch.cuda.mem_get_info()
        rec.update(cuda_allocated=round(torch.cuda.memory_allocated() / 2**20, 1),
                   cuda_reserved=round(torch.cuda.memory_reserved() / 2**20, 1),
                   device_used=round((total - free) / 2**20, 1))
    print("PROBE " + json.dumps(rec), flush=True)

T0 = time.perf_counter()
args = json.loads(sys.argv[1])
import torch
from appliance.config import config_from_dict, load_config
from appliance.core import SynthesisRequest, SynthParams
from appliance.synth.pipeline import Pipeline
stage("import", torch)
cuda = torch.cuda.is_available() and args["device"] != "cpu"
if cuda:
    torch.zeros(1, device="cuda")
    stage("context", torch)
if args["config"]:
    cfg = load_config(args["config"])
else:
    cfg = config_from_dict({"model": {"path": args["ckpt"], "backend": "torch", "device": "cuda" if cuda else "cpu",
                                      "dtype": "float16" if cuda else "float32", "compile": args["compile"],
                                      "threads": 2, **args["model"]}}, base_dir=args["ckpt"])
p = Pipeline.from_config(cfg)
stage("loaded", torch)
p.warmup()
stage("warmup", torch)
for i in (1, 2):
    job = p.prepare(SynthesisRequest(id=f"probe{i}", text=args["text"], seed=i, params=SynthParams(max_new_tokens=args["steps"])))
    n = sum(c.samples.size for c in p.run(job))
    stage(f"request{i}", torch)
p.close()
"""


def run_mode(mode: str, a: argparse.Namespace) -> list[dict]:
    """One fresh process with ``CUDA_MODULE_LOADING=mode``; its stage records."""
    env = dict(os.environ, CUDA_MODULE_LOADING=mode)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
    args = {"ckpt": str(Path(a.ckpt).resolve()), "config": a.config, "device": a.device, "compile": a.compile,
            "text": a.text, "steps": a.steps, "model": json.loads(a.model)}
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], env=env, capture_output=True, text=True,
                       timeout=a.timeout, cwd=Path(a.ckpt).resolve())
    recs = [json.loads(line[6:]) for line in p.stdout.splitlines() if line.startswith("PROBE ")]
    if p.returncode != 0:
        raise SystemExit(f"CUDA_MODULE_LOADING={mode}: the probe failed (rc {p.returncode}):\n{p.stderr[-4000:]}")
    for r in recs:
        r["mode"] = mode
    return recs


def report(recs: list[dict]) -> str:
    """A table per mode: each stage's RSS, anonymous, device numbers, and the groups that grew most."""
    lines, prev = [], None
    for r in recs:
        if prev is None or prev["mode"] != r["mode"]:
            lines.append(f"\nCUDA_MODULE_LOADING={r['mode']}")
            lines.append(f"{'stage':>9} {'Rss':>8} {'Anon':>8} {'maxrss':>8} {'alloc':>7} {'reserv':>7} {'device':>7}  growth by mapping (MiB)")
            prev = None
        g = r.get("groups", {})
        grew = ""
        if prev is not None:
            pg = prev.get("groups", {})
            d = sorted(((k, g.get(k, 0) - pg.get(k, 0)) for k in set(g) | set(pg)), key=lambda kv: -abs(kv[1]))
            grew = ", ".join(f"{k} {v:+.0f}" for k, v in d[:6] if abs(v) >= 1)

        def f(k: str) -> str:
            return f"{r[k]:7.0f}" if r.get(k) is not None else f"{'-':>7}"
        lines.append(f"{r['stage']:>9} {r.get('Rss', 0):8.0f} {r.get('Anonymous', 0):8.0f} {r['maxrss']:8.0f} "
                     f"{f('cuda_allocated')} {f('cuda_reserved')} {f('device_used')}  {grew}")
        prev = r
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", help="checkpoint directory (holding asset/)")
    ap.add_argument("--config", help="a config file instead of the built-in one (torch backend)")
    ap.add_argument("--modes", default="LAZY,EAGER", help="CUDA_MODULE_LOADING values, one process each")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu"))
    ap.add_argument("--compile", default="off", choices=("off", "auto"))
    ap.add_argument("--model", default="{}", help="extra model.* settings as JSON, e.g. '{\"max_seq_len\": 512}'")
    ap.add_argument("--text", default="今天天气很好，我们去公园散步吧。")
    ap.add_argument("--steps", type=int, default=200, help="max_new_tokens per request")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--json", help="write every stage record here")
    a = ap.parse_args(argv)
    recs = []
    for mode in a.modes.split(","):
        recs += run_mode(mode.strip(), a)
    print(report(recs))
    if a.json:
        Path(a.json).write_text(json.dumps(recs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
