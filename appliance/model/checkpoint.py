"""Load the official ChatTTS checkpoint layout (HF ``2Noise/ChatTTS`` ``asset/``) into our modules.

:func:`read_checkpoint` reads ``gpt/config.json`` and the safetensors *headers*, infers the shapes
(:class:`~appliance.model.shapes.ModelShapes`) from the config and the tensor shapes, and checks
every tensor against :mod:`appliance.model.layout`: all missing, unexpected and misshaped keys are
reported at once, each with its file, before any weight is read. :func:`load_model` then builds a
:class:`ChatTTSModel` on the ``meta`` device and streams each file once into it
(:mod:`appliance.model.tensorfile` reads and hashes, :mod:`appliance.model.assemble` copies each
tensor to the device in its final dtype and fuses there), comparing every file's sha256 with its
recorded sum (:mod:`appliance.model.integrity`) before the model is returned. Peak host memory is
the model's final host part plus one 16 MiB buffer; what the load allocated on the host is handed
back to the OS before it returns (:func:`release_host_memory`).

The GPT file's unused ``embed_tokens.weight`` is never loaded (but hashed); Vocos's
feature-extractor buffers and ISTFT window are accepted and ignored; ``DVAE.safetensors`` is not read.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..errors import CheckpointError
from . import layout
from .assemble import Assembler, empty_model
from .decoder import Decoder
from .embed import Embed, apply_speaker
from .gpt import GPT
from .integrity import Sums
from .shapes import FULL, ModelShapes
from .tensorfile import CHUNK_BYTES, TensorFile
from .vocos import Vocos

log = logging.getLogger(__name__)


def asset_dir(path: str | Path) -> Path:
    """The ``asset/`` directory of a checkpoint: ``path/asset`` or ``path`` itself.

    Raises:
        CheckpointError: neither holds ``gpt/config.json``.
    """
    p = Path(path)
    for cand in (p / "asset", p):
        if (cand / layout.GPT_CONFIG).is_file():
            return cand
    raise CheckpointError(
        f"{p} is not a ChatTTS checkpoint: no asset/{layout.GPT_CONFIG} under it. Point model.path at a "
        "directory holding asset/ (official 2Noise/ChatTTS layout), or write a random one with "
        "'chattts-appliance model random --size tiny DIR'."
    )


def _count(keys, pattern: str) -> int:
    rx = re.compile(pattern)
    return len({m.group(1) for k in keys if (m := rx.fullmatch(k))})


Shapes = dict[str, tuple[int, ...]]

#: The weight files a model is made of: (part of :class:`ChatTTSModel`, file relative to ``asset/``).
PARTS = (("gpt", layout.GPT_FILE), ("embed", layout.EMBED_FILE), ("decoder", layout.DECODER_FILE),
         ("vocos", layout.VOCOS_FILE))


def _dim(t: Shapes, key: str, axis: int, default: int) -> int:
    return int(t[key][axis]) if key in t and len(t[key]) > axis else default


@dataclass
class CheckpointFiles:
    """A validated checkpoint: its shapes, the headers of its weight files (``files``: part ->
    :class:`~appliance.model.tensorfile.TensorFile`; no weight read yet), the control-token ids
    and the sha256 of the ``gpt/config.json`` bytes that were parsed."""

    asset: Path
    shapes: ModelShapes
    files: dict[str, TensorFile]
    special_ids: dict[str, int]
    config_sha256: str


def read_shapes(cfg: dict, gpt: Shapes, embed: Shapes, dec: Shapes, voc: Shapes) -> ModelShapes:
    """Shapes from ``config.json`` (GPT) and tensor shapes ``{key: shape}`` (Embed, Decoder, Vocos).

    Raises:
        CheckpointError: config.json lacks a GPT dimension or asks for GQA / bias.
    """
    try:
        hidden = int(cfg["hidden_size"])
        n_layers = int(cfg["num_hidden_layers"])
        n_heads = int(cfg["num_attention_heads"])
        ffn = int(cfg["intermediate_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{layout.GPT_CONFIG}: missing or bad key {e}") from e
    kv = cfg.get("num_key_value_heads") or n_heads
    if int(kv) != n_heads:
        raise CheckpointError(f"{layout.GPT_CONFIG}: num_key_value_heads {kv} != num_attention_heads {n_heads} (GQA is not supported)")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise CheckpointError(f"{layout.GPT_CONFIG}: attention_bias / mlp_bias are not supported")
    rope = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or FULL.rope_theta)
    return ModelShapes(
        hidden=hidden, n_layers=n_layers, n_heads=n_heads, ffn=ffn,
        max_pos=int(cfg.get("max_position_embeddings") or FULL.max_pos),
        rope_theta=theta, rms_eps=float(cfg.get("rms_norm_eps") or FULL.rms_eps),
        num_text_tokens=_dim(embed, "emb_text.weight", 0, int(cfg.get("num_text_tokens") or FULL.num_text_tokens)),
        num_audio_tokens=_dim(embed, "emb_code.0.weight", 0, FULL.num_audio_tokens),
        num_vq=_count(embed, r"emb_code\.(\d+)\.weight") or FULL.num_vq,
        dec_idim=_dim(dec, "decoder.conv_in.0.weight", 1, hidden // 2),
        dec_odim=_dim(dec, "decoder.conv_out.weight", 0, hidden // 2),
        dec_hidden=_dim(dec, "decoder.conv_in.2.weight", 0, FULL.dec_hidden),
        dec_layers=_count(dec, r"decoder\.decoder_block\.(\d+)\.dwconv\.weight"),
        dec_bn=_dim(dec, "decoder.conv_in.0.weight", 0, FULL.dec_bn),
        voc_dim=_dim(voc, "backbone.embed.weight", 0, FULL.voc_dim),
        voc_intermediate=_dim(voc, "backbone.convnext.0.pwconv1.weight", 0, FULL.voc_intermediate),
        voc_layers=_count(voc, r"backbone\.convnext\.(\d+)\.dwconv\.weight"),
        n_fft=_dim(voc, "head.out.weight", 0, FULL.n_fft + 2) - 2,
        n_mels=_dim(dec, "out_conv.weight", 0, FULL.n_mels),
    )


def check_tensors(file: str, tensors: Shapes, expected: dict[str, tuple],
                  optional: dict[str, tuple] | None = None) -> list[str]:
    """Compare the shapes ``tensors`` (key -> shape) with ``expected``; one problem line per bad key."""
    optional = optional or {}
    probs = []
    for k, shp in expected.items():
        if k not in tensors:
            probs.append(f"{file}: missing key {k!r} (shape {list(shp)})")
        elif tuple(tensors[k]) != tuple(shp):
            probs.append(f"{file}: key {k!r} has shape {list(tensors[k])}, expected {list(shp)}")
    for k in tensors:
        if k in expected:
            continue
        if k in optional:
            if tuple(tensors[k]) != tuple(optional[k]):
                probs.append(f"{file}: key {k!r} has shape {list(tensors[k])}, expected {list(optional[k])}")
            continue
        probs.append(f"{file}: unexpected key {k!r} (shape {list(tensors[k])})")
    return probs


def read_special_ids(tok_dir: Path) -> dict[str, int]:
    """Ids of the added (control and BERT special) tokens from ``tokenizer/tokenizer.json``.

    Raises:
        CheckpointError: the file is missing or not a tokenizers JSON.
    """
    f = tok_dir / "tokenizer.json"
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
        return {t["content"]: int(t["id"]) for t in data.get("added_tokens", [])}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"cannot read tokenizer {f}: {e}") from e


def read_checkpoint(path: str | Path) -> CheckpointFiles:
    """Read and validate a checkpoint in the official layout (``path`` or ``path/asset``): the config
    and the safetensors headers only, no weights.

    Raises:
        CheckpointError: a file is missing or unreadable; any missing, unexpected or misshaped
            key (all listed, each with its file); inconsistent dimensions.
    """
    a = asset_dir(path)
    try:
        raw = (a / layout.GPT_CONFIG).read_bytes()
        cfg = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {a / layout.GPT_CONFIG}: {e}") from e
    files = {part: TensorFile(a / rel) for part, rel in PARTS}
    for name in layout.TOKENIZER_FILES:
        if not (a / layout.TOKENIZER_DIR / name).is_file():
            raise CheckpointError(f"checkpoint file missing: {a / layout.TOKENIZER_DIR / name}")
    gpt = {k: v for k, v in files["gpt"].shapes().items() if k not in layout.GPT_IGNORED}
    embed, dec, voc = (files[p].shapes() for p in ("embed", "decoder", "vocos"))
    s = read_shapes(cfg, gpt, embed, dec, voc)
    if s.hidden % s.n_heads:
        raise CheckpointError(f"{layout.GPT_CONFIG}: hidden_size {s.hidden} not divisible by num_attention_heads {s.n_heads}")
    probs = (
        check_tensors(layout.GPT_FILE, gpt, layout.gpt_keys(s))
        + check_tensors(layout.EMBED_FILE, embed, layout.embed_keys(s))
        + check_tensors(layout.DECODER_FILE, dec, layout.decoder_keys(s))
        + check_tensors(layout.VOCOS_FILE, voc, layout.vocos_keys(s), layout.vocos_buffers(s))
    )
    if not probs and 2 * s.dec_idim != s.hidden:
        probs.append(f"{layout.DECODER_FILE}: decoder input width {s.dec_idim} must be hidden_size/2 = {s.hidden // 2}")
    if probs:
        raise CheckpointError(f"checkpoint {a} does not match the ChatTTS layout:\n  " + "\n  ".join(probs))
    special = read_special_ids(a / layout.TOKENIZER_DIR)
    log.info("checkpoint %s: D=%d layers=%d heads=%d text vocab=%d", a, s.hidden, s.n_layers, s.n_heads, s.num_text_tokens)
    return CheckpointFiles(a, s, files, special, hashlib.sha256(raw).hexdigest())


class ChatTTSModel(torch.nn.Module):
    """The four inference parts with small helpers. Build with :func:`load_model`.

    Attributes: ``gpt`` (:class:`GPT`), ``embed`` (:class:`Embed`), ``decoder`` (:class:`Decoder`),
    ``vocos`` (:class:`Vocos`), ``shapes``, ``special_ids`` (token -> id), ``spk_emb_id``.
    """

    def __init__(self, s: ModelShapes, special_ids: dict[str, int] | None = None):
        super().__init__()
        self.shapes = s
        self.gpt = GPT(s)
        self.embed = Embed(s)
        self.decoder = Decoder(s)
        self.vocos = Vocos(s)
        self.special_ids = dict(special_ids or {})
        self.spk_emb_id = self.special_ids.get("[spk_emb]", -1)

    def embed_prompt(self, ids: torch.Tensor, spk_emb: torch.Tensor | None = None) -> torch.Tensor:
        """Text prompt ``ids [T]`` int64 (+ speaker ``[D]`` or None) -> ``[1, T, D]``; the
        ``[spk_emb]`` positions get the L2-normalised speaker vector (upstream ``Speaker.apply``)."""
        emb = self.embed.embed_text(ids)
        if spk_emb is not None:
            emb = apply_speaker(emb, ids, spk_emb, self.spk_emb_id)
        return emb.unsqueeze(0)

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes [B, Q]`` int64 -> ``[B, 1, D]`` (sum of the Q code embeddings)."""
        return self.embed.embed_codes(codes).unsqueeze(1)

    def audio_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [B, D]`` -> ``[B, Q, V]``."""
        return self.embed.audio_logits(hidden)


def release_host_memory() -> bool:
    """Return what a load freed to the OS: ``gc.collect()`` then glibc's ``malloc_trim(0)`` (freed
    heap pages below the top of the heap otherwise stay resident). True if ``malloc_trim`` ran
    (glibc only; a no-op elsewhere, e.g. musl or macOS)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, *,
               vocoder_dtype: Optional[torch.dtype] = None, quant: Optional[str] = None, text_head: bool = True,
               verify: bool = True) -> ChatTTSModel:
    """Read, validate, verify and build the model from a checkpoint directory, straight on ``device``.

    Args:
        path: the checkpoint (``path`` or ``path/asset``).
        device: where every weight goes (the host holds one 16 MiB read buffer beside it).
        dtype: the GPT's and Embed's dtype, and the Decoder's and Vocos' unless ``vocoder_dtype``.
        vocoder_dtype: the Decoder's and Vocos' dtype (None: ``dtype``).
        quant: None, ``int8`` or ``fp8``: the GPT block linears weight-only (:mod:`appliance.model.quant`),
            quantized from the checkpoint's float32 values.
        text_head: keep the text head (refine-text); False leaves ``embed.head_text`` an identity.
        verify: compare each file's sha256, computed while it is read, with its recorded sum
            (``SHA256SUMS.json`` beside ``asset/``, else upstream's map); also ``gpt/config.json``.

    The RoPE tables stay float32 (cast per call). Returns the model in eval mode; its
    ``verified_files`` attribute lists ``(file, sha256)`` of what was verified (empty without ``verify``).

    Raises:
        CheckpointError: see :func:`read_checkpoint`; a file could not be read.
        IntegrityError: a file's sha256 differs from its recorded sum (names the file, both sums
            and what to do); the model is discarded.
    """
    t0 = time.perf_counter()
    ck = read_checkpoint(path)
    sums = Sums.of(ck.asset) if verify else None
    verified: list[tuple[Path, str]] = []
    if sums is not None:
        verified.append((ck.asset / layout.GPT_CONFIG, sums.check(layout.GPT_CONFIG, ck.config_sha256)))
    dev = torch.device(device)
    with empty_model():
        m = ChatTTSModel(ck.shapes, ck.special_ids)
    voc = vocoder_dtype or dtype
    asm = Assembler(m, dev, {"gpt": dtype, "embed": dtype, "decoder": voc, "vocos": voc}, quant=quant, text_head=text_head)
    buf = np.empty(CHUNK_BYTES, np.uint8)
    for part, rel in PARTS:
        digest = ck.files[part].stream(asm.sink(part), asm.wanted(part), buf=buf, digest=verify)
        if sums is not None:
            verified.append((ck.asset / rel, sums.check(rel, digest)))
    del buf
    m = asm.finish()
    m.verified_files = verified
    release_host_memory()
    log.info("loaded %s onto %s in %.2f s (%s)", ck.asset, dev, time.perf_counter() - t0,
             f"{len(verified)} files match {sums.source}" if sums is not None else "sha256 not checked")
    return m
