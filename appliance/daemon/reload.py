"""SIGHUP: re-read the config file and apply what can change without a restart.

Applied at once (:data:`LIVE_SECTIONS`): the sampling defaults (``synthesis``), the health
thresholds, the named ``voices`` (the pipeline resolves the new names at the next request; Wyoming
offers them in ``describe`` and takes them in ``synthesize``; the MQTT voice select lists them),
and the play-out volume (``audio.volume_db`` and each channel's ``volume_db``: the next device
block plays at it, :mod:`appliance.audio.volume`), even when other keys of ``audio`` or
``service`` changed too. Everything else (model, engines, audio devices, socket, channels, MQTT,
telemetry) is bound at start-up: a change there is reported as needing a restart.

A file that does not validate (or a voice string that does not decode) is not taken, in whole:
the running configuration is kept, the daemon never stops on a bad reload, and the failure is the
``reload_failed`` health condition, ``reload failed: <file>:<line>: <reason>``
(:func:`~appliance.config.position.located`), in ``health``, ``status``, ``STATUS=`` and the
MQTT health sensor until a reload succeeds.

Signals in a burst (an editor saving twice, ``systemctl reload`` run three times) make one
reload: the first starts a settle time of :data:`SETTLE_S`, and those within it join it
(:class:`Coalescer`); one after the reload has run makes another.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..config import Config, load_config
from ..config.position import located
from ..errors import ApplianceError
from ..text.voices import VoiceBook

log = logging.getLogger(__name__)

LIVE_SECTIONS = ("synthesis", "health", "voices")
"""Config sections a reload applies without a restart (and the volume keys, see the docstring)."""

SETTLE_S = 0.5
"""Seconds a reload waits after the SIGHUP that asked for it; SIGHUPs within join it."""


@dataclass(frozen=True)
class Reload:
    """What a reload decided.

    Attributes:
        live: section name -> its new value, to put in the running config now (empty: nothing).
            ``audio`` and ``service`` appear only for their volume keys: the running section
            with the new ``volume_db`` values.
        status: the status line for systemd (``READY=1`` follows), e.g.
            ``ready (config reloaded: applied synthesis, volume; restart needed for model)``.
        failed: ``reload failed: <file>:<line>: <reason>`` for health's ``reload_failed``
            condition; None when the file was taken.
    """

    live: dict[str, Any]
    status: str
    failed: Optional[str] = None

    @property
    def volume(self) -> bool:
        """The play-out volume changed."""
        return "audio" in self.live or "service" in self.live


def _volumes(cfg: Config) -> tuple:
    return cfg.audio.volume_db, tuple((c.name, c.volume_db) for c in cfg.service.channels)


def _without_volume(cfg: Config) -> Config:
    """``cfg`` with every volume key at 0 (what is left must be equal for a volume-only change)."""
    chans = tuple(dataclasses.replace(c, volume_db=0.0) for c in cfg.service.channels)
    return dataclasses.replace(cfg, audio=dataclasses.replace(cfg.audio, volume_db=0.0),
                               service=dataclasses.replace(cfg.service, channels=chans))


def _with_volume(running: Config, new: Config) -> dict[str, Any]:
    """The running ``audio`` and ``service`` sections with the volume keys of ``new`` (a channel
    that is not running yet gets nothing: adding one needs a restart)."""
    db = {c.name: c.volume_db for c in new.service.channels}
    chans = tuple(dataclasses.replace(c, volume_db=db.get(c.name, c.volume_db)) for c in running.service.channels)
    return {"audio": dataclasses.replace(running.audio, volume_db=new.audio.volume_db),
            "service": dataclasses.replace(running.service, channels=chans)}


def _failed(config_path: str, e: Exception) -> Reload:
    where = located(config_path, str(e))
    log.error("SIGHUP: reload failed, keeping the running configuration: %s", where)
    return Reload({}, f"ready (reload failed, running config kept: {where})", f"reload failed: {where}")


def plan_reload(config_path: str, running: Config, text_mode: bool, backend: str, hidden_size: int) -> Reload:
    """Compare the config file at ``config_path`` with the ``running`` config.

    Args:
        config_path: the file to re-read.
        running: the configuration in force.
        text_mode: the backend can refine text (``synthesis.refine_text`` may be turned on).
        backend: the backend's name, for the log.
        hidden_size: the speaker vector's size D: the new voice strings are decoded against it.
    """
    try:
        new = load_config(config_path)
        VoiceBook(new.voices).check(hidden_size, new.synthesis.voice)
    except ApplianceError as e:
        return _failed(config_path, e)
    a, b = _without_volume(new), _without_volume(running)
    changed = [f.name for f in dataclasses.fields(Config)
               if f.name not in ("base_dir", "source") and getattr(a, f.name) != getattr(b, f.name)]
    live = {n: getattr(new, n) for n in changed if n in LIVE_SECTIONS}
    restart = [n for n in changed if n not in LIVE_SECTIONS]
    if "synthesis" in live and new.synthesis.refine_text and not text_mode:
        log.error("SIGHUP: synthesis.refine_text needs a backend with a text mode; %s has none: "
                  "keeping the running synthesis section", backend)
        del live["synthesis"]
        restart.append("synthesis (refine_text unsupported by this backend)")
    if "synthesis" in live and new.synthesis.max_new_tokens > running.synthesis.max_new_tokens:
        restart.append("synthesis.max_new_tokens above its start-up value")
    applied = list(live)
    if _volumes(new) != _volumes(running):
        live.update(_with_volume(running, new))
        applied.append("volume")
    parts = []
    if applied:
        parts.append("applied " + ", ".join(applied))
    if restart:
        parts.append("restart needed for " + ", ".join(restart))
    msg = "; ".join(parts) or "no change"
    (log.warning if restart else log.info)("SIGHUP: reloaded %s: %s", config_path, msg)
    return Reload(live, f"ready (config reloaded: {msg})")


class Coalescer:
    """One reload for a burst of SIGHUPs (module docstring), on the event loop's thread.

    Args:
        loop: the daemon's loop. settle_s: :data:`SETTLE_S`.
        begin: called at the first SIGHUP of a burst (``RELOADING=1``).
        run: the reload, :data:`SETTLE_S` later, once for the burst.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, begin: Callable[[], None], run: Callable[[], None],
                 settle_s: float = SETTLE_S) -> None:
        self.loop, self.begin, self.run, self.settle_s = loop, begin, run, settle_s
        self.pending = False
        self.joined = 0         # SIGHUPs that joined the pending reload

    def signal(self) -> None:
        """A SIGHUP arrived (the loop's signal handler)."""
        if self.pending:
            self.joined += 1
            return
        self.pending, self.joined = True, 0
        self.begin()
        self.loop.call_later(self.settle_s, self._fire)

    def _fire(self) -> None:
        self.pending = False
        if self.joined:
            log.info("SIGHUP: %d more within %.2f s joined this reload", self.joined, self.settle_s)
        self.run()


__all__ = ["Reload", "plan_reload", "Coalescer", "LIVE_SECTIONS", "SETTLE_S"]
