"""The graph-capture seam of the CUDA runner, and its attention-length buckets.

:class:`GraphSeam` turns a step function for one shape key into a replayable callable, captured
once: on CUDA a ``torch.cuda.CUDAGraph`` (all graphs share one memory pool; nothing in it is live
between replays), on a CPU the function itself, so tests run the same logic eagerly. This is what
gpt-fast does for its ``decode_one_token`` (pytorch-labs/gpt-fast ``generate.py``) with
``mode="reduce-overhead"``, done by hand so that one graph holds the whole step (embedding, 20
layers, heads, sampler, ring writes) and so that it also works where Triton is absent (JetPack's
PyTorch) with the plain eager step inside.
"""

from __future__ import annotations

from typing import Callable

import torch


class GraphSeam:
    """Capture ``fn`` once per key and hand back the replay (see module doc).

    Args:
        cuda: capture CUDA graphs (False: return ``fn`` itself).
        warmup: eager runs on a side stream before each capture (a compiled ``fn`` compiles there).

    ``before_capture()`` runs before each warm-up run and before the capture (resets state the
    warm-up mutates). ``captures`` counts captures per key.
    """

    def __init__(self, cuda: bool, warmup: int = 2):
        self.cuda, self.warmup = cuda, warmup
        self.graphs: dict = {}
        self.captures: dict = {}
        self._pool = None
        self._stream = None  # ONE warm-up stream: cuBLAS keeps a workspace per stream (tens of MiB each)

    def get(self, key, fn: Callable[[], None], before_capture: Callable[[], None] = lambda: None) -> Callable[[], None]:
        """The replay callable for ``key`` (captured on first use)."""
        g = self.graphs.get(key)
        if g is not None:
            return g
        self.captures[key] = self.captures.get(key, 0) + 1
        if not self.cuda:
            self.graphs[key] = fn
            return fn
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        s = self._stream
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(self.warmup):
                before_capture()
                fn()
        torch.cuda.current_stream().wait_stream(s)
        before_capture()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            fn()
        if self._pool is None:
            self._pool = graph.pool()
        self.graphs[key] = graph.replay
        return graph.replay

    def clear(self) -> None:
        """Drop every graph (their memory pool goes with them)."""
        self.graphs.clear()
        self._pool = None


def kv_buckets(max_seq: int, smallest: int = 256) -> list[int]:
    """Attention spans captured: powers of two from ``smallest`` below ``max_seq``, then ``max_seq``."""
    out, L = [], smallest
    while L < max_seq:
        out.append(L)
        L *= 2
    return out + [max_seq]


def bucket(buckets: list[int], n: int) -> int:
    """The smallest bucket >= ``n``; raises ValueError when none is."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
