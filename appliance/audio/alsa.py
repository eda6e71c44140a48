"""What ALSA says about a PCM behind a PortAudio device: its real device, the sample formats it
offers, and an ALSA ``plug`` converter in front of one whose formats PortAudio cannot write.

PortAudio's ALSA host writes FLOAT_LE, S32_LE, S24_3LE (packed), S16_LE, S8 or U8
(:data:`PORTAUDIO_FORMATS`) and converts float32 to the closest one the device offers; a device
that offers none of them (4-byte ``S24_LE`` only, as some USB and I2S codecs do; mu-law) fails
with "Sample format not supported". ALSA's ``plug`` plugin converts any format, so for such a
device :func:`plug_for` defines ``pcm.chattts_plug_<n> { type plug slave.pcm "<pcm>" }`` in a
private ALSA configuration file that is added to ``ALSA_CONFIG_PATH`` (after ALSA's own
``alsa.conf``, which still reads ``/etc/asound.conf`` and ``~/.asoundrc``); PortAudio lists the
wrapper once it is initialised again (:func:`~appliance.audio.devices.rescan`, which the caller
runs while no stream is open), and the device is opened through it. Everything here goes
through ``libasound`` (ctypes), the library PortAudio itself uses; without it every function
answers None (nothing known) and no converter is made.

:func:`describe` names the device behind a PCM (``default``, a PipeWire or PulseAudio route, a
user's ``.asoundrc`` entry): its ALSA plugin type and, where the chain ends at a sound card, the
card and its name (for a PulseAudio or PipeWire route, the server's default sink as ``pactl``
reports it), so the log says where the sound goes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional


log = logging.getLogger(__name__)

_ASOUND = None
#: alsa-lib's error handler type (its varargs are never read); a no-op one keeps the probe quiet
_ERROR_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p)
_QUIET = _ERROR_HANDLER(lambda *args: None)


def asound():
    """``libasound`` (ctypes; the library PortAudio uses), or False where it cannot be loaded."""
    global _ASOUND
    if _ASOUND is None:
        try:
            _ASOUND = ctypes.CDLL(ctypes.util.find_library("asound") or "libasound.so.2")
        except OSError:
            _ASOUND = False
    return _ASOUND


LOCK = threading.RLock()
"""Held around every PortAudio re-initialisation and stream open/close, and every call into
libasound here (any thread)."""

PORTAUDIO_FORMATS = ("FLOAT_LE", "S32_LE", "S24_3LE", "S16_LE", "S8", "U8")
"""The ALSA sample formats PortAudio's ALSA host can write (it converts float32 to one of them)."""
PA_SAMPLE_FORMAT_NOT_SUPPORTED = -9994
"""PortAudio's ``paSampleFormatNotSupported``."""
_HW = re.compile(r"\((hw:\d+,\d+)\)\s*$")
_PLUGS: dict[str, str] = {}          # PCM -> the name of its plug wrapper
_PLUG_LOCK = threading.Lock()
_CONF: Optional[Path] = None


def pcm_of(device_name: str) -> str:
    """The ALSA PCM string PortAudio opens for a device it lists as ``device_name``: ``hw:N,M`` for
    a card's device (``USB Audio: - (hw:1,0)``), else the name itself (``default``, an
    ``.asoundrc`` entry)."""
    m = _HW.search(device_name)
    return m.group(1) if m else device_name


def _open(pcm: str) -> Optional[ctypes.c_void_p]:
    """``snd_pcm_t*`` of ``pcm`` opened for playback, non-blocking (close it with ``snd_pcm_close``);
    None if libasound is missing or the PCM does not open. Call with :data:`LOCK` held."""
    lib = asound()
    if not lib:
        return None
    handle = ctypes.c_void_p()
    lib.snd_lib_error_set_handler(_QUIET)
    try:
        rc = lib.snd_pcm_open(ctypes.byref(handle), pcm.encode(), 0, 1)    # PLAYBACK, NONBLOCK
    finally:
        lib.snd_lib_error_set_handler(None)
    return handle if rc == 0 else None


def offered_formats(pcm: str) -> Optional[list[str]]:
    """The sample formats ``pcm`` accepts (ALSA names, e.g. ``['S24_LE']``), from its hardware
    parameter space (``snd_pcm_hw_params_test_format``); None when it cannot be asked (no
    libasound, the PCM does not open: missing or busy)."""
    lib = asound()
    with LOCK:
        h = _open(pcm)
        if h is None:
            return None
        params = ctypes.c_void_p()
        try:
            if lib.snd_pcm_hw_params_malloc(ctypes.byref(params)) < 0:
                return None
            try:
                if lib.snd_pcm_hw_params_any(h, params) < 0:
                    return None
                lib.snd_pcm_format_name.restype = ctypes.c_char_p
                out = []
                for fmt in range(0, 64):
                    name = lib.snd_pcm_format_name(fmt)
                    if name and lib.snd_pcm_hw_params_test_format(h, params, fmt) == 0:
                        out.append(name.decode())
                return out
            finally:
                lib.snd_pcm_hw_params_free(params)
        finally:
            lib.snd_pcm_close(h)


def describe(pcm: str, depth: int = 6) -> Optional[str]:
    """Where ``pcm`` leads, in words, from ALSA's configuration as it is now (a re-pointed
    ``default`` shows its new target; nothing is opened): its plugin chain down to a card, e.g.
    ``file (/path) -> null``, ``plug -> hw card 1``, ``pipewire``; ``hw:N,M`` names the card. None
    when ALSA cannot say (no libasound, no such definition)."""
    m = re.fullmatch(r"(?:plug)?hw:(?:CARD=)?([^,]+)(?:,(?:DEV=)?(\d+))?", pcm)
    if m:
        return f"hw card {m.group(1)} device {m.group(2) or 0}"
    lib = asound()
    if not lib:
        return None
    with LOCK:
        if lib.snd_config_update() < 0:
            return None
        top = ctypes.c_void_p.in_dll(lib, "snd_config")
        conf = ctypes.c_void_p()
        lib.snd_lib_error_set_handler(_QUIET)
        try:
            if lib.snd_config_search_definition(top, b"pcm", pcm.encode(), ctypes.byref(conf)) < 0:
                return None
        finally:
            lib.snd_lib_error_set_handler(None)
        try:
            kind = _get(lib, conf, "type") or "?"
            slave = _get(lib, conf, "slave.pcm") or _get(lib, conf, "slave")
            card = _get(lib, conf, "card")
            target = _get(lib, conf, "file") if kind == "file" else None
        finally:
            lib.snd_config_delete(conf)
    text = f"{kind} card {card}" if kind == "hw" and card is not None else kind
    if target:
        text += f" ({target if len(target) <= 200 else '...' + target[-197:]})"
    if slave and depth > 0 and slave != pcm:
        return f"{text} -> {describe(slave, depth - 1) or slave}"
    return text


def _get(lib, conf: ctypes.c_void_p, key: str) -> Optional[str]:
    """The value of ``key`` under config node ``conf`` as a string (a string, integer or a name), or None."""
    node = ctypes.c_void_p()
    if lib.snd_config_search(conf, key.encode(), ctypes.byref(node)) < 0:
        return None
    out = ctypes.c_char_p()
    if lib.snd_config_get_ascii(node, ctypes.byref(out)) < 0 or out.value is None:
        return None
    value = out.value.decode(errors="replace")
    return value if len(value) <= 1000 else None


def describe_route(dev: dict) -> Optional[str]:
    """Where PortAudio device ``dev`` leads (:func:`describe` of its PCM), with its name:
    ``'default' -> file -> null``; None when ALSA cannot say."""
    pcm = pcm_of(dev["name"])
    what = describe(pcm)
    if what is not None and re.search(r"\b(pulse|pipewire)\b", what):
        sink = server_sink()
        what += f" (the sound server's default sink: {sink})" if sink else ""
    plug = plug_of(pcm)
    via = f" (through ALSA's plug converter {plug!r}: PortAudio cannot write its formats)" if plug else ""
    return None if what is None else f"{pcm!r} -> {what}{via}"


def server_sink() -> Optional[str]:
    """The default sink of the sound server behind ALSA's ``pulse`` / ``pipewire`` plugin
    (``pactl get-default-sink``: PulseAudio and PipeWire's pulse service), or None (no ``pactl``,
    no server, no answer within 2 s)."""
    exe = shutil.which("pactl")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, "get-default-sink"], capture_output=True, text=True, timeout=2.0)
    except (OSError, subprocess.SubprocessError):
        return None
    out = r.stdout.strip()
    return out[:200] if r.returncode == 0 and out else None


def plug_of(pcm: str) -> Optional[str]:
    """The name of the ``plug`` wrapper made for ``pcm`` (:func:`plug_for`), or None."""
    with _PLUG_LOCK:
        return _PLUGS.get(pcm)


def needs_plug(formats: Optional[list[str]]) -> bool:
    """True when ALSA says the device offers formats and none of them is one PortAudio writes."""
    return bool(formats) and not set(formats) & set(PORTAUDIO_FORMATS)


def plug_for(pcm: str) -> str:
    """Define (once) a ``plug`` wrapper of ``pcm`` in the box's private ALSA configuration file and
    put that file on ``ALSA_CONFIG_PATH`` (module docstring); returns the wrapper's PCM name.
    PortAudio lists it after its next initialisation (the caller's rescan, no stream open).

    Raises:
        OSError: the configuration file cannot be written.
    """
    global _CONF
    with _PLUG_LOCK:
        if pcm in _PLUGS:
            return _PLUGS[pcm]
        name = f"chattts_plug_{len(_PLUGS)}"
        _PLUGS[pcm] = name
        if _CONF is None:
            _CONF = Path(tempfile.mkdtemp(prefix="chattts-alsa-")) / "plugs.conf"     # private (0700)
        body = "".join(f'pcm.{n} {{ type plug slave.pcm "{p}" }}\n' for p, n in _PLUGS.items())
        tmp = _CONF.with_name("plugs.conf.tmp")
        tmp.write_text("# ALSA plug converters for devices whose formats PortAudio cannot write (chattts-appliance)\n"
                       + body)
        os.replace(tmp, _CONF)
        parts = [p for p in os.environ.get("ALSA_CONFIG_PATH", "").split(":") if p] or [_alsa_conf()]
        if str(_CONF) not in parts:
            os.environ["ALSA_CONFIG_PATH"] = ":".join(parts + [str(_CONF)])
    log.info("sound device %r: ALSA plug converter %r defined in %s", pcm, name, _CONF)
    return name


def _alsa_conf() -> str:
    """ALSA's own top configuration file (``<topdir>/alsa.conf``, e.g. /usr/share/alsa/alsa.conf)."""
    lib = asound()
    top = "/usr/share/alsa"
    if lib:
        lib.snd_config_topdir.restype = ctypes.c_char_p
        top = (lib.snd_config_topdir() or top.encode()).decode()
    return os.path.join(top, "alsa.conf")
