"""The error of each CPU weight precision against FP32, on the same checkpoint (``calibrate``-style).

For each ``--precisions`` export against ``--reference`` (ONNX Runtime's ``fp32``, or ``llama-f32``): ``<p>`` is ``<engine_dir>/onnx/<p>``
(ONNX Runtime), ``llama-<type>`` is ``<engine_dir>/llama/<type>`` (the GPT on llama.cpp from
``gpt.gguf``: ``llama-f32``, ``llama-q8_0``, ``llama-q4_k_m``, ...; ``-kvf16`` / ``-kvq8_0`` appended
picks the KV cache, e.g. ``llama-q8_0-kvq8_0`` against ``--reference llama-q8_0-kvf16``):

1. the prompt of a fixed sentence is prefilled into both runners; then ``--steps`` decode steps are
   run *teacher-forced*: both runners get the same codes each step (FP32's greedy codes, the
   argmax of its logits), so every step compares the same inputs;
2. per step: the hidden state's error (``20 log10(rms(h - h32) / rms(h32))``, dB) and the logits'
   (the same on the logits; and the largest absolute logit difference), and whether the greedy
   codes agree (all 4 codebooks; the fraction over ``Q x steps`` codes);
3. free-running: each runner decodes greedily on its own codes; the first step where the codes
   differ (``first_divergence``; None = never within ``--steps``);
4. the PCM of the teacher-forced hidden states through the (FP32) Decoder, Vocos and ISTFT, one
   pass, against FP32's: ``20 log10(max |pcm - pcm32| / max |pcm32|)`` (dB of the peak), as
   ``chattts-appliance calibrate`` states its errors.

Appends one record per precision (``bench: precision``) to ``bench/results/precision.jsonl``. Random weights: the numbers say how the
rounding propagates through this network's shapes, not how a trained voice sounds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from bench import harness

ROOT = harness.ROOT
TEXT = "[Stts][speed_5]今天天气很好，我们一起去公园散步吧。[Ptts]"


def db(err: np.ndarray, ref: np.ndarray) -> float:
    return float(20 * np.log10(max(np.sqrt(np.mean(err ** 2)), 1e-30) / max(np.sqrt(np.mean(ref ** 2)), 1e-30)))


def open_runner(ckpt: str, engine_dir: str, precision: str, threads: int):
    """ONNX Runtime for ``fp32`` / ``int8`` / ``int4``; llama.cpp for ``llama-<type>`` (KV cache as
    configured by default) or ``llama-<type>-kv<f16|q8_0>`` (that KV cache)."""
    from appliance.config import config_from_dict

    if precision.startswith("llama-"):
        from appliance.engines.llama.runner import LlamaRunner

        qtype, _, kv = precision[len("llama-"):].partition("-kv")
        cfg = config_from_dict({"model": {"path": ckpt, "backend": "llama", "engine_dir": engine_dir, "threads": threads,
                                          "llama_precision": qtype, **({"llama_kv_cache": kv} if kv else {})}})
        return LlamaRunner(cfg, reason="precision bench")
    from appliance.engines.onnx.runner import OnnxRunner

    cfg = config_from_dict({"model": {"path": ckpt, "backend": "onnxruntime", "engine_dir": engine_dir,
                                      "threads": threads,
                                      "onnx_precision": precision}})
    return OnnxRunner(cfg, reason="precision bench")


def pcm(r, hid: np.ndarray) -> np.ndarray:
    from appliance.synth.istft import istft

    mel = r.forward_decoder(hid)
    re, im = r.forward_vocos(mel)
    return istft(re, im)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench precision", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--engine-dir", required=True, help="holding onnx/fp32 and onnx/<precision> (llama/<type>) exports")
    ap.add_argument("--precisions", default="int8,int4")
    ap.add_argument("--reference", default="fp32", help="fp32 (ONNX Runtime) or llama-f32 (the F32 GGUF on llama.cpp)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=0)
    harness.add_common(ap)
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(args.checkpoint) / "asset" / "tokenizer" / "tokenizer.json"))
    ids = np.asarray(tok.encode(TEXT, add_special_tokens=False).ids, np.int64)
    ref = open_runner(args.checkpoint, args.engine_dir, args.reference, args.threads)
    slot = np.zeros(1, np.int64)
    # FP32: teacher codes (greedy), hidden states and logits per step
    lg, hd = ref.forward_prefill(0, ids, None)
    codes = [lg.argmax(-1)]
    H32, L32 = [hd.copy()], [lg.copy()]
    for s in range(args.steps):
        lg, hd = ref.forward_decode(slot, codes[-1][None], np.array([len(ids) + s]))
        H32.append(hd[0].copy())
        L32.append(lg[0].copy())
        codes.append(lg[0].argmax(-1))
    H32, L32 = np.stack(H32), np.stack(L32)
    pcm32 = pcm(ref, H32[1:])
    recs = []
    for p in args.precisions.split(","):
        r = open_runner(args.checkpoint, args.engine_dir, p, args.threads)
        lg, hd = r.forward_prefill(0, ids, None)
        H, Lg = [hd.copy()], [lg.copy()]
        for s in range(args.steps):
            lg, hd = r.forward_decode(slot, codes[s][None], np.array([len(ids) + s]))
            H.append(hd[0].copy())
            Lg.append(lg[0].copy())
        H, Lg = np.stack(H), np.stack(Lg)
        agree = float(np.mean(Lg.argmax(-1) == L32.argmax(-1)))
        # free-running greedy: own codes, from a fresh prefill (llama.cpp keeps a sequence's positions)
        c = r.forward_prefill(0, ids, None)[0].argmax(-1)
        first_div = None
        c32 = codes[0]
        for s in range(args.steps):
            if first_div is None and not np.array_equal(c, c32):
                first_div = s
                break
            lg, _ = r.forward_decode(slot, c[None], np.array([len(ids) + s]))
            c = lg[0].argmax(-1)
            c32 = codes[s + 1]
        p_pcm = pcm(ref, H[1:])   # the FP32 vocoder (the same in every export) on this precision's states
        n = min(p_pcm.size, pcm32.size)
        backend = "llama.cpp" if p.startswith("llama-") else "onnxruntime"
        recs.append(harness.record(
            "precision", checkpoint=harness.checkpoint_size(args.checkpoint), backend=backend, machine=args.machine,
            notes="teacher-forced on FP32's greedy codes; PCM through the FP32 Decoder/Vocos",
            precision=p, reference=args.reference, steps=args.steps,
            hidden_err_db=round(db(H - H32, H32), 1),
            hidden_err_db_worst_step=round(max(db(H[i] - H32[i], H32[i]) for i in range(len(H))), 1),
            logits_err_db=round(db(Lg - L32, L32), 1), logits_max_abs_diff=round(float(np.abs(Lg - L32).max()), 4),
            greedy_agreement=round(agree, 4), first_divergence_free_running=first_div,
            pcm_err_db_of_peak=round(float(20 * np.log10(np.abs(p_pcm[:n] - pcm32[:n]).max()
                                                         / np.abs(pcm32[:n]).max())), 1)))
        r.close()
    harness.write(recs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
