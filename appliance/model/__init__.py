"""Our PyTorch definition of ChatTTS and its checkpoints.

Modules (import them directly; this package file imports nothing heavy):

* :mod:`.shapes`      – :class:`ModelShapes`, presets ``FULL`` and ``TINY``
* :mod:`.layout`      – the official file/key/shape table
* :mod:`.gpt`, :mod:`.embed`, :mod:`.decoder`, :mod:`.vocos` – the networks (torch)
* :mod:`.checkpoint`  – ``read_checkpoint``, ``load_model`` -> ``ChatTTSModel`` (torch)
* :mod:`.tensorfile`  – one safetensors file read once through a small buffer, hashed as read (no torch)
* :mod:`.assemble`    – those chunks into a meta-built model, on the device, in the final dtype (torch)
* :mod:`.integrity`   – the recorded sha256 of a checkpoint and the error for a mismatch (no torch)
* :mod:`.reverify`    – re-hash the mapped weight files in bounded background steps (no torch)
* :mod:`.fetch`       – download ``2Noise/ChatTTS`` and verify sha256 (no torch)

Random checkpoints and the ONNX export are tools built on this package: :mod:`appliance.build`.
"""
