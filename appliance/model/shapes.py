"""Model dimensions of ChatTTS: one frozen dataclass, two presets.

Shapes are never assumed at load: :func:`appliance.model.checkpoint.read_checkpoint` reads them
back from ``asset/gpt/config.json`` and from the tensor shapes. The presets are what
:mod:`appliance.build.random_ckpt` writes.

Source of the FULL values: upstream ``ChatTTS/config/config.py`` (0.2.5), the HF
``2Noise/ChatTTS`` ``asset/gpt/config.json``, vocos 0.1.0.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShapes:
    """Every dimension the four inference parts (GPT, Embed, Decoder, Vocos) and the DVAE need.

    GPT (HF Llama):
        hidden: D, model width (768). n_layers: transformer blocks (20). n_heads: attention heads
        (12, MHA: as many KV heads). ffn: SiLU-GLU inner width (3072). max_pos: RoPE positions
        (4096). rope_theta: RoPE base (1e4). rms_eps: RMSNorm epsilon (1e-6).
    Embed:
        num_text_tokens: text vocabulary (21178 = 21128 BERT + 50 control tokens).
        num_audio_tokens: V per codebook (626 = 625 FSQ codes + EOS). num_vq: Q codebooks (4).
    Decoder (upstream ``DVAE`` without encoder/VQ, GPT hidden -> mel):
        dec_idim = dec_odim = D/2 (each hidden becomes two frames), dec_hidden, dec_layers,
        dec_bn (conv_in bottleneck).
    DVAE (written by the random checkpoint so the layout is complete; never loaded):
        dvae_dim (decoder idim/odim, = vq_dim/2), dvae_hidden, dvae_layers, dvae_bn, vq_dim.
    Vocos:
        voc_dim, voc_intermediate, voc_layers; n_fft (1024), hop (256 samples), n_mels (100).
    """

    hidden: int = 768
    n_layers: int = 20
    n_heads: int = 12
    ffn: int = 3072
    max_pos: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    num_text_tokens: int = 21178
    num_audio_tokens: int = 626
    num_vq: int = 4
    dec_idim: int = 384
    dec_odim: int = 384
    dec_hidden: int = 512
    dec_layers: int = 12
    dec_bn: int = 128
    dvae_dim: int = 512
    dvae_hidden: int = 256
    dvae_layers: int = 12
    dvae_bn: int = 128
    vq_dim: int = 1024
    voc_dim: int = 512
    voc_intermediate: int = 1536
    voc_layers: int = 8
    n_fft: int = 1024
    hop: int = 256
    n_mels: int = 100

    @property
    def head_dim(self) -> int:
        """Per-head width D / n_heads (64 full)."""
        return self.hidden // self.n_heads

    @property
    def n_freq(self) -> int:
        """STFT bins n_fft/2 + 1 (513)."""
        return self.n_fft // 2 + 1


#: The real ChatTTS shapes (PyPI chattts 0.2.5, HF 2Noise/ChatTTS).
FULL = ModelShapes()

#: A tiny model with the same code paths (a few hundred kB; CI and parity goldens).
#: Text vocabulary: 5 BERT specials + ASCII + punctuation + 300 CJK + 50 control tokens.
TINY = ModelShapes(
    hidden=64, n_layers=2, n_heads=4, ffn=256,
    num_text_tokens=512,  # 462 base WordPiece entries + 50 control tokens (random_ckpt.build_vocab)
    dec_idim=32, dec_odim=32, dec_hidden=64, dec_layers=2, dec_bn=32,
    dvae_dim=32, dvae_hidden=64, dvae_layers=2, dvae_bn=32, vq_dim=64,
    voc_dim=64, voc_intermediate=192, voc_layers=2,
)
