"""Which sound devices the box has now: found by name or ALSA card, listed again when they change.

PortAudio lists the devices once, when it is initialised (``Pa_Initialize``), and leaves out a
device another process holds at that moment (it opens each one to list it). A USB speaker pulled
and plugged back comes back under another ALSA card index (``... (hw:2,0)`` where it was
``(hw:1,0)``), a device that was busy becomes free, an ``.asoundrc`` is rewritten: none of that is
seen until PortAudio is initialised again. So:

* :func:`rescan` terminates and re-initialises PortAudio (sounddevice's ``_terminate`` /
  ``_initialize``; about 5-10 ms on the 2-core dev box with three ALSA plugin devices, plus the
  opening of each device). ``Pa_Terminate`` closes every open stream, so the caller
  (:class:`~appliance.audio.output.AudioOutput`) closes its idle streams first and calls it only
  when none is open; :data:`LOCK` serialises it with every stream open and close.
* :func:`fingerprint` is what can change the list: the ALSA card list (``/proc/asound/cards``) and
  the ALSA configuration files (their mtimes and sizes); a rescan is worth it when it changed.
* :func:`find_output_device` matches ``audio.device`` / ``channels[].device`` against the list: an
  ALSA card id or name (``/proc/asound/cards``, mapped to the card's *current* index), else a
  case-insensitive part of the PortAudio name with its ``(hw:N,M)`` suffix ignored, so the same
  setting finds a speaker under any card index. When nothing matches, ALSA itself is asked
  (:func:`alsa_probe`: ``snd_pcm_open`` non-blocking, through the ``libasound`` PortAudio uses) to
  tell a device that is there but held by another process (``device_busy``) from one that is not
  there (``device_lost``); either error names what was looked for and what was found.

udev events (pyudev) would tell a replug sooner, but not an ``.asoundrc`` rewritten or a device
freed by another process; the fingerprint, read every second, sees all three.
The ``sounddevice`` import is lazy: without PortAudio every call here raises
:class:`~appliance.errors.AudioDeviceError` (and :func:`list_output_devices` returns []).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from ..errors import AudioDeviceError, DeviceBusyError, DeviceLostError
from .alsa import LOCK, PORTAUDIO_FORMATS, _QUIET, asound, needs_plug, offered_formats, pcm_of, plug_for, plug_of

log = logging.getLogger(__name__)


CARDS = Path("/proc/asound/cards")
_HW = re.compile(r"\s*\(hw:(\d+),(\d+)\)\s*$")
BUSY = (errno.EBUSY, errno.EAGAIN)
"""ALSA's answers for a device another process holds (``snd_pcm_open`` non-blocking)."""
PA_DEVICE_UNAVAILABLE = -9985
PA_INVALID_SAMPLE_RATE = -9997
PA_SAMPLE_FORMAT_NOT_SUPPORTED = -9994
"""PortAudio's error codes (``paDeviceUnavailable``: ALSA said the device is busy)."""


def load_sounddevice():
    """Import sounddevice; AudioDeviceError if PortAudio is missing."""
    try:
        import sounddevice
    except (OSError, ImportError) as e:
        raise AudioDeviceError(f"sounddevice/PortAudio is not usable ({e}); install libportaudio2 or set audio.output: wav") from e
    return sounddevice


def list_output_devices() -> list[dict]:
    """PortAudio output devices as dicts (``index``, ``name``, ``default_samplerate``), [] without PortAudio."""
    try:
        sd = load_sounddevice()
        with LOCK:
            devs = sd.query_devices()
    except Exception as e:  # PortAudio init failure is an OSError/PortAudioError
        log.debug("cannot list sound devices: %s", e)
        return []
    return [dict(d, index=i) for i, d in enumerate(devs) if d.get("max_output_channels", 0) > 0]


def rescan() -> None:
    """Initialise PortAudio again so that its device list is current (module docstring). Every
    stream must be closed (``Pa_Terminate`` would close them under their owners).

    Raises:
        AudioDeviceError: PortAudio is missing or cannot be initialised.
    """
    sd = load_sounddevice()
    with LOCK:
        try:
            sd._terminate()
            sd._initialize()
        except Exception as e:
            raise AudioDeviceError(f"cannot initialise PortAudio again: {e}") from e


@dataclass(frozen=True)
class Card:
    """One ALSA sound card: ``index`` (changes at each plug), ``id`` (e.g. ``Speaker``), ``name``."""

    index: int
    id: str
    name: str


def alsa_cards() -> list[Card]:
    """The ALSA cards the kernel has now (``/proc/asound/cards``; [] where there is none)."""
    try:
        text = CARDS.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for m in re.finditer(r"^\s*(\d+)\s+\[([^\]]*)\]:\s*[^-]*-\s*(.*)$", text, re.M):
        out.append(Card(int(m.group(1)), m.group(2).strip(), m.group(3).strip()))
    return out


def _config_files() -> list[Path]:
    env = os.environ.get("ALSA_CONFIG_PATH")
    home = Path(os.environ.get("HOME", "/nonexistent"))
    xdg = Path(os.environ.get("XDG_CONFIG_HOME", home / ".config"))
    base = [Path(p) for p in env.split(":")] if env else [Path("/usr/share/alsa/alsa.conf")]
    return base + [Path("/etc/asound.conf"), home / ".asoundrc", xdg / "alsa" / "asoundrc"]


def fingerprint() -> tuple:
    """What the device list depends on: the card list and the ALSA config files' mtimes and sizes."""
    files = []
    for p in _config_files():
        try:
            st = p.stat()
            files.append((str(p), st.st_mtime_ns, st.st_size))
        except OSError:
            files.append((str(p), None, None))
    return tuple(alsa_cards()), tuple(files)


def alsa_probe(pcm: str) -> Optional[int]:
    """ALSA's answer to opening PCM ``pcm`` for playback, non-blocking (the device is closed again
    at once): 0 it opens, else the errno (``EBUSY``: another process holds it; ``ENOENT``: no such
    PCM). None where ``libasound`` cannot be loaded. alsa-lib's own messages (``Unknown PCM``) are
    not printed meanwhile: the probe runs every second while a device is missing."""
    lib = asound()
    if not lib:
        return None
    handle = ctypes.c_void_p()
    with LOCK:
        lib.snd_lib_error_set_handler(_QUIET)
        try:
            rc = lib.snd_pcm_open(ctypes.byref(handle), pcm.encode(), 0, 1)   # PLAYBACK, NONBLOCK
            if rc == 0:
                lib.snd_pcm_close(handle)
        finally:
            lib.snd_lib_error_set_handler(None)                              # alsa-lib's default again
    return -rc


def _key(name: str) -> str:
    """A device name as matched: lower case, without PortAudio's ``(hw:N,M)`` suffix."""
    return _HW.sub("", name).strip().lower()


def _by_card(query: str, outs: list[dict]) -> Optional[dict]:
    """The first output on the ALSA card whose id or name is ``query`` (case-insensitive)."""
    q = query.strip().lower()
    for card in alsa_cards():
        if q in (card.id.lower(), card.name.lower()):
            for d in outs:
                m = _HW.search(d["name"])
                if m and int(m.group(1)) == card.index:
                    return d
    return None


def seen(outs: list[dict]) -> str:
    """What was found, for an error message: PortAudio's output names and ALSA's cards."""
    names = ", ".join(repr(d["name"]) for d in outs) or "none"
    cards = ", ".join(f"{c.index} [{c.id}] {c.name!r}" for c in alsa_cards()) or "none"
    return f"PortAudio lists: {names}; ALSA cards: {cards}"


def find_output_device(query: Optional[str], what: str = "audio.device") -> dict:
    """The output device ``query`` names (module docstring); None = PortAudio's default.
    ``what`` names the setting in messages.

    Raises:
        DeviceBusyError: ALSA has the device but another process holds it.
        DeviceLostError: no such device (the message lists what there is).
        AudioDeviceError: PortAudio is missing.
    """
    sd = load_sounddevice()
    outs = list_output_devices()
    if query is None:
        if not outs:
            raise DeviceLostError(f"sound device missing: looked for the default output ({what} null); found none; "
                                  f"{seen(outs)}")
        try:
            idx = sd.default.device[1]
        except Exception:
            idx = -1
        return next((d for d in outs if d["index"] == idx), outs[0])
    found = _by_card(query, outs) or next((d for d in outs if _key(query) in _key(d["name"])), None)
    if found is not None:
        return found
    looked = f"looked for {query!r} ({what}: an ALSA card id or name, or part of the device name)"
    pcm = next((f"hw:CARD={c.id},DEV=0" for c in alsa_cards() if query.strip().lower() in (c.id.lower(), c.name.lower())),
               query if re.fullmatch(r"[\w.:,=-]+", query) else None)
    rc = alsa_probe(pcm) if pcm is not None else None
    if rc in BUSY:
        raise DeviceBusyError(f"sound device busy: {looked}; ALSA has {pcm!r} but another process holds it "
                              f"({os.strerror(rc)}); {seen(outs)}")
    if rc == 0:
        raise DeviceLostError(f"sound device not listed yet: {looked}; ALSA opens {pcm!r} but PortAudio has not "
                              f"listed it (re-scanned within a second when the streams are idle); {seen(outs)}")
    return_why = f"; ALSA: {os.strerror(rc)}" if rc else ""
    raise DeviceLostError(f"sound device missing: {looked}; found none{return_why}; {seen(outs)}")


def open_error(dev: dict, rate: int, e: Exception, looked: str, rate_hint: str) -> AudioDeviceError:
    """What PortAudio's failure to open ``dev`` at ``rate`` Hz means, in words: busy (another
    process holds it), the rate refused (change ``rate_hint``), or PortAudio's own error."""
    code = e.args[1] if len(e.args) > 1 else None
    host = e.args[2] if len(e.args) > 2 else ""
    where = f"sound device {dev['name']!r} (PortAudio #{dev['index']}, {looked})"
    if code == PA_DEVICE_UNAVAILABLE or "busy" in f"{host} {e}".lower():
        return DeviceBusyError(f"{where} is busy: another process holds it ({e})")
    if code == PA_INVALID_SAMPLE_RATE:
        return AudioDeviceError(f"{where} refuses {rate} Hz float32 mono ({e}); change {rate_hint}")
    if code == PA_SAMPLE_FORMAT_NOT_SUPPORTED:
        offered = offered_formats(pcm_of(dev["name"]))
        return AudioDeviceError(f"{where} offers sample formats {', '.join(offered) if offered else 'ALSA cannot list'}; "
                                f"PortAudio writes only {', '.join(PORTAUDIO_FORMATS)} ({e}); ALSA's plug converter is put in "
                                f"front of such a device when the devices are listed again (the log says if it cannot be)")
    return AudioDeviceError(f"cannot open {where}: {e}")


def add_plugs(devices: Iterable) -> bool:
    """Put an ALSA ``plug`` converter in front of every device of ``devices`` (the
    :class:`~appliance.audio.device.DeviceOutput` s) not playing (at start: all) whose
    sample formats PortAudio cannot write (:mod:`appliance.audio.alsa`; asked of ALSA while no stream is open); True when
    one was added (PortAudio must list the devices again)."""
    added = False
    for dev in devices:
        if dev.ok:                    # it plays: nothing to convert (and nothing to open twice)
            continue
        try:
            pcm = pcm_of(find_output_device(dev.query, dev.setting)["name"])
        except AudioDeviceError:
            continue
        if plug_of(pcm) is not None or pcm.startswith("chattts_plug_"):
            continue
        formats = offered_formats(pcm)
        if needs_plug(formats):
            try:
                name = plug_for(pcm)
            except OSError as e:
                log.error("sound device %r offers only %s, which PortAudio cannot write, and no ALSA plug "
                          "converter could be defined: %s", pcm, ", ".join(formats), e)
                continue
            log.warning("sound device %r offers only %s, which PortAudio cannot write: it plays through ALSA's "
                        "plug converter %r", pcm, ", ".join(formats), name)
            added = True
    return added
