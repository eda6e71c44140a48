"""Load the official ChatTTS checkpoint layout (HF ``2Noise/ChatTTS`` ``asset/``) into our modules.

:func:`read_checkpoint` reads ``gpt/config.json`` and the safetensors files, infers the shapes
(:class:`~appliance.model.shapes.ModelShapes`) from the config and the tensors, and checks every
tensor against :mod:`appliance.model.layout`: all missing, unexpected and misshaped keys are
reported at once, each with its file. :func:`load_model` builds a :class:`ChatTTSModel` from it.

The GPT file's unused ``embed_tokens.weight`` is never read; Vocos's feature-extractor buffers
and ISTFT window are accepted and ignored; ``DVAE.safetensors`` is not read.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from . import layout
from .decoder import Decoder
from .embed import Embed, apply_speaker, fold_weight_norm
from .gpt import GPT
from .shapes import FULL, ModelShapes
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


def _read_tensors(path: Path, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if k not in skip}
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"cannot read {path}: {e}") from e


def _count(keys, pattern: str) -> int:
    rx = re.compile(pattern)
    return len({m.group(1) for k in keys if (m := rx.fullmatch(k))})


def _dim(t: dict[str, torch.Tensor], key: str, axis: int, default: int) -> int:
    return int(t[key].shape[axis]) if key in t and t[key].dim() > axis else default


@dataclass
class CheckpointTensors:
    """Validated host tensors of one checkpoint, per file, plus its shapes and paths."""

    asset: Path
    shapes: ModelShapes
    gpt: dict[str, torch.Tensor]
    embed: dict[str, torch.Tensor]
    decoder: dict[str, torch.Tensor]
    vocos: dict[str, torch.Tensor]
    special_ids: dict[str, int]

    @property
    def tokenizer_dir(self) -> Path:
        return self.asset / layout.TOKENIZER_DIR


def read_shapes(cfg: dict, gpt: dict, embed: dict, dec: dict, voc: dict) -> ModelShapes:
    """Shapes from ``config.json`` (GPT) and tensor shapes (Embed, Decoder, Vocos).

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


def check_tensors(file: str, tensors: dict[str, torch.Tensor], expected: dict[str, tuple],
                  optional: dict[str, tuple] | None = None) -> list[str]:
    """Compare ``tensors`` with ``expected`` (key -> shape); returns one problem line per bad key."""
    optional = optional or {}
    probs = []
    for k, shp in expected.items():
        if k not in tensors:
            probs.append(f"{file}: missing key {k!r} (shape {list(shp)})")
        elif tuple(tensors[k].shape) != tuple(shp):
            probs.append(f"{file}: key {k!r} has shape {list(tensors[k].shape)}, expected {list(shp)}")
    for k in tensors:
        if k in expected:
            continue
        if k in optional:
            if tuple(tensors[k].shape) != tuple(optional[k]):
                probs.append(f"{file}: key {k!r} has shape {list(tensors[k].shape)}, expected {list(optional[k])}")
            continue
        probs.append(f"{file}: unexpected key {k!r} (shape {list(tensors[k].shape)})")
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


def read_checkpoint(path: str | Path) -> CheckpointTensors:
    """Read and validate a checkpoint in the official layout (``path`` or ``path/asset``).

    Raises:
        CheckpointError: a file is missing or unreadable; any missing, unexpected or misshaped
            key (all listed, each with its file); inconsistent dimensions.
    """
    a = asset_dir(path)
    try:
        cfg = json.loads((a / layout.GPT_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {a / layout.GPT_CONFIG}: {e}") from e
    gpt = _read_tensors(a / layout.GPT_FILE, skip=layout.GPT_IGNORED)
    embed = _read_tensors(a / layout.EMBED_FILE)
    dec = _read_tensors(a / layout.DECODER_FILE)
    voc = _read_tensors(a / layout.VOCOS_FILE)
    for name in layout.TOKENIZER_FILES:
        if not (a / layout.TOKENIZER_DIR / name).is_file():
            raise CheckpointError(f"checkpoint file missing: {a / layout.TOKENIZER_DIR / name}")
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
    return CheckpointTensors(a, s, gpt, embed, dec, voc, special)


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


def build_model(ck: CheckpointTensors) -> ChatTTSModel:
    """Modules from validated tensors (weight norm folded). Float32, CPU.

    Raises:
        CheckpointError: a state dict does not load (should not happen after validation).
    """
    s = ck.shapes
    m = ChatTTSModel(s, ck.special_ids)
    emb = {k: v for k, v in ck.embed.items() if "parametrizations" not in k}
    emb["head_text.weight"] = fold_weight_norm(ck.embed["head_text.parametrizations.weight.original0"],
                                               ck.embed["head_text.parametrizations.weight.original1"])
    for i in range(s.num_vq):
        p = f"head_code.{i}.parametrizations.weight."
        emb[f"head_code.{i}.weight"] = fold_weight_norm(ck.embed[p + "original0"], ck.embed[p + "original1"])
    voc = {k: v for k, v in ck.vocos.items() if k in layout.vocos_keys(s)}
    try:
        with torch.no_grad():
            m.gpt.load_state_dict(ck.gpt, strict=True)
            m.embed.load_state_dict(emb, strict=True)
            m.decoder.load_state_dict(ck.decoder, strict=True)
            m.vocos.load_state_dict(voc, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {ck.asset}: {e}") from e
    return m.float().eval()


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> ChatTTSModel:
    """Read, validate and build the model from a checkpoint directory, on ``device`` in ``dtype``.

    Raises:
        CheckpointError: see :func:`read_checkpoint`.
    """
    m = build_model(read_checkpoint(path))
    m.gpt.rope_cos = m.gpt.rope_cos.float()
    m.gpt.rope_sin = m.gpt.rope_sin.float()
    m = m.to(device=device)
    for mod in (m.gpt.layers, m.gpt.norm, m.embed, m.decoder, m.vocos):
        mod.to(dtype=dtype)
    return m
