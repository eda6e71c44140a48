"""Host memory that each sampler kernel family loads into the CUDA driver (lazy module loading).

    python bench/sampler_heap_probe.py [--ops sort,cumsum,pairwise,...]

Each op family runs once in a fresh process after a CUDA context and one FP16 GEMM, and the
process's anonymous RSS growth (``/proc/self/status`` ``RssAnon``, MiB) is printed: on torch
2.11+cu130 the first call of a kernel loads its whole module, and the driver keeps the module's
host image (bench/RESULTS.md, the H200 heap probe). ``pairwise`` is the sort-free top-P/top-K
(ranks by comparison, masses by masked sums) the device sampler could use instead.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import sys, torch
def anon():
    for l in open('/proc/self/status'):
        if l.startswith('RssAnon'): return int(l.split()[1]) / 1024
op = sys.argv[1]
x = torch.randn(3, 4, 626, device='cuda')
a = torch.randn(256, 768, device='cuda', dtype=torch.float16); (a @ a.T).sum().item()
torch.cuda.synchronize(); base = anon()
if op == 'sort':
    s, i = torch.sort(x, dim=-1, stable=True)
elif op == 'softmax':
    s = x.softmax(-1)
elif op == 'cumsum':
    s = x.cumsum(-1)
elif op == 'topk':
    s = x.topk(20, dim=-1)
elif op == 'multinomial':
    s = torch.multinomial(x.softmax(-1).view(-1, 626), 1)
elif op == 'scatter_gather':
    s = torch.empty_like(x).scatter_(-1, x.argsort(-1)[..., :1] * 0, x[..., :1]); s = x.gather(-1, torch.zeros_like(x[..., :1], dtype=torch.long))
elif op == 'argmax':
    s = x.argmax(-1)
elif op == 'pairwise':
    p = x.softmax(-1)
    lt = (x[..., None, :] < x[..., :, None])                      # [.., i, j]: x_j < x_i
    rank = lt.sum(-1)
    cum = (p[..., None, :] * (x[..., None, :] <= x[..., :, None])).sum(-1)
    tri = torch.ones(626, 626, device='cuda').triu()
    c2 = p @ tri
    s = (rank, cum, c2)
elif op == 'all_current':
    s, i = torch.sort(x, dim=-1, stable=True); c = s.softmax(-1).cumsum(-1); t = s.gather(-1, torch.zeros_like(x[..., :1], dtype=torch.long))
    y = torch.empty_like(x).scatter_(-1, i, s); y.softmax(-1).cumsum(-1); y.argmax(-1)
torch.cuda.synchronize()
print(json.dumps({"op": op, "anon_growth_mib": round(anon() - base, 1)}) if False else '{"op": "%s", "anon_growth_mib": %.1f}' % (op, anon() - base))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default="softmax,argmax,cumsum,sort,topk,multinomial,scatter_gather,pairwise,all_current")
    a = ap.parse_args()
    for op in a.ops.split(","):
        p = subprocess.run([sys.executable, "-c", "import json\n" + CHILD, op], capture_output=True, text=True, timeout=120)
        line = [x for x in p.stdout.splitlines() if x.startswith("{")]
        print(line[-1] if line else json.dumps({"op": op, "error": p.stderr[-300:]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
