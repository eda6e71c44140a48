"""CUDA kernels of one decode step of the CUDA runner, by name (eager step body, B=3, KV 256):
the list that tells where two versions of the step differ. ``APPLIANCE_TREE=DIR`` profiles another
checkout (e.g. the tree before a change; it must have this tree's ``CudaRunner.start``, i.e. any
commit since the one-generation-path redesign). Prints one JSON object:
{"total": n, "kernels": {name: count}}.

Usage: ``python bench/step_kernels.py CHECKPOINT``
"""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("APPLIANCE_TREE") or str(ROOT))
if os.environ.get("APPLIANCE_TREE"):
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]


def main() -> int:
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    from appliance.config import config_from_dict
    from appliance.core import SamplingParams
    from appliance.engines.torch.cuda_runner import CudaRunner
    cfg = config_from_dict({"model": {"path": sys.argv[1], "backend": "torch", "device": "cuda", "dtype": "float16",
                                      "max_batch": 3, "max_seq_len": 256, "max_prompt_tokens": 64}})
    r = CudaRunner(cfg, buckets=[256], capture_batches=[3])
    for s in range(3):
        r.prefill(s, np.arange(1, 20), None)
        r.start(s, SamplingParams(), s)
    with torch.inference_mode():
        r._step_body(3, 256)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            r._step_body(3, 256)
            torch.cuda.synchronize()
    names = collections.Counter(e.name[:80] for e in p.events() if e.device_type.name == "CUDA")
    print(json.dumps({"total": sum(names.values()), "kernels": dict(names.most_common())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
