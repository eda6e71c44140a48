"""GPU benchmark of the production path: CudaRunner + Pipeline + BatchEngine on random full weights.

Everything that is timed runs through the code the daemon runs: the runner chosen by
``appliance.engines.select`` (CudaRunner, plain CUDA graphs or the compiled step), the
:class:`~appliance.synth.pipeline.Pipeline` and its :class:`~appliance.synth.batch.BatchEngine`
(decode loop, vocoder windows, ISTFT), with the stream settings of the config. Sections, each
written to ``--work``/``bench_gpu.json`` as soon as it is done (a timeout still leaves data):

1. ``env``: versions, GPU, device-to-device copy bandwidth (bytes read + written / time).
2. ``ours_<variant>`` for each of ``--variants`` (``plain``: CUDA graphs of the eager step, the
   default; ``compiled``: ``model.compile: default``): start-up (load + captures), ms per decode
   step at B=1 and B=3 (``runner.step`` of ``step_chunk`` steps: wall incl. the host sync and the
   codes copy; and graph replay alone by CUDA events), TTFB (``Pipeline.run`` of a 20-character
   sentence until the first PCM chunk, median of 5), RTF per channel with 1 and 3 channels
   through the BatchEngine, TTFB of a third channel that joins two running ones, peak GPU memory.
3. ``copies``: what one decode chunk (8 steps, B=3) and one vocoder window cost in CUDA kernels
   and host<->device copies (torch profiler): the tensors that cross the PCIe bus per call.
4. ``fidelity``: FP32 (TF32 off) against FP16 / BF16: greedy codes identical for how many steps.

The records (``bench: gpu``, one per variant and batch; ``copies`` and ``fidelity`` ride on the
B=1 records) go to ``bench/results/gpu.jsonl``::

    python -m bench gpu --ckpt /tmp/ckpt_full --variants plain,compiled --calibrate --engine-dir /tmp/eng
    python -m bench gpu --device cpu --size tiny --sections ours   # a dry run of every code path, no GPU

Its per-call first-audio trace and cross-commit bisection answered their question (bench/HISTORY.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from bench import harness

SENTENCE_20 = "今天天气很好我们一起去公园散步吧你说好吗"  # 20 characters, no digits
TEXTS = [SENTENCE_20, "请注意前方路口右转然后直行三百米到达目的地", "明天早上七点有雨出门记得带伞路上注意安全"]
AUDIO_STEPS_PER_S = 46.875


class Report:
    """Accumulates sections; rewrites ``<work>/bench_gpu.json`` after every section."""

    def __init__(self, out: Path):
        self.out, self.data, self.t0 = out, {"sections": {}, "records": [], "errors": {}}, time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def put(self, section: str, value) -> None:
        self.data["sections"][section] = value
        self.save()

    def save(self) -> None:
        (self.out / "bench_gpu.json").write_text(json.dumps(self.data, indent=1, default=str))


def _cfg(ckpt, device, dtype="float16", compile="off", max_batch=3, max_seq=2048, engine_dir=None, **stream):
    from appliance.config import config_from_dict

    model = {"path": str(ckpt), "backend": "torch", "device": device, "dtype": dtype, "threads": 0,
             "max_batch": max_batch, "max_seq_len": max_seq, "max_prompt_tokens": 256, "compile": compile}
    if engine_dir:
        model["engine_dir"] = str(engine_dir)
    return config_from_dict({"model": model, "stream": stream, "synthesis": {"max_new_tokens": 1024}})


def _pipeline(cfg):
    """The production objects: Pipeline.from_config (select -> runner; tokenizer)."""
    from appliance.synth.pipeline import Pipeline

    t = time.perf_counter()
    p = Pipeline.from_config(cfg)
    return p, time.perf_counter() - t


def section_env(rep, args, torch):
    env = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
           "device": args.device, "size": args.size}
    if args.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sm=f"{p.major}.{p.minor}", sms=p.multi_processor_count, cuda=torch.version.cuda)
        n = 1 << 30
        a = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
        b = torch.empty_like(a)
        ev0, ev1, ts = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), []
        for i in range(13):   # 3 warm-up copies
            ev0.record()
            b.copy_(a)
            ev1.record()
            ev1.synchronize()
            ts += [ev0.elapsed_time(ev1) / 1e3] if i >= 3 else []
        env["copy_bw_gbps"] = 2 * n / statistics.median(ts) / 1e9
        del a, b
        torch.cuda.empty_cache()
    rep.put("env", env)
    print(f"[env] {env}", flush=True)
    return env


def _request(text, rid, seed, steps):
    from appliance.core import SynthesisRequest, SynthParams

    return SynthesisRequest(id=rid, text=text, seed=seed, params=SynthParams(min_new_tokens=steps, max_new_tokens=steps))


def _start(r, slot, ids, params, seed):
    r.prefill(slot, ids, None)
    return r.start(slot, params, seed)


def _step_ms(torch, r, b, reps=25):
    """ms per decode step at batch b: runner.step wall (sync + codes copy incl.) and replay alone."""
    from appliance.core import SamplingParams

    rng = np.random.default_rng(0)
    for s in range(b):
        _start(r, s, rng.integers(0, 400, 24), SamplingParams(min_new_tokens=4000, max_new_tokens=4000), s)
    slots = np.arange(b)
    k = 8
    r.step(slots, k)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        r.step(slots, k)
        ts.append((time.perf_counter() - t) / k)
    out = {"ms_per_step": 1e3 * statistics.median(ts), "k": k}
    if torch.cuda.is_available():
        from appliance.engines.torch.cuda_graphs import bucket

        run = r._graph(b, bucket(r.buckets, int(r.pos_host[:b].max()) + 50))
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.inference_mode():
            ev0.record()
            for _ in range(50):
                run()
            ev1.record()
            ev1.synchronize()
        out["replay_ms"] = ev0.elapsed_time(ev1) / 50
    return out


def _ttfb(p, n=5):
    """Pipeline.run of SENTENCE_20 until the first PCM chunk (ms); median of n after one warm run."""
    ts, internal = [], []
    for i in range(n + 1):
        t = time.perf_counter()
        job = p.prepare(_request(SENTENCE_20, f"t{i}", 10 + i, 60))
        it = run = p.run(job)
        next(it)
        dt = 1e3 * (time.perf_counter() - t)
        for _ in it:
            pass
        if i:
            ts.append(dt)
            internal.append(run.report.stats.ttfb_ms)
    return {"ttfb_ms": statistics.median(ts), "ttfb_ms_min": min(ts), "internal_ttfb_ms": statistics.median(internal)}


def _channels(p, n, steps, join_third_at=None):
    """n jobs in the BatchEngine as the scheduler drives it; RTF per channel (wall / audio s) and
    TTFB per channel (add -> first PCM). ``join_third_at``: the last job joins after that many steps."""
    eng = p.engine
    jobs = [p.prepare(_request(TEXTS[i % 3], f"c{i}", 20 + i, steps)) for i in range(n)]
    first, done, samples, added, tasks, t0 = {}, {}, {i: 0 for i in range(n)}, {}, {}, time.perf_counter()

    def sink(i):
        def f(chunk):
            samples[i] += chunk.samples.size
            first.setdefault(i, time.perf_counter())
        return f

    late = n - 1 if join_third_at is not None else None
    for i in range(n):
        if i != late:
            tasks[i] = eng.add(jobs[i], sink(i))
            added[i] = t0
    step = 0
    while len(done) < n:
        if late is not None and late not in tasks and step >= join_third_at:
            tasks[late] = eng.add(jobs[late], sink(late))
            added[late] = time.perf_counter()
        for t in eng.step():
            done[[k for k, v in tasks.items() if v is t][0]] = time.perf_counter()
        step += 1
    return {"rtf": [(done[i] - added[i]) / (samples[i] / 24000) for i in range(n)],
            "ttfb_ms": [1e3 * (first[i] - added[i]) for i in range(n)]}


def section_ours(rep, args, torch, variant):
    key = f"ours_{variant}"
    cfg = _cfg(args.ckpt, args.device, compile={"compiled": "default", "auto": "auto"}.get(variant, "off"),
               max_seq=args.compiled_max_seq if variant in ("compiled", "auto") else 2048,
               engine_dir=args.engine_dir)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    p, load_s = _pipeline(cfg)
    r = p.runner
    res = {"load_s": load_s, "backend": r.info.backend, "compiled": getattr(r, "compiled", None),
           "step_source": getattr(r, "step_source", None),
           "max_seq_len": cfg.model.max_seq_len,
           "lookahead_tokens": p.vocoders[0].lookahead_tokens, "first_chunk_tokens": cfg.stream.first_chunk_tokens}
    print(f"[{key}] loaded in {load_s:.1f} s", flush=True)
    if args.load_only:   # a cold start: the load (compilations, captures) is the measurement
        rep.put(key, res)
        p.close()
        return res
    t = time.perf_counter()
    p.warmup()
    res["warmup_s"] = time.perf_counter() - t
    for b in (1, 3):
        res[f"b{b}"] = _step_ms(torch, r, b)
        print(f"[{key}] B={b}: {res[f'b{b}']}", flush=True)
    res.update(_ttfb(p))
    print(f"[{key}] ttfb {res['ttfb_ms']:.1f} ms (internal {res['internal_ttfb_ms']:.1f})", flush=True)
    if args.calibrate:
        from appliance.build.calibrate import calibrate

        t = time.perf_counter()
        cal = calibrate(p, -60.0)
        res["calibration"] = {"lookahead_tokens": cal.lookahead_tokens, "exact": cal.exact_lookahead,
                              "curve": cal.curve, "s": time.perf_counter() - t,
                              "floor_db": max(s["streaming_floor_db"] for s in cal.sentences)}
        res["ttfb_exact_ms"] = res["ttfb_ms"]
        p.set_lookahead(cal.lookahead_tokens)
        res["lookahead_tokens"] = p.vocoders[0].lookahead_tokens
        res.update(_ttfb(p))
        print(f"[{key}] calibrated look-ahead {cal.lookahead_tokens} (exact {cal.exact_lookahead}, curve {cal.curve}): "
              f"ttfb {res['ttfb_ms']:.1f} ms (exact {res['ttfb_exact_ms']:.1f})", flush=True)
    steps = int(5 * AUDIO_STEPS_PER_S)
    one = _channels(p, 1, steps)
    three = _channels(p, 3, steps)
    join = _channels(p, 3, steps, join_third_at=40)
    res.update(rtf_1ch=one["rtf"][0], rtf_3ch=max(three["rtf"]), ttfb_3ch_ms=three["ttfb_ms"],
               third_join_ttfb_ms=join["ttfb_ms"][2])
    if torch.cuda.is_available():
        res["peak_alloc_mib"] = torch.cuda.max_memory_allocated() / 2**20
        res["peak_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
    res["device_memory_mib"] = p.device_memory_bytes() / 2**20
    print(f"[{key}] rtf 1ch {res['rtf_1ch']:.3f} 3ch {res['rtf_3ch']:.3f}; third channel joining: "
          f"{res['third_join_ttfb_ms']:.1f} ms; peak {res.get('peak_reserved_mib')}", flush=True)
    rep.put(key, res)
    p.close()
    return res


def section_copies(rep, args, torch):
    """Kernels and host<->device copies of one decode chunk and one vocoder window (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from appliance.core import SamplingParams
    from appliance.engines.runner import VocodeWindow

    cfg = _cfg(args.ckpt, args.device)
    p, _ = _pipeline(cfg)
    r = p.runner
    for s in range(3):
        _start(r, s, np.arange(1, 25), SamplingParams(min_new_tokens=500, max_new_tokens=500), s)
    for _ in range(10):
        r.step(np.arange(3), 8)
    w = VocodeWindow(20, 60, 60, 80, 40, 80, 54, 80)

    def window():
        r.vocode(0, w)
    window()
    out = {}
    for name, fn in (("decode chunk (8 steps, B=3)", lambda: r.step(np.arange(3), 8)),
                     ("vocoder window (40 tokens in, 26 spectrum frames out)", window)):
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            fn()
            torch.cuda.synchronize() if torch.cuda.is_available() else None
        kernels = copies_h2d = copies_d2h = 0
        for e in prof.events():
            n = e.name
            if "Memcpy HtoD" in n or "Memcpy HtoD" in n.replace("_", " "):
                copies_h2d += 1
            elif "Memcpy DtoH" in n or "Memcpy DtoH" in n.replace("_", " "):
                copies_d2h += 1
            elif e.device_type.name == "CUDA":
                kernels += 1
        out[name] = {"cuda_kernels": kernels, "h2d_copies": copies_h2d, "d2h_copies": copies_d2h}
        print(f"[copies] {name}: {out[name]}", flush=True)
    rep.put("copies", out)
    p.close()


def section_fidelity(rep, args, torch):
    """FP32 (TF32 off) vs FP16/BF16: greedy codes, 200 steps, through runner.start/step."""
    from appliance.core import SamplingParams
    from appliance.engines.torch.cuda_runner import CudaRunner

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    prompt = np.arange(3, 40)
    params = SamplingParams(greedy=True, min_new_tokens=200, max_new_tokens=200)
    codes = {}
    for dt in ("float32", "float16", "bfloat16"):
        r = CudaRunner(_cfg(args.ckpt, args.device, dtype=dt, max_batch=1, max_seq=512), capture_batches=[1])
        r.prefill(0, prompt, None)
        c = [r.start(0, params, 0)] + [x[0] for _ in range(25) for x in r.step(np.array([0]), 8).copy()]
        codes[dt] = np.array(c[:200])
        r.close()
    diff = {dt: np.nonzero((codes[dt] != codes["float32"]).any(axis=1))[0] for dt in ("float16", "bfloat16")}
    res = {dt: {"identical_steps": int(d[0]) if d.size else 200, "of": 200} for dt, d in diff.items()}
    print(f"[fidelity] {res}", flush=True)
    rep.put("fidelity", res)


def records(rep, args, env) -> list[dict]:
    """The ``bench: gpu`` records of the sections measured (module docstring)."""
    s, recs = rep.data["sections"], []
    hinfo = harness.host(gpu=args.device == "cuda")
    for variant in args.variants.split(","):
        o = s.get(f"ours_{variant}")
        if not isinstance(o, dict) or "b1" not in o:
            continue
        for b in (1, 3):
            ms = o[f"b{b}"]["ms_per_step"]
            extra = {"copies": s.get("copies"), "fidelity": s.get("fidelity")} if b == 1 else {}
            recs.append(harness.record(
                "gpu", checkpoint=args.size, machine=args.machine, host_info=hinfo,
                backend="torch-cuda" + ("-compiled" if o.get("compiled") else "") if args.device == "cuda" else "torch-cpu",
                notes=f"{args.label}: production path (select -> runner, Pipeline, BatchEngine), {variant} step, "
                      f"start-up {o['load_s']:.1f} s; " + ("TTFB = Pipeline.run to first PCM" if b == 1 else
                                                           "TTFB = the third channel joining two running ones"),
                variant=variant, precision="fp16" if args.device == "cuda" else "fp32", batch=b, ms_per_step=ms,
                replay_ms=o[f"b{b}"].get("replay_ms"), steps_per_s=1e3 / ms * b,
                rtf=o["rtf_1ch"] if b == 1 else o["rtf_3ch"],
                ttfb_ms=o["ttfb_ms"] if b == 1 else o["third_join_ttfb_ms"], ttfb_exact_ms=o.get("ttfb_exact_ms"),
                peak_mem_mib=o.get("peak_reserved_mib"), max_seq_len=o.get("max_seq_len"), load_s=o["load_s"],
                lookahead_tokens=o["lookahead_tokens"], first_chunk_tokens=o["first_chunk_tokens"],
                copy_bw_gbps=env.get("copy_bw_gbps"), **extra))
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/bench_gpu", help="the sections' raw JSON, the checkpoint if written")
    ap.add_argument("--ckpt", default=None, help="checkpoint dir (written with random weights if missing)")
    ap.add_argument("--size", default="full", choices=("full", "tiny"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--variants", default="plain,compiled")
    ap.add_argument("--sections", default="ours,copies,fidelity")
    ap.add_argument("--label", default="this tree", help="what the records' notes call the tree measured")
    ap.add_argument("--calibrate", action="store_true", help="calibrate the look-ahead, then measure with it too")
    ap.add_argument("--load-only", action="store_true", help="measure the start-up only (cold compile cache)")
    ap.add_argument("--engine-dir", default=None, help="engine dir (calibration record, compile cache)")
    ap.add_argument("--compiled-max-seq", type=int, default=2048,
                    help="KV length of the compiled variant (fewer attention buckets: fewer compilations)")
    ap.add_argument("--budget-s", type=float, default=400.0, help="skip later sections past this many seconds")
    harness.add_common(ap)
    args = ap.parse_args(argv)
    import torch

    rep = Report(Path(args.work))
    if args.ckpt is None or not (Path(args.ckpt) / "asset").is_dir():
        from appliance.build.random_ckpt import write_random_checkpoint

        args.ckpt = args.ckpt or str(Path(args.work) / f"ckpt_{args.size}")
        write_random_checkpoint(args.ckpt, args.size, seed=0)
    env = section_env(rep, args, torch)
    plan = [(f"ours_{v}", lambda v=v: section_ours(rep, args, torch, v)) for v in args.variants.split(",")
            if "ours" in args.sections]
    if "copies" in args.sections:
        plan.append(("copies", lambda: section_copies(rep, args, torch)))
    if "fidelity" in args.sections:
        plan.append(("fidelity", lambda: section_fidelity(rep, args, torch)))
    for name, fn in plan:
        if rep.elapsed() > args.budget_s:
            rep.data["errors"][name] = f"skipped: budget {args.budget_s} s spent"
            continue
        try:
            fn()
        except Exception:  # one section's failure must not lose the others
            rep.data["errors"][name] = traceback.format_exc()
            print(f"[{name}] FAILED\n{traceback.format_exc()}", flush=True)
            rep.save()
    recs = [] if args.load_only else records(rep, args, env)
    rep.data["records"] = recs
    rep.save()
    harness.write(recs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
