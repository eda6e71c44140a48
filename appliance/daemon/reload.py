"""SIGHUP: re-read the config file and apply what can change without a restart.

:data:`LIVE_SECTIONS` (the sampling defaults and the health thresholds) are applied at once.
Everything else (model, engines, audio devices, socket, channels, MQTT, telemetry) is bound at
start-up: a change there is reported as needing a restart. A config that no longer validates
is logged and the running one is kept; the daemon never stops on a bad reload.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Optional

from ..config import Config, load_config
from ..errors import ApplianceError

log = logging.getLogger(__name__)

LIVE_SECTIONS = ("synthesis", "health")
"""Config sections a reload applies without a restart."""


@dataclass(frozen=True)
class Reload:
    """What a reload decided.

    Attributes:
        live: section name -> its new value, to apply now (empty: nothing to apply).
        status: the status line for systemd (``READY=1`` follows), e.g.
            ``ready (config reloaded: applied synthesis; restart needed for audio)``.
        failed: why the file was not taken (``reload failed: ...``), for health's
            ``reload_failed`` condition; None when it was read.
    """

    live: dict[str, Any]
    status: str
    failed: Optional[str] = None


def plan_reload(config_path: str, running: Config, text_mode: bool, backend: str) -> Reload:
    """Compare the config file at ``config_path`` with the ``running`` config.

    Args:
        config_path: the file to re-read.
        running: the configuration in force.
        text_mode: the backend can refine text (``synthesis.refine_text`` may be turned on).
        backend: the backend's name, for the log.
    """
    try:
        new = load_config(config_path)
    except ApplianceError as e:
        log.error("SIGHUP: %s is not valid, keeping the running configuration: %s", config_path, e)
        return Reload({}, f"ready (reload failed, running config kept: {e})",
                      f"reload failed: {e}; the running configuration is kept")
    changed = [f.name for f in dataclasses.fields(Config)
               if f.name not in ("base_dir", "source") and getattr(new, f.name) != getattr(running, f.name)]
    live = {n: getattr(new, n) for n in changed if n in LIVE_SECTIONS}
    restart = [n for n in changed if n not in LIVE_SECTIONS]
    if "synthesis" in live and new.synthesis.refine_text and not text_mode:
        log.error("SIGHUP: synthesis.refine_text needs a backend with a text mode; %s has none: "
                  "keeping the running synthesis section", backend)
        del live["synthesis"]
        restart.append("synthesis (refine_text unsupported by this backend)")
    if "synthesis" in live and new.synthesis.max_new_tokens > running.synthesis.max_new_tokens:
        restart.append("synthesis.max_new_tokens above its start-up value")
    parts = []
    if live:
        parts.append("applied " + ", ".join(live))
    if restart:
        parts.append("restart needed for " + ", ".join(restart))
    msg = "; ".join(parts) or "no change"
    (log.warning if restart else log.info)("SIGHUP: reloaded %s: %s", config_path, msg)
    return Reload(live, f"ready (config reloaded: {msg})")
