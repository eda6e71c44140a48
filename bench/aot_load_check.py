"""Why AOTInductor packages crash torch's loader on this machine: tiny packages loaded in child processes.

    python bench/aot_load_check.py --work DIR [--cases consts,inputs,no-output] [--real CKPT] [--deadline-s 150]
                                   [--out FILE.json]

On the H200 (torch 2.11.0+cu130) the decode-step packages ``chattts-appliance engines compile`` built
crashed ``aoti_load_package`` with SIGSEGV in ``torch/export/pt2_archive/_package.py`` ``_load_aoti``
(bench/RESULTS.md), with the public loader and a bare path too. Those packages differ from the
documentation's example in two ways: every weight and state tensor is an input (no constants,
~250 inputs, some mutated in place) and the step returns nothing. This script bisects, in one
short run:

* facts: torch and its CUDA, the CUDA toolkit torch's extension builder finds (``CUDA_HOME``,
  ``nvcc``), the C++ compiler, the driver (a wrapper compiled against another CUDA's headers or
  linked to another ``libcudart`` than torch's is a known cause of faults);
* tiny cases, each compiled here (``torch.export`` + ``aoti_compile_and_package``, inductor's
  default options, as ``engines compile`` uses), then loaded and run once in a child process that
  prints native frames on a fault (c10's fatal-signal handler):
  ``consts`` (a Linear with its weight baked in, one output: the documentation's example),
  ``inputs`` (the weight an input, a state input mutated in place, one output),
  ``no-output`` (as ``inputs`` but writing its result into an input and returning nothing: the
  decode step's form), ``many-inputs`` (``no-output`` with 256 weight inputs);
* ``--real CKPT``: one real package, ``engines compile --batches 1 --buckets 256`` at KV 3 x 512
  (its own load check runs it in a child; ~100 s cold on the H200), then a bare-path load.

For each package: its files, the libraries its ``.so`` needs as ``ldd`` resolves them (CUDA
runtime, torch), and the ops its proxy-executor JSON runs outside the generated code. One line per
case: ``loads and runs``, or the signal or error, where, and the innermost native frames.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CASES = ("consts", "inputs", "no-output", "many-inputs")

LOAD_CHILD = r"""
import json, sys, torch
t = getattr(torch._C, "_set_print_stack_traces_on_fatal_signal", None)
if t is not None:
    t(True)
job = json.loads(sys.argv[1])
from torch._inductor import aoti_load_package
print("doing load", flush=True)
kw = {"run_single_threaded": True, "device_index": 0 if torch.cuda.is_available() else -1} if job["ours"] else {}
m = aoti_load_package(job["path"], **kw)
if job.get("inputs"):
    xs = [x.cuda() if torch.cuda.is_available() else x for x in torch.load(job["inputs"])]
    print("doing run", flush=True)
    with torch.inference_mode():
        m(*xs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
print("doing done", flush=True)
"""


def _sh(cmd: list[str], timeout: float = 30) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (r.stdout + r.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"({cmd[0]}: {e})"


def facts() -> dict:
    """Versions and paths a compiled wrapper depends on."""
    import torch

    try:
        from torch.utils import cpp_extension

        cuda_home = cpp_extension.CUDA_HOME
    except Exception as e:  # noqa: BLE001 - a fact, not a failure
        cuda_home = f"({e})"
    nvcc = shutil.which("nvcc") or (str(Path(cuda_home) / "bin" / "nvcc") if cuda_home and Path(str(cuda_home), "bin", "nvcc").exists() else None)
    out = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "CUDA_HOME_env": os.environ.get("CUDA_HOME"),
           "cuda_home_torch_finds": cuda_home, "nvcc": nvcc,
           "nvcc_version": _sh([nvcc, "--version"]).splitlines()[-1] if nvcc else None,
           "cxx": _sh([os.environ.get("CXX", "g++"), "--version"]).splitlines()[0],
           "LD_LIBRARY_PATH": os.environ.get("LD_LIBRARY_PATH")}
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")
        libs = sorted({ln.split()[-1] for ln in open("/proc/self/maps") if re.search(r"lib(cudart|cuda)\.so", ln)})
        out.update(gpu=torch.cuda.get_device_name(0), driver=_sh(["nvidia-smi", "--query-gpu=driver_version",
                                                                  "--format=csv,noheader"]), cuda_libs_loaded=libs)
    return out


def inspect_package(pt2: Path) -> dict:
    """Files of a package, ``ldd`` of its shared objects (CUDA and torch lines), proxy-executor ops."""
    info: dict = {"files": [], "ldd": {}, "extern_ops": []}
    with zipfile.ZipFile(pt2) as z, tempfile.TemporaryDirectory() as tmp:
        cubins = 0
        for zi in z.infolist():
            if zi.filename.endswith((".cubin", ".fatbin")):
                cubins += 1
            else:
                info["files"].append(f"{Path(zi.filename).name} {zi.file_size}")
            if zi.filename.endswith(".so"):
                p = Path(z.extract(zi, tmp))
                keep = [ln.strip() for ln in _sh(["ldd", str(p)]).splitlines()
                        if re.search(r"cuda|cudart|torch|c10|not found|stdc\+\+", ln)]
                info["ldd"][Path(zi.filename).name] = keep
            elif zi.filename.endswith(".json") and "aotinductor" in zi.filename:
                try:
                    data = json.loads(z.read(zi))
                except ValueError:
                    continue
                info["extern_ops"] += sorted(set(re.findall(r'"target": "([^"]+)"', json.dumps(data))))
        info["files"].append(f"({cubins} cubin/fatbin files)")
    return info


def load_in_child(pt2: Path, ours: bool, inputs: Path | None, timeout: float) -> str:
    """One fresh process loads (and with ``inputs`` runs) the package; its outcome in one line."""
    from appliance.engines.torch.aot_canary import _fault_frame, _native_frames

    job = {"path": str(pt2), "ours": ours, "inputs": str(inputs) if inputs else None}
    try:
        r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", LOAD_CHILD, json.dumps(job)], capture_output=True,
                           text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"did not finish within {timeout:.0f} s"
    doing = ([ln[6:] for ln in r.stdout.splitlines() if ln.startswith("doing ")] or ["start"])[-1]
    if r.returncode == 0:
        return "loads and runs" if inputs else "loads"
    if r.returncode < 0:
        try:
            name = signal.Signals(-r.returncode).name
        except ValueError:
            name = f"signal {-r.returncode}"
        return f"died by {name} while {doing}, at {_fault_frame(r.stderr) or '?'}; native: {_native_frames(r.stderr, 5) or '?'}"
    last = next((ln.strip() for ln in reversed(r.stderr.splitlines()) if ln.strip()), f"exit status {r.returncode}")
    return f"failed while {doing}: {last[:300]}"


def build_case(case: str, work: Path) -> tuple[Path, Path, float]:
    """Compile one tiny case -> (package, its saved inputs, seconds)."""
    import torch
    from torch import nn

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n = 64

    class Consts(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(n, n)

        def forward(self, x):
            return torch.relu(self.lin(x))

    class Inputs(nn.Module):
        def forward(self, x, w, state):
            state.add_(1)
            return torch.relu(x @ w.T) + state.sum()

    class NoOutput(nn.Module):
        def forward(self, x, out, state, *ws):
            h = x
            for w in ws:
                h = torch.relu(h @ w.T)
            out.copy_(h)
            state.add_(1)
            return ()

    x = torch.randn(4, n, device=dev)
    if case == "consts":
        mod, args = Consts().to(dev), (x,)
    elif case == "inputs":
        mod, args = Inputs(), (x, torch.randn(n, n, device=dev), torch.zeros(4, device=dev))
    else:
        k = 256 if case == "many-inputs" else 1
        mod, args = NoOutput(), (x, torch.zeros(4, n, device=dev), torch.zeros(1, dtype=torch.int64, device=dev),
                                 *[torch.randn(n, n, device=dev) / 8 for _ in range(k)])
    t0 = time.perf_counter()
    with torch.no_grad():
        ep = torch.export.export(mod, args, strict=False)
        pt2 = work / f"{case}.pt2"
        torch._inductor.aoti_compile_and_package(ep, package_path=str(pt2))
    inputs = work / f"{case}.inputs.pt"
    torch.save([a.cpu() for a in args], inputs)
    return pt2, inputs, time.perf_counter() - t0


def build_real(ckpt: str, work: Path, timeout: float) -> tuple[Path | None, str]:
    """``engines compile`` of one decode-step package (b1, L256, KV 3 x 512); (package, its output tail)."""
    eng = work / "engines"
    cfg = work / "config.json.yaml"
    cfg.write_text(json.dumps({"model": {"path": ckpt, "backend": "torch", "device": "cuda", "dtype": "float16",
                                         "engine_dir": str(eng), "max_batch": 3, "max_seq_len": 512,
                                         "max_prompt_tokens": 64}, "safety": {"cache_dir": str(work / "cache")}}))
    try:
        r = subprocess.run([sys.executable, "-m", "appliance", "engines", "compile", "--config", str(cfg), "--batches", "1",
                            "--buckets", "256"], capture_output=True, text=True, timeout=timeout, cwd=str(work))
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-12:])
    except subprocess.TimeoutExpired:
        tail = f"engines compile did not finish within {timeout:.0f} s"
    found = sorted(eng.glob("aot/*/step_b1_L256.pt2"))
    return (found[0] if found else None), tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="a scratch directory (packages are written here)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--real", metavar="CKPT", help="also build and load one real decode-step package of this checkpoint")
    ap.add_argument("--deadline-s", type=float, default=150.0, help="start nothing new after this")
    ap.add_argument("--child-timeout-s", type=float, default=60.0)
    ap.add_argument("--out", help="write the findings as JSON here")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    res: dict = {"facts": facts(), "cases": {}}
    print("facts: " + json.dumps(res["facts"], indent=1), flush=True)
    todo = [c.strip() for c in a.cases.split(",") if c.strip()] + (["real"] if a.real else [])
    for case in todo:
        if time.perf_counter() - t0 > a.deadline_s - 20:
            res["cases"][case] = {"skipped": f"the {a.deadline_s:.0f} s deadline"}
            continue
        try:
            if case == "real":
                pt2, tail = build_real(a.real, work, max(30.0, a.deadline_s - (time.perf_counter() - t0)))
                r = {"engines_compile": tail}
                if pt2 is not None:
                    r.update(inspect_package(pt2), load_bare_path=load_in_child(pt2, False, None, a.child_timeout_s))
            else:
                pt2, inputs, secs = build_case(case, work)
                r = {"build_s": round(secs, 1), **inspect_package(pt2),
                     "load_and_run": load_in_child(pt2, False, inputs, a.child_timeout_s),
                     "load_ours": load_in_child(pt2, True, None, a.child_timeout_s)}
        except Exception as e:  # noqa: BLE001 - a case that cannot build is a finding too
            r = {"error": f"{type(e).__name__}: {str(e)[-600:]}"}
        res["cases"][case] = r
        print(f"\n== {case}: " + json.dumps(r, indent=1), flush=True)
    print("\nsummary:")
    for case, r in res["cases"].items():
        what = r.get("load_and_run") or r.get("load_bare_path") or r.get("error") or r.get("skipped") or "?"
        extra = f"; load with run_single_threaded/device_index: {r['load_ours']}" if "load_ours" in r else ""
        print(f"  {case:12s} {what}{extra}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
