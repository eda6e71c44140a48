"""Engines benchmark: TensorRT builder memory vs the 1.5 GB budget, ONNX Runtime ms/step on CPU.

Usage::

    python bench/bench_engines.py [--ckpt models/random-full] [--work engines/build/bench-full]
                                  [--machine cpu-2core] [--threads 0] [--steps 20]

1. Writes the FULL-size random checkpoint if missing (``chattts-appliance model random --size full``).
2. Exports ONNX graphs: fp32 and int8 (MatMulNBits) for ONNX Runtime, fp16 for TensorRT.
3. Builds TensorRT plans with the installed builder (TensorRT-RTX on a machine without a GPU):
   fp16 and fp8 for sm 8.9, int8 weight-only for sm 8.6 (TensorRT-RTX cannot target Orin's 8.7;
   the weight bytes are the same there). Reports the builder's weight and activation memory per
   graph and in total, plus the FP16 KV cache of ``max_batch x max_seq_len``, against
   ``service.memory_budget_mb`` (1500 MiB).
4. Times, each in a fresh process (peak RSS is per configuration): the ONNX Runtime decode step
   at B=1 and B=3 with 32 and 512 filled cache positions, prefill of a 64-token prompt, the
   Decoder + Vocos on a 1-second window (+ context), the numpy inverse STFT of 1 s of audio,
   and our PyTorch CPU runner as the reference (``torch-cpu``).

Prints a table and appends records (the project's record fields, plus ``weights_mib`` /
``activation_mib`` / ``kv_mib`` / ``budget_mib`` for builds and ``fill`` for steps) to
``bench/results/engines-<date>-<machine>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
STEP_AUDIO_S = 512 / 24000  # one decode step = 2 mel frames x 256 samples at 24 kHz (21.3 ms)
M, S, P = 3, 2048, 256  # config defaults: max_batch, max_seq_len, max_prompt_tokens


def _cfg(ckpt: Path, work: Path, backend: str, threads: int):
    from appliance.config import config_from_dict

    return config_from_dict({"model": {"path": str(ckpt), "backend": backend, "device": "cpu", "threads": threads,
                                       "max_batch": M, "max_seq_len": S, "max_prompt_tokens": P,
                                       "engine_dir": str(work)}}, base_dir=str(ROOT))


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(kind: str, ckpt: Path, work: Path, threads: int, steps: int) -> dict:
    """Time one backend in this process; returns a dict of measurements."""
    if kind == "torch":
        from appliance.engines.torch.cpu_runner import TorchRunner

        r = TorchRunner(_cfg(ckpt, work, "torch", threads), reason="bench")
    else:
        from appliance.engines.onnx.runner import OnnxRunner

        r = OnnxRunner(_cfg(ckpt, work, "onnxruntime", threads), reason="bench", export_dir=work / "onnx" / kind)
    load_rss = _rss_mib()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, min(20000, r.shapes.num_text_tokens if kind == "torch" else r._n_text), 64)
    r.forward_prefill(0, ids, None)  # warm-up (first-call allocations, weight prepacking)
    t0 = time.perf_counter()
    for slot in range(M):
        r.forward_prefill(slot, ids, None)
    prefill_ms = (time.perf_counter() - t0) * 1e3 / M
    out = {"load_rss_mib": load_rss, "prefill_ms": prefill_ms, "steps": {}}
    for b in (1, 3):
        for fill in (32, 512):
            slots = np.arange(b)
            codes = np.zeros((b, 4), np.int64)
            pos = np.full(b, fill, np.int64)
            for _ in range(3):
                r.forward_decode(slots, codes, pos)
            ts = []
            for i in range(steps):
                t0 = time.perf_counter()
                r.forward_decode(slots, codes, pos + i)
                ts.append((time.perf_counter() - t0) * 1e3)
            # median, and min: the machine is shared, the min is the least disturbed step
            out["steps"][f"{b}/{fill}"] = (float(np.median(ts)), float(np.min(ts)))
    if kind != "torch":  # the host-side part of keeping the KV cache in place: writing k_new/v_new at pos
        io, bufs = r._bind[3]
        slots, pos = np.arange(3), np.full(3, 100)
        t0 = time.perf_counter()
        for _ in range(100):
            r._k[:, pos, slots] = bufs["k_new"][:, :, 0]
            r._v[:, pos, slots] = bufs["v_new"][:, :, 0]
        out["kv_write_ms_b3"] = (time.perf_counter() - t0) * 1e3 / 100
    h = rng.standard_normal((47 + 80, r.info.hidden_size)).astype(np.float32)  # 1 s + receptive-field context
    mel = rng.standard_normal((100, 94 + 60)).astype(np.float32)
    r.forward_decoder(h)
    r.forward_vocos(mel)
    t0 = time.perf_counter()
    for _ in range(3):
        r.forward_decoder(h)
    out["decoder_ms_per_s"] = (time.perf_counter() - t0) * 1e3 / 3
    t0 = time.perf_counter()
    for _ in range(3):
        re, im = r.forward_vocos(mel)
    out["vocos_ms_per_s"] = (time.perf_counter() - t0) * 1e3 / 3
    from appliance.synth.istft import istft

    t0 = time.perf_counter()
    for _ in range(10):
        istft(re[:94], im[:94])
    out["istft_numpy_ms_per_s"] = (time.perf_counter() - t0) * 1e3 / 10
    out["peak_rss_mib"] = _rss_mib()
    out["weight_mib"] = r.info.weight_bytes / 2**20
    return out


def _run(cmd: list[str], what: str) -> None:
    print(f"... {what}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    print(f"    {what}: {time.perf_counter() - t0:.0f} s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default=str(ROOT / "models" / "random-full"))
    ap.add_argument("--work", default=str(ROOT / "engines" / "build" / "bench-full"))
    ap.add_argument("--machine", default="cpu-2core")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip-build", action="store_true", help="reuse exports/plans already in --work")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    ckpt, work = Path(a.ckpt), Path(a.work)
    if a.worker:
        print(json.dumps(worker(a.worker, ckpt, work, a.threads, a.steps)))
        return 0
    py = sys.executable
    cli = [py, "-m", "appliance"]
    if not (ckpt / "asset" / "gpt" / "model.safetensors").is_file():
        _run(cli + ["model", "random", "--size", "full", str(ckpt)], "random full checkpoint")
    cfgf = work / "bench-config.yaml"
    work.mkdir(parents=True, exist_ok=True)
    cfgf.write_text(f"model:\n  path: {ckpt}\n  engine_dir: {work}\n  max_batch: {M}\n  max_seq_len: {S}\n  max_prompt_tokens: {P}\n")
    builds = [("fp16", "8.9"), ("int8", "8.6"), ("fp8", "8.9")]
    if not a.skip_build:
        for p in ("fp32", "int8", "fp16"):
            _run(cli + ["engines", "export", "--config", str(cfgf), "--precision", p], f"export {p}")
        for p, cc in builds:
            _run(cli + ["engines", "build", "--config", str(cfgf), "--precision", p, "--target", cc], f"build {p} (sm {cc})")

    date = dt.date.today().isoformat()
    recs = []
    base = dict(bench="engines", date=date, machine=a.machine, checkpoint="full", ttfb_ms=None, baseline_ms_per_step=None)
    budget = 1500
    kv_fp16_mib = 2 * 20 * 768 * 2 * S * M / 2**20
    print(f"\nTensorRT builder memory (full checkpoint, KV cache fp16 {M} x {S} = {kv_fp16_mib:.0f} MiB), budget {budget} MiB")
    print(f"{'precision':9s} {'target':6s} {'graph':12s} {'weights MiB':>11s} {'activ. MiB':>10s}")
    for p, cc in builds:
        mpath = work / "trt" / p / "manifest.json"
        if not mpath.is_file():
            continue
        m = json.loads(mpath.read_text())
        sh = m["shapes"]
        kv_fp16_mib = 2 * sh["n_layers"] * sh["hidden"] * 2 * S * M / 2**20
        for g, e in m["graphs"].items():
            print(f"{p:9s} {cc:6s} {g:12s} {(e['weights_bytes'] or 0) / 2**20:11.1f} {(e['activation_bytes'] or 0) / 2**20:10.1f}")
        w = m["memory"]["weights_bytes"] / 2**20
        act = m["memory"]["activation_bytes"] / 2**20
        act_max = m["memory"].get("activation_bytes_max", 0) / 2**20
        total = w + act + kv_fp16_mib
        print(f"{p:9s} {cc:6s} {'TOTAL':12s} {w:11.1f} {act:10.1f}   + KV {kv_fp16_mib:.0f} = {total:.0f} MiB "
              f"({'within' if total <= budget else 'OVER'} {budget})")
        recs.append(dict(base, backend="tensorrt", precision=p, batch=M, ms_per_step=None, steps_per_s=None, rtf=None,
                         peak_mem_mib=round(total, 1), weights_mib=round(w, 1), activation_mib=round(act, 1),
                         activation_max_mib=round(act_max, 1), kv_mib=round(kv_fp16_mib, 1), budget_mib=budget,
                         notes=f"{m['runtime']['name']} {m['runtime']['version']} built on CPU for sm {cc}; builder-reported "
                               "memory (engines not run); peak_mem = weights + sum of activations + fp16 KV; per graph: "
                               + ", ".join(f"{g} {(e['weights_bytes'] or 0) / 2**20:.0f}+{(e['activation_bytes'] or 0) / 2**20:.0f}"
                                           for g, e in m["graphs"].items())))

    print(f"\nCPU step times ({os.cpu_count()} cores, threads={a.threads or 'all'}), ms; RTF = ms/step / {STEP_AUDIO_S * 1e3:.1f}")
    print(f"{'backend':12s} {'prec':5s} {'B':>2s} {'fill':>5s} {'ms/step':>8s} {'min':>7s} {'RTF':>6s} {'prefill':>8s} {'dec+voc/s':>9s} {'istft/s':>8s} {'RSS MiB':>8s}")
    for kind in ("fp32", "int8", "torch"):
        if kind != "torch" and not (work / "onnx" / kind / "manifest.json").is_file():
            continue
        res = subprocess.run([py, __file__, "--worker", kind, "--ckpt", str(ckpt), "--work", str(work),
                              "--threads", str(a.threads), "--steps", str(a.steps)],
                             cwd=ROOT, capture_output=True, text=True)
        if res.returncode != 0:
            print(f"{kind}: worker failed:\n{res.stderr[-2000:]}")
            continue
        r = json.loads(res.stdout.strip().splitlines()[-1])
        backend = "torch-cpu" if kind == "torch" else "onnxruntime"
        prec = "fp32" if kind == "torch" else kind
        for key, (ms, ms_min) in r["steps"].items():
            b, fill = (int(x) for x in key.split("/"))
            rtf = ms / 1e3 / STEP_AUDIO_S
            print(f"{backend:12s} {prec:5s} {b:2d} {fill:5d} {ms:8.1f} {ms_min:7.1f} {rtf:6.2f} {r['prefill_ms']:8.1f} "
                  f"{r['decoder_ms_per_s'] + r['vocos_ms_per_s']:9.1f} {r['istft_numpy_ms_per_s']:8.2f} {r['peak_rss_mib']:8.0f}")
            recs.append(dict(base, backend=backend, precision=prec, batch=b, ms_per_step=round(ms, 2), ms_per_step_min=round(ms_min, 2),
                             steps_per_s=round(b * 1e3 / ms, 2), rtf=round(rtf, 3), peak_mem_mib=round(r["peak_rss_mib"], 1),
                             fill=fill, prefill_ms=round(r["prefill_ms"], 1),
                             decoder_ms_per_audio_s=round(r["decoder_ms_per_s"], 1), vocos_ms_per_audio_s=round(r["vocos_ms_per_s"], 1),
                             istft_numpy_ms_per_audio_s=round(r["istft_numpy_ms_per_s"], 2),
                             kv_write_ms_b3=round(r["kv_write_ms_b3"], 3) if "kv_write_ms_b3" in r else None,
                             load_rss_mib=round(r["load_rss_mib"], 1),
                             notes=f"ms_per_step = median of {a.steps} steps (min beside it; shared machine: load {os.getloadavg()[0]:.1f} at the end); GPT decode step only (no sampling); {fill} filled KV positions; rtf per channel = ms/step / 21.33; "
                                   f"decoder/vocos on a 1 s window + context; weights on disk {r['weight_mib']:.0f} MiB"))
    out = ROOT / "bench" / "results" / f"engines-{date}-{a.machine}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(out.read_text()) if out.is_file() else []
    out.write_text(json.dumps(old + recs, indent=1) + "\n")
    print(f"\n{len(recs)} records appended to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
