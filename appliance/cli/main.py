"""The ``chattts-appliance`` command line.

Subcommands (each imports its stage lazily, so ``say`` never loads numpy-heavy or torch code):

* ``model random --size tiny|full [--seed N] OUT_DIR`` – write a random checkpoint in the
  official layout (:mod:`appliance.build.random_ckpt`).
* ``model fetch OUT_DIR`` – download ``2Noise/ChatTTS`` and verify sha256 (:mod:`appliance.model.fetch`).
* ``model sums DIR`` – record a checkpoint's sha256 sums, checked at every start (:mod:`appliance.model.integrity`).
* ``serve`` – run the daemon (:mod:`appliance.daemon.daemon`).
* ``say TEXT`` – send a request over the socket, print the timings (:mod:`appliance.cli.say`).
* ``status`` / ``cancel --id ID | --channel NAME`` – ask a running daemon (:mod:`appliance.cli.control`).
* ``normalize TEXT`` – print what would be said, without synthesizing; no daemon needed
  (``--socket`` asks a running one) (same module).
* ``config show`` – the effective config, with where each value came from (:mod:`appliance.cli.config_show`).
* ``health`` – field health check, here or by the running daemon (:mod:`appliance.ops.health`).
* ``engines export|build`` – ONNX graphs and TensorRT plans (:mod:`appliance.build.cli`);
  ``engines compile`` – the CUDA decode step compiled ahead of time (:mod:`appliance.build.aot`).

Every subcommand reads the same config file (:func:`appliance.config.find_config`): ``--config``,
else ``$CHATTTS_APPLIANCE_CONFIG``, else ``./config.local.yaml``, else ``./config.yaml``; the
clients (``say``, ``status``, ``cancel``, ``health --daemon``) take the daemon's socket from it,
so ``--socket`` is only needed for a socket that config does not name. Without any config file
the clients and ``engines`` use the built-in defaults; ``serve``, ``normalize`` and ``calibrate``
stop with an error listing that search order.

Every :class:`~appliance.errors.ApplianceError` ends the command with exit status 2 and its
message on stderr (no traceback); other exit codes are documented per subcommand.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from ..config import find_config
from ..engines.llama.lib import FTYPES as GGUF_TYPES
from ..errors import ApplianceError
from .utf8 import check_paths, reexec_in_utf8_mode, text_arg

CONFIG_HELP = ("config file (default: $CHATTTS_APPLIANCE_CONFIG, else ./config.local.yaml, else "
               "./config.yaml)")
VERBOSE_HELP = "debug logging (without it normalize, calibrate and health log only warnings)"

#: Subcommands that also work without a config file (they only need the socket path).
_CLIENTS = ("say", "status", "cancel", "health")
#: Subcommands whose output is their result (dry runs, measurements): they log WARNING and
#: above only, unless ``-v``.
_QUIET = ("normalize", "calibrate", "health")
#: Subcommands that run on the built-in defaults when there is no config file.
_DEFAULTS_OK = _CLIENTS + ("engines export", "engines build", "engines compile", "config show")

# subcommand -> (module, function). The function takes the parsed argparse namespace and
# returns an exit status.
_COMMANDS = {
    "model random": ("appliance.build.random_ckpt", "cli_main"),
    "model fetch": ("appliance.model.fetch", "cli_main"),
    "model sums": ("appliance.model.integrity", "cli_main"),
    "serve": ("appliance.daemon.daemon", "cli_main"),
    "say": ("appliance.cli.say", "cli_main"),
    "health": ("appliance.ops.health", "cli_main"),
    "status": ("appliance.cli.control", "status_main"),
    "cancel": ("appliance.cli.control", "cancel_main"),
    "normalize": ("appliance.cli.control", "normalize_main"),
    "engines export": ("appliance.build.cli", "cli_export"),
    "engines build": ("appliance.build.cli", "cli_build"),
    "engines compile": ("appliance.build.aot", "cli_main"),
    "calibrate": ("appliance.build.calibrate", "cli_main"),
    "config show": ("appliance.cli.config_show", "cli_main"),
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (kept separate for tests and ``--help``)."""
    p = argparse.ArgumentParser(prog="chattts-appliance", description="ChatTTS speech appliance")
    p.add_argument("--version", action=_Version, help="print the version and exit")
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    # -v also after the sub-command (`serve -v`); SUPPRESS keeps a -v given before it
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    sub = _Sub(p.add_subparsers(dest="cmd", required=True), common)

    m = _Sub(sub.add_parser("model", help="checkpoints", leaf=False).add_subparsers(dest="sub", required=True), common)
    r = m.add_parser("random", help="write a random checkpoint in the official layout")
    r.add_argument("--size", choices=("tiny", "full"), default="tiny",
                   help="tiny: 2 layers, ~3 MB (tests); full: the real shapes, 1.2 GB (benchmarks)")
    r.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    r.add_argument("out_dir", help="directory to write (asset/ goes inside)")
    f = m.add_parser("fetch", help="download 2Noise/ChatTTS from the HuggingFace hub")
    f.add_argument("out_dir", help="directory to download into (asset/ goes inside)")
    f.add_argument("--revision", default=None, help="hub revision (default: main)")
    su = m.add_parser("sums", help="record the sha256 of a checkpoint of your own (DIR/SHA256SUMS.json)")
    su.add_argument("dir", help="the checkpoint directory (holding asset/)")

    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument("--config", default=None, help=CONFIG_HELP)

    y = sub.add_parser("say", help="speak TEXT through a running daemon")
    y.add_argument("text", help="what to say (UTF-8; control tokens like [uv_break] allowed)")
    y.add_argument("--config", default=None, help="read the socket path from this " + CONFIG_HELP)
    y.add_argument("--socket", default=None, help="socket path (overrides --config)")
    y.add_argument("--channel", default=None, help="channel name from config (default: the first channel)")
    y.add_argument("--voice", default=None, help="a voice name from config 'voices' (e.g. calm), 'seed:N' or an "
                   "upstream speaker string (default: synthesis.voice)")
    y.add_argument("--seed", type=int, default=None, help="sampling seed, 0 <= N < 2**63: same seed, same audio")
    y.add_argument("--priority", default="normal", choices=("alert", "normal", "background"),
                   help="an alert preempts what plays on its channel")
    y.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="cap EACH SENTENCE at N decode steps (46.875 = 1 s of audio; params.max_new_tokens); "
                        "default synthesis.max_new_tokens")
    y.add_argument("--wav", default=None, help="also write the returned audio to this WAV file")
    y.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for 'done'")
    y.add_argument("--json", action="store_true", help="print the events as JSON lines")

    for name, hlp in (("status", "print a running daemon's status"),
                      ("cancel", "cancel a request (--id) or everything on a channel (--channel)")):
        c = sub.add_parser(name, help=hlp)
        c.add_argument("--config", default=None, help="read the socket path from this " + CONFIG_HELP)
        c.add_argument("--socket", default=None, help="socket path (overrides --config)")
        c.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the reply")
        if name == "status":
            c.add_argument("--json", action="store_true", help="print the status as JSON")
        else:
            g = c.add_mutually_exclusive_group(required=True)
            g.add_argument("--id", default=None, help="request id")
            g.add_argument("--channel", default=None, help="channel name")
            c.add_argument("--scope", choices=("current", "queue", "all"), default=None,
                           help="with --channel: current (what sounds now), queue (the default: that and the "
                                "queued requests, alerts kept) or all (alerts too)")

    n = sub.add_parser("normalize", help="print what TEXT would be said as, without synthesizing (dry run)")
    n.add_argument("text", help="the text a speak request would carry")
    n.add_argument("--config", default=None, help="config whose model.path tokenizer and limits to use: "
                   + CONFIG_HELP)
    n.add_argument("--socket", default=None, help="ask the running daemon on this socket instead")
    n.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the daemon's reply")
    n.add_argument("--json", action="store_true", help="print the normalized reply as JSON")

    h = sub.add_parser("health", help="field health check (exit 1 when unhealthy)")
    h.add_argument("--config", default=None, help=CONFIG_HELP)
    h.add_argument("--json", action="store_true", help="print the health report as JSON")
    h.add_argument("--daemon", action="store_true",
                   help="ask the running daemon (at the config's service.socket) instead of loading the engines here")
    h.add_argument("--socket", default=None, help="ask the running daemon at this socket (implies --daemon)")

    e = _Sub(sub.add_parser("engines", help="ONNX export, TensorRT build, ahead-of-time compiled step", leaf=False)
             .add_subparsers(dest="sub", required=True), common)
    ex = e.add_parser("export", help="export ONNX graphs (or the GPT as a GGUF for llama.cpp) from a checkpoint")
    ex.add_argument("--config", default=None, help=CONFIG_HELP)
    ex.add_argument("--checkpoint", default=None, help="checkpoint dir (default: model.path)")
    ex.add_argument("--out", default=None, help="output dir (default: model.engine_dir)")
    ex.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "int8", "int4", "fp8", *GGUF_TYPES),
                    help="weights of the exported graphs (int8 / int4: 8 / 4-bit weight-only GPT; default fp32); "
                         f"{' / '.join(GGUF_TYPES)}: the GPT as gpt.gguf of that type for llama.cpp, beside the FP32 vocoder")
    ex.add_argument("--window-tokens", type=int, default=None,
                    help="longest Decoder window in tokens for TensorRT profiles (default 256; Vocos: 2x in mel frames)")
    b = e.add_parser("build", help="build TensorRT plans from the exported ONNX graphs")
    b.add_argument("--config", default=None, help=CONFIG_HELP)
    b.add_argument("--dir", default=None, help="engine dir (default: model.engine_dir)")
    b.add_argument("--precision", default="fp16", choices=("fp16", "int8", "fp8"),
                   help="plan precision (fp8 needs sm >= 8.9; not on Jetson Orin; default fp16)")
    b.add_argument("--target", default=None, help="compute capability to build for, e.g. 8.7 (default: this GPU)")
    b.add_argument("--workspace-mib", type=int, default=None,
                   help="builder workspace (memory pool) limit in MiB (default: min(1024, service.memory_budget_mb))")
    b.add_argument("--graphs", default=None, help="comma-separated subset: gpt,decoder,vocos")
    c = e.add_parser("compile", help="compile the CUDA runner's decode step ahead of time (AOTInductor packages); "
                                     "exit 1 when they fail their load check in a child process")
    c.add_argument("--config", default=None, help=CONFIG_HELP)
    c.add_argument("--mode", default="default", choices=("default", "max-autotune-no-cudagraphs"),
                   help="inductor mode the packages are compiled with (default: default)")
    c.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: model.device")
    c.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1..model.max_batch)")
    c.add_argument("--buckets", default=None, help="comma-separated attention spans (default: the runner's)")
    c.add_argument("--out", default=None, help="output dir (default: <model.engine_dir>/aot)")
    for x in (ex, b):
        x.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                       help="skip measuring the vocoder look-ahead on the result (chattts-appliance calibrate)")

    cf = _Sub(sub.add_parser("config", help="the configuration", leaf=False).add_subparsers(dest="sub", required=True), common)
    cs = cf.add_parser("show", help="print the effective config and where each value came from (default, file:line)")
    cs.add_argument("--config", default=None, help=CONFIG_HELP)
    cs.add_argument("--json", action="store_true", help="print a JSON list of {key, value, source, resolved}")

    cal = sub.add_parser("calibrate", help="measure the vocoder look-ahead this checkpoint and backend need",
                         description="Synthesize a fixed set of sentences (Chinese, English, mixed; two voices) on the "
                                     "configured checkpoint and backend, stream each with less right context than the "
                                     "exact receptive field (53 decode steps at full size), and keep the smallest "
                                     "look-ahead whose PCM error stays "
                                     "under the threshold. The result and the whole curve go to "
                                     "<model.engine_dir>/calibration.json; the daemon uses it from its next start "
                                     "(stream.lookahead: auto).")
    cal.add_argument("--config", default=None, help="config file (default: $CHATTTS_APPLIANCE_CONFIG, "
                     "./config.local.yaml, ./config.yaml)")
    cal.add_argument("--threshold-db", type=float, default=None,
                     help="largest PCM error relative to the signal peak (default: stream.lookahead_threshold_db)")
    cal.add_argument("--json", action="store_true", help="print the whole calibration record as JSON")
    cal.add_argument("--if-missing", action="store_true", help="only where the daemon would find no calibration for "
                     "the engines it opens (installers; the daemon itself calibrates at such a start)")
    return p


class _Version(argparse.Action):
    """``--version``: print ``chattts-appliance <version>`` and exit (the version is looked up only
    then: building the parser stays free of numpy, for the clients)."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from ..core import version
        print(f"{parser.prog} {version()}")
        parser.exit()


class _Sub:
    """A subparsers action whose leaf parsers all take the common options (``-v``)."""

    def __init__(self, action: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
        self.action, self.common = action, common

    def add_parser(self, name: str, leaf: bool = True, **kw) -> argparse.ArgumentParser:
        return self.action.add_parser(name, parents=[self.common] if leaf else [], **kw)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``chattts-appliance`` console script; returns the exit status. Run
    from the command line (``argv`` None) it first makes sure it is in UTF-8 mode
    (:mod:`appliance.cli.utf8`). A closed standard output (``status | head``) ends it quietly
    with status 141 (128 + SIGPIPE, as the shell reports a command killed by it)."""
    if argv is None:
        reexec_in_utf8_mode()
    args = build_parser().parse_args(argv)
    for k in ("text", "voice", "channel"):
        if isinstance(getattr(args, k, None), str):
            setattr(args, k, text_arg(getattr(args, k)))
    if (sys.stdout.encoding or "").lower().replace("-", "") != "utf8":    # PYTHONUTF8=0 in a narrow locale
        sys.stdout.reconfigure(errors="backslashreplace")
    key = args.cmd if getattr(args, "sub", None) is None else f"{args.cmd} {args.sub}"
    if not logging.getLogger().handlers:
        # journald with structured fields under systemd, stderr otherwise
        from ..ops.logsetup import setup_logging

        setup_logging(args.verbose, quiet=key in _QUIET)
    module, func = _COMMANDS[key]
    try:
        if "config" in args:   # one config for every subcommand; None: clients and engines use defaults
            needed = key not in _DEFAULTS_OK and not (key == "normalize" and args.socket)
            found = find_config(args.config, required=needed)
            args.config = str(found) if found is not None else None
            if found is not None and not sys.flags.utf8_mode:   # PYTHONUTF8=0: a path the locale lacks
                from ..config import load_config
                check_paths(load_config(found))
        fn = getattr(importlib.import_module(module), func)
        rc = int(fn(args) or 0)
        sys.stdout.flush()
        return rc
    except ApplianceError as e:
        print(f"chattts-appliance {key}: error: {e}", file=sys.stderr)
        return int(getattr(e, "exit_status", 2))
    except UnicodeError as e:     # a path or text this locale cannot represent (outside UTF-8 mode)
        print(f"chattts-appliance {key}: error: {e}; run in UTF-8 mode (PYTHONUTF8=1) or a UTF-8 locale",
              file=sys.stderr)
        return 2
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit
        return 141
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
