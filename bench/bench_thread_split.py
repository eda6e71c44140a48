"""The thread split at three channels: the GPT's three-row decode step (llama.cpp) and the
vocoder's three windows (ONNX Runtime Decoder + Vocos, one ``--chunk``-step window per row, first
pass) at 1 and 2 threads each, in turns in one process (they run one after the other on the
worker, so each stage's best count is the split). Prints one JSON line: the median ms of each at
each count, the rounds, the 1-min load.

    python bench/bench_thread_split.py --checkpoint CKPT --engine-dir ENGINES   # llama/q8_0 exported
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--checkpoint", required=True)
ap.add_argument("--engine-dir", required=True)
ap.add_argument("--precision", default="q8_0")
ap.add_argument("--chunk", type=int, default=24, help="decode steps per vocoder window")
ap.add_argument("--rounds", type=int, default=8)
args = ap.parse_args()
from appliance.config import config_from_dict  # noqa: E402
from appliance.engines.llama.runner import LlamaRunner  # noqa: E402
from appliance.engines.onnx.vocoder import OrtVocoder, session_options  # noqa: E402
from appliance.engines.runner import receptive_fields  # noqa: E402
import onnxruntime as ort  # noqa: E402
cfg = config_from_dict({"model": {"path": args.checkpoint, "backend": "llama", "engine_dir": args.engine_dir,
                                  "threads": 2, "llama_precision": args.precision, "max_batch": 3, "max_seq_len": 1024}})
r = LlamaRunner(cfg, reason="split bench")
m, d = r.manifest, r.dir
s = m["shapes"]
vocs = {t: OrtVocoder(ort, d, m["graphs"], session_options(ort, t, False), s["hidden"], s["n_mels"],
                      receptive_fields(s["dec_layers"], s["voc_layers"])["decoder_rf"]) for t in (1, 2)}
rng = np.random.default_rng(0)
ids = np.arange(100, 140)
for slot in range(3):
    r.forward_prefill(slot, ids, None)
slots = np.arange(3)
codes = rng.integers(0, 600, (3, 4))
T = args.chunk
hid = rng.standard_normal((T, s["hidden"])).astype(np.float32) * 0.5
res = {}
def gpt(t, pos):
    r._set_threads(t)
    t0 = time.perf_counter(); r.forward_decode(slots, codes, np.full(3, pos)); return time.perf_counter() - t0
def voc(t):
    v = vocs[t]; t0 = time.perf_counter()
    for _ in range(3):
        mel, c = v.decoder_stream(hid, 0, None, None)
        v.vocos_stream(mel, 0, mel.shape[1], None)
    return time.perf_counter() - t0
pos = len(ids)
for rnd in range(args.rounds):
    for t in (2, 1):
        ts = []
        for _ in range(10):
            ts.append(gpt(t, pos)); pos += 1
        res.setdefault(("gpt3", t), []).append(statistics.median(ts))
        res.setdefault(("voc3", t), []).append(statistics.median([voc(t) for _ in range(3)]))
load = os.getloadavg()[0]
out = {f"{k}@{t}": round(1e3 * statistics.median(v), 2) for (k, t), v in res.items()}
print(json.dumps({"chunk_steps": T, "ms": out, "rounds": {f"{k}@{t}": [round(1e3 * x, 1) for x in v] for (k, t), v in res.items()}, "load": load}))
