"""GPU benchmark: our CudaRunner against upstream ChatTTS 0.2.5, same random weights, one process.

Run through the device tool in ONE call (see bench/RESULTS.md for the command). Sections, each
written to ``OUT/bench_gpu.json`` as soon as it is done (a timeout still leaves data):

1. ``env``: versions, GPU, device-to-device copy bandwidth (bytes read + written / time).
2. ``ours``: CudaRunner FP16 with plain CUDA graphs (what ``runtime/select.py`` builds): ms per
   decode step at B=1 and B=3 (``decode_many`` wall per step incl. the host sync and copies, and
   graph replay alone by CUDA events), fidelity against FP32 (greedy codes for
   ``--greedy-steps``, logits along the FP32 path), TTFB for a 20-character sentence (prefill ->
   first exact PCM of the windowed Decoder/Vocos) with the time of each runner call before it and
   for several ``stream.first_chunk_tokens`` (``--first-chunks``), RTF per channel with 1 and 3
   channels, peak GPU memory (allocated and reserved) and the allocator's segments per stream/pool,
   the weight-read floor and our ratio to it, what a step is made of (kernels per step and the
   top kernels by time, sampler alone, attention span).
3. ``compiled``: the same for the step body through ``torch.compile`` (each of
   ``--compile-modes``) captured in our graphs, B=1 and B=3 over one bucket
   (``--compiled-max-seq``).
4. ``upstream``: ``chattts`` 0.2.5 on the same checkpoint, FP32 eager as shipped: ms per step
   (GPT ``generate`` at two lengths, difference / steps), TTFB (``infer(stream=True)`` first
   non-empty chunk), RTF with 1 and 3 texts, peak memory. ``--upstream-json`` reuses the upstream
   numbers of an earlier raw JSON in the records instead (marked as reused).
5. ``fidelity``: FP32 reference (TF32 off) vs FP16 / BF16 / INT8 / FP8: prefill logits relative
   error, greedy codes through 200+ steps (identical, or the first divergence step and the
   FP32 top-1 minus top-2 gap there), and step time of each precision.

Usage: ``python bench/bench_gpu.py --out DIR [--ckpt DIR] [--size full|tiny] [--device cuda|cpu]
[--no-upstream] [--sections ours,compiled,upstream,fidelity] [--compile-modes default,...]
[--upstream-json RAW] [--steps 200] [--budget-s 420]``. On a machine without a GPU ``--device cpu
--size tiny --no-upstream`` dry-runs every code path of ours (eager seam).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata as md
import json
import logging
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SENTENCE_20 = "今天天气很好我们一起去公园散步吧你说好吗"  # 20 characters, no digits (no wetext)
AUDIO_STEPS_PER_S = 46.875
log = logging.getLogger("bench_gpu")
GRAPHS = {"on": None}  # set to False when capture failed once (later runners then run eager)


def _v(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "absent"


class Report:
    """Accumulates sections and records; rewrites the JSON after every section."""

    def __init__(self, out: Path):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.data = {"sections": {}, "records": [], "errors": {}}
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def put(self, section: str, value) -> None:
        self.data["sections"][section] = value
        self.save()

    def error(self, section: str, e: BaseException) -> None:
        self.data["errors"][section] = "".join(traceback.format_exception(e))[-4000:]
        print(f"[{section}] FAILED: {e!r}", flush=True)
        self.save()

    def save(self) -> None:
        tmp = self.out / "bench_gpu.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1, default=float))
        tmp.replace(self.out / "bench_gpu.json")


def _cfg(ckpt, device, dtype, max_batch=3, max_seq=2048):
    from appliance.config import config_from_dict

    return config_from_dict({"model": {"path": str(ckpt), "backend": "torch", "device": device, "dtype": dtype,
                                       "threads": 0, "max_batch": max_batch, "max_seq_len": max_seq,
                                       "max_prompt_tokens": 256}})


def _sync(torch, dev):
    if dev == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------- env

def section_env(rep, args, torch):
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
           "chattts": _v("chattts"), "transformers": _v("transformers"), "vocos": _v("vocos"),
           "device": args.device, "size": args.size}
    if args.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sm=f"{p.major}.{p.minor}", sms=p.multi_processor_count, gpu_mem_gib=p.total_memory / 2**30,
                   cuda=torch.version.cuda)
        n = 1 << 30
        a = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
        b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(10):
            ev0.record()
            b.copy_(a)
            ev1.record()
            ev1.synchronize()
            ts.append(ev0.elapsed_time(ev1) / 1e3)
        env["copy_bw_gbps"] = 2 * n / statistics.median(ts) / 1e9  # read + write
        del a, b
        torch.cuda.empty_cache()
    else:
        env["copy_bw_gbps"] = None
    rep.put("env", env)
    print(f"[env] {env}", flush=True)
    return env


# --------------------------------------------------------------------------------------- ours

def _prompts(tok, n, text=SENTENCE_20):
    from appliance.text.tokenizer import Tokenizer

    return [tok.encode(Tokenizer.prompt_text(text, with_speaker=True, prompt="[speed_5]")) for _ in range(n)]


def _time_steps(torch, r, dev, b, prompt, k=16, reps=12):
    """ms per step at batch b: decode_many wall (sync + copies included) and graph replay alone."""
    from appliance.core import SamplingParams

    for s in range(b):
        r.prefill(s, prompt, None)
        r.begin(s, SamplingParams(min_new_tokens=2000, max_new_tokens=2000), seed=s)
    slots = np.arange(b)
    r.decode_many(slots, k)  # warm (also permutes rows if needed)
    walls = []
    for _ in range(reps):
        t = time.perf_counter()
        r.decode_many(slots, k)
        walls.append((time.perf_counter() - t) * 1e3 / k)
    top = int(r.pos_host[:b].max())
    L = r._bucket(top + k)
    run = r._graph(b, L)
    replay = None
    if dev == "cuda":
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(5):
            r.pos[:b] = int(r.pos_host[:b].min())  # stay inside the bucket; KV content is irrelevant here
            r.t.zero_()
            ev0.record()
            for _ in range(k):
                run()
            ev1.record()
            ev1.synchronize()
            ts.append(ev0.elapsed_time(ev1) / k)
        replay = statistics.median(ts)
    return {"ms_per_step": statistics.median(walls), "ms_per_step_min": min(walls), "replay_ms": replay,
            "bucket": L, "pos": top, "chunk": k}


class _Timers:
    """Wraps runner methods on the instance to sum their wall time (s) until the first PCM."""

    NAMES = ("prefill", "begin", "decode_many", "decoder", "vocos")

    def __init__(self, r):
        self.r, self.t, self.n, self.on = r, dict.fromkeys(self.NAMES, 0.0), dict.fromkeys(self.NAMES, 0), True
        for name in self.NAMES:
            fn = getattr(r, name)

            def wrap(*a, _fn=fn, _name=name, **k):
                t = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    if self.on:
                        self.t[_name] += time.perf_counter() - t
                        self.n[_name] += 1
            setattr(r, name, wrap)

    def remove(self):
        for name in self.NAMES:
            delattr(self.r, name)


def _run_channels(r, prompts, spk, steps, chunk_first=12, chunk=24, breakdown=None):
    """n channels decoded together to the end: (ttfb_s of channel 0, wall_s, audio_s per channel).

    ``chunk_first`` is ``stream.first_chunk_tokens`` (decode steps past the lookahead in the first
    push). With ``breakdown`` (a dict) the wall time of each runner call before the first PCM and
    the host ISTFT/bookkeeping rest are written into it (ms)."""
    from appliance.core import SamplingParams
    from appliance.synth.decode_loop import DecodeLoop, Sequence
    from appliance.synth.vocoder import WindowedVocoder

    tm = _Timers(r) if breakdown is not None else None
    loop = DecodeLoop(r, device_chunk=8)
    n = len(prompts)
    vocs = [WindowedVocoder(r, steps + 8) for _ in range(n)]
    seqs = [Sequence(ids=p, spk_emb=spk, params=SamplingParams(min_new_tokens=steps, max_new_tokens=steps), seed=i)
            for i, p in enumerate(prompts)]
    pending = [[] for _ in range(n)]
    emitted = [0] * n
    samples = [0] * n
    ttfb = None
    look = vocs[0].lookahead_tokens
    t0 = time.perf_counter()
    for i, s in enumerate(seqs):
        h = loop.join(s)
        if h is not None:
            pending[i].append(h[None])
    while loop.active:
        got, hidden = loop.step()
        for j, s in enumerate(got):
            i = seqs.index(s)
            pending[i].append(hidden[j:j + 1])
            target = chunk_first if emitted[i] == 0 else chunk
            if s.steps - look - emitted[i] >= target:
                pcm = vocs[i].push(np.concatenate(pending[i]))
                pending[i].clear()
                emitted[i] = max(0, s.steps - look)
                samples[i] += pcm.size
                if pcm.size and ttfb is None and i == 0:
                    ttfb = time.perf_counter() - t0
                    if tm is not None:
                        tm.on = False
                        breakdown.update({f"{k}_ms": v * 1e3 for k, v in tm.t.items()})
                        breakdown.update({f"{k}_calls": v for k, v in tm.n.items()})
                        breakdown["ttfb_ms"] = ttfb * 1e3
                        breakdown["steps_at_first_pcm"] = s.steps
                        breakdown["rest_ms"] = ttfb * 1e3 - sum(v * 1e3 for v in tm.t.values())
    for i in range(n):
        if pending[i]:
            samples[i] += vocs[i].push(np.concatenate(pending[i])).size
        samples[i] += vocs[i].finish().size
    wall = time.perf_counter() - t0
    if tm is not None:
        tm.remove()
    return ttfb if ttfb is not None else wall, wall, [x / 24000 for x in samples], [s.steps for s in seqs]


def _kernels_per_step(torch, r, b, L):
    try:
        from torch.profiler import ProfilerActivity, profile

        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as p:
            r._body(b, L)
            torch.cuda.synchronize()
        return sum(1 for e in p.events() if e.device_type.name == "CUDA")
    except Exception as e:  # profiler unavailable: not essential
        return f"n/a ({e})"


def _kernel_table(torch, r, b, L, top=14):
    """CUDA kernels of one step (the step body run outside the graph, same kernels): count, sum of
    kernel durations (us) and the top kernels by total time. Sum << graph replay time means the
    gaps between graph nodes bound the step; sum ~ replay means the kernels themselves do."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with torch.inference_mode():
            r._body(b, L)  # warm
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                r._body(b, L)
                torch.cuda.synchronize()
        agg = {}
        for e in p.events():
            if e.device_type.name != "CUDA":
                continue
            us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            a = agg.setdefault(e.name[:90], [0, 0.0])
            a[0] += 1
            a[1] += us
        rows = sorted(agg.items(), key=lambda kv: -kv[1][1])
        return {"kernels": sum(v[0] for v in agg.values()), "kernel_us_sum": sum(v[1] for v in agg.values()),
                "top": [{"name": k, "n": v[0], "us": round(v[1], 1)} for k, v in rows[:top]]}
    except Exception as e:  # profiler unavailable: not essential
        return f"n/a ({e!r})"


def _sampler_ms(torch, r, b):
    """Graph replay time of the device sampler alone for b rows (ms)."""
    s = r.sampler
    logits = torch.randn(b, r.shapes.num_vq, r.shapes.num_audio_tokens, device="cuda")
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    saved = [x.clone() for x in s.state()]
    with torch.cuda.stream(st):
        s.sample(logits, slice(0, b))
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        s.sample(logits, slice(0, b))
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    for _ in range(50):
        g.replay()
    ev1.record()
    ev1.synchronize()
    for x, y in zip(s.state(), saved):
        x.copy_(y)
    return ev0.elapsed_time(ev1) / 50


def _mem_segments(torch):
    """Allocated / reserved MiB per (stream, memory pool) from the caching allocator's snapshot:
    the default-stream pool, the warm-up stream's (cuBLAS workspace), the graph pool."""
    out = {}
    try:
        for seg in torch.cuda.memory_snapshot():
            key = f"stream {seg.get('stream')} pool {tuple(seg.get('segment_pool_id', (0, 0)))}"
            e = out.setdefault(key, {"reserved_mib": 0.0, "allocated_mib": 0.0, "segments": 0, "big_blocks_mib": []})
            e["reserved_mib"] += seg["total_size"] / 2**20
            e["allocated_mib"] += seg["allocated_size"] / 2**20
            e["segments"] += 1
            for b in seg.get("blocks", []):
                if b.get("state") == "active_allocated" and b["size"] >= 4 << 20:
                    e["big_blocks_mib"].append(round(b["size"] / 2**20, 2))
        for e in out.values():
            e["big_blocks_mib"] = sorted(e["big_blocks_mib"], reverse=True)[:24]
    except Exception as e:  # diagnostics only
        out["error"] = repr(e)
    return out


def _greedy_codes(r, prompt, spk, n):
    from appliance.core import SamplingParams

    p = SamplingParams(greedy=True, min_new_tokens=n, max_new_tokens=n)
    pl, _ = r.prefill(0, prompt, spk)
    pl = pl.copy()
    codes = [r.begin(0, p, 0).copy()]
    while len(codes) < n:
        c, _ = r.decode_many(np.array([0]), min(16, n - len(codes)))
        codes.extend(c[:, 0].copy())
    return pl, np.array(codes)


def _logits_along(r, prompt, spk, codes):
    lg, _ = r.prefill(0, prompt, spk)
    out = [lg.copy()]
    for i in range(len(codes) - 1):
        lg, _ = r.decode(np.array([0]), codes[i:i + 1], np.array([len(prompt) + i]))
        out.append(lg[0].copy())
    return np.array(out)


def fp32_reference(args, torch, prompt):
    """FP32 (TF32 off) greedy codes (device sampler, penalty on) and the logits along them."""
    from appliance.engines.cuda_runner import CudaRunner
    from appliance.text.speaker import resolve_voice

    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    r = CudaRunner(_cfg(args.ckpt, args.device, "float32", max_batch=1, max_seq=512), buckets=[512])
    spk = resolve_voice("seed:2", r.info.hidden_size)
    _, codes = _greedy_codes(r, prompt, spk, args.greedy_steps)
    logits = _logits_along(r, prompt, spk, codes)
    r.close()
    del r
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {"codes": codes, "logits": logits, "spk": spk}


def _fidelity_vs(r, ref, prompt):
    """Greedy codes and logits of runner ``r`` against the FP32 reference (same prompt/voice)."""
    _, codes = _greedy_codes(r, prompt, ref["spk"], len(ref["codes"]))
    lg = _logits_along(r, prompt, ref["spk"], ref["codes"])
    l32 = ref["logits"]
    rel = [float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(lg, l32)]
    same = (codes == ref["codes"]).all(axis=1)
    first = None if same.all() else int(np.argmin(same))
    out = {"greedy_steps": int(len(same)), "greedy_identical_steps": int(len(same)) if first is None else first,
           "first_divergence": first, "logits_rel_l2_max": max(rel), "prefill_logits_rel_l2": rel[0]}
    if first is not None:
        srt = np.sort(l32[first], -1)
        out["fp32_gap_at_divergence"] = (srt[:, -1] - srt[:, -2]).tolist()
        out["fp32_logit_absmax"] = float(np.abs(l32).max())
    return out


def _ttfb(r, tok, spk, chunk_first, n=5):
    """Median TTFB (ms) over n runs and the breakdown of the median run."""
    runs = []
    for _ in range(n):
        bd = {}
        _run_channels(r, _prompts(tok, 1), spk, 90, chunk_first=chunk_first, breakdown=bd)
        runs.append(bd)
    runs.sort(key=lambda d: d.get("ttfb_ms", 1e9))
    med = runs[len(runs) // 2]
    return {"ttfb_ms": med.get("ttfb_ms"), "all_ms": [d.get("ttfb_ms") for d in runs], "breakdown": med}


def section_ours(rep, args, torch, env, dtype="float16", compile=None, key=None, max_seq=2048, buckets=None,
                 capture_batches=None, fidelity_ref=None, compile_dynamic=False):
    from appliance.engines.cuda_runner import CudaRunner
    from appliance.text.speaker import resolve_voice
    from appliance.text.tokenizer import Tokenizer

    dev = args.device
    key = key or f"ours_{dtype}"
    if dev == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    kw = dict(compile=compile or False, buckets=buckets, capture_batches=capture_batches)
    if compile_dynamic:
        kw["compile_dynamic"] = True
    cfg = _cfg(args.ckpt, dev, dtype, max_seq=max_seq)
    try:
        r = CudaRunner(cfg, **kw)
    except Exception as e:  # keep going with eager steps so the section still gives numbers
        if compile:
            raise
        rep.error(f"{key}_graph_capture", e)
        GRAPHS["on"] = False
        r = CudaRunner(cfg, graphs=False, **kw)
    _sync(torch, dev)
    load_s = time.perf_counter() - t
    res = {"precision": r.info.precision, "compile": r.compiled, "load_s": load_s, "graphs": r.seam.cuda,
           "buckets": r.buckets, "max_seq_len": max_seq,
           "captures": len(r.seam.captures), "weight_mib": r.info.weight_bytes / 2**20,
           "step_weight_mib": r.step_weight_bytes / 2**20,
           "kv_mib": r.kv_bytes / 2**20}
    if dev == "cuda":
        res["mem_before_capture_mib"] = r.mem_before_capture / 2**20
        res["mem_after_load_mib"] = torch.cuda.memory_allocated() / 2**20
        res["peak_load_mib"] = torch.cuda.max_memory_allocated() / 2**20
        res["reserved_after_load_mib"] = torch.cuda.memory_reserved() / 2**20
        res["mem_segments_after_load"] = _mem_segments(torch)
    rep.put(key, res)
    print(f"[{key}] loaded in {load_s:.1f} s: {({k: v for k, v in res.items() if 'segments' not in k})}", flush=True)
    tok = Tokenizer.from_dir(Path(args.ckpt) / "asset" / "tokenizer")
    spk = resolve_voice("seed:2", r.info.hidden_size)
    prompt = _prompts(tok, 1)[0]
    res["prompt_tokens"] = int(len(prompt))
    for b in (1, 3):
        res[f"b{b}"] = _time_steps(torch, r, dev, b, prompt)
        print(f"[{key}] B={b}: {res[f'b{b}']}", flush=True)
        rep.put(key, res)
    if fidelity_ref is not None:
        try:
            res["fidelity_vs_fp32"] = _fidelity_vs(r, fidelity_ref, prompt)
            print(f"[{key}] fidelity: {res['fidelity_vs_fp32']}", flush=True)
        except Exception as e:
            rep.error(f"{key}_fidelity", e)
        rep.put(key, res)
    # TTFB (20-char sentence) and RTF with 1 / 3 channels, peak memory with three channels
    _run_channels(r, _prompts(tok, 1), spk, 80)  # warm-up: decoder/vocos kernels, cuDNN plans
    tt = _ttfb(r, tok, spk, 12)
    res["ttfb_ms"], res["ttfb_all_ms"], res["ttfb_breakdown"] = tt["ttfb_ms"], tt["all_ms"], tt["breakdown"]
    print(f"[{key}] TTFB (first chunk 12): {tt}", flush=True)
    rep.put(key, res)
    for fc in args.first_chunks:
        tt = _ttfb(r, tok, spk, fc, n=3)
        res[f"ttfb_first_chunk_{fc}"] = tt
        print(f"[{key}] TTFB (first chunk {fc}): {tt['ttfb_ms']}", flush=True)
    res["lookahead_tokens"] = (r.info.decoder_rf + r.info.vocos_rf + 3) // 2 + 1
    steps = args.rtf_steps
    for n in (1, 3):
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        _, wall, audio, st = _run_channels(r, _prompts(tok, n), spk, steps)
        res[f"rtf_{n}ch"] = wall / min(audio)
        res[f"rtf_{n}ch_detail"] = {"wall_s": wall, "audio_s": audio, "steps": st}
        if dev == "cuda":
            res[f"peak_{n}ch_mib"] = torch.cuda.max_memory_allocated() / 2**20
            res[f"peak_reserved_{n}ch_mib"] = torch.cuda.max_memory_reserved() / 2**20
        print(f"[{key}] {n} channel(s): RTF {res[f'rtf_{n}ch']:.4f} {res[f'rtf_{n}ch_detail']}", flush=True)
        rep.put(key, res)
    if dev == "cuda":
        res["peak_overall_mib"] = max(res["peak_load_mib"], res["peak_3ch_mib"])
        bw = env.get("copy_bw_gbps")
        res["floor_ms"] = r.step_weight_bytes / (bw * 1e9) * 1e3 if bw else None
        if res["floor_ms"]:
            res["ratio_to_floor_b1"] = res["b1"]["ms_per_step"] / res["floor_ms"]
        res["kernels_per_step_b1"] = _kernels_per_step(torch, r, 1, r.buckets[0])
        for b in (1, 3):
            res[f"kernel_table_b{b}"] = _kernel_table(torch, r, b, r.buckets[0])
        rep.put(key, res)
        res["sampler_ms_b1"] = _sampler_ms(torch, r, 1)
        res["sampler_ms_b3"] = _sampler_ms(torch, r, 3)
        # attention span: replay at the smallest and the largest bucket (B=1)
        spans = {}
        for L in (r.buckets[0], r.buckets[-1]):
            run = r._graph(1, L)
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            r.pos[:1] = 10
            ev0.record()
            for _ in range(20):
                run()
            ev1.record()
            ev1.synchronize()
            spans[str(L)] = ev0.elapsed_time(ev1) / 20
        res["replay_ms_by_span_b1"] = spans
        res["mem_segments_end"] = _mem_segments(torch)
    rep.put(key, res)
    r.close()
    del r
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return res


# --------------------------------------------------------------------------------------- upstream

def section_upstream(rep, args, torch):
    import ChatTTS

    asset = Path(args.ckpt) / "asset"
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    chat = ChatTTS.Chat()
    t = time.perf_counter()
    ok = chat._load(vocos_ckpt_path=str(asset / "Vocos.safetensors"), dvae_ckpt_path=str(asset / "DVAE.safetensors"),
                    gpt_ckpt_path=str(asset / "gpt"), embed_path=str(asset / "Embed.safetensors"),
                    decoder_ckpt_path=str(asset / "Decoder.safetensors"), tokenizer_path=str(asset / "tokenizer"),
                    device=torch.device("cuda"), compile=False)
    torch.cuda.synchronize()
    res = {"load_s": time.perf_counter() - t, "loaded": bool(ok), "dtype": str(next(chat.gpt.parameters()).dtype),
           "mem_after_load_mib": torch.cuda.memory_allocated() / 2**20}
    spk = chat.sample_random_speaker()

    def params(n):
        p = ChatTTS.Chat.InferCodeParams(spk_emb=spk, temperature=0.3, top_P=0.7, top_K=20, repetition_penalty=1.05,
                                         max_new_token=n, min_new_token=n)
        p.show_tqdm = False
        p.ensure_non_empty = False
        p.manual_seed = 0
        return p

    def gen(texts, n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in chat._infer_code(texts, False, chat.device, True, params(n)):
            pass
        torch.cuda.synchronize()
        return time.perf_counter() - t

    text = SENTENCE_20
    gen([text], 10)  # warm-up
    for b in (1, 3):
        n1, n2 = 40, 40 + args.steps
        t1, t2 = gen([text] * b, n1), gen([text] * b, n2)
        res[f"b{b}"] = {"ms_per_step": (t2 - t1) / (n2 - n1) * 1e3, "t_short_s": t1, "t_long_s": t2, "n": [n1, n2]}
        print(f"[upstream] B={b}: {res[f'b{b}']}", flush=True)
        rep.put("upstream", res)
    kw = dict(skip_refine_text=True, do_text_normalization=False, do_homophone_replacement=False, split_text=False)
    ttfbs = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for chunk in chat.infer([text], stream=True, params_infer_code=params(150), **kw):
            w = chunk[0] if isinstance(chunk, (list, tuple)) else chunk
            if w is not None and np.size(w) and np.abs(np.asarray(w)).max() > 0:
                break
        ttfbs.append((time.perf_counter() - t) * 1e3)
    res["ttfb_ms"] = statistics.median(ttfbs)
    res["ttfb_all_ms"] = ttfbs
    rep.put("upstream", res)
    steps = args.rtf_steps
    for n in (1, 3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        chat.infer([text] * n, stream=False, params_infer_code=params(steps), **kw)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        res[f"rtf_{n}ch"] = wall / (steps / AUDIO_STEPS_PER_S)
        print(f"[upstream] {n} text(s): wall {wall:.2f} s, RTF {res[f'rtf_{n}ch']:.3f}", flush=True)
        rep.put("upstream", res)
    res["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    res["peak_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
    rep.put("upstream", res)
    chat = None  # free it before the next section
    gc.collect()
    torch.cuda.empty_cache()
    return res


# --------------------------------------------------------------------------------------- fidelity

def section_fidelity(rep, args, torch, rep_key="fidelity"):
    from appliance.core import SamplingParams
    from appliance.engines.cuda_runner import CudaRunner
    from appliance.text.speaker import resolve_voice
    from appliance.text.tokenizer import Tokenizer

    dev = args.device
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    tok = Tokenizer.from_dir(Path(args.ckpt) / "asset" / "tokenizer")
    prompt = _prompts(tok, 1)[0]
    n = args.greedy_steps
    greedy = SamplingParams(greedy=True, min_new_tokens=n, max_new_tokens=n)

    def run(dtype, quant=None):
        r = CudaRunner(_cfg(args.ckpt, dev, dtype, max_batch=3, max_seq=1024), quant=quant, buckets=[512, 1024],
                       graphs=GRAPHS["on"])
        spk = resolve_voice("seed:2", r.info.hidden_size)
        pl, _ = r.prefill(0, prompt, spk)
        pl = pl.copy()
        c0 = r.begin(0, greedy, 0)
        codes = [c0.copy()]  # greedy codes from the device sampler (penalty included), decode_many path
        left = n - 1
        while left > 0:
            c, _ = r.decode_many(np.array([0]), min(16, left))
            codes.extend(c[:, 0].copy())
            left -= c.shape[0]
        t = _time_steps(torch, r, dev, 1, prompt, reps=4)["ms_per_step"]
        t3 = _time_steps(torch, r, dev, 3, prompt, reps=4)["ms_per_step"]
        # logits along the reference's greedy path, through the plain decode()
        r2 = r
        out = {"prefill_logits": pl, "codes": np.array(codes), "ms_b1": t, "ms_b3": t3,
               "weight_mib": r.info.weight_bytes / 2**20, "step_weight_mib": r.step_weight_bytes / 2**20}
        r2.close()
        del r, r2
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
        return out

    def logits_along(dtype, quant, path_codes, spk_np):
        r = CudaRunner(_cfg(args.ckpt, dev, dtype, max_batch=1, max_seq=1024), quant=quant, buckets=[512, 1024])
        lg, _ = r.prefill(0, prompt, spk_np)
        outs = [lg.copy()]
        t0 = len(prompt)
        for i in range(min(len(path_codes) - 1, 60)):
            lg, _ = r.decode(np.array([0]), path_codes[i:i + 1], np.array([t0 + i]))
            outs.append(lg[0].copy())
        r.close()
        del r
        gc.collect()
        return np.array(outs)

    res = {}
    ref = run("float32")
    spk_np = resolve_voice("seed:2", 768 if args.size == "full" else 64)
    ref_logits = logits_along("float32", None, ref["codes"], spk_np)
    res["fp32"] = {"ms_b1": ref["ms_b1"], "ms_b3": ref["ms_b3"], "weight_mib": ref["weight_mib"]}
    rep.put(rep_key, res)
    for name, dtype, quant in (("fp16", "float16", None), ("bf16", "bfloat16", None), ("int8", "float16", "int8"),
                               ("fp8", "float16", "fp8")):
        if args.budget_s and rep.elapsed() > args.budget_s:
            res[name] = "skipped: time budget"
            continue
        try:
            o = run(dtype, quant)
            lg = logits_along(dtype, quant, ref["codes"], spk_np)
            rel_pf = float(np.linalg.norm(o["prefill_logits"] - ref["prefill_logits"]) / np.linalg.norm(ref["prefill_logits"]))
            rel_steps = [float(np.linalg.norm(lg[i] - ref_logits[i]) / np.linalg.norm(ref_logits[i])) for i in range(len(lg))]
            rel_max = [float(np.abs(lg[i] - ref_logits[i]).max() / np.abs(ref_logits[i]).max()) for i in range(len(lg))]
            same = (o["codes"] == ref["codes"]).all(axis=1)
            first = int(np.argmin(same)) if not same.all() else None
            entry = {"prefill_logits_rel_l2": rel_pf, "step_logits_rel_l2_max": max(rel_steps),
                     "step_logits_rel_maxabs_max": max(rel_max), "greedy_steps": int(len(same)),
                     "greedy_identical_steps": int(len(same)) if first is None else first,
                     "first_divergence": first, "ms_b1": o["ms_b1"], "ms_b3": o["ms_b3"],
                     "weight_mib": o["weight_mib"], "step_weight_mib": o["step_weight_mib"]}
            if first is not None and first < len(ref_logits):
                l32 = np.sort(ref_logits[first], -1)
                entry["fp32_gap_at_divergence"] = (l32[:, -1] - l32[:, -2]).tolist()
            res[name] = entry
            print(f"[fidelity] {name}: {entry}", flush=True)
        except Exception as e:  # one precision failing must not lose the others
            res[name] = f"failed: {e!r}"
            rep.error(f"fidelity_{name}", e)
        rep.put(rep_key, res)
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    return res


# --------------------------------------------------------------------------------------- compiled

def section_compiled(rep, args, torch, env, ref):
    """The step body through ``torch.compile`` (each mode of ``--compile-modes``), captured in our
    graphs for B=1 and B=3 over one attention bucket (``--compiled-max-seq``): the same
    measurements as ``ours`` plus fidelity against FP32."""
    out = {}
    for mode in args.compile_modes:
        if args.budget_s and rep.elapsed() > args.budget_s:
            rep.data["errors"][f"compiled_{mode}"] = f"skipped: {rep.elapsed():.0f} s elapsed > budget"
            continue
        L = args.compiled_max_seq
        try:
            if args.compile_dynamic:  # the production shape: every (b, L) of a 2048 cache, symbolic sizes
                out[mode] = section_ours(rep, args, torch, env, "float16", compile=mode,
                                         key=f"compiled_{mode}_dynamic", fidelity_ref=ref, compile_dynamic=True)
                continue
            out[mode] = section_ours(rep, args, torch, env, "float16", compile=mode, key=f"compiled_{mode}",
                                     max_seq=L, buckets=[L], capture_batches=[1, 3], fidelity_ref=ref)
        except Exception as e:
            rep.error(f"compiled_{mode}", e)
        records(rep, args, env)
    return out


# --------------------------------------------------------------------------------------- records

def records(rep, args, env):
    s = rep.data["sections"]
    date = env["date"][:10]
    machine = "h200" if args.device == "cuda" and "H200" in str(env.get("gpu", "")) else (
        "cpu-2core" if args.device == "cpu" else str(env.get("gpu", "gpu")).lower().replace(" ", "-"))
    up = s.get("upstream", {}) if isinstance(s.get("upstream"), dict) else {}
    recs = []

    def rec(backend, precision, batch, ms, rtf=None, ttfb=None, peak=None, base=None, notes=""):
        recs.append({"bench": "gpu", "date": date, "machine": machine, "backend": backend, "precision": precision,
                     "checkpoint": args.size, "batch": batch, "ms_per_step": ms,
                     "steps_per_s": (1e3 / ms * batch) if ms else None, "rtf": rtf, "ttfb_ms": ttfb,
                     "peak_mem_mib": peak, "baseline_ms_per_step": base, "notes": notes})

    o = s.get("ours_float16")
    if isinstance(up, dict) and not up and args.upstream_from:
        up = args.upstream_from
    if isinstance(o, dict) and "b1" in o:
        for b in (1, 3):
            if f"b{b}" not in o:
                continue
            ub = up.get(f"b{b}", {}).get("ms_per_step")
            rec("torch-cuda", "fp16", b, o[f"b{b}"]["ms_per_step"], rtf=o.get(f"rtf_{b}ch"),
                ttfb=o.get("ttfb_ms") if b == 1 else None, peak=o.get(f"peak_{b}ch_mib"), base=ub,
                notes=f"CUDA graph per (batch, kv bucket), on-device sampling, decode_many k=16 wall incl. sync; "
                      f"replay {o[f'b{b}'].get('replay_ms')} ms; floor {o.get('floor_ms')} ms; "
                      f"upstream ttfb {up.get('ttfb_ms')} ms rtf {up.get(f'rtf_{b}ch')}")
    for b in (1, 3):
        if f"b{b}" in up:
            rec("upstream-chattts", "fp32", b, up[f"b{b}"]["ms_per_step"], rtf=up.get(f"rtf_{b}ch"),
                ttfb=up.get("ttfb_ms") if b == 1 else None, peak=up.get("peak_mib"), base=up[f"b{b}"]["ms_per_step"],
                notes="chattts 0.2.5 eager FP32 as shipped, same random weights, same process"
                + (f" (NOT re-run: reused from the run of {up['reused_from']})" if up.get("reused_from") else ""))
    f = s.get("fidelity", {})
    for name in ("fp32", "bf16", "int8", "fp8"):
        e = f.get(name)
        if isinstance(e, dict):
            for b in (1, 3):
                rec("torch-cuda", name, b, e.get(f"ms_b{b}"), base=up.get(f"b{b}", {}).get("ms_per_step"),
                    notes=f"fidelity vs fp32: {json.dumps({k: v for k, v in e.items() if 'ms' not in k})}")
    for key, c in s.items():
        if not key.startswith("compiled_") or not isinstance(c, dict):
            continue
        for b in (1, 3):
            if f"b{b}" in c:
                rec("torch-cuda-compiled", "fp16", b, c[f"b{b}"]["ms_per_step"], rtf=c.get(f"rtf_{b}ch"),
                    ttfb=c.get("ttfb_ms") if b == 1 else None, peak=c.get(f"peak_{b}ch_mib"),
                    base=up.get(f"b{b}", {}).get("ms_per_step"),
                    notes=f"torch.compile mode {key[9:]} of the step body inside our CUDA graph (KV {c.get('max_seq_len')} "
                          f"positions); replay {c[f'b{b}'].get('replay_ms')} ms; compile+capture {c.get('load_s')} s; "
                          f"fidelity vs fp32 {json.dumps(c.get('fidelity_vs_fp32'))}")
    rep.data["records"] = recs
    rep.save()
    return recs


def table(rep):
    s = rep.data["sections"]
    o, u = s.get("ours_float16", {}), s.get("upstream") or rep.data.get("upstream_reused") or {}
    rows = [("ms/step B=1", "b1"), ("ms/step B=3", "b3")]
    print("\n| metric | ours fp16 | upstream fp32 | ours/upstream |\n|---|---|---|---|")
    for label, k in rows:
        a = o.get(k, {}).get("ms_per_step") if isinstance(o, dict) else None
        b = u.get(k, {}).get("ms_per_step") if isinstance(u, dict) else None
        print(f"| {label} | {a} | {b} | {a / b if a and b else None} |")
    for label, k, ku in (("TTFB ms", "ttfb_ms", "ttfb_ms"), ("RTF 1 ch", "rtf_1ch", "rtf_1ch"), ("RTF 3 ch", "rtf_3ch", "rtf_3ch"),
                         ("peak MiB (3 ch)", "peak_overall_mib", "peak_mib")):
        a, b = (o.get(k) if isinstance(o, dict) else None), (u.get(ku) if isinstance(u, dict) else None)
        print(f"| {label} | {a} | {b} | {a / b if a and b else None} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out/bench_gpu"))
    ap.add_argument("--ckpt", default=None, help="checkpoint dir (written here with random weights if missing)")
    ap.add_argument("--size", default="full", choices=("full", "tiny"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--no-upstream", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--steps", type=int, default=200, help="upstream: extra steps between its two timed lengths")
    ap.add_argument("--rtf-steps", type=int, default=235, help="decode steps per channel for RTF (235 = 5 s audio)")
    ap.add_argument("--greedy-steps", type=int, default=210)
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip later sections past this many seconds")
    ap.add_argument("--sections", default="ours,compiled,upstream,fidelity")
    ap.add_argument("--compile-modes", default="default,max-autotune-no-cudagraphs")
    ap.add_argument("--compiled-max-seq", type=int, default=512, help="KV length (one bucket) of the compiled runners")
    ap.add_argument("--first-chunks", default="4,1", help="extra stream.first_chunk_tokens values for TTFB")
    ap.add_argument("--compile-dynamic", action="store_true",
                    help="compiled section: production shape (all batches and buckets of max_seq 2048), symbolic sizes")
    ap.add_argument("--upstream-json", default=None, help="reuse upstream numbers (a raw bench_gpu.json) in records")
    a = ap.parse_args(argv)
    a.compile_modes = [m for m in a.compile_modes.split(",") if m]
    a.first_chunks = [int(x) for x in a.first_chunks.split(",") if x]
    a.upstream_from = None
    if a.upstream_json:
        raw = json.loads(Path(a.upstream_json).read_text())
        runs = [v for v in raw.values() if isinstance(v, dict)] if "sections" not in raw else [raw]
        for run in runs:
            if isinstance(run.get("sections", {}).get("upstream"), dict) and "b1" in run["sections"]["upstream"]:
                a.upstream_from = dict(run["sections"]["upstream"], reused_from=run["sections"]["env"]["date"])
                break
    logging.basicConfig(level=logging.WARNING)
    import torch

    rep = Report(Path(a.out))
    if a.ckpt is None:
        a.ckpt = str(Path(a.out).parent / f"ckpt_{a.size}") if a.device == "cpu" else f"/tmp/ckpt_{a.size}"
    if not (Path(a.ckpt) / "asset" / "gpt" / "config.json").is_file():
        from appliance.build.random_ckpt import write_random_checkpoint

        t = time.perf_counter()
        write_random_checkpoint(a.ckpt, a.size, seed=0)
        print(f"[ckpt] random {a.size} checkpoint written to {a.ckpt} in {time.perf_counter() - t:.1f} s", flush=True)
    env = section_env(rep, a, torch)
    want = a.sections.split(",")
    if a.upstream_from:
        rep.data["upstream_reused"] = a.upstream_from
    ref = {}

    def reference():
        if "codes" not in ref:
            from appliance.text.tokenizer import Tokenizer

            t = time.perf_counter()
            ref.update(fp32_reference(a, torch, _prompts(Tokenizer.from_dir(Path(a.ckpt) / "asset" / "tokenizer"), 1)[0]))
            rep.put("fp32_reference", {"steps": len(ref["codes"]), "s": time.perf_counter() - t})
        return ref

    for name, fn in (("ours", lambda: section_ours(rep, a, torch, env, fidelity_ref=reference())),
                     ("compiled", lambda: section_compiled(rep, a, torch, env, reference())),
                     ("upstream", lambda: section_upstream(rep, a, torch)),
                     ("fidelity", lambda: section_fidelity(rep, a, torch))):
        if name not in want or (name == "upstream" and a.no_upstream) or (name == "compiled" and a.no_compile):
            continue
        if a.budget_s and rep.elapsed() > a.budget_s:
            rep.data["errors"][name] = f"skipped: {rep.elapsed():.0f} s elapsed > budget {a.budget_s} s"
            continue
        try:
            fn()
        except Exception as e:
            rep.error(name, e)
        records(rep, a, env)
        print(f"[time] {name} done at {rep.elapsed():.1f} s", flush=True)
    records(rep, a, env)
    table(rep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
