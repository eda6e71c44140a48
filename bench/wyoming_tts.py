"""The daemon over Wyoming as wyoming-bench measures it, and one event announcing 300 MB.

Time to first audio and RTF measured by ``wyoming-bench`` (PyPI, ``pip install wyoming-bench``),
one-shot and streaming, as Home Assistant would hear them; and what one hostile event announcing
300,000,000 bytes costs the daemon's memory.

Starts the real daemon (``python -m appliance serve``) with its Wyoming server on a free
``tcp://127.0.0.1`` port (audio only to the client, nothing played), a checkpoint (default: a fresh
random tiny one; torch on the CPU, or ``--device cuda`` for the GPU) and every sentence fixed at
``--steps`` decode steps (EOS masked, so the audio length does not depend on the random weights),
then:

* runs ``wyoming-bench tts 127.0.0.1:PORT --mode both -v`` (its default four texts of 1-4 English
  sentences, ``--rounds`` rounds after one warm-up, ``--no-unique``: the daemon caches nothing).
  Its per-measurement lines give TTFT (``synthesize`` / ``synthesize-start`` sent -> first
  ``audio-chunk``), total time (-> ``audio-stop`` / ``synthesize-stopped``) and the audio's
  duration; RTF = total / audio. Streaming sends each sentence as one ``synthesize-chunk``.
* sends one event whose header announces ``data_length`` 300,000,000 and then sends the bytes
  (1 MiB at a time, as fast as the daemon takes them), and reads the daemon's peak RSS
  (``VmHWM``) before and after, and whether an ``error`` came back.

Prints a table, appends one JSON record per mode (``bench: wyoming``) and one for the hostile
event (``bench: wyoming_payload``) to ``bench/results/wyoming.jsonl`` and
``bench/results/wyoming_payload.jsonl``; ``--log FILE`` keeps wyoming-bench's own output. ``--tree DIR`` runs the daemon from another checkout (e.g. the commit before a
change) for a side-by-side run. Timings on a shared 2-core machine are noisy: compare trees of
one run, not runs of different days.

    python -m bench wyoming --steps 20 --rounds 1          # a fresh random tiny checkpoint, torch on the CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import harness

ROOT = harness.ROOT

from tests.fixtures_mqtt import free_port  # noqa: E402
from tests.fixtures_service import launch_daemon  # noqa: E402

LINE = re.compile(r"\[(?P<mode>\w+)\] r(?P<round>\d+) sent=(?P<sent>\d+) ttft=(?P<ttft>\d+)ms "
                  r"total=(?P<total>\d+)ms audio=(?P<audio>[\d.]+)s")
"""One ``wyoming-bench -v`` measurement line (wyoming_bench/tts/bench.py ``_print_verbose``)."""
HOSTILE_BYTES = 300_000_000


def _hwm_mib(pid: int) -> float:
    for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
        if ln.startswith("VmHWM:"):
            return round(int(ln.split()[1]) / 1024, 1)
    raise RuntimeError("no VmHWM")


def _config(args, tmp: Path, port: int) -> dict:
    return {
        "model": {"path": args.checkpoint, "backend": "torch", "device": args.device,
                  "dtype": "float32" if args.device == "cpu" else args.dtype, "threads": args.threads,
                  "max_batch": 3, "max_seq_len": 1024, **({"compile": args.compile} if args.device == "cuda" else {})},
        "synthesis": {"min_new_tokens": args.steps, "max_new_tokens": args.steps, "voice": "seed:2", "seed": 5},
        "audio": {"output": "wav", "wav_dir": str(tmp / "wav")},
        "service": {"socket": str(tmp / "run" / "appliance.sock"), "warmup": True, "spool_dir": str(tmp / "spool")},
        "wyoming": {"enabled": True, "uris": [f"tcp://127.0.0.1:{port}"], "play": False},
    }


async def _hostile(port: int) -> dict:
    """One event announcing HOSTILE_BYTES of data, then the bytes; what came back."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    header = {"type": "synthesize", "data_length": HOSTILE_BYTES, "version": "1.10.2"}
    writer.write(json.dumps(header).encode() + b"\n")
    block, sent, t0 = b"a" * (1 << 20), 0, time.perf_counter()
    try:
        while sent < HOSTILE_BYTES:
            writer.write(block[: min(len(block), HOSTILE_BYTES - sent)])
            await asyncio.wait_for(writer.drain(), 30)
            sent += min(len(block), HOSTILE_BYTES - sent)
        answer = await asyncio.wait_for(reader.read(1 << 16), 60)
    except (ConnectionError, asyncio.TimeoutError) as e:
        answer = f"<{type(e).__name__}>".encode()
    finally:
        writer.close()
    return {"bytes_sent": sent, "send_s": round(time.perf_counter() - t0, 2),
            "answer": answer[:200].decode("utf-8", "replace")}


def run_tree(args, tmp: Path) -> tuple[list[dict], dict, str]:
    port = free_port()
    prefix = ["env", "-C", args.tree] if args.tree else None
    d = launch_daemon(tmp, _config(args, tmp, port), timeout_s=600.0, argv_prefix=prefix)
    try:
        deadline = time.monotonic() + 120
        while "wyoming: listening" not in d.log():        # the listener starts after the socket
            if time.monotonic() > deadline or d.proc.poll() is not None:
                raise RuntimeError(d.log()[-3000:])
            time.sleep(0.1)
        cmd = [args.wyoming_bench, "tts", f"127.0.0.1:{port}", "--mode", "both", "--rounds", str(args.rounds),
               "--warmup", "1", "--no-unique", "--timeout", "300", "-v"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        text = out.stdout + out.stderr
        rows = []
        for mode in ("non_streaming", "streaming"):
            ms = [m.groupdict() for m in LINE.finditer(text) if m["mode"] == mode]
            if not ms:
                raise RuntimeError(f"no {mode} measurements:\n{text[-3000:]}")
            rtf = [int(m["total"]) / 1000 / float(m["audio"]) for m in ms]
            by_sent: dict[str, list] = {}
            for m in ms:
                by_sent.setdefault(m["sent"], []).append(int(m["ttft"]))
            rows.append({"mode": mode, "n": len(ms), "failed": text.count(f"[{mode}] r") - len(ms),
                         "ttfb_ms": statistics.median(int(m["ttft"]) for m in ms),
                         "ttfb_ms_by_sentences": {k: statistics.median(v) for k, v in sorted(by_sent.items())},
                         "total_ms": statistics.median(int(m["total"]) for m in ms),
                         "rtf": round(statistics.median(rtf), 3), "audio_s": sorted({float(m["audio"]) for m in ms})})
        hwm0 = _hwm_mib(d.proc.pid)
        hostile = asyncio.run(_hostile(port))
        alive = d.proc.poll() is None
        hostile.update(hwm_before_mib=hwm0, hwm_after_mib=_hwm_mib(d.proc.pid) if alive else None, daemon_alive=alive)
    finally:
        d.stop()
    return rows, hostile, text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench wyoming", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=None, help="checkpoint dir (default: a fresh random tiny one)")
    ap.add_argument("--steps", type=int, default=94, help="decode steps per sentence (EOS masked); 46.875 = 1 s")
    ap.add_argument("--rounds", type=int, default=3, help="wyoming-bench --rounds (x its 4 texts, per mode)")
    ap.add_argument("--threads", type=int, default=0, help="model.threads (0 = every core)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="model.device (torch backend)")
    ap.add_argument("--dtype", default="float16", help="model.dtype on cuda")
    ap.add_argument("--compile", default="auto", help="model.compile on cuda (auto, off, default)")
    ap.add_argument("--wyoming-bench", default=shutil.which("wyoming-bench") or
                    str(Path(sys.executable).with_name("wyoming-bench")), help="the wyoming-bench command")
    harness.add_common(ap)
    ap.add_argument("--log", default=None, help="write wyoming-bench's output here")
    ap.add_argument("--tree", action="append", default=None,
                    help="run the daemon from this checkout (repeatable; 'here' = this one); default: here")
    args = ap.parse_args(argv)
    version = subprocess.run([args.wyoming_bench, "--version"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="bench-wyoming-") as tmp:
        if args.checkpoint is None:
            from appliance.build.random_ckpt import write_random_checkpoint
            args.checkpoint = str(Path(tmp) / "tiny")
            write_random_checkpoint(Path(args.checkpoint), "tiny", seed=0)
        size = harness.checkpoint_size(args.checkpoint)
        hinfo = harness.host(gpu=args.device == "cuda")
        logs = []
        recs = []
        backend = "torch-cpu" if args.device == "cpu" else f"torch-cuda compile={args.compile}"
        precision = "fp32" if args.device == "cpu" else {"float16": "fp16", "bfloat16": "bf16"}.get(args.dtype, args.dtype)
        for i, tree in enumerate(args.tree or ["here"]):
            args_tree = None if tree == "here" else tree
            load0 = os.getloadavg()[0]
            rows, hostile, text = run_tree(argparse.Namespace(**{**vars(args), "tree": args_tree}), Path(tmp) / f"t{i}")
            label = "this checkout" if args_tree is None else args_tree
            note = (f"{version}, {args.rounds} rounds x 4 texts (1-4 sentences) after 1 warm-up, sentences of "
                    f"{args.steps} steps (EOS masked); 1-min load {load0:.2f} -> {os.getloadavg()[0]:.2f}")
            for r in rows:
                recs.append(harness.record(
                    "wyoming", checkpoint=size, backend=backend, machine=args.machine, host_info=hinfo, notes=note,
                    tree=label, precision=precision, batch=1, rtf=r["rtf"], ttfb_ms=r["ttfb_ms"],
                    peak_mem_mib=hostile["hwm_before_mib"],
                    **{k: v for k, v in r.items() if k not in ("rtf", "ttfb_ms")}))
            recs.append(harness.record(
                "wyoming_payload", checkpoint=size, backend=backend, machine=args.machine, host_info=hinfo,
                notes="one header with data_length 300000000, then the bytes 1 MiB at a time",
                tree=label, announced_bytes=HOSTILE_BYTES, **hostile, peak_mem_mib=hostile["hwm_after_mib"]))
            logs.append(f"# tree: {label}\n{text}")
    if args.log:
        Path(args.log).write_text("\n".join(logs))
    harness.write(recs, args.out)
    print("\n| tree | mode | TTFA median (1/2/3/4 sentences) | total median | RTF median | n |")
    print("|---|---|---|---|---|---|")
    for r in (r for r in recs if r["bench"] == "wyoming"):
        by = " / ".join(f"{v:.0f}" for v in r["ttfb_ms_by_sentences"].values())
        print(f"| {r['tree']} | {r['mode']} | {r['ttfb_ms']:.0f} ms ({by}) | {r['total_ms']:.0f} ms | {r['rtf']} | {r['n']} |")
    print("\n| tree | 300 MB event: peak RSS before -> after | bytes the client got out | what it read back |")
    print("|---|---|---|---|")
    for r in (r for r in recs if r["bench"] == "wyoming_payload"):
        print(f"| {r['tree']} | {r['hwm_before_mib']} -> {r['hwm_after_mib']} MiB | {r['bytes_sent']} | {r['answer'][:60]!r} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
