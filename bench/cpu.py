"""CPU benchmark of the main job through the production path: Pipeline.from_config (the backend
``appliance.engines.select`` picks), its warm-up, decode loop, vocoder windows and chunk schedule.

Measures for one tree (this checkout, or ``--tree DIR``: e.g. a checkout of the commit before a
change, for a side-by-side run; trees before the one-generation-path redesign are refused):

* ``load_s`` / ``warmup_s``: ``Pipeline.from_config`` and ``Pipeline.warmup``;
* ``ms_per_step``: decode steps alone at B=1 (``DecodeLoop.step`` incl. sampling), median of 100;
* ``ttfb_ms``: ``Pipeline.run`` start to the first PCM chunk for a short sentence (prefill,
  look-ahead, first chunk, first vocoder window), median of ``--ttfb-runs`` after warm-up;
  ``first_ttfb_ms``: the first request after the warm-up alone (is anything still cold?);
* ``rtf``: wall / audio seconds for a ``--steps`` utterance (EOS masked); ``peak_mem_mib``: RSS.
* ``host_read_gbps``: the host's read bandwidth measured in the same run with the bench's threads
  (before and after, the larger kept); ``weight_bytes_per_step``: the ``gpt`` graph's initializer
  bytes; ``bandwidth_frac`` = bytes / step / bandwidth; ``baseline_ms_per_step``: ``--baseline-ms``
  (upstream's loop in the same session, ``python -m bench upstream``).
* ``lookahead``: what the pipeline used (exact or calibrated, from ``--lookahead``).
* ``stages``: where the RTF utterance's time went, seconds per second of audio:
  ``in_pipeline`` as timed inside the run (``gpt``: the runner's decode passes; ``sampling``: the
  rest of its step, the numpy sampler and its bookkeeping; ``prefill``; ``vocoder``: the windows,
  Decoder + Vocos + inverse STFT; ``glue``: the wall time outside them: the batch engine, the
  chunk schedule, the PCM checks) and ``alone``: the same stages timed by themselves (the GPT
  and sampling over as many decode steps with no vocoder in between, the vocoder replaying the
  run's windows on those hidden states, prefill and glue as in the run); ``sum_alone`` and
  ``rtf_over_sum`` = rtf / sum_alone: above 1.1 the stages slow each other down (thread pools
  that fight over the cores). The timers wrap the runner's and the vocoders' methods on the
  bench's own instances (a bench harness: the daemon has none).
* ``threads``, ``threads_source``: the runner's thread budget and where it came from.
* ``--three``: ``three_sequential_s`` (three requests of ``--steps`` one after another) and
  ``three_batched_s`` (the same three at once, one batched decode: what three channels do), and
  ``three_batched_over_sequential``; run inside a cgroup with a CPU quota (``systemd-run -p CPUQuota=100%``)
  it says whether the threads the runner chose fit the quota.

Appends one record per run (``bench: cpu``, :mod:`bench.harness`'s schema) to
``bench/results/cpu.jsonl``. For a side-by-side, run it in turns with ``--tree`` (the commit
before a change) and ``python -m bench upstream`` (upstream's GPT loop) in the same session.

    python -m bench cpu --checkpoint models/random-full --engine-dir engines/build/full [--three]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

from bench import harness

ROOT = harness.ROOT
SENTENCE = "今天天气很好，我们去公园散步吧。"


def _import_tree(tree: str | None) -> None:
    """Import ``appliance`` from ``tree`` (default this checkout).

    Raises:
        SystemExit: the tree predates the one-generation-path redesign (no ``appliance.core``).
    """
    sys.path.insert(0, tree or str(ROOT))
    if tree:   # an editable install of another tree must not fill in missing modules
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    try:
        from appliance.core import SynthesisRequest  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"{tree or ROOT} has no appliance.core.SynthesisRequest: a tree before the "
                         f"one-generation-path redesign, which this bench no longer runs ({e})") from e


def gpt_weight_bytes(engine_dir: str | None, precision: str, backend: str = "onnxruntime") -> int | None:
    """Bytes of the ``gpt`` graph's initializers (what one decode step reads once) in
    ``<engine_dir>/onnx/<precision>/gpt.onnx``, or the size of ``<engine_dir>/llama/<type>/gpt.gguf``;
    None where there is no such file."""
    if backend == "llama.cpp":
        g = Path(engine_dir or ROOT / "engines" / "build") / "llama" / precision / "gpt.gguf"
        return g.stat().st_size if g.is_file() else None
    f = Path(engine_dir or ROOT / "engines" / "build") / "onnx" / precision / "gpt.onnx"
    if not f.is_file():
        return None
    import onnx

    n = 0
    for t in onnx.load(str(f), load_external_data=False).graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        n += int(ext["length"]) if "length" in ext else len(t.raw_data)
    return n


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class StageClock:
    """Timers around one pipeline's stages (the ``stages`` field, module docstring): wraps the
    runner's ``forward_decode``, ``step`` and ``forward_prefill`` and every vocoder's ``push`` and
    ``finish`` on these instances; records the window pushes of slot-0 vocoder's sentence so that
    :meth:`breakdown` can replay them alone."""

    def __init__(self, pipe) -> None:
        self.pipe = pipe
        self.t: dict[str, float] = {}
        self.pushes: list[int] = []
        r = pipe.runner
        self._wrap(r, "forward_decode", "gpt")
        self._wrap(r, "step", "step")
        self._wrap(r, "forward_prefill", "prefill")
        for i, v in enumerate(pipe.vocoders):
            self._wrap(v, "push", "vocoder", record=self.pushes if i == 0 else None)
            self._wrap(v, "finish", "vocoder")
        self.reset()

    def reset(self) -> None:
        self.t = {k: 0.0 for k in ("gpt", "step", "prefill", "vocoder")}
        self.pushes.clear()

    def _wrap(self, obj, name: str, key: str, record: list | None = None) -> None:
        f = getattr(obj, name)
        t = self

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                t.t[key] += time.perf_counter() - t0
                if record is not None:
                    record.append(a[0])
        setattr(obj, name, timed)

    def breakdown(self, wall: float, audio_s: float, job, steps: int, Sequence) -> dict:
        """Stages in and alone, seconds per audio second (module docstring)."""
        import numpy as np

        inside = dict(self.t)
        pipe_stages = {"gpt": inside["gpt"], "sampling": inside["step"] - inside["gpt"], "prefill": inside["prefill"],
                       "vocoder": inside["vocoder"]}
        pipe_stages["glue"] = wall - inside["step"] - inside["prefill"] - inside["vocoder"]
        pushes = list(self.pushes)
        # alone: as many decode steps with no vocoder in between, then the same windows replayed
        seq = Sequence(ids=job.prompts[0], spk_emb=job.spk_emb, params=job.params, seed=2)
        loop = self.pipe.loop
        loop.join(seq)
        self.reset()
        while seq.steps < steps and not seq.finished:
            loop.step(min(8, steps - seq.steps))
        gpt, samp = self.t["gpt"], self.t["step"] - self.t["gpt"]
        voc = self.pipe.vocoders[0]
        voc.reset(seq.slot)
        self.reset()
        for n in pushes:
            voc.push(min(int(n), seq.steps))
        voc.finish()
        vocoder = self.t["vocoder"]
        loop.leave(seq)
        alone = {"gpt": gpt, "sampling": samp, "prefill": pipe_stages["prefill"], "vocoder": vocoder,
                 "glue": pipe_stages["glue"]}
        per = lambda d: {k: round(v / audio_s, 4) for k, v in d.items()}  # noqa: E731
        total = float(np.sum(list(alone.values()))) / audio_s
        return {"in_pipeline": per(pipe_stages), "alone": per(alone), "sum_alone": round(total, 4),
                "rtf_over_sum": round(wall / audio_s / total, 3), "windows": len(pushes), "steps": steps}


def run(args) -> dict:
    from appliance.config import config_from_dict
    from appliance.core import SynthesisRequest as Req
    from appliance.core import SynthParams
    from appliance.synth.decode_loop import Sequence
    from appliance.synth.pipeline import Pipeline

    model = {"path": args.checkpoint, "backend": args.backend, "device": "cpu", "max_batch": 3, "max_seq_len": 2048,
             "threads": args.threads}
    if args.precision != "auto":
        model["onnx_precision"] = args.precision
    if args.engine_dir:
        model["engine_dir"] = args.engine_dir
    model.update(json.loads(args.model))
    data = {"model": model, "synthesis": {"max_new_tokens": max(args.steps, 200)}, "stream": {"lookahead": args.lookahead}}
    cfg = config_from_dict(data)
    t = time.perf_counter()
    pipe = Pipeline.from_config(cfg)
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    pipe.warmup()
    warmup_s = time.perf_counter() - t

    clock = StageClock(pipe)

    def ttfb_once(i, steps=60):
        t0 = time.perf_counter()
        job = pipe.prepare(Req(text=SENTENCE, id=f"t{i}", seed=i, params=SynthParams(min_new_tokens=steps, max_new_tokens=steps)))
        it = pipe.run(job)
        next(it)
        ms = 1e3 * (time.perf_counter() - t0)
        for _ in it:
            pass
        return ms

    first_ttfb = ttfb_once(0)
    ttfbs = [ttfb_once(i + 1) for i in range(args.ttfb_runs)]
    # decode steps alone, B=1
    job = pipe.prepare(Req(text=SENTENCE, id="steps", seed=1, params=SynthParams(min_new_tokens=400, max_new_tokens=400)))
    loop = pipe.loop
    seq = Sequence(ids=job.prompts[0], spk_emb=job.spk_emb, params=job.params, seed=1)
    loop.join(seq)
    for _ in range(5):
        loop.step()
    ts = []
    for _ in range(100):
        t = time.perf_counter()
        loop.step()
        ts.append(time.perf_counter() - t)
    loop.leave(seq)
    # a whole utterance: RTF
    job = pipe.prepare(Req(text=SENTENCE, id="rtf", seed=2, params=SynthParams(min_new_tokens=args.steps, max_new_tokens=args.steps)))
    clock.reset()
    t = time.perf_counter()
    run = pipe.run(job)
    samples = sum(c.samples.size for c in run)
    wall = time.perf_counter() - t
    st = run.report.stats
    info = pipe.info
    stages = clock.breakdown(wall, samples / 24000, job, st.steps, Sequence)
    three = _three(pipe, Req, SynthParams, args.steps) if args.three else {}
    la = pipe.describe_lookahead()
    pipe.close()
    return {"backend": info.backend, "precision": info.precision, "batch": 1,
            "ms_per_step": round(1e3 * statistics.median(ts), 2), "steps_per_s": round(1 / statistics.median(ts), 2),
            "rtf": round(st.rtf, 3), "ttfb_ms": round(statistics.median(ttfbs), 1), "first_ttfb_ms": round(first_ttfb, 1),
            "ttfb_runs_ms": [round(x, 1) for x in ttfbs], "peak_mem_mib": round(peak_rss_mib(), 1),
            "audio_s": round(samples / 24000, 2), "load_s": round(load_s, 1), "warmup_s": round(warmup_s, 1),
            "lookahead": la, "stages": stages, "threads": getattr(info, "threads", None) or None,
            "threads_source": getattr(info, "threads_source", None) or None, **three}


def _three(pipe, Req, SynthParams, steps: int) -> dict:
    """Three requests one after another, then the same three at once (``--three``)."""
    jobs = lambda: [pipe.prepare(Req(text=SENTENCE, id=f"three{i}", seed=10 + i,  # noqa: E731
                                     params=SynthParams(min_new_tokens=steps, max_new_tokens=steps))) for i in range(3)]
    t = time.perf_counter()
    for job in jobs():
        for _ in pipe.run(job):
            pass
    seq = time.perf_counter() - t
    eng = pipe.engine
    t = time.perf_counter()
    tasks = [eng.add(job, lambda chunk: None) for job in jobs()]
    while not all(x.finished for x in tasks):
        eng.step()
    bat = time.perf_counter() - t
    return {"three_sequential_s": round(seq, 2), "three_batched_s": round(bat, 2),
            "three_batched_over_sequential": round(bat / seq, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench cpu", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="checkpoint dir (chattts-appliance model random --size full DIR)")
    ap.add_argument("--engine-dir", default=None, help="exported engines (ONNX graphs, GGUF)")
    ap.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "llama", "torch"))
    ap.add_argument("--tree", default=None, help="import appliance from this checkout instead of this one")
    ap.add_argument("--lookahead", default="auto", help="stream.lookahead: auto (calibrated if recorded), exact or N")
    ap.add_argument("--steps", type=int, default=200, help="decode steps of the RTF utterance (EOS masked)")
    ap.add_argument("--ttfb-runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--precision", default="auto", help="model.onnx_precision: auto, int8, int4, fp32")
    ap.add_argument("--model", default="{}", help='extra model.* settings as JSON, e.g. \'{"spin_wait": true}\'')
    ap.add_argument("--three", action="store_true", help="also three requests one after another and at once")
    ap.add_argument("--label", default="")
    ap.add_argument("--baseline-ms", type=float, default=None,
                    help="upstream's GPT loop, ms per step at B=1, measured in the same session (python -m bench upstream)")
    harness.add_common(ap)
    args = ap.parse_args(argv)
    _import_tree(args.tree)
    threads = args.threads or len(os.sched_getaffinity(0))
    gbps0 = harness.host_read_gbps(threads)
    r = run(args)
    gbps = max(gbps0, harness.host_read_gbps(threads))
    wbytes = gpt_weight_bytes(args.engine_dir, r["precision"], r["backend"]) if args.backend != "torch" else None
    rec = harness.record(
        "cpu", checkpoint=harness.checkpoint_size(args.checkpoint), backend=r["backend"], machine=args.machine,
        host_info=harness.host(gbps),
        notes=f"{args.label}; look-ahead {r['lookahead']}; TTFB runs {r['ttfb_runs_ms']}; {args.steps}-step "
              f"utterance {r['audio_s']} s audio; load {r['load_s']} s, warm-up {r['warmup_s']} s",
        **{k: r[k] for k in ("precision", "batch", "ms_per_step", "steps_per_s", "rtf", "ttfb_ms", "peak_mem_mib")},
        first_ttfb_ms=r["first_ttfb_ms"], baseline_ms_per_step=args.baseline_ms,
        host_read_gbps=round(gbps, 2), weight_bytes_per_step=wbytes,
        bandwidth_frac=round(wbytes / (r["ms_per_step"] / 1e3) / (gbps * 1e9), 3) if wbytes else None,
        threads=r["threads"] or threads, threads_source=r["threads_source"], stages=r["stages"],
        **{k: v for k, v in r.items() if k.startswith("three_")},
        tree=args.tree or "this checkout", lookahead=r["lookahead"])
    harness.write([rec], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
