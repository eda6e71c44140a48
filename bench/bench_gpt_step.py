"""The whole GPT decode step on the CPU, candidates side by side in one session.

Each candidate is one runtime with one weight precision running the exported ``gpt`` graph (all
20 layers, the 4 heads, the in-place KV cache bound by pointer as
:class:`appliance.engines.onnx_runner.OnnxRunner` binds it) for one new token at B=1 after ``P``
cached positions. The candidates are timed in turns (``--rounds`` rounds of ``--steps`` steps
each, per position), so a busy neighbour slows all of them alike; the host's read bandwidth is
measured in the same session with the same thread count (a numpy reduction over 512 MB split over
the threads), and each record carries ``weight_bytes_per_step`` (the graph's initializer bytes:
everything a step reads once) and ``bandwidth_frac`` = bytes / step time / read bandwidth.

Candidates (``--candidates``; graphs made once under ``--work`` from an ``int8`` and an ``fp32``
export of the same checkpoint):

* ``ort-int8``: ONNX Runtime, the export's ``MatMulNBits`` 8-bit graph (block 32, accuracy 4);
* ``ort-int4``: ONNX Runtime, ``MatMulNBits`` 4-bit, block 32, accuracy level 4 (int8 activations);
* ``ort-int8-fused`` / ``ort-int4-fused``: the same after ONNX Runtime's transformer optimizer
  (RMSNorm -> ``SimplifiedLayerNormalization``, residual add + norm -> ``SkipSimplifiedLayerNormalization``);
* ``...-nospin``: the same with ``session.intra_op.allow_spinning`` 0 (idle threads sleep);
* ``ov-int8`` / ``ov-int4``: OpenVINO's CPU plugin on the same ``MatMulNBits`` files (its ONNX
  front end maps them to compressed-weight fully connected layers with int8 dynamic quantization of
  the activations), inputs and cache shared with numpy (no copy).

Appends one record per candidate and position (``bench: gpt_step``) to ``--out`` (default
``bench/results/gpt-step-<date>-<machine>.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import host_read_gbps  # noqa: E402 - the same measure as the pipeline bench

L, M, H, HD, D, Q, V = 20, 3, 12, 64, 768, 4, 626


def weight_bytes(onnx_file: Path) -> int:
    """Bytes of the graph's initializers (external data file plus inline tensors)."""
    import onnx

    m = onnx.load(str(onnx_file), load_external_data=False)
    n = 0
    for t in m.graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        n += int(ext["length"]) if "length" in ext else len(t.raw_data)
    return n


def make_graphs(base: Path, work: Path, names: list[str]) -> dict[str, Path]:
    """The candidates' ``gpt`` graphs (made once under ``work``)."""
    from appliance.build.graph_precision import matmul_nbits

    out = {}
    for n in names:
        bits = 4 if "int4" in n else 8
        fused = "-fused" in n
        f = work / f"gpt-int{bits}{'-fused' if fused else ''}.onnx"
        if not f.exists():
            work.mkdir(parents=True, exist_ok=True)
            src = base / "fp32" / "gpt.onnx"
            if fused:
                from appliance.build.graph_precision import fuse_norms
                tmp = work / "gpt-fp32-fused.onnx"
                if not tmp.exists():
                    fuse_norms(src, tmp)
                src = tmp
            if bits == 8 and not fused:
                f = base / "int8" / "gpt.onnx"
            else:
                matmul_nbits(src, f, bits=bits, block_size=32, accuracy_level=4)
        out[n] = f
    return out


class OrtStep:
    """ONNX Runtime: the production runner's bindings (cache prefix by pointer)."""

    def __init__(self, f: Path, threads: int, spin: bool = True):
        import onnxruntime as ort

        so = ort.SessionOptions()
        if not spin:  # idle threads sleep instead of spinning (a shared or busy host)
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        self.s = ort.InferenceSession(str(f), sess_options=so, providers=["CPUExecutionProvider"])
        self.io = self.s.io_binding()
        self.bufs = {"emb": np.zeros((1, 1, D), np.float32), "pos": np.zeros(1, np.int64), "slots": np.zeros(1, np.int64),
                     "logits": np.zeros((1, Q, V), np.float32), "hidden": np.zeros((1, D), np.float32),
                     "k_new": np.zeros((L, 1, 1, H, HD), np.float32), "v_new": np.zeros((L, 1, 1, H, HD), np.float32)}
        for k in ("emb", "pos", "slots"):
            self.io.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(self.bufs[k]))
        for k in ("logits", "hidden", "k_new", "v_new"):
            self.io.bind_ortvalue_output(k, ort.OrtValue.ortvalue_from_numpy(self.bufs[k]))

    def step(self, kc: np.ndarray, vc: np.ndarray, emb: np.ndarray, p: int) -> tuple[np.ndarray, np.ndarray]:
        self.bufs["emb"][:] = emb
        self.bufs["pos"][:] = p
        shape = [p, M, H, HD]
        for i in range(L):
            self.io.bind_input(f"k_cache.{i}", "cpu", 0, np.float32, shape, kc[i].ctypes.data)
            self.io.bind_input(f"v_cache.{i}", "cpu", 0, np.float32, shape, vc[i].ctypes.data)
        self.s.run_with_iobinding(self.io)
        return self.bufs["logits"], self.bufs["hidden"]


class OvStep:
    """OpenVINO CPU plugin on the same ONNX file; inputs wrap the numpy buffers (shared memory)."""

    def __init__(self, f: Path, threads: int):
        import openvino as ov

        core = ov.Core()
        self.ov = ov
        self.cm = core.compile_model(str(f), "CPU", {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY",
                                                     "NUM_STREAMS": 1})
        self.req = self.cm.create_infer_request()
        self.emb = np.zeros((1, 1, D), np.float32)
        self.pos = np.zeros(1, np.int64)
        self.slots = np.zeros(1, np.int64)

    def step(self, kc: np.ndarray, vc: np.ndarray, emb: np.ndarray, p: int) -> tuple[np.ndarray, np.ndarray]:
        T = self.ov.Tensor
        self.emb[:] = emb
        self.pos[:] = p
        feeds = {"emb": T(self.emb, shared_memory=True), "pos": T(self.pos, shared_memory=True),
                 "slots": T(self.slots, shared_memory=True)}
        for i in range(L):
            feeds[f"k_cache.{i}"] = T(kc[i][:p], shared_memory=True)
            feeds[f"v_cache.{i}"] = T(vc[i][:p], shared_memory=True)
        self.req.infer(feeds, share_outputs=True)
        return self.req.get_tensor("logits").data, self.req.get_tensor("hidden").data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", required=True, help="<engine_dir>/onnx holding int8/ and fp32/ exports of one checkpoint")
    ap.add_argument("--work", required=True, help="where the candidate graphs are written (once)")
    ap.add_argument("--candidates", default="ort-int8,ort-int4,ov-int8,ov-int4")
    ap.add_argument("--positions", default="64,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--machine", default="cpu-2core")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    names = args.candidates.split(",")
    graphs = make_graphs(Path(args.engines), Path(args.work), names)
    gbps0 = host_read_gbps(args.threads)
    runners = {n: OvStep(graphs[n], args.threads) if n.startswith("ov-") else
               OrtStep(graphs[n], args.threads, spin=not n.endswith("-nospin")) for n in names}
    wbytes = {n: weight_bytes(graphs[n]) for n in names}
    rng = np.random.default_rng(0)
    S = max(int(p) for p in args.positions.split(",")) + 1
    kc = (rng.standard_normal((L, S, M, H, HD), np.float32) * 0.5)
    vc = (rng.standard_normal((L, S, M, H, HD), np.float32) * 0.5)
    emb = rng.standard_normal((1, 1, D), np.float32) * 0.1
    load0 = os.getloadavg()[0]
    res: dict[tuple[str, int], list[float]] = {}
    for p in (int(x) for x in args.positions.split(",")):
        for r in runners.values():  # warm-up at this shape
            for _ in range(3):
                r.step(kc, vc, emb, p)
        for _ in range(args.rounds):
            for n, r in runners.items():
                ts = []
                for _ in range(args.steps):
                    t = time.perf_counter()
                    r.step(kc, vc, emb, p)
                    ts.append(time.perf_counter() - t)
                res.setdefault((n, p), []).append(statistics.median(ts))
    gbps1 = host_read_gbps(args.threads)
    gbps = max(gbps0, gbps1)
    # agreement with the first candidate's outputs (a sanity check, not the precision study)
    ref = {p: [x.copy() for x in runners[names[0]].step(kc, vc, emb, p)] for p in (64,)}
    today = dt.date.today().isoformat()
    recs = []
    for (n, p), meds in res.items():
        ms = 1e3 * statistics.median(meds)
        lg, hd = runners[n].step(kc, vc, emb, 64)
        rel = float(np.abs(hd - ref[64][1]).max() / (np.abs(ref[64][1]).max() + 1e-12))
        recs.append({"bench": "gpt_step", "date": today, "machine": args.machine, "candidate": n,
                     "backend": "openvino" if n.startswith("ov-") else "onnxruntime",
                     "precision": "int4" if "int4" in n else "int8", "checkpoint": "full", "batch": 1, "positions": p,
                     "ms_per_step": round(ms, 2), "ms_rounds": [round(1e3 * x, 2) for x in meds],
                     "weight_bytes_per_step": wbytes[n], "host_read_gbps": round(gbps, 2),
                     "bandwidth_frac": round(wbytes[n] / (ms / 1e3) / (gbps * 1e9), 3),
                     "hidden_rel_err_vs_first": round(rel, 5), "threads": args.threads,
                     "notes": f"{args.label}; host read {gbps0:.1f} / {gbps1:.1f} GB/s before / after; "
                              f"1-min load average {load0:.2f} -> {os.getloadavg()[0]:.2f}"})
    for r in recs:
        print(f"{r['candidate']:16s} P={r['positions']:4d}  {r['ms_per_step']:6.2f} ms  {r['weight_bytes_per_step'] / 1e6:6.1f} MB"
              f"  {r['bandwidth_frac']:.2f} of {r['host_read_gbps']:.1f} GB/s  rounds {r['ms_rounds']}")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"gpt-step-{today}-{args.machine}.json"
    old = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(old + recs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
