"""llama.cpp's GPU build tried in a child process before the GPT is offloaded (the llama load canary).

A CUDA build of llama-cpp-python made with another C++ standard library than the one it runs
against segfaulted inside ``llama_model_load_from_file`` on an H200 (built with the image's
``/opt/gcc`` g++; the same sdist built with the system ``g++`` loads and runs: bench/HISTORY.md).
A fault kills the process, no ``try`` catches it, and a daemon that dies at every start under
systemd is a crash loop. So before :class:`~appliance.engines.llama.runner.LlamaRunner` loads a
GGUF with its layers offloaded, :func:`check` has a child process (``sys.executable``) load the
same file with every layer offloaded and decode one row. A signal, an exception, a non-finite
logit, another exit status or a timeout is a failure: the runner then loads the GPT on the CPU
and reports it (``info.fallback``; health: ``engine_fallback``). Success lets it offload.

The verdict is kept beside the GGUF as ``load-check-llama-<llama-cpp-python version>.json``
(:func:`marker_path`) with the GGUF's sha256 from the manifest: later starts with the same build
and file take it and skip the child (a new export or a new llama-cpp-python version tries again).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: Seconds the child may take (loading a 4-bit GPT and its CUDA kernels on an Orin: a few s).
TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Verdict:
    """``ok``: the GGUF loaded offloaded and decoded in a child; ``reason`` says what happened;
    ``cached``: taken from the marker, no child run."""

    ok: bool
    reason: str
    cached: bool = False


def marker_path(gguf: Path, version: str) -> Path:
    """The verdict file for ``gguf`` under llama-cpp-python ``version``."""
    return gguf.parent / f"load-check-llama-{version}.json"


def check(gguf: Path, sha256: str, version: str, timeout_s: float = TIMEOUT_S) -> Verdict:
    """Load ``gguf`` with every layer offloaded in a child process and decode one row, unless a
    marker for this ``sha256`` and ``version`` holds the verdict. Never raises for the child's
    failure (it is the verdict); the marker is written where the directory allows."""
    marker = marker_path(gguf, version)
    try:
        rec = json.loads(marker.read_text())
        if rec.get("gguf_sha256") == sha256:
            return Verdict(bool(rec["ok"]), str(rec["reason"]), cached=True)
    except (OSError, ValueError, KeyError):
        pass
    try:
        r = subprocess.run([sys.executable, "-X", "faulthandler", "-m", __name__, str(gguf)], capture_output=True,
                           text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        v = Verdict(False, f"{gguf} did not load offloaded within {timeout_s:.0f} s in a test process")
    else:
        tail = " | ".join((r.stderr or "").strip().splitlines()[-3:])
        if r.returncode == 0:
            v = Verdict(True, f"{gguf} loaded with every layer on the GPU and decoded in a test process")
        elif r.returncode < 0:
            v = Verdict(False, f"llama.cpp's GPU build died with signal {-r.returncode} loading {gguf} offloaded "
                               f"in a test process ({tail})")
        else:
            v = Verdict(False, f"llama.cpp's GPU build could not load {gguf} offloaded in a test process "
                               f"(exit {r.returncode}: {tail})")
    try:
        marker.write_text(json.dumps({"gguf_sha256": sha256, "ok": v.ok, "reason": v.reason,
                                      "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}) + "\n")
    except OSError as e:
        log.debug("cannot keep the llama load check's verdict in %s: %s", marker, e)
    return v


def _child(gguf: str) -> int:
    """Load ``gguf`` offloaded, decode one embedding row, exit 0 when its logits are finite."""
    import numpy as np

    from . import lib as llama_lib

    lc = llama_lib.lib()
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = 999
    model = lc.llama_model_load_from_file(gguf.encode(), mp)
    if not model:
        print(f"load failed: {llama_lib.recent_log()}", file=sys.stderr)
        return 2
    ctx = llama_lib.new_context(lc, model, seqs=1, seq_len=16, batch=1, threads=1)
    d = lc.llama_model_n_embd(model)
    n = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    b = lc.llama_batch_init(1, d, 1)
    np.ctypeslib.as_array(b.embd, shape=(1, d))[:] = 0.01
    b.n_tokens, b.pos[0], b.n_seq_id[0], b.seq_id[0][0], b.logits[0] = 1, 0, 1, 0, 1
    if lc.llama_decode(ctx, b) != 0:
        print(f"decode failed: {llama_lib.recent_log()}", file=sys.stderr)
        return 3
    if not np.isfinite(np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(n,))).all():
        print("non-finite logits", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
