"""Speakers: spk_stat, seeded random speakers, upstream's speaker-string format, bad strings."""

import lzma

import numpy as np
import pybase16384 as b14
import pytest

from appliance.errors import SpeakerError
from appliance.text.speaker import (
    SPK_STAT_DIM,
    decode_speaker,
    encode_speaker,
    random_speaker,
    resolve_voice,
    spk_stat,
)

_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]


def upstream_encode(vec_fp16: np.ndarray) -> str:
    """Upstream Speaker._encode, written out: base16384(raw LZMA2 9|extreme(fp16 bytes))."""
    return b14.encode_to_string(lzma.compress(vec_fp16.astype(np.float16).tobytes(),
                                              format=lzma.FORMAT_RAW, filters=_FILTERS))


def test_spk_stat_matches_upstream_ranges():
    std, mean = spk_stat()
    assert std.shape == mean.shape == (768,)
    # ranges documented in reference/chattts-internals.md §1.7 (decoded from upstream's config)
    assert 1.6 < std.min() < 1.7 and 15.6 < std.max() < 15.8
    assert -8.9 < mean.min() < -8.8 and 8.9 < mean.max() < 9.0


def test_random_speaker_reproducible_and_distributed():
    a, b, c = random_speaker(7), random_speaker(7), random_speaker(8)
    assert a.dtype == np.float32 and a.shape == (768,)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    std, mean = spk_stat()
    z = np.stack([(random_speaker(s) - mean) / std for s in range(200)])
    assert abs(z.mean()) < 0.02 and abs(z.std() - 1) < 0.02
    small = random_speaker(7, dim=32)
    assert small.shape == (32,)
    np.testing.assert_array_equal(small, np.asarray(a[:32]))  # same draws, first 32 stats


def test_round_trip_exact():
    v = random_speaker(3)
    s = encode_speaker(v)
    assert all("\u3d00" <= ch <= "\u8dff" for ch in s)
    np.testing.assert_array_equal(decode_speaker(s), v)
    # line breaks / spaces from copy-paste are ignored
    np.testing.assert_array_equal(decode_speaker(s[:100] + "\n " + s[100:]), v)


def test_decode_upstream_encoded_string():
    rng = np.random.default_rng(0)
    std, mean = spk_stat()
    up = (rng.standard_normal(768) * std + mean).astype(np.float16)
    s = upstream_encode(up)
    out = decode_speaker(s)
    np.testing.assert_array_equal(out, up.astype(np.float32))
    assert encode_speaker(out) == s  # byte-identical to upstream's encoder


def test_resolve_voice():
    np.testing.assert_array_equal(resolve_voice("seed:5"), random_speaker(5))
    np.testing.assert_array_equal(resolve_voice(" SEED:5 ", dim=16), random_speaker(5, 16))
    v = random_speaker(9)
    np.testing.assert_array_equal(resolve_voice(encode_speaker(v)), v)
    assert resolve_voice("none") is None and resolve_voice(" None ") is None


@pytest.mark.parametrize("bad, words", [
    ("", "empty"),
    ("hello world", "not base16384"),
    ("seed:abc", "integer"),
    ("seed:-1", "integer"),
    ("乙乙乙乙乙乙", "LZMA2"),
])
def test_malformed_strings(bad, words):
    with pytest.raises(SpeakerError, match=words):
        resolve_voice(bad)


def test_malformed_lengths_and_values():
    good = encode_speaker(random_speaker(1))
    with pytest.raises(SpeakerError, match="truncated|LZMA2"):
        decode_speaker(good[: len(good) // 2])
    with pytest.raises(SpeakerError, match="needs 768"):
        decode_speaker(upstream_encode(np.zeros(100, np.float16)))
    with pytest.raises(SpeakerError, match="more than 768"):
        decode_speaker(upstream_encode(np.zeros(769, np.float16)))
    with pytest.raises(SpeakerError, match="needs 32"):
        decode_speaker(good, dim=32)
    bad = np.zeros(768, np.float16)
    bad[5] = np.nan
    with pytest.raises(SpeakerError, match="NaN"):
        decode_speaker(upstream_encode(bad))
    with pytest.raises(SpeakerError):
        decode_speaker(12345)  # type: ignore[arg-type]
    with pytest.raises(SpeakerError, match="fp16 range"):
        encode_speaker(np.full(768, 1e6, np.float32))
    with pytest.raises(SpeakerError):
        random_speaker(1, dim=SPK_STAT_DIM + 1)


def test_bomb_is_bounded():
    # 10 MB of zeros compresses to a few KB; decoding must stop early, not inflate it all.
    s = b14.encode_to_string(lzma.compress(bytes(10_000_000), format=lzma.FORMAT_RAW, filters=_FILTERS))
    with pytest.raises(SpeakerError, match="more than"):
        decode_speaker(s)
