"""llama.cpp's CUDA build on a GPU: the GPT's GGUF with every layer offloaded against the same file
on the CPU, in one process (does the CUDA variant load, and does it compute the same step?).

For each ``--types`` GGUF (``<gguf-dir>/<type>/gpt.gguf``; with ``--checkpoint`` the F32 GGUF is
written from that checkpoint and quantized to each type first, as ``engines export`` does): two
contexts of the production shape (:class:`bench.step.LlamaStep`: 3 sequences, the embeddings
through ``batch.embd``, one ``llama_decode`` per step), one with ``n_gpu_layers`` 0 (``--threads``
CPU threads), one with every layer on the GPU. At each ``--positions`` P and ``--batches`` B both get
the same prefill and the same step input; recorded per shape: the step's wall time (median of
``--steps``, ms; the logits copied to the host are part of the step, as in the runner), and the
GPU step's error against the CPU's on the logits and the final hidden states
(``20 log10(rms(a - b) / rms(b))``, dB) with the greedy agreement of the four codebooks.

Appends one record per type and shape (``bench: llama``) to ``bench/results/llama.jsonl``::

    python -m bench llama --checkpoint /tmp/ckpt_full --gguf-dir /tmp/gguf --types q8_0,q4_k_m,f16
 Exit 1 when a GPU load fails
(the exception is recorded); a crash inside llama.cpp ends the process (the shell that runs it
records the signal).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench import harness
from bench.step import HD, D, H, L, M, Q, V, LlamaStep  # the production-shaped step


def db(a: np.ndarray, ref: np.ndarray) -> float:
    """``20 log10(rms(a - ref) / rms(ref))``, dB."""
    return float(20 * np.log10(max(float(np.sqrt(np.mean((a - ref) ** 2))), 1e-30)
                               / max(float(np.sqrt(np.mean(ref ** 2))), 1e-30)))


def write_ggufs(ckpt: str, out: Path, types: list[str]) -> None:
    """The checkpoint's GPT as ``out/<type>/gpt.gguf`` for each type (F32 written, then quantized)."""
    import torch

    from appliance.build.gguf_export import quantize, write_gguf
    from appliance.model.checkpoint import load_model

    f32 = out / "f32" / "gpt.gguf"
    if not f32.exists():
        f32.parent.mkdir(parents=True, exist_ok=True)
        write_gguf(load_model(ckpt, dtype=torch.float32), f32)
    for t in types:
        f = out / t / "gpt.gguf"
        if t != "f32" and not f.exists():
            f.parent.mkdir(parents=True, exist_ok=True)
            quantize(f32, f, t)


def timed(r: LlamaStep, emb: np.ndarray, p: int, b: int, steps: int) -> float:
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        r.step(None, None, emb, p, b)
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench llama", description=__doc__.split("\n")[0])
    ap.add_argument("--gguf-dir", required=True, help="holding <type>/gpt.gguf (written there with --checkpoint)")
    ap.add_argument("--checkpoint", default=None, help="write the GGUFs from this checkpoint first")
    ap.add_argument("--types", default="q8_0", help="GGUF types, e.g. q8_0,q4_k_m,f16")
    ap.add_argument("--positions", default="64,512")
    ap.add_argument("--batches", default="1,3")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=8, help="the CPU context's threads")
    ap.add_argument("--label", default="")
    harness.add_common(ap)
    args = ap.parse_args(argv)
    types = args.types.split(",")
    positions = [int(x) for x in args.positions.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    gdir = Path(args.gguf_dir)
    if args.checkpoint:
        write_ggufs(args.checkpoint, gdir, types)
    from appliance.engines.llama import lib as llama_lib

    lc = llama_lib.lib()
    offload = bool(lc.llama_supports_gpu_offload())
    system = lc.llama_print_system_info().decode(errors="replace").strip()
    print(f"llama.cpp supports GPU offload: {offload}; {system}", flush=True)
    recs: list[dict] = []
    hinfo = harness.host(gpu=True)
    size = harness.checkpoint_size(args.checkpoint) or "full"

    def record(**figures) -> dict:
        return harness.record("llama", checkpoint=size, backend="llama.cpp", machine=args.machine, host_info=hinfo,
                              **figures)

    rc = 0
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((1, 1, D), np.float32) * 0.1
    for t in types:
        f = gdir / t / "gpt.gguf"
        t0 = time.perf_counter()
        cpu = LlamaStep(f, args.threads, positions)
        load_cpu = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            gpu = LlamaStep(f, args.threads, positions, gpu_layers=L + 1)
        except Exception as e:  # noqa: BLE001 - recorded: the point of this bench
            recs.append(record(type=t, gpu_offload=offload, gpu_load=f"failed: {type(e).__name__}: {e}",
                               notes=args.label))
            print(recs[-1], flush=True)
            rc = 1
            continue
        load_gpu = time.perf_counter() - t0
        print(f"{t}: loaded on the CPU in {load_cpu:.2f} s, with {L + 1} layers offloaded in {load_gpu:.2f} s", flush=True)
        for p in positions:
            for b in batches:
                lc_, hc = (x.copy() for x in cpu.step(None, None, emb, p, b))
                lg, hg = (x.copy() for x in gpu.step(None, None, emb, p, b))
                agree = float(np.mean(lg.argmax(-1) == lc_.argmax(-1)))
                ms_cpu = timed(cpu, emb, p, b, args.steps)
                ms_gpu = timed(gpu, emb, p, b, args.steps)
                rec = record(type=t, gpu_offload=offload, gpu_load="ok", gpu_layers=L + 1, positions=p, batch=b,
                             load_s_cpu=round(load_cpu, 2), load_s_gpu=round(load_gpu, 2),
                             ms_per_step_cpu=round(ms_cpu, 3), ms_per_step_gpu=round(ms_gpu, 3), cpu_threads=args.threads,
                             logits_db_gpu_vs_cpu=round(db(lg, lc_), 1), hidden_db_gpu_vs_cpu=round(db(hg, hc), 1),
                             greedy_agreement=round(agree, 4), system_info=system,
                             notes=f"{args.label}; {M} sequences, F16 KV cache, {H} heads x {HD}, {Q} x {V} logits per row")
                recs.append(rec)
                print(f"{t} P={p} B={b}: cpu {ms_cpu:.2f} ms, gpu {ms_gpu:.2f} ms, logits {rec['logits_db_gpu_vs_cpu']} dB, "
                      f"hidden {rec['hidden_db_gpu_vs_cpu']} dB, greedy {agree:.3f}", flush=True)
    harness.write(recs, args.out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
