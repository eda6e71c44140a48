"""The official checkpoint layout: which file holds which tensor, with which shape.

Key names are exactly upstream's (``state_dict`` of the PyPI ``chattts`` 0.2.5 modules, HF
``LlamaModel`` naming for the GPT, vocos 0.1.0 for Vocos), so the same table drives both the
loader's checks (:mod:`appliance.model.checkpoint`) and the random checkpoint writer
(:mod:`appliance.build.random_ckpt`).

Files, relative to the ``asset/`` directory::

    gpt/config.json         HF LlamaConfig + ChatTTS keys
    gpt/model.safetensors   LlamaModel (with an unused ``embed_tokens.weight``, vocab_size x D)
    Embed.safetensors       emb_code.N, emb_text, head_text / head_code.N (weight norm g, v)
    Decoder.safetensors     upstream DVAE used as hidden->mel Decoder (+ coef [1, 100, 1])
    DVAE.safetensors        DVAE with encoder + GFSQ (only for voice cloning; not loaded here)
    Vocos.safetensors       feature_extractor buffers, backbone.*, head.out.*, head.istft.window
    tokenizer/              tokenizer.json, tokenizer_config.json, special_tokens_map.json
"""

from __future__ import annotations

from .shapes import ModelShapes

GPT_CONFIG = "gpt/config.json"
GPT_FILE = "gpt/model.safetensors"
EMBED_FILE = "Embed.safetensors"
DECODER_FILE = "Decoder.safetensors"
DVAE_FILE = "DVAE.safetensors"
VOCOS_FILE = "Vocos.safetensors"
TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

#: HF vocab_size of the unused ``embed_tokens`` in the real gpt/model.safetensors.
GPT_VOCAB_SIZE = 32000

Shape = tuple[int, ...]


def gpt_keys(s: ModelShapes) -> dict[str, Shape]:
    """Tensors of ``gpt/model.safetensors`` that the model uses (``embed_tokens`` excluded)."""
    d, f = s.hidden, s.ffn
    out: dict[str, Shape] = {}
    for i in range(s.n_layers):
        p = f"layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[p + f"self_attn.{n}.weight"] = (d, d)
        out[p + "mlp.gate_proj.weight"] = (f, d)
        out[p + "mlp.up_proj.weight"] = (f, d)
        out[p + "mlp.down_proj.weight"] = (d, f)
        out[p + "input_layernorm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (d,)
    out["norm.weight"] = (d,)
    return out


#: Keys present in the GPT file that are skipped (not checked for shape beyond being 2-D).
GPT_IGNORED = ("embed_tokens.weight",)


def embed_keys(s: ModelShapes) -> dict[str, Shape]:
    """Tensors of ``Embed.safetensors`` (weight norm as torch parametrizations: original0 = g, original1 = v)."""
    d, v, t = s.hidden, s.num_audio_tokens, s.num_text_tokens
    out: dict[str, Shape] = {}
    for i in range(s.num_vq):
        out[f"emb_code.{i}.weight"] = (v, d)
    out["emb_text.weight"] = (t, d)
    out["head_text.parametrizations.weight.original0"] = (t, 1)
    out["head_text.parametrizations.weight.original1"] = (t, d)
    for i in range(s.num_vq):
        out[f"head_code.{i}.parametrizations.weight.original0"] = (v, 1)
        out[f"head_code.{i}.parametrizations.weight.original1"] = (v, d)
    return out


def _dvae_decoder_keys(prefix: str, idim: int, odim: int, hidden: int, n_layer: int, bn: int) -> dict[str, Shape]:
    """Upstream ``DVAEDecoder`` (conv_in, ConvNeXt blocks k7 dilation 2, conv_out)."""
    out: dict[str, Shape] = {
        prefix + "conv_in.0.weight": (bn, idim, 3),
        prefix + "conv_in.0.bias": (bn,),
        prefix + "conv_in.2.weight": (hidden, bn, 3),
        prefix + "conv_in.2.bias": (hidden,),
    }
    for i in range(n_layer):
        p = f"{prefix}decoder_block.{i}."
        out[p + "dwconv.weight"] = (hidden, 1, 7)
        out[p + "dwconv.bias"] = (hidden,)
        out[p + "norm.weight"] = (hidden,)
        out[p + "norm.bias"] = (hidden,)
        out[p + "pwconv1.weight"] = (4 * hidden, hidden)
        out[p + "pwconv1.bias"] = (4 * hidden,)
        out[p + "pwconv2.weight"] = (hidden, 4 * hidden)
        out[p + "pwconv2.bias"] = (hidden,)
        out[p + "weight"] = (hidden,)
    out[prefix + "conv_out.weight"] = (odim, hidden, 1)
    return out


def decoder_keys(s: ModelShapes) -> dict[str, Shape]:
    """Tensors of ``Decoder.safetensors`` (upstream ``DVAE(decoder_config, dim=idim, coef)``)."""
    out = {"coef": (1, s.n_mels, 1)}
    out.update(_dvae_decoder_keys("decoder.", s.dec_idim, s.dec_odim, s.dec_hidden, s.dec_layers, s.dec_bn))
    out["out_conv.weight"] = (s.n_mels, s.dec_odim, 3)
    return out


def _mel_buffers(prefix: str, s: ModelShapes) -> dict[str, Shape]:
    """torchaudio ``MelSpectrogram`` buffers (present in the files, unused for inference)."""
    return {prefix + "spectrogram.window": (s.n_fft,), prefix + "mel_scale.fb": (s.n_freq, s.n_mels)}


def dvae_keys(s: ModelShapes) -> dict[str, Shape]:
    """Tensors of ``DVAE.safetensors`` (encoder + GFSQ G=2 R=2 + decoder). Written, never loaded."""
    dim, vq = s.dvae_dim, s.vq_dim
    out: dict[str, Shape] = {"coef": (1, s.n_mels, 1)}
    out.update({
        "downsample_conv.0.weight": (dim, s.n_mels, 3), "downsample_conv.0.bias": (dim,),
        "downsample_conv.2.weight": (dim, dim, 4), "downsample_conv.2.bias": (dim,),
    })
    out.update(_mel_buffers("preprocessor_mel.mel_spec.", s))
    out.update(_dvae_decoder_keys("encoder.", dim, vq, s.dvae_hidden, s.dvae_layers, s.dvae_bn))
    out.update(_dvae_decoder_keys("decoder.", dim, dim, s.dvae_hidden, s.dvae_layers, s.dvae_bn))
    out["out_conv.weight"] = (s.n_mels, dim, 3)
    for g in range(2):
        p = f"vq_layer.quantizer.rvqs.{g}."
        out[p + "project_in.weight"] = (4, vq // 2)
        out[p + "project_in.bias"] = (4,)
        out[p + "project_out.weight"] = (vq // 2, 4)
        out[p + "project_out.bias"] = (vq // 2,)
    return out


def vocos_keys(s: ModelShapes) -> dict[str, Shape]:
    """Tensors of ``Vocos.safetensors`` that the model uses (backbone + ISTFT head linear)."""
    d, m = s.voc_dim, s.voc_intermediate
    out: dict[str, Shape] = {
        "backbone.embed.weight": (d, s.n_mels, 7),
        "backbone.embed.bias": (d,),
        "backbone.norm.weight": (d,),
        "backbone.norm.bias": (d,),
    }
    for i in range(s.voc_layers):
        p = f"backbone.convnext.{i}."
        out[p + "dwconv.weight"] = (d, 1, 7)
        out[p + "dwconv.bias"] = (d,)
        out[p + "norm.weight"] = (d,)
        out[p + "norm.bias"] = (d,)
        out[p + "pwconv1.weight"] = (m, d)
        out[p + "pwconv1.bias"] = (m,)
        out[p + "pwconv2.weight"] = (d, m)
        out[p + "pwconv2.bias"] = (d,)
        out[p + "gamma"] = (d,)
    out["backbone.final_layer_norm.weight"] = (d,)
    out["backbone.final_layer_norm.bias"] = (d,)
    out["head.out.weight"] = (s.n_fft + 2, d)
    out["head.out.bias"] = (s.n_fft + 2,)
    return out


def vocos_buffers(s: ModelShapes) -> dict[str, Shape]:
    """Vocos buffers present in the real file and ignored at load (mel features, ISTFT window)."""
    out = _mel_buffers("feature_extractor.mel_spec.", s)
    out["head.istft.window"] = (s.n_fft,)
    return out
