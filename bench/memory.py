"""Memory and ready time of the production pipeline, per backend and stage.

For each backend (``onnxruntime``, ``torch-cpu``, ``torch-cuda``) the stages below are measured
each in a FRESH process that runs every stage up to it and then reports, so that ``ru_maxrss``
(the peak resident set since the process began) is the peak *up to that stage*: the ``loaded``
process's peak is the load peak.

1. ``import``: the runtime (``onnxruntime`` or ``torch``) and the appliance's synthesis layer;
2. ``context``: the runtime's context: on CUDA the CUDA context and one cuBLAS GEMM in the
   model's dtype, on a CPU one GEMM (torch) or one tiny ONNX Runtime session;
3. ``loaded``: ``Pipeline.from_config`` (what the daemon loads: checkpoint check, weights, KV
   cache, graph captures or compilation, the tokenizer and text normalizer); its time since the
   process began is ``ready_s``;
4. ``warm``: after ``Pipeline.warmup`` (the daemon runs it before it reports ready);
5. ``requests10``: after 10 requests (a short sentence, ``--steps`` decode steps each, EOS masked).

Per stage: RSS and anonymous memory (``Rss`` / ``Anonymous`` of ``/proc/self/smaps_rollup``:
anonymous is the process's own, the rest is mapped files), ``ru_maxrss``, device memory
(``torch.cuda.memory_reserved`` and, where NVML is present (``pynvml``; else ``nvidia-smi``), the
process's whole device memory with its CUDA context), seconds since the process began.

Prints a table and appends one record per backend (``bench: memory``: the DESIGN.md section 7 fields,
``load_peak_rss_mib``, ``rss_mib`` and ``anon_mib`` after 10 requests, ``device_mib``, ``ready_s``,
``compile``, ``warm_cache``, and the per-stage list) to ``--out`` (default
``bench/results/memory.jsonl``).

Usage::

    python -m bench memory --checkpoint models/random-full --engine-dir ENG --backends onnxruntime torch-cpu
    python -m bench memory --checkpoint /tmp/ckpt_full --engine-dir /tmp/eng --backends torch-cuda \\
        --compile off auto                           # the GPU machine (bench/gpu.sh memory)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench import harness

ROOT = harness.ROOT
STAGES = ("import", "context", "loaded", "warm", "requests10")
SENTENCE = "今天天气很好，我们去公园散步吧。"


# --------------------------------------------------------------------------- child (one process)
def _smaps() -> dict:
    """``Rss`` and ``Anonymous`` of /proc/self/smaps_rollup, MiB."""
    kb = {}
    for ln in Path("/proc/self/smaps_rollup").read_text().splitlines():
        k, _, v = ln.partition(":")
        if k in ("Rss", "Anonymous"):
            kb[k] = int(v.split()[0])
    return {"rss_mib": round(kb["Rss"] / 1024, 1), "anon_mib": round(kb["Anonymous"] / 1024, 1)}


def _nvml_mib() -> float | None:
    """This process's device memory as the driver sees it (CUDA context included), MiB; None without NVML/nvidia-smi."""
    pid = os.getpid()
    try:
        import pynvml

        pynvml.nvmlInit()
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == pid and p.usedGpuMemory is not None:
                    return round(p.usedGpuMemory / 2**20, 1)
        return None
    except Exception:  # no pynvml, or NVML refused: try the CLI
        pass
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for ln in out.splitlines():
        parts = [x.strip() for x in ln.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return float(parts[1])
    return None


def _measure(t0: float, cuda: bool) -> dict:
    m = {**_smaps(), "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
         "elapsed_s": round(time.time() - t0, 2)}
    if cuda:
        import torch

        torch.cuda.synchronize()
        m["torch_reserved_mib"] = round(torch.cuda.memory_reserved() / 2**20, 1)
        m["device_mib"] = _nvml_mib()
    return m


def _context(backend: str, dtype: str) -> None:
    if backend == "onnxruntime":
        import onnxruntime as ort

        try:
            from onnx import TensorProto, helper
        except ImportError:   # ORT-only box: the first real session is the context
            return
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 8])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 8])
        g = helper.make_graph([helper.make_node("MatMul", ["x", "x"], ["y"])], "ctx", [x], [y])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        import numpy as np

        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": np.ones((8, 8), np.float32)})
        return
    import torch

    dev = "cuda" if backend == "torch-cuda" else "cpu"
    a = torch.randn(256, 256, device=dev, dtype=getattr(torch, dtype) if dev == "cuda" else torch.float32)
    (a @ a).sum().item()


def child(a) -> None:
    t0 = float(os.environ["BENCH_T0"])
    spec = json.loads(a.child)
    backend, upto = spec["backend"], STAGES.index(spec["stage"])
    cuda = backend == "torch-cuda"
    if backend == "onnxruntime":
        import onnxruntime  # noqa: F401
    else:
        import torch  # noqa: F401
    sys.path.insert(0, str(ROOT))
    from appliance.config import config_from_dict
    from appliance.core import SynthesisRequest, SynthParams
    from appliance.synth.pipeline import Pipeline

    out: dict = {"stage": spec["stage"]}
    if upto >= 1:
        _context(backend, spec["dtype"])
    if upto >= 2:
        pipe = Pipeline.from_config(config_from_dict(spec["config"]))
        out["ready_s"] = round(time.time() - t0, 2)
        info, runner = pipe.info, pipe.runner
        out.update(backend=info.backend, precision=info.precision, weight_mib=round(info.weight_bytes / 2**20, 1),
                   compile=getattr(runner, "compiled", None), step_source=getattr(runner, "step_source", None))
    if upto >= 3:
        out["warmup_s"] = round(pipe.warmup(), 2)
    if upto >= 4:
        rtf = []
        for i in range(10):
            n = spec["steps"]
            job = pipe.prepare(SynthesisRequest(text=SENTENCE, id=f"m{i}", seed=i,
                                                params=SynthParams(min_new_tokens=n, max_new_tokens=n)))
            run = pipe.run(job)
            for _ in run:
                pass
            rtf.append(round(run.report.stats.rtf, 3))
        out["rtf"] = rtf
    out.update(_measure(t0, cuda))
    print("RESULT " + json.dumps(out), flush=True)


# --------------------------------------------------------------------------- parent
def _config(a, backend: str, compile_setting: str | None) -> dict:
    model = {"path": a.checkpoint, "engine_dir": a.engine_dir, "threads": a.threads,
             "backend": "onnxruntime" if backend == "onnxruntime" else "torch",
             "device": {"torch-cuda": "cuda", "torch-cpu": "cpu"}.get(backend, "auto")}
    if backend != "onnxruntime":
        model["dtype"] = a.dtype if backend == "torch-cuda" else "float32"
    if compile_setting:
        model["compile"] = compile_setting
    if a.max_seq_len:
        model["max_seq_len"] = a.max_seq_len
    return {"model": model, "safety": {"cache_dir": str(Path(a.engine_dir) / "sums")},
            "synthesis": {"max_new_tokens": max(a.steps, 64)}}


def run_backend(a, backend: str, compile_setting: str | None) -> dict:
    cfg = _config(a, backend, compile_setting)
    eng = Path(a.engine_dir)
    caches = [eng / "aot", eng / "torch_compile"]
    warm_cache = any(any(c.rglob("*.pt2")) or (c.name == "torch_compile" and any(c.rglob("*"))) for c in caches if c.is_dir())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    stages = []
    for stage in STAGES:
        spec = {"backend": backend, "stage": stage, "config": cfg, "dtype": a.dtype, "steps": a.steps}
        t = time.time()
        p = subprocess.run([sys.executable, "-m", "bench.memory", "--child", json.dumps(spec)], capture_output=True, text=True,
                           env={**env, "BENCH_T0": repr(t)}, timeout=a.timeout_s, cwd=str(ROOT))
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            raise SystemExit(f"{backend} {stage} failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
        r = json.loads(line[7:])
        stages.append(r)
        print(f"  {backend:12s} {stage:11s} RSS {r['rss_mib']:7.1f}  anon {r['anon_mib']:7.1f}  peak {r['peak_rss_mib']:7.1f}"
              f"  device {r.get('device_mib')}  {r['elapsed_s']:6.1f} s", flush=True)
    return {"backend": backend, "compile_setting": compile_setting, "warm_cache": warm_cache, "stages": stages}


def record(a, res: dict) -> dict:
    st = {s["stage"]: s for s in res["stages"]}
    loaded, last = st["loaded"], st["requests10"]
    cuda = res["backend"] == "torch-cuda"
    dev = last.get("device_mib") if last.get("device_mib") is not None else last.get("torch_reserved_mib")
    return harness.record(
        "memory", checkpoint=harness.checkpoint_size(a.checkpoint), backend=loaded["backend"], machine=a.machine,
        host_info=harness.host(gpu=cuda),
        precision=loaded["precision"], batch=1,
        peak_mem_mib=dev if cuda else last["peak_rss_mib"],   # CPU: peak of the whole run
        load_peak_rss_mib=loaded["peak_rss_mib"], rss_mib=last["rss_mib"], anon_mib=last["anon_mib"],
        device_mib=dev if cuda else None, ready_s=loaded["ready_s"],
        compile=(loaded.get("compile") or "off") if cuda else None,
        warm_cache=res["warm_cache"] if cuda else None,
        stages=res["stages"],
        notes=f"fresh process per stage; {a.steps}-step requests (EOS masked) x 10; config defaults except "
                 f"path/backend/device{'/dtype ' + a.dtype if cuda else ''}"
                 f"{', max_seq_len ' + str(a.max_seq_len) if a.max_seq_len else ''}; "
                 + (f"device_mib = {'NVML (the process, CUDA context included)' if last.get('device_mib') is not None else 'torch reserved'}; "
                    f"step: {loaded.get('step_source')}; " if cuda else "")
                 + f"1-min load average {os.getloadavg()[0]:.1f}; {a.label}".strip("; "))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint")
    ap.add_argument("--engine-dir", help="model.engine_dir (ONNX export for onnxruntime; aot/ and torch_compile/ for CUDA)")
    ap.add_argument("--backends", nargs="+", default=["onnxruntime", "torch-cpu"],
                    choices=("onnxruntime", "torch-cpu", "torch-cuda"))
    ap.add_argument("--compile", nargs="+", default=["auto"], help="model.compile settings to run on torch-cuda")
    ap.add_argument("--dtype", default="float16", help="torch-cuda dtype (torch-cpu runs float32)")
    ap.add_argument("--max-seq-len", type=int, default=None, help="model.max_seq_len (default: the config default)")
    ap.add_argument("--steps", type=int, default=48, help="decode steps per request")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--label", default="")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    harness.add_common(ap)
    a = ap.parse_args(argv)
    if a.child:
        child(a)
        return 0
    if not (a.checkpoint and a.engine_dir):
        ap.error("--checkpoint and --engine-dir are required")
    recs = []
    for backend in a.backends:
        for c in (a.compile if backend == "torch-cuda" else [None]):
            print(f"== {backend}{' compile ' + c if c else ''}", flush=True)
            recs.append(record(a, run_backend(a, backend, c)))
    print("\n| backend | precision | compile | load peak RSS MiB | RSS after 10 req | anon | device MiB | ready s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in recs:
        print(f"| {r['backend']} | {r['precision']} | {r['compile']} | {r['load_peak_rss_mib']} | {r['rss_mib']} | "
              f"{r['anon_mib']} | {r['device_mib']} | {r['ready_s']} |")
    harness.write(recs, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
