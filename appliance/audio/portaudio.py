"""The PortAudio boundary: the lazy ``sounddevice`` import and output devices found by name.

:func:`find_output_device` matches a case-insensitive substring of the PortAudio name. The
``sounddevice`` import is lazy: without PortAudio :func:`sounddevice_module` and
:func:`find_output_device` raise :class:`~appliance.errors.AudioDeviceError` and
:func:`list_output_devices` returns [].
"""

from __future__ import annotations

import logging
from typing import Optional

from ..errors import AudioDeviceError

log = logging.getLogger(__name__)


def sounddevice_module():
    """Import sounddevice; AudioDeviceError if PortAudio is missing."""
    try:
        import sounddevice
    except (OSError, ImportError) as e:
        raise AudioDeviceError(f"sounddevice/PortAudio is not usable ({e}); install libportaudio2 or set audio.output: wav") from e
    return sounddevice


def list_output_devices() -> list[dict]:
    """PortAudio output devices as dicts (``index``, ``name``, ``default_samplerate``), [] without PortAudio."""
    try:
        sd = sounddevice_module()
        devs = sd.query_devices()
    except Exception as e:  # PortAudio init failure is an OSError/PortAudioError
        log.debug("cannot list sound devices: %s", e)
        return []
    return [dict(d, index=i) for i, d in enumerate(devs) if d.get("max_output_channels", 0) > 0]


def find_output_device(query: Optional[str]) -> dict:
    """The output device whose name contains ``query`` (case-insensitive); None = the default.

    Raises:
        AudioDeviceError: no PortAudio, no output device, or none matching (the message lists them).
    """
    sd = sounddevice_module()
    outs = list_output_devices()
    if not outs:
        raise AudioDeviceError("PortAudio lists no output device; set audio.output: wav or connect one")
    if query is None:
        try:
            idx = sd.default.device[1]
        except Exception:
            idx = -1
        for d in outs:
            if d["index"] == idx:
                return d
        return outs[0]
    q = query.lower()
    for d in outs:
        if q in d["name"].lower():
            return d
    names = ", ".join(repr(d["name"]) for d in outs)
    raise AudioDeviceError(f"no output device matches {query!r}; output devices: {names}")
