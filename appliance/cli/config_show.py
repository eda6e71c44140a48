"""``chattts-appliance config show``: the effective configuration, one key a line, with where
each value came from (:mod:`appliance.config.sources`).

The file is validated as a start validates it: a bad value ends the command with its one-line
error (``<file>:<line>: <key>: expected ...``) and exit status 2, as ``serve`` would.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..config import CONFIG_ENV
from ..config.position import located
from ..config.sources import effective, render
from ..errors import ConfigError


def _named_by(path: str) -> str:
    env = os.environ.get(CONFIG_ENV)
    if env and Path(env).resolve() == Path(path).resolve():
        return f"named by the environment (${CONFIG_ENV}) or --config"
    return "named by --config or found in the current directory"


def cli_main(args: Any) -> int:
    """Print the effective config (``--json``: a list of {key, value, source, resolved})."""
    try:
        _, rows = effective(args.config)
    except ConfigError as e:
        raise ConfigError(located(args.config, str(e)) if args.config else str(e)) from e
    if args.json:
        print(json.dumps([r._asdict() for r in rows], ensure_ascii=False, indent=1))
        return 0
    if args.config is None:
        print("# no config file found: the built-in defaults")
    else:
        print(f"# {Path(args.config).resolve()} ({_named_by(args.config)}); null in the file means the default")
    print(render(rows))
    return 0
