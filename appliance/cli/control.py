"""``chattts-appliance status``, ``cancel`` and ``normalize``: one request, one reply, printed.

``status`` and ``cancel`` ask the running daemon over its socket (:mod:`appliance.cli.client`);
``normalize`` is a dry run here (what would be said, see :func:`normalize_main`) or, with
``--socket``, the daemon's answer. Exit statuses: :data:`appliance.cli.client.EXIT_DONE` etc.,
per function below.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from .client import EXIT_DONE, EXIT_ERROR, not_utf8, one_reply


def _num(v: Any, spec: str, unit: str = "") -> str:
    """``v`` formatted with ``spec`` (and ``unit``), or ``n/a`` when the daemon has no value."""
    return "n/a" if v is None else f"{format(v, spec)}{unit}"


def status_main(args: Any) -> int:
    """``chattts-appliance status``: print the daemon's status (JSON with ``--json``)."""
    rc, ev = one_reply(args, {"type": "status"}, "status")
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
    print(f"  memory {_num(ev.get('memory_mib'), '.0f')} of {_num(ev.get('memory_budget_mib'), '.0f', ' MiB')} "
          f"({ev.get('memory_kind') or '?'}), all-in {_num(ev.get('memory_all_in_mib'), '.0f', ' MiB')}, "
          f"torch {'loaded' if ev.get('torch_loaded') else 'not loaded'}")
    for net, how in (ev.get("networks") or {}).items():
        print(f"  {net}: {how}")
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
    """``chattts-appliance cancel (--id ID | --channel NAME [--scope current|queue|all])``: prints one ``cancelled ID`` line per
    request hit (from the daemon's ``cancel_done``); exit 0 when something was cancelled, 1 when
    there was nothing to cancel (message on stderr), 2 when the daemon is not reachable."""
    req: dict = {"type": "cancel"}
    if args.id:
        req["id"] = args.id
    if args.channel:
        req["channel"] = args.channel
    if getattr(args, "scope", None):
        req["scope"] = args.scope
    rc, ev = one_reply(args, req, "cancel",
                       lambda ev: ev.get("type") == "cancel_done" or
                       (ev.get("type") == "error" and ev.get("code") != "cancelled"))
    if ev is None:
        return rc
    if ev.get("type") == "error":
        print(f"cancel: error [{ev.get('code')}]: {ev.get('message')}", file=sys.stderr)
        return EXIT_ERROR
    for rid in ev.get("ids") or []:
        print(f"cancelled {rid}")
    return EXIT_DONE


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
        rc, ev = one_reply(args, {"type": "normalize", "text": args.text}, "normalize")
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
