"""Where the configured checkpoint is: the one check a start makes before it writes anything.

The daemon calls :func:`require_checkpoint` before it creates its directories (a copy of a config
file whose relative ``model.path`` points nowhere fails without leaving a socket or spool
directory behind), and :meth:`~appliance.synth.pipeline.Pipeline.from_config` before it loads.
"""

from __future__ import annotations

from pathlib import Path

from ..config import Config
from ..errors import CheckpointError


def require_checkpoint(cfg: Config) -> Path:
    """The checkpoint's ``asset/`` directory: ``model.path``/asset, or ``model.path`` itself, the
    first holding ``gpt/config.json`` (the official 2Noise/ChatTTS layout).

    Raises:
        CheckpointError: neither holds one (the message says how to get one and where to set it).
    """
    root = cfg.resolve(cfg.model.path)
    asset = next((c for c in (root / "asset", root) if (c / "gpt" / "config.json").is_file()), None)
    if asset is None:
        raise CheckpointError(
            f"model.path {root} holds no ChatTTS checkpoint (no asset/gpt/config.json under it). Get the "
            f"official one with 'chattts-appliance model fetch DIR' (or copy the asset/ folder of "
            f"2Noise/ChatTTS into DIR), or write a random one with 'chattts-appliance model random --size "
            f"tiny DIR'; then set model.path to DIR in {cfg.file_hint}")
    return asset
