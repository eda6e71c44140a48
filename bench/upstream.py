"""Upstream ChatTTS 0.2.5's GPT decode loop on this machine: the baseline for ``python -m bench cpu``.

Runs upstream's own ``GPT.generate`` (``ChatTTS/model/gpt.py``: transformers' ``LlamaModel`` with
its KV cache, upstream's code embeddings, heads and logits processors: repetition penalty 1.05
over 16 codes, top-P 0.7, top-K 20, temperature 0.3) on the same random checkpoint, FP32, on the
CPU, at batch 1 and 3. Only the GPT loop: upstream's Decoder and Vocos need ``vocos`` and
``torchaudio`` (no build for this machine's torch), and the loop is what the decode step compares
with. ``ms_per_step`` is ``(t(N + 2) - t(2)) / N`` for ``generate`` with ``max_new_token`` = ``min_new_token``
(EOS masked), so the prefill cancels.

Upstream is not installed: ``--src`` is an unpacked ``chattts==0.2.5`` sdist (``pip download
--no-deps --no-binary :all: chattts==0.2.5``). Its package ``__init__`` imports the DVAE and Vocos
(torchaudio), so this loads ``ChatTTS.model.gpt``/``embed``/``processors`` under an empty parent
package instead. Needs ``transformers`` (and ``requests``, which ``ChatTTS.utils`` imports).

Appends one record per batch size (``bench: upstream``, ``backend: upstream-chattts``) to
``bench/results/upstream.jsonl``::

    python -m bench upstream --checkpoint models/random-full --src /tmp/chattts-0.2.5 --batches 1,3
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import types
from pathlib import Path

from bench import harness
PROMPT = 24   # tokens, as bench_cpu's sentence with its [Stts][spk_emb][speed_5] ... [Ptts] frame


def load_upstream(src: Path):
    """Import upstream's GPT, Embed and gen_logits from the sdist at ``src`` without its package ``__init__``s."""
    for name in ("ChatTTS", "ChatTTS.model"):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(src / name.replace(".", "/"))]
        sys.modules[name] = pkg
    gpt = importlib.import_module("ChatTTS.model.gpt")
    embed = importlib.import_module("ChatTTS.model.embed")
    proc = importlib.import_module("ChatTTS.model.processors")
    return gpt.GPT, embed.Embed, proc.gen_logits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench upstream", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="checkpoint dir holding asset/ (chattts-appliance model random)")
    ap.add_argument("--src", required=True, help="unpacked chattts-0.2.5 sdist (the directory holding ChatTTS/)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batches", default="1,3")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = all cores)")
    ap.add_argument("--label", default="")
    harness.add_common(ap)
    args = ap.parse_args(argv)

    import logging

    import torch

    logging.disable(logging.WARNING)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    GPT, Embed, gen_logits = load_upstream(Path(args.src).resolve())
    asset = Path(args.checkpoint) / "asset"
    cfg = json.loads((asset / "gpt" / "config.json").read_text())
    dims = {k: int(cfg.get(k, d)) for k, d in (("num_audio_tokens", 626), ("num_text_tokens", 21178), ("num_vq", 4))}
    embed = Embed(int(cfg["hidden_size"]), dims["num_audio_tokens"], dims["num_text_tokens"], dims["num_vq"])
    embed.load_pretrained(str(asset / "Embed.safetensors"), torch.device("cpu"))
    gpt_config = {"hidden_size": int(cfg["hidden_size"]), "intermediate_size": int(cfg["intermediate_size"]),
                  "num_attention_heads": int(cfg["num_attention_heads"]), "num_hidden_layers": int(cfg["num_hidden_layers"]),
                  "use_cache": False, "max_position_embeddings": int(cfg.get("max_position_embeddings", 4096)),
                  "spk_emb_dim": 192, "spk_KL": False, **dims}
    gpt = GPT(gpt_config, embed)
    gpt.load_pretrained(str(asset / "gpt"), str(asset / "Embed.safetensors"))
    gpt.eval()
    warpers, processors = gen_logits(dims["num_audio_tokens"] - 1, top_P=0.7, top_K=20, repetition_penalty=1.05)

    def generate(b: int, n: int) -> float:
        ids = torch.randint(0, min(1000, dims["num_text_tokens"]), (b, PROMPT, 1)).expand(b, PROMPT, dims["num_vq"]).contiguous()
        text_mask = torch.ones(b, PROMPT, dtype=torch.bool)
        t0 = time.perf_counter()
        with torch.inference_mode():
            emb = embed(ids, text_mask)
            out = gpt.generate(emb, ids, temperature=torch.tensor([0.3] * dims["num_vq"]),
                               eos_token=dims["num_audio_tokens"] - 1,
                               attention_mask=torch.ones(b, PROMPT, dtype=torch.bool), max_new_token=n, min_new_token=n,
                               logits_processors=(*processors, *warpers), infer_text=False, return_hidden=True,
                               show_tqdm=False, ensure_non_empty=False, manual_seed=1)
            res = list(out)[-1]   # a generator (upstream streams through it): run it to the end
            assert len(res.hiddens) == b and res.hiddens[0].shape[0] == n, (len(res.hiddens), res.hiddens[0].shape)
        return time.perf_counter() - t0

    recs = []
    load0 = os.getloadavg()[0]
    for b in (int(x) for x in args.batches.split(",")):
        generate(b, 4)   # warm-up
        short = min(generate(b, 2) for _ in range(2))
        long_ = generate(b, args.steps + 2)
        ms = 1e3 * max(0.0, long_ - short) / args.steps
        recs.append(harness.record(
            "upstream", checkpoint=harness.checkpoint_size(args.checkpoint), backend="upstream-chattts",
            machine=args.machine, host_info=harness.host(),
            notes=f"{args.label}; upstream chattts 0.2.5 GPT.generate, transformers "
                  f"{importlib.import_module('transformers').__version__}, torch {torch.__version__}, "
                  f"{torch.get_num_threads()} threads; prompt {PROMPT} tokens, {args.steps} steps; "
                  f"rtf = the GPT loop alone; 1-min load average {load0:.2f} -> {os.getloadavg()[0]:.2f}",
            precision="fp32", batch=b, ms_per_step=round(ms, 2), steps_per_s=round(1e3 / ms, 2) if ms else None,
            rtf=round(ms * 46.875 / 1e3, 3)))
    harness.write(recs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
