"""``chattts-appliance say TEXT``: send one ``speak`` over the UNIX socket and report; also
``status``, ``cancel`` and ``normalize`` (a dry run: what would be said, see :func:`normalize_main`).

Prints ``accepted`` / ``started`` / ``done`` as they arrive, in human form (TTFB in ms, RTF,
seconds of audio, decode steps/s, where the audio went), or the raw JSON lines with
``--json``. ``--wav FILE`` asks for ``return_audio`` and writes the PCM it receives to a 16-bit
WAV (see :mod:`appliance.audio.wav`).

Exit status: 0 on ``done``; 1 on an ``error`` event (message on stderr), a timeout, the
daemon closing the connection early, or a text that is not UTF-8 (nothing is sent; the message
names the byte); 2 when the daemon cannot be reached (the message says how to start it).

The socket path: ``--socket``, else ``service.socket`` of the config every subcommand uses
(``--config``, else ``$CHATTTS_APPLIANCE_CONFIG``, else ``./config.local.yaml``, else
``./config.yaml``), else the built-in default. Only the stdlib (plus numpy for ``--wav``) is
imported, so ``say`` starts fast.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from ..errors import ApplianceError

EXIT_DONE, EXIT_ERROR, EXIT_UNREACHABLE = 0, 1, 2


class Unreachable(Exception):
    """The daemon's socket does not exist or refuses connections."""


def socket_path(config: Optional[str], sock: Optional[str]) -> Path:
    """The daemon's socket: ``--socket``, else ``service.socket`` of the config
    (:func:`~appliance.config.find_config`: ``--config``, ``$CHATTTS_APPLIANCE_CONFIG``,
    ``./config.local.yaml``, ``./config.yaml``), else the built-in default.

    Raises:
        ConfigError: the config file named cannot be read or is invalid.
    """
    if sock:
        return Path(sock)
    from ..config import Config, find_config, load_config
    found = find_config(config)
    cfg = load_config(found) if found is not None else Config()
    return cfg.resolve(cfg.service.socket)


class Client:
    """A blocking connection to the daemon.

    Args:
        path: socket path. timeout_s: overall deadline for connecting and reading, s
            (``socket.timeout`` when it passes).

    Raises:
        Unreachable: no socket file, connection refused, or no permission (message says why).
    """

    def __init__(self, path: str | Path, timeout_s: float = 600.0) -> None:
        self.path = Path(path)
        self.deadline = time.monotonic() + timeout_s
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        try:
            self.sock.connect(str(self.path))
        except FileNotFoundError:
            self.sock.close()
            raise Unreachable(f"no daemon socket at {self.path}") from None
        except ConnectionRefusedError:
            self.sock.close()
            raise Unreachable(f"nobody is listening on {self.path}: the daemon is stopping or not running "
                              f"(a socket file left behind)") from None
        except PermissionError:
            self.sock.close()
            raise Unreachable(f"no permission to connect to {self.path}; join the service's group") from None
        self._buf = bytearray()

    def send(self, obj: dict) -> None:
        """Send one request (a JSON object) as one line."""
        self.sock.sendall(json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n")

    def _recv(self, n: int) -> bytes:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("deadline passed")
        self.sock.settimeout(left)
        return self.sock.recv(n)

    def _read_line(self) -> Optional[bytes]:
        while True:
            i = self._buf.find(b"\n")
            if i >= 0:
                line = bytes(self._buf[:i])
                del self._buf[:i + 1]
                return line
            data = self._recv(65536)
            if not data:
                return None
            self._buf += data

    def _read_exact(self, n: int) -> bytes:
        while len(self._buf) < n:
            data = self._recv(max(65536, n - len(self._buf)))
            if not data:
                raise ConnectionError("the daemon closed the connection inside an audio payload")
            self._buf += data
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def events(self) -> Iterator[tuple[dict, Optional[bytes]]]:
        """Yield (event dict, payload bytes or None) until the daemon closes the connection."""
        while True:
            line = self._read_line()
            if line is None:
                return
            ev = json.loads(line)
            payload = self._read_exact(int(ev["bytes"])) if ev.get("type") == "audio" else None
            yield ev, payload

    def close(self) -> None:
        self.sock.close()


def speak(path: str | Path, request: dict, timeout_s: float = 600.0) -> Iterator[tuple[dict, Optional[bytes]]]:
    """Send ``request`` (a speak object) and yield its events up to its ``done`` or ``error``."""
    c = Client(path, timeout_s)
    try:
        c.send(request)
        for ev, payload in c.events():
            yield ev, payload
            if ev.get("type") in ("done", "error"):
                return
    finally:
        c.close()


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
        if ev.get("unspeakable"):
            s += f"\n          could not speak (skipped): {', '.join(ev.get('unspeakable_names') or ev['unspeakable'])}"
        return s
    return json.dumps(ev, ensure_ascii=False)


def not_utf8(what: str, text: str) -> Optional[str]:
    """Why ``text`` (from the command line) cannot be sent as UTF-8, or None when it can.

    Python decodes a command-line argument that is not valid UTF-8 (in a UTF-8 locale) with
    ``surrogateescape``: each undecodable byte becomes a lone surrogate, which JSON cannot carry.
    The message names the first such byte and how to fix the input."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        raw = text[e.start:e.end].encode("utf-8", "surrogateescape") if 0xDC80 <= ord(text[e.start]) <= 0xDCFF else b""
        byte = f"byte 0x{raw[0]:02x}" if raw else f"character U+{ord(text[e.start]):04X}"
        return (f"{what} is not valid UTF-8 ({byte} at character {e.start + 1}): convert it first, e.g. "
                f"`iconv -f GBK -t UTF-8`, or run in a UTF-8 locale (LANG=C.UTF-8)")


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


def _one_reply(args: Any, request: dict, prog: str) -> tuple[int, Optional[dict]]:
    """Send one request and return (exit status, its first reply) — for ``status`` / ``cancel``."""
    try:
        path = socket_path(args.config, args.socket)
        c = Client(path, args.timeout)
    except (ApplianceError, Unreachable) as e:
        print(f"{prog}: the daemon is not reachable: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE, None
    try:
        c.send(request)
        for ev, _ in c.events():
            return (EXIT_ERROR if ev.get("type") == "error" else EXIT_DONE), ev
    except (socket.timeout, OSError, ValueError) as e:
        print(f"{prog}: no reply from {path}: {e}", file=sys.stderr)
        return EXIT_ERROR, None
    finally:
        c.close()
    print(f"{prog}: the daemon closed the connection without a reply", file=sys.stderr)
    return EXIT_ERROR, None


def _num(v: Any, spec: str, unit: str = "") -> str:
    """``v`` formatted with ``spec`` (and ``unit``), or ``n/a`` when the daemon has no value."""
    return "n/a" if v is None else f"{format(v, spec)}{unit}"


def status_main(args: Any) -> int:
    """``chattts-appliance status``: print the daemon's status (JSON with ``--json``)."""
    rc, ev = _one_reply(args, {"type": "status"}, "status")
    if ev is None:
        return rc
    if args.json or ev.get("type") != "status":
        print(json.dumps(ev, ensure_ascii=False))
        return rc
    print(f"state {ev['state']}, backend {ev['backend']}, throttle {ev.get('throttle')}, "
          f"last RTF {_num(ev.get('last_rtf'), '.3f')}, last TTFB {_num(ev.get('last_ttfb_ms'), '.0f', ' ms')}, "
          f"temperature {_num(ev.get('temperature_c'), '.1f', ' C')}")
    if ev.get("threads"):
        print(f"  CPU threads {ev['threads']} ({ev.get('threads_source') or '?'})")
    print(f"health {ev.get('health', 'n/a')}")
    for c in ev.get("conditions") or ():
        print(f"  - {c.get('name')} ({c.get('severity')}, {c.get('for_s', 0):g} s): {c.get('reason')}")
    for name, ch in (ev.get("channels") or {}).items():
        print(f"  {name}: active {ch.get('active') or '-'}, queued {ch.get('queued', 0)}"
              + "".join(f", {k} {_field(v)}" for k, v in ch.items() if k not in ("active", "queued")))
    return rc


def _field(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}"
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v)) or "-"
    if isinstance(v, dict):       # e.g. a channel's start decision: (id ..., predicted_rtf ..., ...)
        return "(" + ", ".join(f"{k} {x:g}" if isinstance(x, float) else f"{k} {_field(x)}"
                               for k, x in v.items()) + ")" if v else "-"
    return str(v)


def cancel_main(args: Any) -> int:
    """``chattts-appliance cancel (--id ID | --channel NAME)``: prints one ``cancelled ID`` line per
    request hit (from the daemon's ``cancel_done``); exit 0 when something was cancelled, 1 when
    there was nothing to cancel (message on stderr), 2 when the daemon is not reachable."""
    req: dict = {"type": "cancel"}
    if args.id:
        req["id"] = args.id
    if args.channel:
        req["channel"] = args.channel
    try:
        path = socket_path(args.config, args.socket)
        c = Client(path, args.timeout)
    except (ApplianceError, Unreachable) as e:
        print(f"cancel: the daemon is not reachable: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        c.send(req)
        for ev, _ in c.events():
            t = ev.get("type")
            if t == "cancel_done":
                for rid in ev.get("ids") or []:
                    print(f"cancelled {rid}")
                return EXIT_DONE
            if t == "error" and ev.get("code") != "cancelled":
                print(f"cancel: error [{ev.get('code')}]: {ev.get('message')}", file=sys.stderr)
                return EXIT_ERROR
    except (socket.timeout, OSError, ValueError) as e:
        print(f"cancel: no reply from {path}: {e}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        c.close()
    print("cancel: the daemon closed the connection without a reply", file=sys.stderr)
    return EXIT_ERROR


def normalize_main(args: Any) -> int:
    """``chattts-appliance normalize TEXT``: print what the box would say, sentence by sentence
    (with each sentence's prompt tokens), and what it cannot speak; nothing is synthesized. When
    the markup stage changed the text (Markdown, HTML, SSML), the cleaned text comes first (dry
    run only: the daemon's ``normalized`` reply has the sentences).

    Without ``--socket`` it needs no daemon: it reads ``--config`` (else ``./config.yaml``, else
    the defaults) and the checkpoint's tokenizer under ``model.path``, and runs the daemon's own
    normalizer and sentence split (:mod:`appliance.text.dryrun`). With ``--socket`` it asks the
    running daemon (a ``normalize`` request), which answers with its live configuration.

    Exit status: 0; 1 when the text cannot be spoken at all (message on stderr); 2 when the
    tokenizer or the daemon cannot be reached.
    """
    why = not_utf8("the text", args.text)
    if why is not None:
        print(f"normalize: {why}", file=sys.stderr)
        return EXIT_ERROR
    if args.socket:
        rc, ev = _one_reply(args, {"type": "normalize", "text": args.text}, "normalize")
        if ev is None:
            return rc
        if ev.get("type") == "error":
            print(f"normalize: error [{ev.get('code')}]: {ev.get('message')}", file=sys.stderr)
            return EXIT_ERROR
    else:
        from ..errors import TextError
        from ..text.dryrun import cli_config, dry_run
        try:
            ev = {"type": "normalized", **dry_run(args.text, cli_config(args.config))}
        except TextError as e:
            print(f"normalize: {e}", file=sys.stderr)
            return EXIT_ERROR
    if args.json:
        print(json.dumps(ev, ensure_ascii=False))
        return EXIT_DONE
    from ..text.dryrun import shown
    print("\n".join(shown(ev, args.text)))
    return EXIT_DONE
