"""Check that our random checkpoints are exactly the official layout for UPSTREAM's own loader,
and compare our model with upstream at full size (device machine; not a pytest test).

1. ``appliance.build.random_ckpt`` writes a FULL random checkpoint; upstream ``ChatTTS.Chat._load``
   loads all of it (DVAE with encoder + GFSQ, Embed, GPT via ``LlamaModel.from_pretrained``,
   Decoder, Vocos, tokenizer: strict ``load_state_dict`` everywhere except HF's loader, whose
   report is printed), then ``Chat.infer`` runs end to end for a few steps.
2. The TINY checkpoint's ``DVAE.safetensors`` loads strictly into upstream's ``DVAE`` with encoder
   and GFSQ.
3. Full size, CPU FP32: our ``TorchRunner`` prefill + 8 teacher-forced decode steps against
   upstream's ``LlamaModel`` + heads on the same embeddings; max relative errors printed.

Usage: ``python tests/golden/check_upstream_layout.py`` (with the wheels of make_goldens.py).

Last run 2026-11-30 on the device machine's CPU (torch 2.11.0, torchaudio 2.11.0, transformers 5.17.0,
chattts 0.2.5): tiny DVAE strict load OK; ``Chat._load`` True (tokenizer len 21178, ``[spk_emb]`` 21143,
``[break_0]`` 21147), ``Chat.infer`` produced a waveform; ours vs upstream at full size: hidden max
relative error <= 6.4e-07, logits <= 4.8e-07 over prefill + 8 decode steps.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    import torch

    torch.manual_seed(0)
    from ChatTTS import Chat
    from ChatTTS.model import DVAE

    from appliance.build.random_ckpt import write_random_checkpoint
    from appliance.config import config_from_dict
    from appliance.engines.torch.cpu_runner import TorchRunner

    tmp = Path(tempfile.mkdtemp())
    full = write_random_checkpoint(tmp / "full", "full", seed=0)
    tiny = write_random_checkpoint(tmp / "tiny", "tiny", seed=0)

    # 2. tiny DVAE, strict
    d = DVAE(decoder_config=dict(idim=32, odim=32, hidden=64, n_layer=2, bn_dim=32),
             encoder_config=dict(idim=32, odim=64, hidden=64, n_layer=2, bn_dim=32),
             vq_config=dict(dim=64, levels=(5, 5, 5, 5), G=2, R=2), dim=32)
    d.load_pretrained(str(tiny / "DVAE.safetensors"), torch.device("cpu"))
    print("tiny DVAE.safetensors: strict load OK")

    # 1. full: upstream Chat._load
    chat = Chat()
    dev = torch.device("cpu")
    ok = chat._load(vocos_ckpt_path=str(full / "Vocos.safetensors"), dvae_ckpt_path=str(full / "DVAE.safetensors"),
                    gpt_ckpt_path=str(full / "gpt"), embed_path=str(full / "Embed.safetensors"),
                    decoder_ckpt_path=str(full / "Decoder.safetensors"), tokenizer_path=str(full / "tokenizer"), device=dev)
    print("upstream Chat._load on the full random checkpoint:", ok, "tokenizer len", chat.tokenizer.len,
          "spk_emb id", chat.tokenizer.spk_emb_ids, "[break_0] id", chat.tokenizer.break_0_ids)
    spk = chat.sample_random_speaker()
    params = Chat.InferCodeParams(spk_emb=spk, max_new_token=24, manual_seed=0, show_tqdm=False)
    wavs = chat.infer(["今天天气很好"], skip_refine_text=True, params_infer_code=params, do_text_normalization=False,
                      do_homophone_replacement=False)
    print("upstream Chat.infer on random weights: wav shapes", [np.shape(w) for w in wavs])

    # 3. our runner vs upstream at full size
    cfg = config_from_dict({"model": {"path": str(full.parent), "backend": "torch", "device": "cpu",
                                      "max_batch": 1, "max_seq_len": 256, "max_prompt_tokens": 128}})
    r = TorchRunner(cfg)
    ids, am, tm = chat.tokenizer.encode(["[Stts][spk_emb][speed_5]今天天气很好，我们去公园散步吧。[Ptts]"], 4)
    spk_vec = torch.from_numpy(chat.speaker._decode(spk)).float()
    with torch.inference_mode():
        emb = chat.embed(ids, tm)
        chat.speaker.apply(emb, spk_vec, ids, chat.tokenizer.spk_emb_ids, dev)
        lg, h = r.prefill(0, ids[0, :, 0].numpy(), spk_vec.numpy())
        rng = np.random.default_rng(0)
        codes = rng.integers(0, 625, (8, 4))
        seq = emb.clone()
        errs_h, errs_l = [], []
        for i in range(9):
            uh = chat.gpt.gpt(inputs_embeds=seq, use_cache=False).last_hidden_state[0, -1]
            ul = torch.stack([chat.embed.head_code[q](uh) for q in range(4)]).numpy()
            uh = uh.numpy()
            errs_h.append(float(np.abs(h.reshape(-1) - uh).max() / np.abs(uh).max()))
            errs_l.append(float(np.abs(lg.reshape(4, -1) - ul).max() / np.abs(ul).max()))
            if i == 8:
                break
            c = torch.from_numpy(codes[i])
            ce = torch.stack([chat.embed.emb_code[q](c[q]) for q in range(4)], 1).sum(1)
            seq = torch.cat([seq, ce.view(1, 1, -1)], 1)
            lg, h = r.decode(np.array([0]), codes[i:i + 1], np.array([ids.shape[1] + i]))
        mel_u = chat.decoder(torch.from_numpy(rng.standard_normal((1, 768, 30)).astype(np.float32)))
    print("full size, ours vs upstream: hidden max rel err per step", ["%.1e" % e for e in errs_h])
    print("full size, ours vs upstream: logits max rel err per step", ["%.1e" % e for e in errs_l])
    print("upstream decoder mel shape", tuple(mel_u.shape))
    return 0


if __name__ == "__main__":
    sys.exit(main())
