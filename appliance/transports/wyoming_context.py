"""What every Wyoming connection of one server shares: the dispatcher, the ``info`` event, the
voices and the limits (built by :class:`~appliance.transports.wyoming_server.WyomingServer`), and
the one rule for a requested voice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from wyoming.event import Event as WyEvent
from wyoming.tts import SynthesizeVoice

from ..errors import SpeakerError
from ..service.dispatch import Dispatcher


@dataclass(frozen=True)
class Context:
    """What every connection of one server shares (built by
    :class:`~appliance.transports.wyoming_server.WyomingServer`).

    Attributes:
        dispatch: the daemon's dispatcher. info: the ``info`` event (``describe``'s answer).
        voices: voice name -> the same name (a ``speak`` carries it; the pipeline resolves it); the first
            is the default. channel, priority, play: of every request. streaming:
            ``wyoming.streaming``. max_chars: ``service.max_text_chars``. max_line:
            ``service.max_line_bytes`` (longest event header). max_payload:
            ``wyoming.max_payload_bytes`` (most data + payload bytes of one event).
            max_buffered_ms: ``wyoming.max_buffered_ms`` (most audio one connection holds for
            its client).
    """

    dispatch: Dispatcher
    info: WyEvent
    voices: dict
    channel: str
    priority: str
    play: bool
    streaming: bool
    max_chars: int
    max_line: int = 65536
    max_payload: int = 1 << 20
    max_buffered_ms: int = 30000

    def voice(self, v: Optional[SynthesizeVoice]) -> str:
        """The voice a ``speak`` carries for a requested voice (None or no name: the default).

        Raises:
            SpeakerError: a name this server does not offer (the message lists those it does).
        """
        name = v.name if v is not None and v.name else None
        if name is None:
            return next(iter(self.voices.values()))
        if name in self.voices:
            return self.voices[name]
        raise SpeakerError(f"unknown voice {name!r}; this box offers: {', '.join(self.voices)}")


__all__ = ["Context"]
