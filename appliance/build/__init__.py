"""Build-time tools: ONNX export, TensorRT plans, random checkpoints, the ``engines`` CLI."""
