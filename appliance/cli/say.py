"""``chattts-appliance say TEXT``: send one ``speak`` over the UNIX socket and report.

Prints ``accepted`` / ``started`` / ``done`` as they arrive, in human form (TTFB in ms, RTF,
seconds of audio, decode steps/s, where the audio went), or the raw JSON lines with
``--json``. ``--wav FILE`` asks for ``return_audio`` and writes the PCM it receives to a 16-bit
WAV (see :mod:`appliance.audio.wav`).

Exit status: 0 on ``done``; 1 on an ``error`` event (message on stderr), a timeout, the
daemon closing the connection early, or a text that is not UTF-8 (nothing is sent; the message
names the byte); 2 when the daemon cannot be reached (the message says how to start it).

The socket path: see :func:`appliance.cli.client.socket_path`. Only the stdlib (plus numpy for
``--wav``) is imported, so ``say`` starts fast.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any

from ..errors import ApplianceError
from .client import EXIT_DONE, EXIT_ERROR, EXIT_UNREACHABLE, Unreachable, not_utf8, socket_path, speak


def _human(ev: dict) -> str:
    t = ev.get("type")
    if t == "accepted":
        s = f"accepted  {ev['id']} on {ev['channel']}, queue position {ev['queue_position']}"
        if ev.get("waiting"):
            s += f" (waiting: {ev['waiting']})"
        return s
    if t == "preempted":
        then = "it will start again after the alert" if ev.get("action") == "resume" else "it is dropped"
        return f"preempted {ev['id']} by alert {ev.get('by')}: {then}"
    if t == "started":
        return f"started   {ev['id']}"
    if t == "done":
        s = (f"done      {ev['id']}: TTFB {ev['ttfb_ms']:.0f} ms, RTF {ev['rtf']:.3f} "
             f"({ev['audio_s']:.2f} s of audio, {ev['steps']} steps at {ev['steps_per_s']:.1f}/s), "
             f"voice {ev.get('voice')}, seed {ev.get('seed')}, -> {ev.get('output')}")
        silent = set(ev.get("silent_sentences") or [])
        for k, sent in enumerate(ev.get("spoken") or []):
            s += f"\n          said {k + 1}: {sent}" + ("   (no audio: the model ended it at once)" if k in silent else "")
        for cut in ev.get("truncated") or []:
            s += (f"\n          cut short {cut['sentence'] + 1}: it reached its cap of {cut['steps']} decode steps "
                  f"and its end may be missing")
        for p in ev.get("pauses") or []:
            s += (f"\n          paused {p['ms']:.0f} ms at {p['at_s']:.2f} s ({p['where'].replace('_', ' ')} "
                  f"{p['sentence'] + 1}, {p['cause']})")
        if ev.get("unspeakable"):
            s += f"\n          could not speak (skipped): {', '.join(ev.get('unspeakable_names') or ev['unspeakable'])}"
        return s
    return json.dumps(ev, ensure_ascii=False)


def cli_main(args: Any) -> int:
    """Entry point of ``say`` (args: text, config, socket, channel, voice, seed, priority,
    max_new_tokens (per sentence), wav, timeout, json); returns the exit status (see the module
    docstring)."""
    for what, value in (("the text", args.text), ("--voice", args.voice), ("--channel", args.channel)):
        why = not_utf8(what, value) if value is not None else None
        if why is not None:
            print(f"say: {why}", file=sys.stderr)
            return EXIT_ERROR
    try:
        path = socket_path(args.config, args.socket)
    except ApplianceError as e:
        print(f"say: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    req: dict = {"type": "speak", "text": args.text, "priority": args.priority}
    for k in ("channel", "voice", "seed"):
        if getattr(args, k, None) is not None:
            req[k] = getattr(args, k)
    if getattr(args, "max_new_tokens", None) is not None:
        req["params"] = {"max_new_tokens": args.max_new_tokens}
    if args.wav:
        parent = os.path.dirname(os.path.abspath(args.wav))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            print(f"say: --wav {args.wav}: directory {parent} does not exist or is not writable", file=sys.stderr)
            return EXIT_ERROR
        req["return_audio"] = True
    pcm: list[bytes] = []
    fmt, rate = "float32", 24000
    t0 = time.monotonic()
    try:
        for ev, payload in speak(path, req, args.timeout):
            t = ev.get("type")
            if t == "audio":
                pcm.append(payload or b"")
                fmt, rate = ev.get("format", fmt), int(ev.get("rate", rate))
                continue
            if args.json:
                print(json.dumps(ev, ensure_ascii=False), flush=True)
            elif t != "error":
                print(_human(ev), flush=True)
            if t == "error":
                print(f"say: error [{ev.get('code')}]: {ev.get('message')}", file=sys.stderr)
                return EXIT_ERROR
            if t == "done":
                if args.wav:
                    try:
                        _write_wav(args.wav, b"".join(pcm), fmt, rate)
                    except (ApplianceError, OSError) as e:
                        print(f"say: the request was spoken but --wav {args.wav} could not be written: {e}",
                              file=sys.stderr)
                        return EXIT_ERROR
                    if not args.json:
                        print(f"wrote {args.wav}", flush=True)
                return EXIT_DONE
    except Unreachable as e:
        cfg = f" --config {args.config}" if args.config else ""
        box = "" if args.config and args.config.endswith("config.local.yaml") else \
            " (or `systemctl start chattts-appliance`)"
        print(f"say: the daemon is not reachable: {e}.\n"
              f"Start it with `chattts-appliance serve{cfg}`{box}, or pass --socket / --config.", file=sys.stderr)
        return EXIT_UNREACHABLE
    except socket.timeout:
        print(f"say: no 'done' within {args.timeout:g} s (--timeout)", file=sys.stderr)
        return EXIT_ERROR
    except (ConnectionError, OSError, ValueError) as e:
        print(f"say: connection to {path} failed: {e}", file=sys.stderr)
        return EXIT_ERROR
    print(f"say: the daemon closed the connection after {time.monotonic() - t0:.1f} s without 'done'", file=sys.stderr)
    return EXIT_ERROR


def _write_wav(path: str, data: bytes, fmt: str, rate: int) -> None:
    import numpy as np

    from ..audio.wav import write_wav
    pcm = np.frombuffer(data, dtype="<f4" if fmt == "float32" else "<i2")
    if fmt != "float32":
        pcm = pcm.astype(np.float32) / 32767.0
    write_wav(path, pcm, rate)
