"""Speaker embeddings: random speakers from upstream's statistics and upstream's speaker strings.

A ChatTTS speaker is a vector of ``dim`` floats (768 for the real model) that replaces the text
embedding at the ``[spk_emb]`` position of the prompt (after L2 normalization, done by the
model, not here).

* :func:`random_speaker` draws ``randn * std + mean`` with upstream's ``spk_stat`` (the
  base16384 string of 1,536 fp16 values, std[768] ‖ mean[768], from ChatTTS 0.2.5
  ``ChatTTS/config/config.py``; stored here as ``appliance/data/spk_stat.txt``), the same
  distribution as upstream ``Speaker._sample_random`` (``ChatTTS/model/speaker.py``).
* :func:`encode_speaker` / :func:`decode_speaker` read and write upstream's speaker-string
  format (``Speaker._encode`` / ``_decode``): base16384 text of raw LZMA2 (preset
  ``9 | PRESET_EXTREME``) of the little-endian fp16 values. Strings users already have from
  upstream (``chat.sample_random_speaker()``) paste in unchanged.
* :func:`resolve_voice` turns a request's ``voice`` field (``"seed:N"`` or a speaker string)
  into a vector.

numpy only (no torch): this runs on boxes without torch.
"""

from __future__ import annotations

import logging
import lzma
import re
from functools import lru_cache
from importlib import resources
from typing import Optional

import numpy as np
import pybase16384 as b14

from ..errors import SpeakerError

log = logging.getLogger(__name__)

#: Width of upstream's speaker statistics (the real model's hidden size).
SPK_STAT_DIM = 768

_LZMA_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]
# base16384: data characters U+4E00..U+8DFF, optionally one trailing length marker U+3D01..U+3D06.
_B14_RE = re.compile(r"[\u4e00-\u8dff]+[\u3d01-\u3d06]?")
_SEED_RE = re.compile(r"seed:(\d+)")


@lru_cache(maxsize=1)
def spk_stat() -> tuple[np.ndarray, np.ndarray]:
    """Upstream's speaker statistics.

    Returns:
        ``(std, mean)``, each ``float32[768]`` (decoded from fp16; read-only arrays).
    """
    text = resources.files("appliance.data").joinpath("spk_stat.txt").read_text("utf-8")
    raw = np.frombuffer(b14.decode_from_string(text.strip()), dtype="<f2")
    if raw.size != 2 * SPK_STAT_DIM:  # a packaging error, not a user error
        raise RuntimeError(f"appliance/data/spk_stat.txt decodes to {raw.size} values, expected 1536")
    std = raw[:SPK_STAT_DIM].astype(np.float32)
    mean = raw[SPK_STAT_DIM:].astype(np.float32)
    std.setflags(write=False)
    mean.setflags(write=False)
    return std, mean


def random_speaker(seed: int, dim: int = SPK_STAT_DIM) -> np.ndarray:
    """A reproducible random speaker: ``randn(dim) * std + mean``.

    Args:
        seed: a non-negative integer; the same seed always gives the same vector (on every machine).
        dim: embedding width (768 for the real model). For a tiny model with ``dim < 768`` the
            first ``dim`` std and mean values are used.

    Returns:
        ``float32[dim]``, rounded through fp16 like upstream's (so it survives
        :func:`encode_speaker` exactly).

    Raises:
        SpeakerError: ``dim`` is not in 1..768, or ``seed`` is negative.

    Note: upstream draws with torch's global RNG (``torch.randn``, fp16); we draw with
    ``numpy.random.default_rng(seed)``, so ``seed:N`` here is a different voice than upstream's
    ``torch.manual_seed(N)``. To reuse an upstream voice, paste its speaker string instead.
    """
    if not 1 <= dim <= SPK_STAT_DIM:
        raise SpeakerError(f"speaker dim {dim} is outside 1..{SPK_STAT_DIM} (upstream's spk_stat width)")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise SpeakerError(f"speaker seed {seed!r} must be a non-negative integer")
    std, mean = spk_stat()
    rng = np.random.default_rng(seed)
    vec = rng.standard_normal(dim, dtype=np.float32) * std[:dim] + mean[:dim]
    return vec.astype(np.float16).astype(np.float32)


def encode_speaker(vec: np.ndarray) -> str:
    """Upstream's speaker string for a vector.

    Args:
        vec: ``float[dim]`` (any float dtype; stored as fp16, as upstream does).

    Returns:
        base16384 text of raw-LZMA2 (preset 9|extreme) compressed little-endian fp16 bytes.

    Raises:
        SpeakerError: not a finite 1-D vector, or a value outside the fp16 range.
    """
    arr = np.asarray(vec)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.floating):
        raise SpeakerError(f"a speaker must be a non-empty 1-D float vector, got shape {arr.shape} {arr.dtype}")
    with np.errstate(over="ignore"):
        half = arr.astype("<f2")
    if not np.all(np.isfinite(half)):
        raise SpeakerError("speaker vector holds NaN/inf or values outside the fp16 range (|x| > 65504)")
    return b14.encode_to_string(lzma.compress(half.tobytes(), format=lzma.FORMAT_RAW, filters=_LZMA_FILTERS))


def decode_speaker(s: str, dim: int = SPK_STAT_DIM) -> np.ndarray:
    """Parse an upstream speaker string.

    Args:
        s: the string (whitespace and line breaks anywhere in it are ignored).
        dim: expected embedding width (768 for the real model).

    Returns:
        ``float32[dim]``.

    Raises:
        SpeakerError: not base16384 text, not raw LZMA2 data, the wrong number of values
            (``dim`` fp16 values expected), or NaN/inf values. The message says which.
    """
    if not isinstance(s, str):
        raise SpeakerError(f"a speaker string must be text, got {type(s).__name__}")
    compact = "".join(s.split())
    if not compact:
        raise SpeakerError("the speaker string is empty; use 'seed:N' or a string from upstream's sample_random_speaker()")
    if not _B14_RE.fullmatch(compact):
        bad = next((c for c in compact if not ("\u4e00" <= c <= "\u8dff" or "\u3d01" <= c <= "\u3d06")), compact[-1])
        raise SpeakerError(
            f"the speaker string is not base16384 text (character {bad!r} U+{ord(bad):04X} at "
            f"position {compact.index(bad)}); it must be a string from upstream's sample_random_speaker() or 'seed:N'")
    data = b14.decode_from_string(compact)
    want = 2 * dim
    dec = lzma.LZMADecompressor(format=lzma.FORMAT_RAW, filters=_LZMA_FILTERS)
    try:
        raw = dec.decompress(data, max_length=want + 1)  # bounded: no decompression bomb
    except lzma.LZMAError as e:
        raise SpeakerError(f"the speaker string does not hold LZMA2 data ({e}); was it truncated or altered?") from e
    if len(raw) > want:
        raise SpeakerError(f"the speaker string holds more than {dim} values, but this model needs {dim} (fp16)")
    if len(raw) < want and dec.eof:
        raise SpeakerError(f"the speaker string holds {len(raw) / 2:g} values, but this model needs {dim} (fp16)")
    if not dec.eof:
        raise SpeakerError("the speaker string is truncated (its LZMA2 data has no end marker)")
    vec = np.frombuffer(raw, dtype="<f2").astype(np.float32)
    if not np.all(np.isfinite(vec)):
        raise SpeakerError(f"the speaker string holds {int(np.sum(~np.isfinite(vec)))} NaN/inf values")
    return vec


def resolve_voice(voice: str, dim: int = SPK_STAT_DIM) -> Optional[np.ndarray]:
    """Turn a ``voice`` field into a speaker vector.

    Args:
        voice: ``"seed:N"`` (N an integer, see :func:`random_speaker`), an upstream speaker
            string (see :func:`decode_speaker`), or ``"none"``: no speaker vector (the prompt
            then holds ``[empty_spk]``, as upstream with ``spk_emb=None``).
        dim: embedding width of the loaded model.

    Returns:
        ``float32[dim]``, or None for ``"none"``.

    Raises:
        SpeakerError: malformed seed or speaker string.
    """
    if not isinstance(voice, str):
        raise SpeakerError(f"voice must be a string ('seed:N' or a speaker string), got {type(voice).__name__}")
    v = voice.strip()
    if v.lower() == "none":
        return None
    if v.lower().startswith("seed:"):
        m = _SEED_RE.fullmatch(v.lower().replace(" ", ""))
        if not m:
            raise SpeakerError(f"voice {voice!r}: 'seed:' must be followed by a non-negative integer, e.g. 'seed:2'")
        if len(m.group(1)) > 19 or int(m.group(1)) >= 2**63:
            raise SpeakerError(f"voice 'seed:N': N must be below 2**63, got {len(m.group(1))} digits")
        return random_speaker(int(m.group(1)), dim)
    return decode_speaker(v, dim)
