"""Generate ``upstream_tiny.npz``: upstream ChatTTS 0.2.5 outputs on a random tiny checkpoint.

Run where upstream installs (it needs torchaudio): the ``device`` machine's CPU, FP32,
deterministic algorithms, 4 threads. The committed file was made on 2026-11-30T01:56:53Z with
(also stored in ``meta_json``):

    chattts 0.2.5 (PyPI sdist, wheel built with pip wheel --no-deps), vocos 0.1.0,
    vector_quantize_pytorch 1.32.0, encodec 0.1.1 (wheel from sdist),
    torch 2.11.0+cu130 (run on CPU, CUDA_VISIBLE_DEVICES empty), torchaudio 2.11.0,
    transformers 5.17.0, numpy 2.5.2, tokenizers 0.23.2, safetensors 0.8.0, Python 3.12.3,
    machine: a lent H200 host, CPU "Intel(R) Xeon(R) Processor" (x86-64).

Wheels carried there (``.whl/``, gitignored): chattts, vocos, encodec, vector_quantize_pytorch,
einx, loguru, frozendict, torch-einops-utils, pybase16384 (cp312), cffi; the run was
``pip install --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site python3
tests/golden/make_goldens.py $OUT/upstream_tiny.npz``.

Usage: ``python tests/golden/make_goldens.py OUT.npz [--steps 216] [--seed 0]``

The tiny checkpoint is written by our own ``appliance.build.random_ckpt`` (seed 0) and loaded by
UPSTREAM's classes: ``ChatTTS.model.Embed`` (``load_pretrained``), ``ChatTTS.model.GPT`` with
``LlamaModel.from_pretrained(asset/gpt)`` (``GPT.load_pretrained``), ``ChatTTS.model.DVAE`` as
Decoder (``DVAE(decoder_config, dim=idim)`` + ``load_pretrained``: its ``coef`` comes from the
file), ``vocos.Vocos`` built as upstream ``core._load`` does and ``load_state_dict`` from
``Vocos.safetensors``. The prompt is encoded by upstream's ``Tokenizer`` (HF BertTokenizerFast over
our tokenizer files), embedded by ``Embed`` and the speaker vector applied by ``Speaker.apply``.

Arrays in the npz:

* ``w|<file>|<key>``: every tensor of ``gpt/model.safetensors`` (except ``embed_tokens.weight``,
  whose shape is in ``meta_json``), ``Embed``, ``Decoder`` and ``Vocos.safetensors``: weights as
  float16 (exact: the tiny weights lie on the float16 grid), buffers (windows, mel filterbank)
  float32; rebuild everything as float32.
* ``f|<path>``: uint8 bytes of ``gpt/config.json`` and the three tokenizer files.
* ``text``: uint8 UTF-8 of the prompt string; ``input_ids`` int64 ``[T]`` (upstream tokenizer);
  ``spk_emb`` float32 ``[D]`` (raw speaker vector, upstream L2-normalises it).
* ``prefill_hidden`` float32 ``[T, D]``: ``LlamaModel`` last hidden states over the prompt
  (``use_cache=False``); ``prefill_logits`` float32 ``[Q, V]``: audio heads at the last position.
* Greedy generation through upstream's own ``GPT.generate`` (temperature 1, max_new_token =
  min_new_token = steps, ``return_hidden=True``) with logits processors: a recorder (raw logits),
  upstream ``CustomRepetitionPenaltyLogitsProcessorRepeat(1.05, 625, 16)``, then a processor that
  masks EOS (625) and keeps only the argmax (so ``multinomial`` is deterministic):
  ``codes`` int64 ``[N, Q]``, ``hiddens`` float32 ``[N, D]`` (``hiddens[i]`` is the hidden state
  that predicted ``codes[i]``; ``hiddens[0]`` is the last prompt position),
  ``gap`` float32 ``[N, Q]`` (top-1 minus top-2 of the penalised logits, EOS excluded),
  ``logit_steps`` int64 ``[S]`` and ``step_logits`` float32 ``[S, Q, V]`` (raw logits at those steps).
* ``mel`` float32 ``[100, 2N]``: upstream Decoder on ``hiddens``; ``wav`` float32 ``[512 N - 256]``:
  ``vocos.decode(mel)``.
* Sampler section (for the text/sampling helper): ``sampler_logits`` float32 ``[8, 626]`` random
  logits, ``sampler_hist`` int64 ``[8, 20]`` code histories, ``sampler_params`` float32 ``[K, 5]``
  rows (temperature, repetition_penalty, top_p, top_k, history_len); for each k:
  ``sampler_pen_k`` = ``CustomRepetitionPenaltyLogitsProcessorRepeat(penalty, 625, 16)(hist[:, -history_len:],
  logits / temperature)`` and ``sampler_out_k`` = ``TopKLogitsWarper(top_k, 3)(TopPLogitsWarper(top_p, 3)(pen))``
  (filtered entries are -inf), exactly as upstream ``gen_logits`` + ``GPT.generate`` order them.
* ``meta_json``: versions, machine, settings.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
import platform
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPT = "[Stts][spk_emb][speed_5]今天天气很好，我们去公园散步吧。hello world 42[uv_break][Ptts]"
EOS = 625


def _version(name: str) -> str:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "absent"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=216)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=4)
    a = ap.parse_args(argv)

    import torch

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(a.threads)

    import transformers
    from ChatTTS.config import Config as UCfg
    from ChatTTS.model import DVAE, GPT, Embed, Speaker, Tokenizer
    from ChatTTS.model.processors import CustomRepetitionPenaltyLogitsProcessorRepeat
    from ChatTTS.utils import load_safetensors
    from safetensors.numpy import load_file
    from transformers.generation import TopKLogitsWarper, TopPLogitsWarper
    from vocos import Vocos
    from vocos.feature_extractors import MelSpectrogramFeatures
    from vocos.heads import ISTFTHead
    from vocos.models import VocosBackbone

    from appliance.build.random_ckpt import write_random_checkpoint
    from appliance.model import layout

    out: dict[str, np.ndarray] = {}
    tmp = Path(tempfile.mkdtemp(prefix="tiny_golden_"))
    asset = write_random_checkpoint(tmp, "tiny", seed=a.seed)
    cfg = json.loads((asset / layout.GPT_CONFIG).read_text())
    D, V, Q = cfg["hidden_size"], cfg["num_audio_tokens"], cfg["num_vq"]

    # ---- weights and files into the npz (float16, exact)
    embed_tokens_shape = None
    for name in (layout.GPT_FILE, layout.EMBED_FILE, layout.DECODER_FILE, layout.VOCOS_FILE):
        for k, v in load_file(str(asset / name)).items():
            if name == layout.GPT_FILE and k == "embed_tokens.weight":
                embed_tokens_shape = list(v.shape)
                continue
            h = v.astype(np.float16)
            exact = np.array_equal(h.astype(np.float32), v)
            assert exact or k.endswith(("window", "mel_scale.fb")), f"{name}:{k} not on the float16 grid"
            out[f"w|{name}|{k}"] = h if exact else v
    for rel in [layout.GPT_CONFIG] + [f"{layout.TOKENIZER_DIR}/{n}" for n in layout.TOKENIZER_FILES]:
        out[f"f|{rel}"] = np.frombuffer((asset / rel).read_bytes(), np.uint8)

    # ---- upstream modules
    ucfg = UCfg()
    dev = torch.device("cpu")
    embed = Embed(D, V, cfg["num_text_tokens"], Q)
    embed.load_pretrained(str(asset / layout.EMBED_FILE), dev)
    gpt_cfg = asdict(ucfg.gpt)
    gpt_cfg.update(hidden_size=D, intermediate_size=cfg["intermediate_size"], num_attention_heads=cfg["num_attention_heads"],
                   num_hidden_layers=cfg["num_hidden_layers"], num_text_tokens=cfg["num_text_tokens"])
    gpt = GPT(gpt_config=gpt_cfg, embed=embed, device=dev, device_gpt=dev)
    gpt.load_pretrained(str(asset / "gpt"), str(asset / layout.EMBED_FILE))
    gpt.gpt.float()
    gpt.eval()
    dec_t = load_file(str(asset / layout.DECODER_FILE))
    idim = dec_t["decoder.conv_in.0.weight"].shape[1]
    dconf = dict(idim=idim, odim=dec_t["decoder.conv_out.weight"].shape[0], hidden=dec_t["decoder.conv_in.2.weight"].shape[0],
                 n_layer=sum(1 for k in dec_t if k.endswith("dwconv.weight")), bn_dim=dec_t["decoder.conv_in.0.weight"].shape[0])
    decoder = DVAE(decoder_config=dconf, dim=idim, device=dev)
    decoder.load_pretrained(str(asset / layout.DECODER_FILE), dev)
    decoder.eval()
    voc_t = load_file(str(asset / layout.VOCOS_FILE))
    vdim = voc_t["backbone.embed.weight"].shape[0]
    vocos = Vocos(
        feature_extractor=MelSpectrogramFeatures(24000, 1024, 256, 100, "center"),
        backbone=VocosBackbone(input_channels=100, dim=vdim, intermediate_dim=voc_t["backbone.convnext.0.pwconv1.weight"].shape[0],
                               num_layers=sum(1 for k in voc_t if k.endswith("dwconv.weight"))),
        head=ISTFTHead(dim=vdim, n_fft=1024, hop_length=256, padding="center"),
    ).eval()
    vocos.load_state_dict(load_safetensors(str(asset / layout.VOCOS_FILE)))
    speaker = Speaker(D, ucfg.spk_stat, dev)
    tok = Tokenizer(str(asset / layout.TOKENIZER_DIR))

    # ---- prompt
    input_ids, attention_mask, text_mask = tok.encode([PROMPT], Q)
    assert (input_ids[0, :, 0] != tok._tokenizer.unk_token_id).all(), "prompt has [UNK]"
    rng = np.random.default_rng(1234)
    spk = rng.standard_normal(D).astype(np.float32) * 3.0
    with torch.inference_mode():
        emb = embed(input_ids, text_mask)
        speaker.apply(emb, torch.from_numpy(spk), input_ids, tok.spk_emb_ids, dev)
        emb = emb.clone()
        o = gpt.gpt(inputs_embeds=emb, attention_mask=attention_mask, use_cache=False)
        ph = o.last_hidden_state[0].float()
        plog = torch.stack([embed.head_code[i](ph[-1]) for i in range(Q)], 0)
    out["text"] = np.frombuffer(PROMPT.encode("utf-8"), np.uint8)
    out["input_ids"] = input_ids[0, :, 0].numpy().astype(np.int64)
    out["spk_emb"] = spk
    out["prefill_hidden"] = ph.numpy().astype(np.float32)
    out["prefill_logits"] = plog.numpy().astype(np.float32)

    # ---- greedy generate through upstream's GPT.generate
    raw, gaps = [], []

    def recorder(ids, scores):
        raw.append(scores.detach().clone())
        return scores

    def greedy(ids, scores):
        s = scores.clone()
        s[:, EOS] = -torch.inf
        top2 = torch.topk(s, 2, dim=-1).values
        gaps.append((top2[:, 0] - top2[:, 1]).clone())
        keep = torch.full_like(s, -torch.inf)
        idx = s.argmax(-1, keepdim=True)
        keep.scatter_(1, idx, s.gather(1, idx))
        return keep

    pen = CustomRepetitionPenaltyLogitsProcessorRepeat(1.05, V - 1, 16)
    n = a.steps
    gen = gpt.generate(emb.clone(), input_ids, temperature=torch.tensor([1.0] * Q), eos_token=EOS,
                       attention_mask=attention_mask, max_new_token=n, min_new_token=n,
                       logits_processors=(recorder, pen, greedy), infer_text=False, return_hidden=True,
                       show_tqdm=False, ensure_non_empty=False, manual_seed=0)
    res = None
    for res in gen:
        pass
    codes = res.ids[0].numpy().astype(np.int64)  # [N, Q]
    hiddens = res.hiddens[0].float().numpy()  # [N, D]
    assert codes.shape == (n, Q) and hiddens.shape == (n, D), (codes.shape, hiddens.shape)
    raw_t = torch.stack(raw).view(n, Q, V).numpy()
    out["codes"], out["hiddens"] = codes, hiddens.astype(np.float32)
    out["gap"] = torch.stack(gaps).view(n, Q).numpy().astype(np.float32)
    steps = np.unique(np.concatenate([np.arange(0, 4), np.arange(0, n, 12), [n - 1]])).astype(np.int64)
    out["logit_steps"], out["step_logits"] = steps, raw_t[steps].astype(np.float32)
    assert np.allclose(raw_t[0], out["prefill_logits"], rtol=1e-4, atol=1e-4)

    with torch.inference_mode():
        mel = decoder(torch.from_numpy(hiddens).T.unsqueeze(0).contiguous())  # [1, 100, 2N]
        wav = vocos.decode(mel)  # [1, 512N - 256]
    out["mel"] = mel[0].float().numpy()
    out["wav"] = wav[0].float().numpy()

    # ---- sampler section
    srng = np.random.default_rng(99)
    logits = (srng.standard_normal((8, V)) * 3.0).astype(np.float32)
    hist = srng.integers(0, 40, (8, 20)).astype(np.int64)  # small range: many repeats
    params = np.array([[1.0, 1.05, 0.7, 20, 20], [0.3, 1.05, 0.7, 20, 16], [0.7, 1.2, 0.5, 5, 7]], np.float32)
    out["sampler_logits"], out["sampler_hist"], out["sampler_params"] = logits, hist, params
    for k, (temp, rp, tp, tk, hl) in enumerate(params.tolist()):
        x = torch.from_numpy(logits.copy()) / torch.tensor(temp)
        h = torch.from_numpy(hist[:, -int(hl):].copy())
        p = CustomRepetitionPenaltyLogitsProcessorRepeat(float(rp), V - 1, 16)(h, x)
        w = TopKLogitsWarper(int(tk), min_tokens_to_keep=3)(h, TopPLogitsWarper(float(tp), min_tokens_to_keep=3)(h, p))
        out[f"sampler_pen_{k}"], out[f"sampler_out_{k}"] = p.numpy().astype(np.float32), w.numpy().astype(np.float32)

    cpu = ""
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    meta = {
        "made": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "chattts": _version("chattts"), "vocos": _version("vocos"), "torch": torch.__version__,
        "torchaudio": _version("torchaudio"), "transformers": transformers.__version__,
        "vector_quantize_pytorch": _version("vector_quantize_pytorch"), "numpy": np.__version__,
        "python": platform.python_version(), "machine": platform.machine(), "node": platform.node(), "cpu": cpu,
        "device": "cpu", "dtype": "float32", "deterministic": True, "threads": a.threads,
        "checkpoint": f"appliance.build.random_ckpt tiny seed {a.seed}", "embed_tokens_shape": embed_tokens_shape,
        "steps": n, "prompt": PROMPT, "repetition_penalty": 1.05, "eos": EOS,
    }
    out["meta_json"] = np.frombuffer(json.dumps(meta, ensure_ascii=False).encode("utf-8"), np.uint8)
    np.savez_compressed(a.out, **out)
    print(json.dumps(meta, ensure_ascii=False, indent=1))
    print("codes[:8]", codes[:8].tolist(), "distinct codes per codebook", [len(set(codes[:, q])) for q in range(Q)])
    print("min gap", float(out["gap"].min()), "wav rms", float(np.sqrt((out["wav"] ** 2).mean())))
    print("size", Path(a.out).stat().st_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
