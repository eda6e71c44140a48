"""Named voices: one table (config ``voices``) read the same way by every transport.

A request's ``voice`` field (socket, MQTT, ``say --voice``, Wyoming, the MQTT voice select) is
one of:

* a **name** from ``voices`` (e.g. ``calm``, configured as ``seed:11``);
* ``seed:N`` or an upstream speaker string (see :func:`~appliance.text.speaker.resolve_voice`),
  or ``none`` (no speaker vector);
* absent: ``synthesis.voice``.

A text of ASCII characters that is none of these is an unknown name (speaker strings are
base16384 text, never ASCII): it is refused with ``unknown voice 'x'; this box offers: a, b``
(:class:`~appliance.errors.SpeakerError`, code ``bad_speaker``), instead of a decoding error about
base16384. :meth:`VoiceBook.lookup` also gives the label ``done`` reports: the name used (for an
absent voice, the first name whose voice is ``synthesis.voice``), else ``seed:N``, ``none`` or
``speaker:<first 12 hex digits of the string's sha256>``.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple, Optional, Sequence

from ..config import VoiceConfig
from ..errors import ConfigError, SpeakerError
from .speaker import resolve_voice


class VoiceChoice(NamedTuple):
    """What a request's ``voice`` field stands for.

    Attributes:
        spec: ``seed:N``, ``none`` or an upstream speaker string (what
            :func:`~appliance.text.speaker.resolve_voice` takes).
        label: how ``done`` names it (a voice name, ``seed:N``, ``none`` or ``speaker:<hex12>``).
    """

    spec: str
    label: str


def _label(spec: str) -> str:
    v = spec.strip()
    if v.lower() == "none" or v.lower().startswith("seed:"):
        return v.lower().replace(" ", "")
    return "speaker:" + hashlib.sha256(v.encode("utf-8", "surrogatepass")).hexdigest()[:12]


class VoiceBook:
    """The named voices of one box.

    Args:
        voices: config ``voices`` (unique names, checked at load); an entry without ``voice``
            stands for ``synthesis.voice``.
    """

    def __init__(self, voices: Sequence[VoiceConfig]) -> None:
        self.voices: dict[str, Optional[str]] = {v.name: v.voice for v in voices}

    @property
    def names(self) -> list[str]:
        """The voice names, in config order (the first is Wyoming's and the MQTT select's default)."""
        return list(self.voices)

    def unknown(self, name: str) -> SpeakerError:
        """The error for a voice name this box does not have."""
        return SpeakerError(f"unknown voice {name!r}; this box offers: {', '.join(self.voices)} "
                            f"(or 'seed:N', or an upstream speaker string)")

    def lookup(self, voice: Optional[str], default: str) -> VoiceChoice:
        """What ``voice`` (a request's field; None = absent) stands for, ``default`` being
        ``synthesis.voice``.

        Raises:
            SpeakerError: ``voice`` is not a string, or an ASCII text that is neither a name,
                ``seed:N`` nor ``none`` (the message lists the names).
        """
        if voice is None:
            name = next((n for n, v in self.voices.items() if (v or default) == default), None)
            return VoiceChoice(default, name or _label(default))
        if not isinstance(voice, str):
            raise SpeakerError(f"voice must be a string (a name, 'seed:N' or a speaker string), got {type(voice).__name__}")
        if voice in self.voices:
            return VoiceChoice(self.voices[voice] or default, voice)
        v = voice.strip().lower()
        if v == "none" or v.startswith("seed:"):
            return VoiceChoice(voice, _label(voice))
        if voice.isascii():
            raise self.unknown(voice)
        return VoiceChoice(voice, _label(voice))

    def check(self, dim: int, default: str) -> None:
        """Resolve every named voice and ``default`` (``synthesis.voice``) once (at start and on
        SIGHUP), so a bad one stops the start, or the reload, naming it.

        Raises:
            ConfigError: a voice string of ``voices`` or ``default`` is malformed.
        """
        try:
            resolve_voice(default, dim)
        except SpeakerError as e:
            raise ConfigError(f"synthesis.voice: {e}") from e
        for i, (name, v) in enumerate(self.voices.items()):
            if v is None:
                continue
            try:
                resolve_voice(v, dim)
            except SpeakerError as e:
                raise ConfigError(f"voices[{i}] ({name}): {e}") from e


__all__ = ["VoiceBook", "VoiceChoice"]
