"""Ready time and step time of the CUDA runner's three step modes: plain CUDA graphs, torch.compile
at start, and the ahead-of-time compiled packages (``chattts-appliance engines compile``).

Each measurement is a FRESH process (``--child``) that opens the runner through the production
path (``appliance.engines.select.open_runner`` with ``model.compile`` off / default / auto), so
its ready time is what a daemon start pays for the engine: interpreter start, imports, checkpoint
check, load, compile or package load, and the graph captures. Then it times ``runner.step`` (8
steps per call, the host sync and the codes copy included; median of 25 calls) at batch 1 and 3
and records the codes of three slots for fixed seeds, so that every mode is compared with the
plain graphs' codes (the same-seed guarantee).

Stages, in this order (each cold/warm pair shares its caches):

* ``plain`` cold, warm;
* ``aot-build``: ``python -m appliance engines compile`` with empty inductor and Triton caches
  (the installer's cold path), then ``aot`` twice (``model.compile: auto`` loading the packages);
* ``jit`` cold (empty ``engine_dir/torch_compile`` and Triton caches), warm.

A stage that would pass ``--deadline-s`` (counted from the start) is skipped and says so;
``--stages aot`` or ``--stages jit`` runs one compiled mode (plain always runs, as the reference). Prints
a table and appends one record per mode (``bench: aot``, DESIGN.md section 7 fields plus
``ready_s``, ``compile``, ``warm_cache``, ``build_s``, ``codes_equal_plain``) to ``--out``.

Usage (the GPU machine; see bench/gpu_aot.sh)::

    python3 bench/bench_aot.py --checkpoint /tmp/ckpt_full --engine-dir /tmp/eng_aot --machine h200 \\
        --out $OUT/aot.json --max-seq-len 512
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"plain": "off", "jit": "default", "aot": "auto"}
SEEDS = (11, 2**40 + 3, 2**63 + 5)


def _config(a) -> dict:
    return {"model": {"path": a.checkpoint, "backend": "torch", "device": a.device, "dtype": a.dtype,
                      "engine_dir": a.engine_dir, "max_batch": a.max_batch, "max_seq_len": a.max_seq_len,
                      "max_prompt_tokens": min(64, a.max_seq_len // 2)},
            "safety": {"cache_dir": str(Path(a.engine_dir) / "sums")}}


def child(a) -> None:
    """One fresh process: open the runner, time it, step it, print one JSON line."""
    t0 = float(os.environ["BENCH_T0"])
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT))
    from appliance.config import config_from_dict
    from appliance.core import SamplingParams
    from appliance.engines.select import open_runner

    t_import = time.time() - t0
    cfg = config_from_dict(json.loads(a.child_config))
    if cfg.model.device == "cpu":   # development run: select's CUDA-runner arguments on the CPU
        from appliance.engines.torch.cuda_runner import CudaRunner
        from appliance.engines.torch.step_modes import compile_mode

        mode = compile_mode(cfg.model.compile)[0]
        eng = cfg.resolve(cfg.model.engine_dir)
        r = CudaRunner(cfg, compile=mode or False, aot_dir=str(eng / "aot"),
                       compile_cache=str(eng / "torch_compile") if mode not in (None, "aot") else None)
    else:
        r = open_runner(cfg)
    ready = time.time() - t0
    out = {"ready_s": round(ready, 2), "import_s": round(t_import, 2), "compiled": getattr(r, "compiled", None),
           "step_source": getattr(r, "step_source", ""), "device_mib": round(r.device_memory_bytes() / 2**20)}
    rng = np.random.default_rng(3)
    p = SamplingParams(min_new_tokens=400, max_new_tokens=400)
    codes = []
    n = r.info.max_batch
    for s in range(n):
        r.prefill(s, rng.integers(0, 400, 12 + 3 * s), None)
        codes.append(r.start(s, p, SEEDS[s]))
    steps = [np.array(codes)] + [c.copy() for _ in range(6) for c in r.step(np.arange(n), 8)]
    out["codes"] = np.array(steps).tolist()   # [49, 3, 4]
    for b in sorted({1, n}):
        slots = np.arange(b)
        for s in range(b):
            r.prefill(s, rng.integers(0, 400, 16), None)
            r.start(s, p, 100 + s)
        r.step(slots, 8)
        times = []
        for _ in range(25):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t = time.perf_counter()
            r.step(slots, 8)
            times.append((time.perf_counter() - t) / 8 * 1e3)
        out[f"ms_b{b}"] = round(statistics.median(times), 4)
    out["rss_mib"] = round(int(next(ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("VmRSS"))) / 1024)
    print("RESULT " + json.dumps(out), flush=True)


def _run(cmd: list[str], env: dict, timeout: float) -> tuple[int, str, float]:
    t = time.time()
    env = {**env, "BENCH_T0": repr(t)}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=max(1.0, timeout), cwd=str(ROOT))
        return p.returncode, p.stdout + p.stderr, time.time() - t
    except subprocess.TimeoutExpired as e:
        return 124, f"{e.stdout or ''}{e.stderr or ''}timed out after {timeout:.0f} s", time.time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint")
    ap.add_argument("--engine-dir")
    ap.add_argument("--machine", default="h200")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--max-seq-len", type=int, default=512, help="KV positions per slot (default 512: 2 buckets x 3 batches)")
    ap.add_argument("--max-batch", type=int, default=3)
    ap.add_argument("--deadline-s", type=float, default=540.0)
    ap.add_argument("--stages", default="aot,jit", help="besides plain (always): aot, jit (comma-separated)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-config", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    if not (a.checkpoint and a.engine_dir):
        ap.error("--checkpoint and --engine-dir are required")
    start = time.time()
    eng = Path(a.engine_dir)
    shutil.rmtree(eng, ignore_errors=True)
    eng.mkdir(parents=True)
    base_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cfg = _config(a)
    (eng / "config.yaml").write_text(json.dumps(cfg))   # JSON is YAML
    results: dict[str, dict] = {}
    logs = Path(a.out).with_suffix(".log") if a.out else None
    log_text = []

    def stage(name: str, mode: str, cache: str, budget: float) -> None:
        left = a.deadline_s - (time.time() - start)
        if left < budget:
            results[name] = {"skipped": f"{left:.0f} s left of --deadline-s, the stage may need {budget:.0f}"}
            print(f"== {name}: skipped ({results[name]['skipped']})", flush=True)
            return
        c = {**cfg, "model": {**cfg["model"], "compile": MODES[mode]}}
        env = {**base_env, "TRITON_CACHE_DIR": str(eng / f"triton-{cache}"),
               "TORCHINDUCTOR_CACHE_DIR": str(eng / f"inductor-{cache}")}
        rc, text, wall = _run([sys.executable, __file__, "--child", "--child-config", json.dumps(c)], env, left)
        log_text.append(f"== {name} rc={rc} wall={wall:.1f}\n{text}")
        line = next((ln for ln in text.splitlines() if ln.startswith("RESULT ")), None)
        results[name] = json.loads(line[7:]) if rc == 0 and line else {"error": text[-1500:], "rc": rc}
        r = results[name]
        print(f"== {name}: rc={rc} ready {r.get('ready_s')} s, step B=1 {r.get('ms_b1')} ms, B=3 {r.get('ms_b3')} ms; "
              f"{r.get('step_source', r.get('error', '')[-300:])}", flush=True)

    todo = set(a.stages.split(","))
    stage("plain-cold", "plain", "plain", 60)
    stage("plain-warm", "plain", "plain", 60)
    if "aot" in todo:
        left = a.deadline_s - (time.time() - start)
        env = {**base_env, "TRITON_CACHE_DIR": str(eng / "triton-aot"), "TORCHINDUCTOR_CACHE_DIR": str(eng / "inductor-aot")}
        rc, text, build_s = _run([sys.executable, "-m", "appliance", "engines", "compile", "--config",
                                  str(eng / "config.yaml")], env, left - 60)
        log_text.append(f"== aot-build rc={rc} wall={build_s:.1f}\n{text}")
        print(f"== aot-build: rc={rc} {build_s:.1f} s; " + " | ".join(
            ln for ln in text.splitlines() if "compiled" in ln or "error" in ln or "load check" in ln)[-900:], flush=True)
        results["aot-build"] = {"rc": rc, "build_s": round(build_s, 1)}
        if rc == 0:
            stage("aot-warm", "aot", "aot", 60)
            stage("aot-warm2", "aot", "aot", 60)
    if "jit" in todo:
        stage("jit-cold", "jit", "jit", 180)
        stage("jit-warm", "jit", "jit", 80)
    if logs:
        logs.parent.mkdir(parents=True, exist_ok=True)
        logs.write_text("\n".join(log_text))
    report(a, results)


def report(a, results: dict) -> None:
    import numpy as np

    ref = results.get("plain-cold", {}).get("codes")
    print("\n| mode | ready cold s | ready warm s | ms/step B=1 | ms/step B=3 | codes = plain | device MiB | RSS MiB | step |")
    print("|---|---|---|---|---|---|---|---|---|")
    records = []
    build = results.get("aot-build", {})
    layers = json.loads((Path(a.checkpoint) / "asset/gpt/config.json").read_text())["num_hidden_layers"]
    size = "full" if layers == 20 else "tiny"
    for mode, cold_key, warm_key in (("plain", "plain-cold", "plain-warm"), ("jit", "jit-cold", "jit-warm"),
                                     ("aot", "aot-build", "aot-warm")):
        cold, warm = results.get(cold_key, {}), results.get(warm_key, {})
        r = warm if "ms_b1" in warm else cold
        same = None
        if ref is not None and r.get("codes") is not None:
            same = float((np.array(r["codes"]) == np.array(ref)).all(axis=-1).mean())
        cold_s = build.get("build_s") if mode == "aot" else cold.get("ready_s")
        cold_txt = f"{cold_s} (build) + {warm.get('ready_s')} (load)" if mode == "aot" else cold_s
        print(f"| {mode} | {cold_txt} | {warm.get('ready_s')} | {r.get('ms_b1')} | {r.get('ms_b3')} | "
              f"{same} | {r.get('device_mib')} | {r.get('rss_mib')} | {r.get('step_source', r.get('skipped', r.get('error', '')))[:90]} |")
        for batch in sorted(int(k[4:]) for k in r if k.startswith("ms_b")):
            ms = r.get(f"ms_b{batch}")
            for warm_cache, rr in ((False, cold), (True, warm)):
                if "ready_s" not in rr and not (mode == "aot" and not warm_cache and build.get("rc") == 0):
                    continue
                records.append({
                    "bench": "aot", "date": dt.date.today().isoformat(), "machine": a.machine, "backend": "torch-cuda"
                    if a.device == "cuda" else "torch-cpu", "precision": {"float16": "fp16", "bfloat16": "bf16"}.get(a.dtype, "fp32"),
                    "checkpoint": size, "batch": batch,
                    "ms_per_step": ms, "steps_per_s": round(1e3 / ms, 1) if ms else None,
                    "rtf": round(ms * 46.875 / 1e3, 4) if ms else None, "ttfb_ms": None,
                    "peak_mem_mib": r.get("device_mib"), "baseline_ms_per_step": None,
                    "ready_s": (round(build["build_s"] + warm["ready_s"], 1) if mode == "aot" and not warm_cache
                                and "ready_s" in warm and "build_s" in build else rr.get("ready_s")),
                    "compile": {"plain": "off", "jit": "torch.compile", "aot": "aot-package"}[mode],
                    "warm_cache": warm_cache, "build_s": build.get("build_s") if mode == "aot" else None,
                    "codes_equal_plain": same,
                    "notes": f"KV {a.max_batch} x {a.max_seq_len}, {a.dtype}; ready = fresh process start -> open_runner done "
                             f"(imports, checkpoint check, load, compile/package load, captures); step = runner.step "
                             f"of 8, median of 25; " + ("cold = engines compile (empty caches), the load after it is "
                                                        "the warm row" if mode == "aot" else "")})
    if a.out:
        p = Path(a.out)
        p.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(p.read_text()) if p.is_file() else []
        p.write_text(json.dumps(old + records, indent=1) + "\n")
        (p.with_suffix(".raw.json")).write_text(json.dumps(
            {k: {kk: vv for kk, vv in v.items() if kk != "codes"} for k, v in results.items()}, indent=1))
        print(f"\n{len(records)} records -> {p}")


if __name__ == "__main__":
    main()
