"""The whole GPT decode step on the CPU, candidates side by side in one session.

Each candidate is one runtime with one weight precision running the GPT (all 20 layers, the 4
heads) for one new token per row, B rows (``--batches``), after ``P`` cached positions: ONNX
Runtime on the exported ``gpt`` graph with the in-place KV cache bound by pointer as
:class:`appliance.engines.onnx.runner.OnnxRunner` binds it; llama.cpp on ``gpt.gguf`` as
:class:`appliance.engines.llama.runner.LlamaRunner` runs it (B sequences of one context, the
embeddings through ``batch.embd``, one ``llama_decode`` per step, logits and hidden states copied
out; each sequence prefilled to ``P`` positions once, the step's position removed after it). The candidates are timed in turns (``--rounds`` rounds of ``--steps`` steps
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
  the activations), inputs and cache shared with numpy (no copy);
* ``llama-<type>`` (``llama-q8_0``, ``llama-q4_k_m``, ...): llama.cpp on ``--llama``'s
  ``<type>/gpt.gguf`` (``chattts-appliance engines export --precision <type>``), F16 KV cache;
  ``-kvq8`` appended: a q8_0 KV cache (flash attention); ``-split``: one ``llama_decode`` per row
  instead of one for all rows (e.g. ``llama-q8_0-split-kvq8``).

Appends one record per candidate, position and batch (``bench: step``, with the ratio to the
first candidate's step in the same rounds (``ratio_vs_first``), the process's CPU time per step beside the wall time
(``cpu_ms_per_step``: the least of the rounds' medians, all the process's threads; on a host shared
with other busy processes it moves far less than the wall time) and the 1-min load average over
them) to ``bench/results/step.jsonl``::

    python -m bench step --engines engines/build/full/onnx --llama engines/build/full/llama --work /tmp/step \\
        --candidates ort-int8,llama-q8_0 --positions 64 --batches 1,3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench import harness
from bench.harness import host_read_gbps

L, M, H, HD, D, Q, V = 20, 4, 12, 64, 768, 4, 626   # M: up to four rows (three channels padded to four)


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
    out: dict[str, Path] = {}
    if not names:
        return out
    from appliance.build.graph_precision import matmul_nbits

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

        self.ort, self.f = ort, f

        so = ort.SessionOptions()
        if not spin:  # idle threads sleep instead of spinning (a shared or busy host)
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        self.s = ort.InferenceSession(str(f), sess_options=so, providers=["CPUExecutionProvider"])
        self.bound: dict[int, tuple] = {}

    def _bind(self, b: int) -> tuple:
        ort = self.ort
        io = self.s.io_binding()
        bufs = {"emb": np.zeros((b, 1, D), np.float32), "pos": np.zeros(b, np.int64), "slots": np.arange(b, dtype=np.int64),
                "logits": np.zeros((b, Q, V), np.float32), "hidden": np.zeros((b, D), np.float32),
                "k_new": np.zeros((L, b, 1, H, HD), np.float32), "v_new": np.zeros((L, b, 1, H, HD), np.float32)}
        for k in ("emb", "pos", "slots"):
            io.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(bufs[k]))
        for k in ("logits", "hidden", "k_new", "v_new"):
            io.bind_ortvalue_output(k, ort.OrtValue.ortvalue_from_numpy(bufs[k]))
        return io, bufs

    def step(self, kc: np.ndarray, vc: np.ndarray, emb: np.ndarray, p: int, b: int = 1) -> tuple[np.ndarray, np.ndarray]:
        if b not in self.bound:
            self.bound[b] = self._bind(b)
        io, bufs = self.bound[b]
        bufs["emb"][:] = emb
        bufs["pos"][:] = p
        shape = [p, M, H, HD]
        for i in range(L):
            io.bind_input(f"k_cache.{i}", "cpu", 0, np.float32, shape, kc[i].ctypes.data)
            io.bind_input(f"v_cache.{i}", "cpu", 0, np.float32, shape, vc[i].ctypes.data)
        self.s.run_with_iobinding(io)
        return bufs["logits"], bufs["hidden"]


class LlamaStep:
    """llama.cpp: the production runner's context and batch (:mod:`appliance.engines.llama.lib`)."""

    def __init__(self, f: Path, threads: int, positions: list[int], split: bool = False, kv: str = "f16",
                 gpu_layers: int = 0):
        from appliance.engines.llama import lib as llama_lib

        lc = self.lc = llama_lib.lib()
        shapes = {"hidden": D, "n_layers": L, "n_heads": H, "ffn": 3072, "num_vq": Q, "num_audio_tokens": V,
                  "max_pos": 4096, "rope_theta": 10000.0, "rms_eps": 1e-6}
        self.model = llama_lib.load_model(lc, f, shapes, gpu_layers=gpu_layers)
        S = max(positions) + 1
        self.ctx = llama_lib.new_context(lc, self.model, seqs=M, seq_len=S + 1, batch=max(positions), threads=threads,
                                         kv_type=kv)
        self.split = split
        self.mem = lc.llama_get_memory(self.ctx)
        self.rows = max(positions)
        self.batch = lc.llama_batch_init(self.rows, D, 1)
        self.embd = np.ctypeslib.as_array(self.batch.embd, shape=(self.rows, D))
        self.logits = np.zeros((M, Q * V), np.float32)
        self.hidden = np.zeros((M, D), np.float32)
        self.filled = -1

    def _decode(self, n: int) -> None:
        self.batch.n_tokens = n
        if self.lc.llama_decode(self.ctx, self.batch) != 0:
            raise RuntimeError("llama_decode failed")

    def step(self, kc, vc, emb: np.ndarray, p: int, b: int = 1) -> tuple[np.ndarray, np.ndarray]:
        lc, bt = self.lc, self.batch
        if self.filled != p:  # each sequence prefilled to P positions once per P (random embeddings)
            rng = np.random.default_rng(p)
            for s in range(M):
                lc.llama_memory_seq_rm(self.mem, s, -1, -1)
                self.embd[:p] = rng.standard_normal((p, D), np.float32) * 0.1
                for i in range(p):
                    bt.pos[i], bt.n_seq_id[i], bt.seq_id[i][0], bt.logits[i] = i, 1, s, 1
                self._decode(p)
            self.filled = p
        for r0, n in ([(i, 1) for i in range(b)] if self.split else [(0, b)]):   # split: one decode per row
            self.embd[:n] = emb[0]
            for i in range(n):
                bt.pos[i], bt.seq_id[i][0] = p, r0 + i
            self._decode(n)
            np.copyto(self.logits[r0:r0 + n], np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), shape=(n, Q * V)))
            np.copyto(self.hidden[r0:r0 + n], np.ctypeslib.as_array(lc.llama_get_embeddings(self.ctx), shape=(n, D)))
        for i in range(b):
            lc.llama_memory_seq_rm(self.mem, i, p, -1)  # the next step runs at P again
        return self.logits[:b].reshape(b, Q, V), self.hidden[:b]


def gguf_step_bytes(f: Path) -> int:
    """Bytes of the GGUF's tensors a step reads (all but ``token_embd``, which the runner never reads)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(f)).tensors if t.name != "token_embd.weight")


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

    def step(self, kc: np.ndarray, vc: np.ndarray, emb: np.ndarray, p: int, b: int = 1) -> tuple[np.ndarray, np.ndarray]:
        if b != 1:
            raise ValueError("the OpenVINO candidate runs B=1 only")
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench step", description=__doc__.split("\n")[0])
    ap.add_argument("--engines", required=True, help="<engine_dir>/onnx holding int8/ and fp32/ exports of one checkpoint")
    ap.add_argument("--llama", default=None, help="<engine_dir>/llama holding <type>/gpt.gguf (llama-<type> candidates)")
    ap.add_argument("--work", required=True, help="where the candidate graphs are written (once)")
    ap.add_argument("--candidates", default="ort-int8,ort-int4,ov-int8,ov-int4")
    ap.add_argument("--positions", default="64,512")
    ap.add_argument("--batches", default="1", help="rows per step, e.g. 1,3")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--label", default="")
    harness.add_common(ap)
    args = ap.parse_args(argv)
    names = args.candidates.split(",")
    positions = [int(x) for x in args.positions.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    gguf = {n: Path(args.llama) / n[len("llama-"):].split("-")[0] / "gpt.gguf" for n in names if n.startswith("llama-")}
    graphs = make_graphs(Path(args.engines), Path(args.work), [n for n in names if n not in gguf])
    gbps0 = host_read_gbps(args.threads)
    runners = {n: LlamaStep(gguf[n], args.threads, positions, split="-split" in n,
                            kv="q8_0" if "-kvq8" in n else "f16") if n in gguf else
               OvStep(graphs[n], args.threads) if n.startswith("ov-") else
               OrtStep(graphs[n], args.threads, spin=not n.endswith("-nospin")) for n in names}
    wbytes = {n: gguf_step_bytes(gguf[n]) if n in gguf else weight_bytes(graphs[n]) for n in names}
    rng = np.random.default_rng(0)
    S = max(positions) + 1
    kc = (rng.standard_normal((L, S, M, H, HD), np.float32) * 0.5)
    vc = (rng.standard_normal((L, S, M, H, HD), np.float32) * 0.5)
    emb = rng.standard_normal((1, 1, D), np.float32) * 0.1
    load0 = os.getloadavg()[0]
    loads: list[float] = []
    res: dict[tuple[str, int, int], list[float]] = {}
    cpu: dict[tuple[str, int, int], list[float]] = {}   # the process's CPU seconds per step (all its threads)
    for p in positions:
        for b in batches:
            live = {n: r for n, r in runners.items() if b == 1 or not n.startswith("ov-")}
            for r in live.values():  # warm-up at this shape
                for _ in range(3):
                    r.step(kc, vc, emb, p, b)

            def timed(r, p=p, b=b) -> tuple[float, float]:
                """``--steps`` steps of one candidate: the median wall and process CPU seconds per step."""
                ts, cs = [], []
                for _ in range(args.steps):
                    t, c = time.perf_counter(), time.process_time()
                    r.step(kc, vc, emb, p, b)
                    ts.append(time.perf_counter() - t)
                    cs.append(time.process_time() - c)
                loads.append(os.getloadavg()[0])
                return statistics.median(ts), statistics.median(cs)

            # the candidates in turns (harness.in_turns): a busy neighbour slows all alike
            got = harness.in_turns({n: (lambda r=r: timed(r)) for n, r in live.items()}, args.rounds)
            for n, vals in got.items():
                res[(n, p, b)], cpu[(n, p, b)] = [v[0] for v in vals], [v[1] for v in vals]
    gbps1 = host_read_gbps(args.threads)
    gbps = max(gbps0, gbps1)
    recs = []
    hinfo = harness.host(round(gbps, 2))
    base = {(p, b): 1e3 * statistics.median(res[(names[0], p, b)]) for (n, p, b) in res if n == names[0]}
    cbase = {(p, b): 1e3 * min(cpu[(names[0], p, b)]) for (n, p, b) in cpu if n == names[0]}
    for (n, p, b), meds in res.items():
        ms = 1e3 * statistics.median(meds)
        cms = 1e3 * min(cpu[(n, p, b)])
        prec = n.split("-")[1]
        recs.append(harness.record(
            "step", checkpoint="full",
            backend="llama.cpp" if n in gguf else "openvino" if n.startswith("ov-") else "onnxruntime",
            machine=args.machine, host_info=hinfo,
            notes=f"{args.label}; host read {gbps0:.1f} / {gbps1:.1f} GB/s before / after; "
                  f"1-min load average {load0:.2f} at start, {min(loads):.2f}-{max(loads):.2f} between rounds",
            candidate=n, precision=prec, batch=b, positions=p,
            ms_per_step=round(ms, 2), ms_rounds=[round(1e3 * x, 2) for x in meds],
            ratio_vs_first=round(ms / base[(p, b)], 3) if (p, b) in base else None, first=names[0],
            cpu_ms_per_step=round(cms, 2), cpu_ms_rounds=[round(1e3 * x, 2) for x in cpu[(n, p, b)]],
            cpu_ratio_vs_first=round(cms / cbase[(p, b)], 3) if (p, b) in cbase else None,
            weight_bytes_per_step=wbytes[n], host_read_gbps=round(gbps, 2),
            bandwidth_frac=round(wbytes[n] / (ms / 1e3) / (gbps * 1e9), 3), threads=args.threads,
            load_avg_1min=[round(min(loads), 2), round(max(loads), 2)]))
    for r in recs:
        print(f"{r['candidate']:16s} P={r['positions']:4d} B={r['batch']}  {r['ms_per_step']:6.2f} ms"
              f"  x{r['ratio_vs_first']}  cpu {r['cpu_ms_per_step']:6.2f} ms x{r['cpu_ratio_vs_first']}"
              f"  {r['weight_bytes_per_step'] / 1e6:6.1f} MB"
              f"  {r['bandwidth_frac']:.2f} of {r['host_read_gbps']:.1f} GB/s  rounds {r['ms_rounds']}")
    harness.write(recs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
