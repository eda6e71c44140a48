"""Precision rewrites of exported ONNX graphs (no torch needed).

TensorRT-RTX and TensorRT 10 build *strongly typed* networks: there are no FP16/INT8/FP8
builder flags, the graph itself says what each tensor is. So:

* :func:`qdq_weights` — weight-only quantization for TensorRT: every constant weight of a
  ``MatMul`` (``[K, N]``) or ``Gemm`` (``transB``: ``[N, K]``) becomes an INT8 (symmetric,
  per output channel, scale = max|w| / 127) or FP8 E4M3 (per tensor, scale = max|w| / 448)
  initializer followed by ``DequantizeLinear`` back to the graph's float type. Activations stay
  FP16. This is TensorRT's "weight-only quantization" pattern (TensorRT developer guide,
  *Explicit Quantization* / *Weight-only quantization*). FP8 needs opset 19 (the graph's opset
  is raised) and an sm >= 8.9 target; the caller checks the target first.
* :func:`matmul_nbits` — weight-only quantization for ONNX Runtime on CPU: constant-weight
  MatMuls become ``com.microsoft.MatMulNBits`` (8-bit, blockwise, symmetric) through
  onnxruntime's own ``MatMulNBitsQuantizer``. Measured: ``quantize_dynamic`` INT8
  (activation quantization) at 28-38 ms/step; weight-only blockwise is what this uses instead.

Both read ``src`` and write ``dst`` (weights in ``dst.data``), and return the number of
rewritten weights. Raise :class:`~appliance.errors.EngineError` when a file cannot be rewritten.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ..errors import EngineError

log = logging.getLogger(__name__)


def _save(model, dst: Path) -> None:
    import onnx

    dst = Path(dst)
    data = dst.with_name(dst.name + ".data")
    data.unlink(missing_ok=True)
    onnx.save_model(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)


def qdq_weights(src: str | Path, dst: str | Path, kind: str) -> int:
    """Rewrite constant MatMul/Gemm weights of ``src`` as INT8 or FP8 + DequantizeLinear.

    Args:
        kind: ``int8`` (per-channel) or ``fp8`` (E4M3, per-tensor).

    Returns:
        The number of weights rewritten.

    Raises:
        EngineError: unreadable graph or unknown ``kind``.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if kind not in ("int8", "fp8"):
        raise EngineError(f"qdq_weights: kind {kind!r} must be int8 or fp8")
    try:
        model = onnx.load(str(src), load_external_data=True)
    except Exception as e:  # onnx raises DecodeError / OSError / ValueError
        raise EngineError(f"cannot read ONNX graph {src}: {e}") from e
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    uses: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1
    new_nodes = []
    done = 0
    for n in g.node:
        if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1 and n.input[1] in inits:
            w_t = inits[n.input[1]]
            w = numpy_helper.to_array(w_t)
            if w.ndim == 2 and w.dtype in (np.float16, np.float32) and w.size >= 4096 and uses.get(w_t.name, 0) == 1:
                trans_b = any(a.name == "transB" and a.i for a in n.attribute) if n.op_type == "Gemm" else False
                axis = 0 if trans_b else 1
                w32 = w.astype(np.float32)
                if kind == "int8":
                    amax = np.abs(w32).max(axis=1 - axis, keepdims=True)
                    scale = np.maximum(amax, 1e-8) / 127.0
                    q = np.clip(np.rint(w32 / scale), -127, 127).astype(np.int8)
                    q_t = numpy_helper.from_array(q, w_t.name + "_q")
                    s_t = numpy_helper.from_array(scale.reshape(-1).astype(w.dtype), w_t.name + "_scale")
                    attrs = {"axis": axis}
                else:
                    import ml_dtypes

                    amax = float(np.abs(w32).max())
                    scale = np.array(max(amax, 1e-8) / 448.0, np.float32)
                    q = (w32 / scale).astype(ml_dtypes.float8_e4m3fn)
                    q_t = helper.make_tensor(w_t.name + "_q", TensorProto.FLOAT8E4M3FN, list(q.shape),
                                             q.view(np.uint8).tobytes(), raw=True)
                    s_t = numpy_helper.from_array(scale.astype(w.dtype), w_t.name + "_scale")
                    attrs = {}
                g.initializer.remove(w_t)
                g.initializer.extend([q_t, s_t])
                dq = helper.make_node("DequantizeLinear", [q_t.name, s_t.name], [w_t.name],
                                      name=w_t.name + "_dq", **attrs)
                new_nodes.append(dq)
                done += 1
        new_nodes.append(n)
    del g.node[:]
    g.node.extend(new_nodes)
    if kind == "fp8":
        for op in model.opset_import:
            if op.domain in ("", "ai.onnx") and op.version < 19:
                op.version = 19
    _save(model, Path(dst))
    log.info("%s: %d weights -> %s + DequantizeLinear", Path(dst).name, done, kind)
    return done


def matmul_nbits(src: str | Path, dst: str | Path, bits: int = 8, block_size: int = 32, accuracy_level: int = 4) -> int:
    """Rewrite constant-weight MatMuls as ``MatMulNBits`` (ONNX Runtime CPU weight-only).

    Args:
        bits: 8 or 4. block_size: weights per scale (16..256, power of 2).
        accuracy_level: onnxruntime's compute type for the activations (0 = as the graph,
            4 = int8; 4 is the fast CPU path).

    Returns:
        The number of MatMulNBits nodes in ``dst``.

    Raises:
        EngineError: the quantizer failed.
    """
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # the quantizer logs one INFO line per graph node; keep its warnings only
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    try:
        model = onnx.load(str(src), load_external_data=True)
        q = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=True,
                                 accuracy_level=accuracy_level, op_types_to_quantize=("MatMul",))
        q.process()
        out = q.model.model
    except Exception as e:  # the quantizer raises assorted errors
        raise EngineError(f"MatMulNBits quantization of {src} failed: {type(e).__name__}: {e}") from e
    _save(out, Path(dst))
    n = sum(1 for nd in out.graph.node if nd.op_type == "MatMulNBits")
    log.info("%s: %d MatMulNBits (%d-bit, block %d)", Path(dst).name, n, bits, block_size)
    return n


def fuse_norms(src: str | Path, dst: str | Path) -> int:
    """Fuse every RMSNorm (``Pow -> ReduceMean -> Add -> Sqrt -> Reciprocal -> Mul -> Mul``) into
    ``SimplifiedLayerNormalization`` and a residual ``Add`` followed by one into
    ``SkipSimplifiedLayerNormalization`` (ONNX Runtime's transformer optimizer fusions;
    com.microsoft ops, ONNX Runtime and OpenVINO read them).

    Returns:
        The number of fused norms in ``dst``.

    Raises:
        EngineError: the graph cannot be read or rewritten.
    """
    import onnx
    from onnxruntime.transformers.fusion_simplified_layernorm import (
        FusionSimplifiedLayerNormalization,
        FusionSkipSimplifiedLayerNormalization,
    )
    from onnxruntime.transformers.onnx_model import OnnxModel

    try:
        om = OnnxModel(onnx.load(str(src), load_external_data=True))
        FusionSimplifiedLayerNormalization(om).apply()
        FusionSkipSimplifiedLayerNormalization(om).apply()
        om.prune_graph()
    except Exception as e:  # the fusions raise assorted errors on unexpected graphs
        raise EngineError(f"norm fusion of {src} failed: {type(e).__name__}: {e}") from e
    _save(om.model, Path(dst))
    n = sum(1 for nd in om.model.graph.node if "SimplifiedLayerNormalization" in nd.op_type)
    log.info("%s: %d fused RMSNorms", Path(dst).name, n)
    return n
