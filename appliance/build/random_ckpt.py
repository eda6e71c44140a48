"""Random ChatTTS checkpoints in exactly the official layout (``chattts-appliance model random``).

Writes ``OUT_DIR/asset/``: ``gpt/config.json`` (HF ``LlamaConfig`` JSON with ChatTTS's keys, so
upstream's ``LlamaModel.from_pretrained`` loads it), ``gpt/model.safetensors`` (with an
``embed_tokens.weight`` like the real one), ``Embed.safetensors``, ``Decoder.safetensors``,
``DVAE.safetensors``, ``Vocos.safetensors`` and ``tokenizer/`` (a BERT WordPiece tokenizer built
with the ``tokenizers`` library, the 50 control tokens of :mod:`appliance.text.tokens` appended
as special added tokens). No torch: numpy + safetensors + tokenizers.

Weights come from ``numpy.random.default_rng(seed)`` (platform-independent): linear/embedding
weights normal(0, 0.02) in the GPT, 1/sqrt(fan_in) in the convolutional parts, norms at 1,
weight-norm heads with row norms g in [1.5, 2.5] so audio logits have a spread of a few units
(codes are not degenerate). The tiny preset rounds every tensor to the float16 grid (stored as
float32, the official dtype) so that goldens can carry its weights in half the bytes, exactly (buffers stay exact).
Random weights speak noise.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from ..model import layout
from ..model.integrity import write_sums
from ..model.shapes import FULL, TINY, ModelShapes
from ..text.tokens import CONTROL_TOKENS

log = logging.getLogger(__name__)

#: Base (pre-control-token) vocabulary sizes.
FULL_BASE_VOCAB = 21128
TINY_BASE_VOCAB = 462

# Common CJK characters for the tiny vocabulary (the first ones that fit are used).
_COMMON_CJK = (
    "今天气很好我们去公园散步吧你是谁这个声音测试一二三四五六七八九十零百千万点"  # config/health sentences first
    "的一是不了人我在有他这中大来上个国到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于"
    "起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其"
    "种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却"
    "代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或司"
    "利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉望直服毛林题建南度统色字请交爱让认算论百吃义科怎元社术结六功指"
    "思非流每青管夫连远资队跟带花快条院变联言权往展该领传近留红治决周保达办运武半候七必城父强步完革深区即求品士转量空甚众技轻程告江"
    "语英基派满式李息写呢识极令黄德收脸钱党倒未持取设始版双历越史商千片容研像找友孩站广改议形委早房音火际则首单据导影失拿网香似斯专"
    "石若兵弟谁校读志飞观争究包组造落视济喜离虽坐集编宝谈府拉黑且随格尽剑讲布杀微怕母调局根曾准团段终乐切级克精哪官示冷"
)
_CJK_PUNCT = "，。！？、：；“”‘’（）《》…—"


def _dedupe(chars: str) -> list[str]:
    seen: dict[str, None] = {}
    for c in chars:
        seen.setdefault(c, None)
    return list(seen)


def build_vocab(size: str) -> list[str]:
    """The base WordPiece vocabulary (before the 50 control tokens), in id order.

    full: 21128 entries laid out like bert-base-chinese ([PAD]=0, [unused1..99], [UNK]=100,
    [CLS], [SEP], [MASK], ASCII, CJK punctuation, ``##`` pieces, CJK from U+4E00 up);
    tiny: 462 entries (5 specials, ASCII, CJK punctuation, ``##`` pieces, common CJK).
    """
    ascii_ = [chr(c) for c in range(33, 127) if not ("A" <= chr(c) <= "Z")]
    pieces = ["##" + c for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    if size == "full":
        head = ["[PAD]"] + [f"[unused{i}]" for i in range(1, 100)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        base = head + ascii_ + list(_CJK_PUNCT) + pieces
        n = FULL_BASE_VOCAB - len(base)
        base += [chr(0x4E00 + i) for i in range(n)]
    else:
        base = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + ascii_ + list(_CJK_PUNCT) + pieces
        cjk = [c for c in _dedupe(_COMMON_CJK) if c not in base]
        n = TINY_BASE_VOCAB - len(base)
        if len(cjk) < n:
            raise AssertionError(f"tiny vocabulary needs {n} CJK chars, only {len(cjk)} listed")
        base += cjk[:n]
    assert len(set(base)) == len(base)
    return base


def vocab_note(vocab: list[str]) -> str:
    """What the tiny vocabulary cannot say, in words (for the marker file and the CLI): its
    tokenizer knows a few hundred common CJK characters, so ordinary Chinese text has characters
    it reports as unspeakable (skipped, listed in ``done.unspeakable``)."""
    n = sum(1 for t in vocab if len(t) == 1 and "\u4e00" <= t <= "\u9fff")
    return (f"its tokenizer knows only {n} common Chinese characters (and ASCII): other characters are "
            f"skipped and reported as unspeakable; the full-size random checkpoint and the real one know them all")


def write_tokenizer(out: Path, vocab: list[str]) -> int:
    """Write ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``; returns the
    total vocabulary size (base + 50 control tokens)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    out.mkdir(parents=True, exist_ok=True)
    ids = {t: i for i, t in enumerate(vocab)}
    tok = Tokenizer(models.WordPiece(vocab=ids, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])],
    )
    bert = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in bert])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    total = tok.get_vocab_size(with_added_tokens=True)
    if total != len(vocab) + len(CONTROL_TOKENS) or tok.token_to_id(CONTROL_TOKENS[0]) != len(vocab):
        raise AssertionError("control tokens were not appended after the base vocabulary")
    tok.save(str(out / "tokenizer.json"))

    decoder = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                         "single_word": False, "special": True} for t in bert + list(CONTROL_TOKENS)}
    cfg = {
        "added_tokens_decoder": decoder, "clean_up_tokenization_spaces": True, "cls_token": "[CLS]",
        "do_basic_tokenize": True, "do_lower_case": True, "mask_token": "[MASK]",
        "model_max_length": 1000000000000000019884624838656, "never_split": None, "pad_token": "[PAD]",
        "sep_token": "[SEP]", "strip_accents": None, "tokenize_chinese_chars": True,
        "tokenizer_class": "BertTokenizerFast", "unk_token": "[UNK]",
        "additional_special_tokens": list(CONTROL_TOKENS),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    smap = {"additional_special_tokens": list(CONTROL_TOKENS), "cls_token": "[CLS]", "mask_token": "[MASK]",
            "pad_token": "[PAD]", "sep_token": "[SEP]", "unk_token": "[UNK]"}
    (out / "special_tokens_map.json").write_text(json.dumps(smap, indent=2) + "\n", encoding="utf-8")
    return total


def gpt_config(s: ModelShapes, vocab_size: int) -> dict:
    """``gpt/config.json``: HF LlamaConfig keys (as the official file) + ChatTTS's keys."""
    return {
        "architectures": ["LlamaModel"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": s.hidden,
        "initializer_range": 0.02, "intermediate_size": s.ffn, "max_position_embeddings": s.max_pos,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": s.n_heads,
        "num_audio_tokens": s.num_audio_tokens, "num_hidden_layers": s.n_layers,
        "num_key_value_heads": s.n_heads, "num_text_tokens": s.num_text_tokens, "num_vq": s.num_vq,
        "pretraining_tp": 1, "rms_norm_eps": s.rms_eps, "rope_scaling": None, "rope_theta": s.rope_theta,
        "spk_KL": False, "spk_emb_dim": 192, "tie_word_embeddings": False, "torch_dtype": "float32",
        "use_cache": False, "vocab_size": vocab_size,
    }


def _hann(n: int) -> np.ndarray:
    """Periodic Hann window computed in float32 (within 6e-8 of torch.hann_window)."""
    k = np.arange(n, dtype=np.float32)
    return (np.float32(0.5) - np.float32(0.5) * np.cos(k * np.float32(2 * np.pi / n))).astype(np.float32)


def _mel_fb(n_freq: int, n_mels: int, sr: int = 24000) -> np.ndarray:
    """HTK mel filterbank ``[n_freq, n_mels]`` as torchaudio ``melscale_fbanks`` (norm None)."""
    hz2mel = lambda f: 2595.0 * np.log10(1.0 + f / 700.0)  # noqa: E731
    mel2hz = lambda m: 700.0 * (10 ** (m / 2595.0) - 1.0)  # noqa: E731
    freqs = np.linspace(0, sr // 2, n_freq)
    pts = mel2hz(np.linspace(hz2mel(0.0), hz2mel(sr / 2), n_mels + 2))
    diff = np.diff(pts)
    slopes = pts[None, :] - freqs[:, None]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    return np.maximum(0.0, np.minimum(down, up)).astype(np.float32)


_BUFFERS = ("window", "mel_scale.fb")


class _Gen:
    """Tensor generator for one file: values by key suffix, all from one numpy Generator."""

    def __init__(self, rng: np.random.Generator, gpt_std: float = 0.02):
        self.rng, self.gpt_std = rng, gpt_std

    def normal(self, shape, std) -> np.ndarray:
        return (self.rng.standard_normal(shape) * std).astype(np.float32)

    def conv_like(self, key: str, shape: tuple) -> np.ndarray:
        """Convolutional parts (Decoder, DVAE, Vocos): 1/sqrt(fan_in) weights, small biases."""
        last = key.rsplit(".", 1)[-1]
        if key.endswith("norm.weight") or key.endswith("layer_norm.weight"):
            return np.ones(shape, np.float32)
        if key.endswith("norm.bias") or key.endswith("layer_norm.bias"):
            return np.zeros(shape, np.float32)
        if last in ("gamma",) or (last == "weight" and len(shape) == 1):
            return np.full(shape, 0.25, np.float32) + self.normal(shape, 0.02)  # layer scale
        if last == "bias":
            return self.normal(shape, 0.02)
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        return self.normal(shape, 1.0 / math.sqrt(fan_in))


def _tensors(s: ModelShapes, rng: np.random.Generator, vocab_size: int, progress) -> dict[str, dict[str, np.ndarray]]:
    g = _Gen(rng)
    files: dict[str, dict[str, np.ndarray]] = {}

    gpt: dict[str, np.ndarray] = {"embed_tokens.weight": g.normal((vocab_size, s.hidden), 0.02)}
    for k, shp in layout.gpt_keys(s).items():
        gpt[k] = np.ones(shp, np.float32) if k.endswith("norm.weight") else g.normal(shp, 0.02)
        progress(1)
    files[layout.GPT_FILE] = gpt

    emb: dict[str, np.ndarray] = {}
    for k, shp in layout.embed_keys(s).items():
        if k.endswith("original0"):  # g: row norms
            emb[k] = rng.uniform(1.5, 2.5, shp).astype(np.float32)
        else:
            emb[k] = g.normal(shp, 0.02 if k.startswith("head") else 1.0)
        progress(1)
    files[layout.EMBED_FILE] = emb

    dec: dict[str, np.ndarray] = {}
    for k, shp in layout.decoder_keys(s).items():
        dec[k] = rng.uniform(0.5, 1.5, shp).astype(np.float32) if k == "coef" else g.conv_like(k, shp)
    files[layout.DECODER_FILE] = dec
    progress(1)

    dvae: dict[str, np.ndarray] = {}
    for k, shp in layout.dvae_keys(s).items():
        if k == "coef":
            dvae[k] = dec["coef"].copy()
        elif k.endswith("spectrogram.window"):
            dvae[k] = _hann(s.n_fft)
        elif k.endswith("mel_scale.fb"):
            dvae[k] = _mel_fb(s.n_freq, s.n_mels)
        else:
            dvae[k] = g.conv_like(k, shp)
    files[layout.DVAE_FILE] = dvae
    progress(1)

    voc: dict[str, np.ndarray] = {}
    for k, shp in layout.vocos_buffers(s).items():
        voc[k] = _mel_fb(s.n_freq, s.n_mels) if k.endswith("fb") else _hann(s.n_fft)
    for k, shp in layout.vocos_keys(s).items():
        voc[k] = g.conv_like(k, shp)
    # log-magnitude half of the head bias around -3 so |S| stays well under the clip at 100
    voc["head.out.bias"][: s.n_freq] -= 3.0
    files[layout.VOCOS_FILE] = voc
    progress(1)
    return files


def write_random_checkpoint(out_dir: str | Path, size: str = "tiny", seed: int = 0, show_progress: bool = False) -> Path:
    """Write a random checkpoint under ``out_dir/asset``; returns the asset directory.

    Args:
        out_dir: target directory (created; existing files are overwritten).
        size: ``tiny`` or ``full``.
        seed: numpy ``default_rng`` seed.
        show_progress: tqdm progress bar (on for ``full`` from the command line).

    Raises:
        CheckpointError: unknown size or the directory cannot be written.
    """
    from safetensors.numpy import save_file

    if size not in ("tiny", "full"):
        raise CheckpointError(f"unknown checkpoint size {size!r}: use tiny or full")
    asset = Path(out_dir) / "asset"
    try:
        (asset / "gpt").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create {asset}: {e}") from e
    vocab = build_vocab(size)
    n_text = write_tokenizer(asset / layout.TOKENIZER_DIR, vocab)
    s = replace(FULL if size == "full" else TINY, num_text_tokens=n_text)
    vocab_size = layout.GPT_VOCAB_SIZE if size == "full" else 32
    rng = np.random.default_rng(seed)

    bar = None
    try:
        from tqdm import tqdm
    except ImportError:  # progress is cosmetic
        show_progress = False
    if show_progress:
        bar = tqdm(total=len(layout.gpt_keys(s)) + len(layout.embed_keys(s)) + 3 + 5, desc="random checkpoint", unit="tensor")
    progress = bar.update if bar is not None else (lambda n: None)
    files = _tensors(s, rng, vocab_size, progress)
    for name, tensors in files.items():
        if size == "tiny":  # weights on the float16 grid; buffers (windows, mel filterbanks) exact
            tensors = {k: v if k.endswith(_BUFFERS) else v.astype(np.float16).astype(np.float32) for k, v in tensors.items()}
        try:
            save_file(tensors, str(asset / name), metadata={"format": "pt"})
        except OSError as e:
            raise CheckpointError(f"cannot write {asset / name}: {e}") from e
        progress(1)
    (asset / layout.GPT_CONFIG).write_text(json.dumps(gpt_config(s, vocab_size), indent=2) + "\n", encoding="utf-8")
    # a marker beside asset/ (the official layout inside asset/ stays exact): the pipeline logs a
    # warning and scripts/quickstart.sh caps the utterance length when it sees it
    (asset.parent / "RANDOM_WEIGHTS").write_text(
        f"random {size} checkpoint, seed {seed}, written by chattts-appliance: these weights speak noise"
        + (f"; {vocab_note(vocab)}" if size == "tiny" else "") + "\n", encoding="utf-8")
    write_sums(asset.parent)    # SHA256SUMS.json: the daemon verifies the files against it at load
    if bar is not None:
        bar.close()
    log.info("wrote random %s checkpoint (seed %d) to %s: random weights speak noise", size, seed, asset)
    return asset


def cli_main(args) -> int:
    """``chattts-appliance model random --size tiny|full [--seed N] OUT_DIR``."""
    asset = write_random_checkpoint(args.out_dir, args.size, args.seed, show_progress=args.size == "full")
    print(f"random {args.size} checkpoint (seed {args.seed}) written to {asset}; random weights speak noise")
    if args.size == "tiny":
        print(f"note: {vocab_note(build_vocab('tiny'))}")
    return 0
