"""The llama.cpp export (``chattts-appliance engines export --precision q8_0``): the GPT as
``gpt.gguf``, beside the FP32 ONNX Decoder and Vocos.

Writes ``<engine_dir>/llama/<type>/`` (type: :data:`TYPES`) holding:

``gpt.gguf``
    The Llama body as llama.cpp's ``llama`` architecture, written with the ``gguf`` package (the
    writer ggml's own converters use) at F32, then quantized by llama.cpp itself
    (``llama_model_quantize``, what ``llama-quantize`` runs) for every other type. Tensors
    (ggml names): ``blk.N.attn_q/k/v/output``, ``ffn_gate/up/down``, ``attn_norm``, ``ffn_norm``,
    ``output_norm`` and ``output.weight = head_code [Q*V, D]``: the four code heads as one output
    matrix of ``n_vocab = Q*V = 2504`` rows, so one decode gives every codebook's logits (row
    ``q*V + c`` = code ``c`` of codebook ``q``). ``token_embd.weight`` (required by the loader,
    unused: the runner feeds embeddings through the batch's ``embd``) is the fused code table of the
    same shape. The tokenizer is ``none`` (no vocabulary). Q and K rows are permuted from HF's
    ``rotate_half`` RoPE to ggml's adjacent-pair rotation, as llama.cpp's ``convert_hf_to_gguf.py``
    (``LlamaModel.permute``) does. llama.cpp's quantizer keeps the norms F32 and, for the 4-bit
    types, the output matrix at Q6_K (its ``Q4_K_M`` / ``Q4_0`` rules).
``embed.safetensors``
    ``emb_text [N, D]``, ``emb_code [Q, V, D]`` float32: the host computes the input embeddings.
``head_text.npy``
    The text head float32 ``[N, D]`` (refine-text: text logits = final hidden state x head_text^T,
    on the host; mapped, read only when refine runs).
``decoder.onnx`` / ``vocos.onnx`` (+ ``.data``)
    The stateful FP32 vocoder graphs of an ONNX Runtime export (:mod:`appliance.build.export`).
``manifest.json``
    ``kind: llama``, ``precision: <type>``, the checkpoint's identity and shapes, limits, and the
    sha256 of every file above (:mod:`appliance.engines.manifest`), checked at load.

Errors: :class:`~appliance.errors.ConfigError` (unknown type, llama-cpp-python / gguf missing),
:class:`~appliance.errors.EngineError` (writing or quantizing failed; names the file).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ..engines import manifest as mf
from ..engines.llama.lib import FTYPES
from ..errors import ConfigError, EngineError

log = logging.getLogger(__name__)

#: GGUF types offered, with llama.cpp's file type for each (``llama_ftype``).
TYPES = FTYPES
GGUF_FILE = "gpt.gguf"
HEAD_TEXT_FILE = "head_text.npy"
ARCH = "llama"


def rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q/k projection ``[H*hd, D]`` from HF's ``rotate_half`` order (each head's first
    half, then its second) to ggml's adjacent pairs (llama.cpp ``convert_hf_to_gguf.py``
    ``LlamaModel.permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """ggml name -> float32 array (numpy row-major ``[out, in]``) for the GPT of ``model``
    (:class:`appliance.model.checkpoint.ChatTTSModel`)."""
    s = model.shapes
    D, F = s.hidden, s.ffn

    def a(t) -> np.ndarray:
        return t.detach().float().contiguous().numpy()

    out = {"token_embd.weight": a(model.embed.emb_code.weight), "output_norm.weight": a(model.gpt.norm.weight),
           "output.weight": a(model.embed.head_code.weight)}
    for i, blk in enumerate(model.gpt.layers):
        qkv, gu = a(blk.self_attn.qkv.weight), a(blk.mlp.gate_up.weight)
        p = f"blk.{i}."
        out.update({
            p + "attn_norm.weight": a(blk.input_layernorm.weight),
            p + "attn_q.weight": rope_permute(qkv[:D], s.n_heads),
            p + "attn_k.weight": rope_permute(qkv[D:2 * D], s.n_heads),
            p + "attn_v.weight": qkv[2 * D:],
            p + "attn_output.weight": a(blk.self_attn.o_proj.weight),
            p + "ffn_norm.weight": a(blk.post_attention_layernorm.weight),
            p + "ffn_gate.weight": gu[:F],
            p + "ffn_up.weight": gu[F:],
            p + "ffn_down.weight": a(blk.mlp.down_proj.weight),
        })
    return out


def write_gguf(model, path: Path, name: str = "chattts-gpt") -> None:
    """Write the F32 GGUF of ``model``'s GPT to ``path`` (see module doc).

    Raises:
        ConfigError: the ``gguf`` package is missing.
    """
    try:
        import gguf
    except ImportError as e:
        raise ConfigError(f"writing gpt.gguf needs the gguf package: pip install 'chattts-appliance[llama]' ({e})") from e
    s = model.shapes
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name(name)
    w.add_context_length(s.max_pos)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.n_layers)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_heads)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(float(s.rope_theta))
    w.add_layer_norm_rms_eps(float(s.rms_eps))
    w.add_vocab_size(s.num_vq * s.num_audio_tokens)
    w.add_file_type(TYPES["f32"])
    w.add_tokenizer_model("none")
    for k, v in gguf_tensors(model).items():
        w.add_tensor(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(src: Path, dst: Path, qtype: str, threads: int = 0) -> None:
    """``llama_model_quantize`` ``src`` (F32 GGUF) into ``dst`` at ``qtype`` (:data:`TYPES`).

    Raises:
        ConfigError: llama-cpp-python is missing, or built for CPU features this CPU lacks
            (checked before its library loads, :mod:`appliance.engines.llama.cpu`).
        EngineError: llama.cpp refused (names both files).
    """
    from ..engines.llama import cpu

    cpu.require()
    try:
        import llama_cpp as lc
    except ImportError as e:
        raise ConfigError(f"quantizing gpt.gguf needs llama-cpp-python: pip install 'chattts-appliance[llama]' ({e})") from e
    p = lc.llama_model_quantize_default_params()
    p.ftype = TYPES[qtype]
    p.nthread = threads
    rc = lc.llama_model_quantize(str(src).encode(), str(dst).encode(), p)
    if rc != 0:
        raise EngineError(f"llama.cpp could not quantize {src} to {qtype} ({dst}): return code {rc}")


def export_llama(ckpt_dir: str | Path, engine_dir: str | Path, *, qtype: str = "q8_0", max_batch: int = 3,
                 max_seq_len: int = 2048, max_prompt_tokens: int = 256, window_tokens: int | None = None,
                 progress: Callable[[str], None] | None = None) -> Path:
    """Export ``ckpt_dir`` for the llama.cpp backend into ``<engine_dir>/llama/<qtype>/`` (see
    module doc); returns that directory. ``progress(step)`` is called before each step.

    Raises:
        CheckpointError, ConfigError, EngineError: see module doc.
    """
    import torch

    from ..model.checkpoint import load_model
    from .export import WINDOW_TOKENS, export_all

    if qtype not in TYPES:
        raise ConfigError(f"GGUF type {qtype!r}: one of {', '.join(TYPES)}")
    out = Path(engine_dir) / "llama" / qtype
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{qtype}-", dir=out.parent))
    try:
        if progress:
            progress("vocoder")
        voc = export_all(ckpt_dir, stage, precision="fp32", max_batch=max_batch, max_seq_len=max_seq_len,
                         max_prompt_tokens=max_prompt_tokens, window_tokens=window_tokens or WINDOW_TOKENS,
                         graphs=("decoder", "vocos"))
        vm = mf.read(voc)
        if progress:
            progress("gguf")
        t0 = time.perf_counter()
        m = load_model(ckpt_dir, dtype=torch.float32)
        f32 = stage / ("gpt-f32.gguf" if qtype != "f32" else GGUF_FILE)
        write_gguf(m, f32)
        t_write = time.perf_counter() - t0
        with torch.no_grad():
            np.save(voc / HEAD_TEXT_FILE, m.embed.head_text.weight.float().contiguous().numpy())
        t1 = time.perf_counter()
        if qtype != "f32":
            if progress:
                progress(f"quantize {qtype}")
            quantize(f32, voc / GGUF_FILE, qtype)
            f32.unlink()
        else:
            shutil.move(str(f32), voc / GGUF_FILE)
        t_quant = time.perf_counter() - t1
        s = m.shapes
        vm.pop("files", None)
        vm.pop("format", None)
        vm.pop("created", None)
        vm.update({
            "kind": "llama", "precision": qtype,
            "runtime": {"name": "llama.cpp", "version": _llama_version(), "torch": torch.__version__},
            "gguf": {"file": GGUF_FILE, "type": qtype, "arch": ARCH, "n_vocab": s.num_vq * s.num_audio_tokens,
                     "write_s": round(t_write, 2), "quantize_s": round(t_quant, 2)},
            "head_text": {"file": HEAD_TEXT_FILE},
        })
        vm["graphs"] = {"gpt": {"file": GGUF_FILE, "inputs": [], "outputs": [], "profiles": []}, **vm["graphs"]}
        vm["build"]["quantization"] = {"gpt": f"gguf-{qtype}"}
        vm["build"]["vocoder_precision"] = "fp32"
        mf.write(voc, vm)  # the sha256 of every file above, head_text included (mf.weight_files)
        if out.exists():
            shutil.rmtree(out)
        shutil.move(str(voc), out)
        log.info("exported %s: gguf written in %.1f s, quantized in %.1f s", out, t_write, t_quant)
        return out
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _llama_version() -> str:
    try:
        import llama_cpp

        return str(getattr(llama_cpp, "__version__", "?"))
    except ImportError:
        return "not installed"
