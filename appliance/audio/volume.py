"""Play-out volume: the gain each channel's audio gets on its sound device.

``audio.volume_db`` (the whole box) plus the channel's ``volume_db``, in dB, as one linear factor
per channel. The mixer (:meth:`appliance.audio.mix.Lanes.mix`) multiplies each voice's samples by
its channel's factor as it copies them into the device's block (no extra buffer), and clips a
voice raised above 0 dB to [-1, 1]. A :class:`Volume` is immutable; a reload (SIGHUP) hands
:class:`~appliance.audio.output.AudioOutput` a new one, which the next block reads, so the change
is heard within one device wake-up, also in audio queued before it. WAV files and clients
(Wyoming, ``return_audio``) get the synthesized level: their player has its own volume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable, Optional

from ..config import Config


def db_to_gain(db: float) -> float:
    """Linear amplitude factor of ``db`` decibels (``-6.02`` -> 0.5)."""
    return math.pow(10.0, db / 20.0)


@dataclass(frozen=True)
class Volume:
    """Per-channel play-out gain.

    Attributes:
        box_db: ``audio.volume_db``. channel_db: channel name -> its ``volume_db``.
    """

    box_db: float = 0.0
    channel_db: dict = field(default_factory=dict)
    _gains: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:      # the factors, once: the mixer only looks them up
        object.__setattr__(self, "_gains", {ch: db_to_gain(self.db(ch)) for ch in self.channel_db})

    @classmethod
    def from_config(cls, cfg: Config) -> "Volume":
        return cls(cfg.audio.volume_db, {c.name: c.volume_db for c in cfg.service.channels})

    def db(self, channel: Optional[Hashable]) -> float:
        """Total gain of ``channel``, dB (an unknown or None channel: the box's alone)."""
        return self.box_db + self.channel_db.get(channel, 0.0)

    def gain(self, channel: Optional[Hashable]) -> float:
        """Total gain of ``channel`` as a linear factor (1.0 at 0 dB); a dict lookup (the mixer
        calls it for each voice in each device block)."""
        g = self._gains.get(channel)
        return g if g is not None else db_to_gain(self.box_db)


__all__ = ["Volume", "db_to_gain"]
