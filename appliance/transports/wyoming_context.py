"""What every Wyoming connection of one server shares: the dispatcher, the :class:`Offer` (the
``info`` event and the voices), the limits (built by
:class:`~appliance.transports.wyoming_server.WyomingServer`), and the one rule for a requested
voice. A reload (SIGHUP) that changes the voices hands the context a new offer
(:meth:`Context.use`): connections already open see it at their next event."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from wyoming.event import Event as WyEvent
from wyoming.tts import SynthesizeVoice

from ..errors import SpeakerError
from ..service.dispatch import Dispatcher


@dataclass(frozen=True)
class Offer:
    """What the server offers now.

    Attributes:
        info: the ``info`` event (``describe``'s answer).
        voices: voice name -> the same name (a ``speak`` carries it; the pipeline resolves it); the
            first is the default.
    """

    info: WyEvent
    voices: dict


@dataclass
class Context:
    """What every connection of one server shares (built by
    :class:`~appliance.transports.wyoming_server.WyomingServer`); only :attr:`offer` ever changes,
    whole, through :meth:`use` (the event loop's thread, as every reader).

    Attributes:
        dispatch: the daemon's dispatcher. offer: the :class:`Offer` in force. channel,
            priority, play: of every request. streaming:
            ``wyoming.streaming``. max_chars: ``service.max_text_chars``. max_line:
            ``service.max_line_bytes`` (longest event header). max_payload:
            ``wyoming.max_payload_bytes`` (most data + payload bytes of one event).
            max_buffered_ms: ``wyoming.max_buffered_ms`` (most audio one connection holds for
            its client). start_timeout_s: ``wyoming.start_timeout_s`` (0: none).
            write_timeout_s: ``wyoming.write_timeout_s``. keepalive_s: ``wyoming.keepalive_s``.
            waiting: ``(channel) -> why its next request cannot start, or None`` (the worker's
            status; what a request that did not start in time is answered with).
    """

    dispatch: Dispatcher
    offer: Offer
    channel: str
    priority: str
    play: bool
    streaming: bool
    max_chars: int
    max_line: int = 65536
    max_payload: int = 1 << 20
    max_buffered_ms: int = 30000
    start_timeout_s: float = 0.0
    write_timeout_s: float = 10.0
    keepalive_s: float = 15.0
    waiting: Optional[Callable[[str], Optional[str]]] = None

    @property
    def info(self) -> WyEvent:
        """``describe``'s answer now."""
        return self.offer.info

    @property
    def voices(self) -> dict:
        """The voices offered now (name -> name; the first is the default)."""
        return self.offer.voices

    def use(self, offer: Offer) -> None:
        """Offer ``offer`` from now on (a reload)."""
        self.offer = offer

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


__all__ = ["Context", "Offer"]
