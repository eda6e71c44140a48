"""Our PyTorch definition of ChatTTS and its checkpoints.

Modules (import them directly; this package file imports nothing heavy):

* :mod:`.shapes`      – :class:`ModelShapes`, presets ``FULL`` and ``TINY``
* :mod:`.layout`      – the official file/key/shape table
* :mod:`.gpt`, :mod:`.embed`, :mod:`.decoder`, :mod:`.vocos` – the networks (torch)
* :mod:`.checkpoint`  – ``read_checkpoint``, ``load_model`` -> ``ChatTTSModel`` (torch)
* :mod:`.fetch`       – download ``2Noise/ChatTTS`` and verify sha256 (no torch)

Random checkpoints and the ONNX export are tools built on this package: :mod:`appliance.build`.
"""
