"""One variant of bench/gpu_heap_probe.py, in a fresh process: stage records on stdout (``HEAP {json}``).

Run by the probe (``python bench/heap_probe_child.py JSON``), never by hand. Two scripts:

* ``pipeline``: the production load, ``Pipeline.from_config`` then ``Pipeline.warmup``, with
  hooks that record a stage inside it: the checkpoint headers, every 256 MiB of weights streamed
  to the device per part (and the first chunk of each part), each file done, the load's
  ``release_host_memory`` (before and after its ``malloc_trim``), the KV cache, each graph
  capture (and its eager warm-up runs when they grew the heap), the pipeline's objects, the
  warm-up's runner calls (when they grew the heap), and at the end a ``malloc_trim`` of the
  probe's own, which shows what was freed but kept.
* ``bare``: plain torch, no appliance code on the data path: the same checkpoint files opened
  with ``safetensors.safe_open`` (a memory map), each tensor moved to the device in the
  production dtype (GPT and Embed FP16 on a GPU, Decoder and Vocos FP32), then one kernel of
  each library the step uses (a cuBLAS FP16 GEMM, SDPA, a cuDNN FP32 depthwise conv1d, the
  sampling kernels) and one small CUDA graph. So a growth that appears here too is torch's or
  CUDA's own, not the appliance's.

Each record: RSS and Anonymous (``/proc/self/smaps_rollup``), the resident set of ``[heap]``
(glibc's main arena, grown by ``brk``), of other anonymous mappings (thread arenas, ``mmap``ed
chunks, pymalloc, driver allocations), of ``/dev/nvidia*`` and of each shared library;
glibc's ``mallinfo2()`` (``arena``: bytes the arenas hold from the OS; ``in_use``: allocated
and live (``uordblks``); ``free``: freed but kept in the arenas (``fordblks``); ``mmapped``:
live chunks of their own mapping (``hblkhd``)); ``ru_maxrss``; on CUDA the caching allocator's
allocated/reserved and the device's used memory. All MiB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import re
import resource
import sys
import time

T0 = time.perf_counter()
ARGS = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
MIB = float(1 << 20)
_NAMES = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in _NAMES]


class _Mallinfo(ctypes.Structure):   # glibc < 2.33: int fields
    _fields_ = [(n, ctypes.c_int) for n in _NAMES]


try:
    LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
except OSError:
    LIBC = None


def mallinfo() -> dict:
    """glibc's allocator totals over all arenas, MiB ({} where there is no glibc)."""
    fn, typ = getattr(LIBC, "mallinfo2", None), _Mallinfo2
    if fn is None:
        fn, typ = getattr(LIBC, "mallinfo", None), _Mallinfo
    if fn is None:
        return {}
    fn.restype, fn.argtypes = typ, []
    m = fn()
    return {"arena": round(m.arena / MIB, 1), "in_use": round(m.uordblks / MIB, 1), "free": round(m.fordblks / MIB, 1),
            "mmapped": round(m.hblkhd / MIB, 1), "mmapped_n": int(m.hblks), "top_free": round(m.keepcost / MIB, 1)}


def trim() -> None:
    gc.collect()
    if LIBC is not None and hasattr(LIBC, "malloc_trim"):
        LIBC.malloc_trim.argtypes, LIBC.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        LIBC.malloc_trim(0)


def rollup() -> dict:
    d = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("Rss", "Anonymous"):
                    d[k] = round(int(v.split()[0]) / 1024, 1)
    except OSError:
        pass
    return d


_HEAD = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def groups() -> dict:
    """Resident MiB by mapping: ``[heap]``, ``anon``, ``nvidia``, ``files``, and each ``*.so`` (>= 0.5 MiB)."""
    out: dict = {}
    cur = None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                if _HEAD.match(line):
                    parts = line.split(None, 5)
                    path = parts[5].strip() if len(parts) > 5 else ""
                    if path == "[heap]":
                        cur = "[heap]"
                    elif not path or path.startswith("[anon") or path.startswith("/memfd:"):
                        cur = "anon"
                    elif path.startswith("/dev/nvidia"):
                        cur = "nvidia"
                    elif path.startswith("["):
                        cur = "other"
                    elif ".so" in os.path.basename(path):
                        cur = re.sub(r"(\.so)(\.[0-9.]+)?$", r"\1", os.path.basename(path))
                    else:
                        cur = "files"
                elif cur is not None and line.startswith("Rss:"):
                    out[cur] = out.get(cur, 0) + int(line.split()[1]) / 1024
    except OSError:
        pass
    return {k: round(v, 1) for k, v in out.items() if v >= 0.5 or k in ("[heap]", "anon")}


_TORCH = None
_LAST = {"mem": 0.0}


def _mem_now() -> float:
    """The cheap figure the threshold watches: anonymous RSS + live heap bytes, MiB."""
    m = mallinfo()
    return rollup().get("Anonymous", 0.0) + m.get("in_use", 0.0)


def stage(name: str, milestone: str | None = None) -> None:
    """Print one record (module doc) and make it the baseline of :func:`maybe`."""
    r = {"stage": name, "t": round(time.perf_counter() - T0, 2), **rollup(),
         "maxrss": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), "g": groups(), "m": mallinfo()}
    if milestone:
        r["milestone"] = milestone
    t = _TORCH
    if t is not None and t.cuda.is_available() and t.cuda.is_initialized():
        free, total = t.cuda.mem_get_info()
        r["cuda"] = {"allocated": round(t.cuda.memory_allocated() / MIB, 1),
                     "reserved": round(t.cuda.memory_reserved() / MIB, 1), "device_used": round((total - free) / MIB, 1)}
    print("HEAP " + json.dumps(r), flush=True)
    _LAST["mem"] = _mem_now()


def maybe(name: str) -> None:
    """Record ``name`` only when memory grew by ``step_mib`` since the last record."""
    if _mem_now() - _LAST["mem"] >= ARGS.get("step_mib", 8):
        stage(name)


def _capturing() -> bool:
    t = _TORCH
    return t is not None and t.cuda.is_available() and t.cuda.is_initialized() and t.cuda.is_current_stream_capturing()


# --------------------------------------------------------------------------- the production load
def hook_pipeline() -> None:
    """Wrap the production load's steps so that each records a stage (module doc)."""
    import appliance.engines.torch.cuda_graphs as cg
    import appliance.engines.torch.cuda_runner as cr
    import appliance.model.assemble as asm
    import appliance.model.checkpoint as ck
    import appliance.model.gpt as gptm
    import appliance.model.tensorfile as tf
    import appliance.synth.pipeline as pl

    def after(owner, name, label, milestone=None):
        orig = getattr(owner, name)

        def wrapped(*a, **k):
            out = orig(*a, **k)
            stage(label(*a, **k) if callable(label) else label, milestone)
            return out
        setattr(owner, name, wrapped)

    after(ck, "read_checkpoint", "checkpoint headers read")
    after(tf.TensorFile, "stream", lambda self, *a, **k: f"load {self.path.parent.name}/{self.path.name} done")
    after(asm.Assembler, "finish", "load: buffers made on the device")
    after(gptm.GPT, "setup_cache", "KV cache allocated")
    after(pl.Normalizer, "__init__", "pipeline: normalizer made (OpenCC, wetext)")
    after(pl.BatchEngine, "__init__", "pipeline: vocoders, look-ahead and batch engine made")
    orig_sink = asm.Assembler.sink

    def sink(self, part):
        take, n = orig_sink(self, part), [0, -1]

        def f(e, r0, raw):
            take(e, r0, raw)
            n[0] += raw.nbytes
            if n[1] < 0 or n[0] - n[1] >= ARGS.get("chunk_mib", 256) * MIB:
                stage(f"load {part}: {n[0] / MIB:.0f} MiB read" + (" (first chunk)" if n[1] < 0 else ""))
                n[1] = n[0]
        return f
    asm.Assembler.sink = sink
    orig_release = ck.release_host_memory

    def release():
        who = {"load_model": "end of load_model"}.get(sys._getframe(1).f_code.co_name, "after the captures")
        stage(f"before malloc_trim ({who})", "weights" if who == "end of load_model" else None)
        ok = orig_release()
        stage(f"after malloc_trim ({who})")
        return ok
    ck.release_host_memory = cr.release_host_memory = release
    orig_get = cg.GraphSeam.get

    def get(self, key, fn, before_capture=lambda: None):
        if key in self.graphs:
            return orig_get(self, key, fn, before_capture)
        calls = [0]

        def watched():
            fn()
            calls[0] += 1
            if calls[0] == 1 and not _capturing():
                maybe(f"eager run {key}")
        out = orig_get(self, key, watched, before_capture)
        stage(f"captured {key}" if self.cuda else f"seam {key} (eager, no graph)")
        return out
    cg.GraphSeam.get = get
    orig_init = pl.Pipeline.__init__

    def init(self, cfg, runner, tokenizer, **kw):
        stage("runner ready, tokenizer loaded", "runner")
        orig_init(self, cfg, runner, tokenizer, **kw)
    pl.Pipeline.__init__ = init
    for meth in ("prefill", "start", "step", "vocode"):
        if hasattr(cr.CudaRunner, meth):
            orig_m = getattr(cr.CudaRunner, meth)

            def m(self, *a, _orig=orig_m, _name=meth, **k):
                out = _orig(self, *a, **k)
                maybe(f"runner.{_name} (warm-up or request)")
                return out
            setattr(cr.CudaRunner, meth, m)


def run_pipeline(torch) -> None:
    from appliance.config import config_from_dict
    from appliance.synth.pipeline import Pipeline

    cuda = torch.cuda.is_available() and ARGS["device"] != "cpu"
    if cuda:
        torch.zeros(1, device="cuda")
        stage("CUDA context", "context")
    if ARGS.get("no_cudnn"):
        torch.backends.cudnn.enabled = False
    hook_pipeline()
    if not cuda and ARGS.get("cuda_runner"):   # development: the CUDA runner's logic on the CPU (no graphs)
        import appliance.engines.select as sel
        from appliance.engines.torch.cuda_runner import CudaRunner

        sel._torch_runner = lambda cfg, reason: CudaRunner(cfg, reason=reason)
    cfg = config_from_dict({"model": {"path": ARGS["ckpt"], "backend": "torch", "device": "cuda" if cuda else "cpu",
                                      "dtype": "float16" if cuda else "float32", "compile": "off", "threads": 2,
                                      **ARGS.get("model", {})},
                            "safety": {"cache_dir": ARGS["cache_dir"]}}, base_dir=ARGS["ckpt"])
    p = Pipeline.from_config(cfg)
    stage("Pipeline.from_config done", "loaded")
    p.warmup()
    stage("Pipeline.warmup done", "warmup")
    for i in range(ARGS.get("requests", 0)):
        from appliance.core import SynthesisRequest, SynthParams

        job = p.prepare(SynthesisRequest(id=f"probe{i}", text="今天天气很好，我们去公园散步吧。", seed=i,
                                         params=SynthParams(max_new_tokens=200)))
        for _ in p.run(job):
            pass
        stage(f"request {i + 1}", "requests")
    trim()
    stage("probe: gc + malloc_trim", "trimmed")
    p.close()


# --------------------------------------------------------------------------- plain torch
def run_bare(torch) -> None:
    from safetensors import safe_open

    from appliance.model import layout  # names only (no torch on the data path)

    cuda = torch.cuda.is_available() and ARGS["device"] != "cpu"
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.zeros(1, device=dev)
        stage("CUDA context", "context")
    asset = os.path.join(ARGS["ckpt"], "asset") if os.path.isdir(os.path.join(ARGS["ckpt"], "asset")) else ARGS["ckpt"]
    half = torch.float16 if cuda else torch.float32
    keep = []
    for part, rel, dt in (("gpt", layout.GPT_FILE, half), ("embed", layout.EMBED_FILE, half),
                          ("decoder", layout.DECODER_FILE, torch.float32), ("vocos", layout.VOCOS_FILE, torch.float32)):
        with safe_open(os.path.join(asset, rel), framework="pt", device="cpu") as f:
            for k in f.keys():
                if k in layout.GPT_IGNORED:
                    continue
                t = f.get_tensor(k)
                keep.append(t.to(dev, dt if t.is_floating_point() else t.dtype) if cuda else t.to(dt).clone())
                del t
        stage(f"bare: {part} weights moved", "weights" if part == "vocos" else None)
    trim()
    stage("bare: gc + malloc_trim", "loaded")
    F = torch.nn.functional
    with torch.inference_mode():
        x = torch.randn(3, 768, dtype=half, device=dev)
        w = torch.randn(3072, 768, dtype=half, device=dev)
        y = F.linear(x, w)
        stage("bare: one FP16 GEMM (cuBLAS)")
        q = torch.randn(3, 12, 256, 64, dtype=half, device=dev)
        y = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        stage("bare: SDPA")
        a = torch.randn(1, 512, 300, device=dev)
        y = F.conv1d(a, torch.randn(512, 1, 7, device=dev), padding=3, groups=512)
        stage("bare: FP32 depthwise conv1d (cuDNN)")
        for n in (100, 200, 400, 800):
            y = F.conv1d(torch.randn(1, 512, n, device=dev), torch.randn(512, 1, 7, device=dev), padding=3, groups=512)
        stage("bare: conv1d at 4 more lengths")
        lg = torch.randn(3, 4, 626, device=dev)
        v, i = torch.topk(lg, 20)
        s = torch.softmax(torch.sort(lg, descending=True)[0], -1).cumsum(-1)
        y = torch.multinomial(torch.softmax(v.reshape(-1, 20), -1), 1)
        stage("bare: sampling kernels (topk, sort, softmax, cumsum, multinomial)")
        del s, y, i
        if cuda:
            st = torch.cuda.Stream()
            st.wait_stream(torch.cuda.current_stream())

            def body():
                h = x
                for _ in range(20):
                    h = F.silu(F.linear(h, w)[:, :768]) + x
                return h
            with torch.cuda.stream(st):
                body()
            torch.cuda.current_stream().wait_stream(st)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                body()
            g.replay()
            torch.cuda.synchronize()
            stage("bare: one CUDA graph of 20 GEMM+SiLU layers", "warmup")
    trim()
    stage("bare: gc + malloc_trim at the end", "trimmed")
    del keep


def glibc_version():
    fn = getattr(LIBC, "gnu_get_libc_version", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_char_p
    return fn().decode()


def main() -> int:
    global _TORCH
    sys.path.insert(0, ARGS.get("root", os.getcwd()))
    import torch

    _TORCH = torch
    stage("import torch", "import")
    (run_bare if ARGS["script"] == "bare" else run_pipeline)(torch)
    print("HEAP " + json.dumps({"stage": "env", "torch": torch.__version__, "glibc": glibc_version(),
                                 "env": {k: os.environ.get(k) for k in ARGS.get("env_keys", [])}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
