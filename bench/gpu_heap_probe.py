"""Where the host heap of the torch CUDA load goes: glibc's view, stage by stage, across allocator settings.

    python bench/gpu_heap_probe.py CKPT [--variants default,bare,nocudnn,mmap128k,eager,arena2,trim0]
                                        [--device auto|cpu] [--model JSON] [--json OUT] [--deadline-s 240]

Why: on the H200 (torch 2.11+cu130, full checkpoint, plain CUDA graphs, KV 3 x 2048;
bench/results/raw/gpu-memory-probe-2026-12-02-h200.json) ``[heap]`` held 127 MiB after the CUDA
context, 780 after ``Pipeline.from_config`` and 985 after the warm-up, with 16 MiB of live CPU
tensors and a ``malloc_trim(0)`` after the load. This probe tells which stage grows the heap and
whether that memory is allocated and live (glibc's ``in_use``: someone holds it) or freed but
kept (``free``: a trim or another allocator setting returns it), and whether plain torch does
the same (then it is torch's or CUDA's, not the appliance's).

Each variant runs in a fresh process (bench/heap_probe_child.py; its docstring lists the stages
and fields):

* ``default``: the production load and warm-up (``CUDA_MODULE_LOADING`` unset: torch sets LAZY);
* ``bare``: plain torch, the same weight files from a safetensors memory map tensor by tensor to
  the device, one kernel per library the step uses and one small CUDA graph; no appliance code;
* ``mmap128k``: ``MALLOC_MMAP_THRESHOLD_=131072`` (a fixed threshold switches off glibc's dynamic
  one, which after a large block is freed serves every later block below its size from the heap);
* ``nocudnn``: the production load with ``torch.backends.cudnn.enabled = False`` (the vocoder's
  FP32 convolutions then use torch's own kernels: shows what cuDNN holds after the warm-up);
* ``eager``: ``CUDA_MODULE_LOADING=EAGER`` (every kernel module loaded with the context);
* ``arena2``: ``MALLOC_ARENA_MAX=2``; ``trim0``: ``MALLOC_TRIM_THRESHOLD_=0``;
* ``bare-mmap128k``: ``bare`` with the fixed threshold.

The glibc settings are also given as ``GLIBC_TUNABLES`` (their documented name since 2.26).
Prints, per variant, the stages that grew the heap most, then ONE table of the milestones of
every variant; ``--json`` writes every record. Without a GPU the CUDA parts are skipped and the
same stages run on the CPU (``--cuda-runner`` runs the CUDA runner's logic there, as
tests/test_gpu_heap_probe.py does on the tiny checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).resolve().with_name("heap_probe_child.py")

#: variant -> (script, environment, extra child arguments)
VARIANTS = {
    "default": ("pipeline", {}, {}),
    "bare": ("bare", {}, {}),
    "mmap128k": ("pipeline", {"MALLOC_MMAP_THRESHOLD_": "131072", "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}, {}),
    "nocudnn": ("pipeline", {}, {"no_cudnn": True}),
    "eager": ("pipeline", {"CUDA_MODULE_LOADING": "EAGER"}, {}),
    "arena2": ("pipeline", {"MALLOC_ARENA_MAX": "2", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, {}),
    "trim0": ("pipeline", {"MALLOC_TRIM_THRESHOLD_": "0", "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, {}),
    "bare-mmap128k": ("bare", {"MALLOC_MMAP_THRESHOLD_": "131072", "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}, {}),
}
#: inherited settings that would change what a variant measures: removed from every child's environment
CLEARED = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
           "GLIBC_TUNABLES", "CUDA_MODULE_LOADING", "LD_PRELOAD")
MILESTONES = ("import", "context", "weights", "runner", "loaded", "warmup", "trimmed")


def variant_env(name: str, base: dict | None = None) -> dict:
    """The child's environment for ``name``: ``base`` (default ``os.environ``) without
    :data:`CLEARED`, plus the variant's settings, plus this checkout on ``PYTHONPATH``."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in CLEARED}
    env.update(VARIANTS[name][1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_variant(name: str, a: argparse.Namespace, timeout: float) -> list[dict]:
    """One fresh process; its stage records (each with ``variant``), or one record with ``error``."""
    script, _, extra = VARIANTS[name]
    with tempfile.TemporaryDirectory(prefix="heap-probe-") as tmp:
        args = {"script": script, "ckpt": str(Path(a.ckpt).resolve()), "device": a.device, "root": str(ROOT),
                "model": json.loads(a.model), "cuda_runner": a.cuda_runner, "requests": a.requests,
                "step_mib": a.step_mib, "chunk_mib": a.chunk_mib, "cache_dir": tmp,
                "env_keys": sorted(set(CLEARED) | set(VARIANTS[name][1])), **extra}
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, str(CHILD), json.dumps(args)], env=variant_env(name), capture_output=True,
                               text=True, timeout=timeout, cwd=tmp, stdin=subprocess.DEVNULL)
            out, err, rc = p.stdout, p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            err, rc = f"timed out after {timeout:.0f} s", None
    recs = [json.loads(line[5:]) for line in out.splitlines() if line.startswith("HEAP ")]
    for r in recs:
        r["variant"] = name
    if rc != 0:
        recs.append({"variant": name, "stage": "error", "error": f"rc {rc}: {err.strip()[-1500:]}"})
    recs.append({"variant": name, "stage": "wall", "wall_s": round(time.perf_counter() - t0, 1)})
    return recs


def _heap(r: dict) -> float:
    return r.get("g", {}).get("[heap]", 0.0)


def _live(r: dict) -> float:
    m = r.get("m", {})
    return m.get("in_use", 0.0) + m.get("mmapped", 0.0)


def growth(recs: list[dict], top: int = 8) -> list[tuple[str, float, float, float, float]]:
    """The stages of one variant that grew most: ``(stage, d[heap], d live, d free, d anon-other)``,
    MiB over the previous record, largest ``|d[heap]| + |d live|`` first."""
    rows, prev = [], None
    for r in recs:
        if "g" not in r:
            continue
        if prev is not None:
            m, pm = r.get("m", {}), prev.get("m", {})
            rows.append((r["stage"], _heap(r) - _heap(prev), _live(r) - _live(prev), m.get("free", 0) - pm.get("free", 0),
                         r["g"].get("anon", 0) - prev["g"].get("anon", 0)))
        prev = r
    rows.sort(key=lambda x: -(abs(x[1]) + abs(x[2])))
    return rows[:top]


def report(recs: list[dict]) -> str:
    """Per variant its largest growths, then one table of every variant's milestones."""
    by: dict[str, list[dict]] = {}
    for r in recs:
        by.setdefault(r["variant"], []).append(r)
    lines = []
    for v, rs in by.items():
        wall = next((r["wall_s"] for r in rs if r["stage"] == "wall"), None)
        env = next((r for r in rs if r["stage"] == "env"), {})
        lines.append(f"\n== {v}  ({wall} s; CUDA_MODULE_LOADING={env.get('env', {}).get('CUDA_MODULE_LOADING')}, "
                     f"glibc {env.get('glibc')})  largest growth, MiB: [heap] RSS, live (in_use+mmapped), free, other anon")
        for s, dh, dl, df, da in growth(rs):
            lines.append(f"   {dh:+7.0f} {dl:+7.0f} {df:+7.0f} {da:+7.0f}  {s}")
        lines += [f"   ERROR {r['error']}" for r in rs if r["stage"] == "error"]
    lines.append("\nmilestones (MiB): Rss, [heap] RSS, other anon RSS, glibc arena / in_use / free / mmapped, device used, maxrss")
    lines.append(f"{'variant':>14} {'milestone':>9} {'Rss':>6} {'[heap]':>6} {'anon':>6} {'arena':>6} {'in_use':>6} "
                 f"{'free':>6} {'mmap':>6} {'device':>6} {'maxrss':>6}  stage")
    for v, rs in by.items():
        for r in rs:
            if r.get("milestone") not in MILESTONES:
                continue
            m, g = r.get("m", {}), r.get("g", {})
            dev = r.get("cuda", {}).get("device_used")
            f = (lambda x: f"{x:6.0f}" if isinstance(x, (int, float)) else f"{'-':>6}")
            lines.append(f"{v:>14} {r['milestone']:>9} {f(r.get('Rss'))} {f(g.get('[heap]'))} {f(g.get('anon'))} "
                         f"{f(m.get('arena'))} {f(m.get('in_use'))} {f(m.get('free'))} {f(m.get('mmapped'))} {f(dev)} "
                         f"{f(r.get('maxrss'))}  {r['stage']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", help="checkpoint directory (holding asset/)")
    ap.add_argument("--variants", default="default,bare,nocudnn,mmap128k,eager,arena2,trim0",
                    help=f"comma-separated, run in this order; known: {', '.join(VARIANTS)}")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu"))
    ap.add_argument("--model", default="{}", help="extra model.* settings as JSON, e.g. '{\"max_seq_len\": 512}'")
    ap.add_argument("--cuda-runner", action="store_true", help="on a CPU: the CUDA runner's logic instead of the torch runner")
    ap.add_argument("--requests", type=int, default=0, help="sentences synthesized after the warm-up")
    ap.add_argument("--step-mib", type=float, default=8.0, help="record a watched call when memory grew this much")
    ap.add_argument("--chunk-mib", type=float, default=256.0, help="record every this many MiB of weights streamed")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per variant")
    ap.add_argument("--deadline-s", type=float, default=240.0, help="skip the variants that would start after this")
    ap.add_argument("--json", help="write every record here")
    a = ap.parse_args(argv)
    names = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    t0, recs = time.perf_counter(), []
    for v in names:
        left = a.deadline_s - (time.perf_counter() - t0)
        if left < 20:
            recs.append({"variant": v, "stage": "error", "error": f"skipped: the {a.deadline_s:.0f} s deadline"})
            continue
        print(f"variant {v} ...", file=sys.stderr, flush=True)
        recs += run_variant(v, a, min(a.timeout_s, left))
        if a.json:   # after each variant: what ran survives a later timeout
            Path(a.json).write_text(json.dumps(recs, indent=1) + "\n")
    print(report(recs))
    return 1 if any(r["stage"] == "error" for r in recs) else 0


if __name__ == "__main__":
    sys.exit(main())
