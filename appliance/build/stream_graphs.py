"""The stateful vocoder graphs of the ONNX Runtime export (fp32, int8 and int4 precisions).

ONNX Runtime's ``decoder`` and ``vocos`` graphs are the streaming passes of
:mod:`appliance.model.stream`: each call takes the new frames and every convolution's cache and
returns the output with the caches to keep (the runner holds them per KV slot).
``decoder_first`` and ``vocos_first`` are a sentence's first pass: no caches in, the layers padded
with zeros at the start as the one-shot pass, so no frame at a negative position is computed (in
the later-pass graph those frames, up to the receptive field per layer, cost as much as the first
window itself). They are exported separately and then merged into their network's graph
(:func:`merge_stream_pair`): one ``If`` on an input ``first`` over one copy of the FP32 weights
(:func:`share_weights` maps the first pass's weights onto the later pass's by content). Measured
at full size (2-core CPU, ONNX Runtime 1.32, 2026-12-02): two sessions held 252 MiB (Decoder) and
142 MiB (Vocos) after a pass each, the merged ones 151 and 99 MiB, the passes as fast.
The TensorRT input (fp16 export) keeps the stateless window graphs of :mod:`appliance.build.export`.

After the merge the ``decoder`` / ``vocos`` graph also takes ``first [] bool``: true runs the
first pass (``pos0`` and the caches are then not read: bind zeros), false the later pass below.

``decoder``
    in ``hidden [T, D] float32`` (new hidden states, T >= 1), ``pos0 [1] int64`` (mel frames
    already final: 2 x hidden states passed before), ``reach [R] uint8`` (its *length* ``R``,
    1..rf, is the Decoder's reach: the provisional frames recomputed per layer,
    :func:`appliance.model.stream.decoder_stream`; the values are not read: a shape carries it so
    that every frame count in the graph is a shape, not data), ``cache.i [C_i, 2 h_i]`` (graph
    dtype); out ``mel [100, R + 2T] float32`` (mel frames ``[pos0 - R, pos0 + 2T)``) and
    ``cache_out.i``. ``decoder_first``: in ``hidden`` and ``reach`` (pos0 = 0), the same outputs.
``vocos``
    in ``mel [100, F] float32`` (F >= 1), ``pos0 [1] int64`` (final mel frames passed before),
    ``n_final [1] int64`` (how many of the F frames are final), ``cache.i``; out ``real, imag
    [rf + F, 513] float32`` (spectrum frames ``[pos0 - rf, pos0 + F)``) and ``cache_out.i``.
    ``vocos_first``: in ``mel`` and ``n_final`` (pos0 = 0), the same outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..model.checkpoint import ChatTTSModel
from ..model.stream import (
    decoder_cache_shapes,
    decoder_stream,
    vocos_cache_shapes,
    vocos_stream,
    zero_caches,
)


class DecoderStreamGraph(nn.Module):
    """Later passes: (hidden [T, D], pos0 [1], reach [R], caches) -> (mel [100, R + 2T] float32,
    *caches); ``first``: (hidden, reach) -> the same outputs for a sentence's first pass (no
    caches read)."""

    def __init__(self, m: ChatTTSModel, first: bool = False):
        super().__init__()
        self.decoder, self.first = m.decoder, first

    def forward(self, hidden: torch.Tensor, pos0: torch.Tensor, reach: torch.Tensor | None = None,
                caches: list[torch.Tensor] | None = None):
        x = hidden.to(self.decoder.out_conv.weight.dtype).t().unsqueeze(0)
        if self.first:  # (hidden, reach)
            mel, new = decoder_stream(self.decoder, x, torch.zeros((), dtype=torch.int64), None, pos0.shape[0])
        else:
            mel, new = decoder_stream(self.decoder, x, pos0.reshape(()), caches, reach.shape[0])
        return (mel[0].float(), *new)


class VocosStreamGraph(nn.Module):
    """Later passes: (mel [100, F], pos0 [1], n_final [1], caches) -> (real, imag [rf + F, 513]
    float32, *caches); ``first``: (mel, n_final) -> the same for a sentence's first pass."""

    def __init__(self, m: ChatTTSModel, first: bool = False):
        super().__init__()
        self.vocos, self.first = m.vocos, first

    def forward(self, mel: torch.Tensor, pos0: torch.Tensor, n_final: torch.Tensor | None = None,
                caches: list[torch.Tensor] | None = None):
        x = mel.to(self.vocos.head.out.weight.dtype).unsqueeze(0)
        if self.first:  # (mel, n_final)
            re, im, new = vocos_stream(self.vocos, x, torch.zeros((), dtype=torch.int64), pos0.reshape(()), None)
        else:
            re, im, new = vocos_stream(self.vocos, x, pos0.reshape(()), n_final.reshape(()), caches)
        return (re[0].float(), im[0].float(), *new)


def stream_specs(m: ChatTTSModel, window_tokens: int, dtype: torch.dtype) -> dict[str, dict[str, Any]]:
    """Export specs (module, example args, dynamic shapes, names) of the four stateful graphs."""
    s = m.shapes
    Dim = torch.export.Dim
    T = Dim("T", min=1, max=window_tokens)
    Fm = Dim("F", min=1, max=2 * window_tokens)
    rf = sum(f // 2 for _, f in decoder_cache_shapes(m.decoder))
    R = Dim("R", min=1, max=rf)
    reach = torch.zeros(rf // 2 + 1, dtype=torch.uint8)
    dc = zero_caches(decoder_cache_shapes(m.decoder), dtype)
    vc = zero_caches(vocos_cache_shapes(m.vocos), dtype)
    one = torch.zeros(1, dtype=torch.int64)
    dco = [f"cache_out.{i}" for i in range(len(dc))]
    vco = [f"cache_out.{i}" for i in range(len(vc))]
    return {
        "decoder": dict(
            module=DecoderStreamGraph(m), args=(torch.randn(16, s.hidden), one + 32, reach, dc),
            dynamic=({0: T}, None, {0: R}, [None] * len(dc)),
            inputs=["hidden", "pos0", "reach"] + [f"cache.{i}" for i in range(len(dc))], outputs=["mel"] + dco, profiles=[]),
        "decoder_first": dict(
            module=DecoderStreamGraph(m, first=True), args=(torch.randn(16, s.hidden), reach), dynamic=({0: T}, {0: R}),
            inputs=["hidden", "reach"], outputs=["mel"] + dco, profiles=[]),
        "vocos": dict(
            module=VocosStreamGraph(m), args=(torch.randn(s.n_mels, 32), one + 64, one + 24, vc),
            dynamic=({1: Fm}, None, None, [None] * len(vc)),
            inputs=["mel", "pos0", "n_final"] + [f"cache.{i}" for i in range(len(vc))], outputs=["real", "imag"] + vco,
            profiles=[]),
        "vocos_first": dict(
            module=VocosStreamGraph(m, first=True), args=(torch.randn(s.n_mels, 32), one + 24), dynamic=({1: Fm}, None),
            inputs=["mel", "n_final"], outputs=["real", "imag"] + vco, profiles=[]),
    }


def share_weights(primary: Path, secondary: Path) -> int:
    """Make ``secondary`` (a first-pass graph) read its weights from ``primary``'s data file.

    Every initializer of ``secondary`` whose bytes equal one of ``primary``'s (the two graphs are
    exported from the same module, but the exporter names derived tensors ``val_N`` by order) is
    renamed to ``primary``'s name and pointed at ``primary``'s external data (same file, offset and
    length); what is left (index constants, a few hundred bytes) is stored inline. So the export
    holds each network's FP32 weights once, and a runner that shares initializers between the two
    sessions (:class:`appliance.engines.onnx.runner.OnnxRunner`) holds them once in memory.

    Returns:
        The number of initializers now shared.

    Raises:
        EngineError: a graph cannot be read, or a large initializer of ``secondary`` has no twin.
    """
    import hashlib

    import onnx
    from onnx import numpy_helper

    from ..errors import EngineError

    primary, secondary = Path(primary), Path(secondary)
    try:
        mp = onnx.load(str(primary), load_external_data=False)
        ms = onnx.load(str(secondary), load_external_data=True)
        data = (primary.parent / (primary.name + ".data")).read_bytes()
    except (OSError, ValueError) as e:
        raise EngineError(f"cannot read {primary} / {secondary} to share their weights: {e}") from e
    by_hash: dict[tuple[str, tuple[int, ...], int], onnx.TensorProto] = {}
    for t in mp.graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        if "location" in ext:
            off, n = int(ext.get("offset", 0)), int(ext["length"])
            by_hash[(hashlib.sha256(data[off:off + n]).hexdigest(), tuple(t.dims), t.data_type)] = t
    rename: dict[str, str] = {}
    kept = []
    twins: set[int] = set()
    for t in ms.graph.initializer:
        raw = numpy_helper.to_array(t).tobytes()
        twin = by_hash.get((hashlib.sha256(raw).hexdigest(), tuple(t.dims), t.data_type))
        if twin is not None:
            rename[t.name] = twin.name
            new = onnx.TensorProto()
            new.CopyFrom(twin)
            kept.append(new)
            twins.add(id(new))
        elif len(raw) > 65536:
            raise EngineError(f"{secondary.name}: initializer {t.name} ({len(raw)} bytes) has no twin in {primary.name}")
        else:
            kept.append(t)
    g = ms.graph
    # the secondary's own values that carry a name of the primary's weights get a prefix
    taken = {t.name for t in mp.graph.initializer}
    outputs = {o.name for o in g.output}
    for n in g.node:
        for x in n.output:
            if x in taken and x not in outputs:
                rename[x] = "first/" + x
    for t in kept:
        if t.name in taken and id(t) not in twins:
            rename[t.name] = "first/" + t.name
            t.name = rename[t.name]
    del g.initializer[:]
    g.initializer.extend(kept)

    def walk(graph):
        for n in graph.node:
            for i, x in enumerate(n.input):
                if x in rename:
                    n.input[i] = rename[x]
            for i, x in enumerate(n.output):
                if x in rename and rename[x].startswith("first/"):
                    n.output[i] = rename[x]
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)

    walk(g)
    (secondary.parent / (secondary.name + ".data")).unlink(missing_ok=True)
    onnx.save_model(ms, str(secondary))
    return len(rename)


def merge_first_pass(primary: Path, secondary: Path, dst: Path) -> None:
    """One graph for both passes of a network: ``If(first, then=secondary's nodes,
    else=primary's nodes)`` over one set of weights (run :func:`share_weights` first, so that the
    twin weights carry one name). Inputs: ``first [] bool`` and the union of the two graphs'
    inputs (the first pass ignores ``pos0`` and the caches: the runner binds small zero arrays);
    outputs: the two graphs' common outputs. The secondary's intermediate names get a ``first/``
    prefix so the branches do not collide.

    Raises:
        EngineError: a graph cannot be read, or the outputs differ.
    """
    import onnx
    from onnx import TensorProto, helper

    from ..errors import EngineError

    try:
        mp = onnx.load(str(primary), load_external_data=False)
        ms = onnx.load(str(secondary), load_external_data=False)
    except (OSError, ValueError) as e:
        raise EngineError(f"cannot read {primary} / {secondary} to merge them: {e}") from e
    gp, gs = mp.graph, ms.graph
    if [o.name for o in gp.output] != [o.name for o in gs.output]:
        raise EngineError(f"{primary.name} and {secondary.name} have different outputs")
    shared = {t.name for t in gp.initializer}
    outer = {i.name for i in gp.input} | {i.name for i in gs.input} | shared
    outs = [o.name for o in gp.output]

    def prefixed(g, pre: str):
        ren = {}
        for n in g.node:
            for o in n.output:
                if o and o not in outer:
                    ren[o] = pre + o
        for t in g.initializer:
            if t.name not in shared:
                ren[t.name] = pre + t.name
        return ren

    def branch(g, pre: str, name: str):
        ren = prefixed(g, pre)
        nodes = []
        for n in g.node:
            c = onnx.NodeProto()
            c.CopyFrom(n)
            c.name = pre + n.name
            for i, x in enumerate(c.input):
                c.input[i] = ren.get(x, x)
            for i, x in enumerate(c.output):
                c.output[i] = ren.get(x, x)
            nodes.append(c)
        own = []
        for t in g.initializer:
            if t.name not in shared:
                c = onnx.TensorProto()
                c.CopyFrom(t)
                c.name = ren[t.name]
                own.append(c)
        # branch outputs must be produced inside the branch: rename them and expose via Identity
        outs_b = []
        for o in g.output:
            inner = pre + "out/" + o.name
            for n in nodes:
                for i, x in enumerate(n.output):
                    if x == ren.get(o.name, o.name):
                        n.output[i] = inner
                for i, x in enumerate(n.input):
                    if x == ren.get(o.name, o.name):
                        n.input[i] = inner
            vi = onnx.ValueInfoProto()
            vi.CopyFrom(o)
            vi.name = inner
            outs_b.append(vi)
        return helper.make_graph(nodes, name, [], outs_b), own

    then_g, own_s = branch(gs, "first/", "first_pass")
    else_g, own_p = branch(gp, "next/", "next_pass")
    if_node = helper.make_node("If", ["first"], outs, name="first_or_next", then_branch=then_g, else_branch=else_g)
    inputs = [helper.make_tensor_value_info("first", TensorProto.BOOL, [])] + list(gp.input)
    names = {i.name for i in inputs}
    inputs += [i for i in gs.input if i.name not in names]
    g = helper.make_graph([if_node], "merged", inputs, list(gp.output), list(gp.initializer) + own_p + own_s)
    model = helper.make_model(g, opset_imports=list(mp.opset_import), ir_version=mp.ir_version)
    onnx.save_model(model, str(dst))


def merge_stream_pair(d: Path, g: str) -> None:
    """Replace ``d/<g>.onnx`` and ``d/<g>_first.onnx`` by one ``d/<g>.onnx`` holding both passes
    over one copy of the weights (:func:`share_weights`, then :func:`merge_first_pass`); the
    first-pass files are removed.

    Raises:
        EngineError: see the two steps.
    """
    d = Path(d)
    primary, secondary, tmp = d / f"{g}.onnx", d / f"{g}_first.onnx", d / f"{g}.merged.onnx"
    share_weights(primary, secondary)
    merge_first_pass(primary, secondary, tmp)
    tmp.replace(primary)
    secondary.unlink()


def merge_first_passes(d: Path, entries: dict, io: Callable[[Path], tuple[list, list]]) -> None:
    """:func:`merge_stream_pair` for each network (``decoder``, ``vocos``) exported with its
    first pass; ``entries`` (the manifest's ``graphs``) loses the ``<g>_first`` entries and gets
    the merged graph's ``inputs`` / ``outputs`` from ``io(onnx_file)``. The manifest written after
    this (:func:`appliance.engines.manifest.write`) records the sha256 of the merged files only.

    Raises:
        EngineError: see :func:`merge_stream_pair`.
    """
    for g in ("decoder", "vocos"):
        if g in entries and f"{g}_first" in entries:
            merge_stream_pair(d, g)
            ins, outs = io(Path(d) / f"{g}.onnx")
            entries[g].update(inputs=ins, outputs=outs)
            del entries[f"{g}_first"]
