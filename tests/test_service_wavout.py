"""WAV output durability and retention, on real files in a real directory: a file appears under
its name only once complete (``.part`` + fsync + rename), a crash's ``.part`` is removed at the
next start, and the oldest ``<id>.wav`` files beyond ``service.wav_keep_files`` /
``service.wav_max_mib`` are deleted, never anything else. A WAV directory that cannot be written
(full, read-only, a write that fails) is health's ``wav_unwritable`` until it can be again."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
import uuid
import wave
from pathlib import Path

import numpy as np
import pytest

from appliance.audio.output import AudioOutput
from appliance.audio.wav import (
    MIB,
    WavRetention,
    WavWriter,
    read_wav,
    remove_partials,
)
from appliance.audio.wavdir import PROBE_S, WavDirHealth
from appliance.config import config_from_dict
from appliance.core import UNHEALTHY
from appliance.errors import AudioDeviceError, ConfigError, NoSpaceError
from tests.fixtures_service import service_config
from tests.waits import wait_for

PCM = (np.sin(np.arange(2400, dtype=np.float32) / 5) * 0.5).astype(np.float32)   # 0.1 s at 24 kHz


def test_a_wav_appears_only_complete_and_no_part_remains(tmp_path):
    path = tmp_path / "wav" / "req-1.wav"
    w = WavWriter(path, 24000)
    for _ in range(5):
        w.write(PCM)
        assert not path.exists(), "the final name must not exist before the file is complete"
        assert w.part.exists() and w.part.parent == path.parent
        assert re.fullmatch(r"\.req-1\.wav\.[0-9a-f]{8}\.part", w.part.name) and w.part.stat().st_mode & 0o777 == 0o640
    assert w.close() == path
    assert not w.part.exists() and list(path.parent.iterdir()) == [path]
    y, rate = read_wav(path)
    assert rate == 24000 and len(y) == 5 * len(PCM)
    assert w.close() == path                                  # idempotent


def test_a_reader_polling_the_final_name_never_sees_a_partial_file(tmp_path):
    path = tmp_path / "live.wav"
    seen: list = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            try:
                with wave.open(str(path), "rb") as r:
                    seen.append((r.getnframes(), len(r.readframes(1 << 30)) // 2))
            except FileNotFoundError:
                pass
            except (wave.Error, EOFError) as e:      # a torn header: what must never be seen
                seen.append(repr(e))

    t = threading.Thread(target=reader)
    t.start()
    try:
        w = WavWriter(path, 24000)
        for _ in range(200):
            w.write(PCM)
        w.close()
        n = 200 * len(PCM)
        wait_for(lambda: (n, n) in seen, 10, "the reader seeing the complete file")
    finally:
        stop.set()
        t.join()
    assert seen, "the reader never saw the file"
    n = 200 * len(PCM)
    assert set(seen) == {(n, n)}, f"a reader saw a partial file: {list(set(seen))[:5]}"


def test_a_discarded_file_leaves_nothing(tmp_path):
    path = tmp_path / "gone.wav"
    w = WavWriter(path, 24000)
    w.write(PCM)
    w.discard()
    assert sorted(os.listdir(tmp_path)) == []


def test_a_crash_leftover_part_is_removed_at_start_and_nothing_else(tmp_path):
    wav = tmp_path / "wav"
    wav.mkdir()
    (wav / ".r1.wav.part").write_bytes(b"RIFF half")              # a crash mid-write
    for keep in ("r0.wav", "notes.part", ".r1.wav.part.bak", "r2.wav.part"):
        (wav / keep).write_bytes(b"x")
    assert remove_partials(tmp_path / "missing") == []
    cfg = config_from_dict({"audio": {"output": "wav", "wav_dir": str(wav)}})
    a = AudioOutput(cfg)
    a.start()                                                     # what the daemon runs at start-up
    a.close(1.0)
    assert sorted(os.listdir(wav)) == [".r1.wav.part.bak", "notes.part", "r0.wav", "r2.wav.part"]


def _files(d: Path, names_sizes: list[tuple[str, int]]) -> None:
    """Create files oldest first (mtimes one second apart)."""
    t0 = time.time() - 1000
    for i, (n, size) in enumerate(names_sizes):
        (d / n).write_bytes(b"\0" * size)
        os.utime(d / n, (t0 + i, t0 + i))


def test_retention_keeps_the_newest_files_and_only_touches_ours(tmp_path):
    _files(tmp_path, [(f"old{i}.wav", 10) for i in range(6)])
    (tmp_path / "my song.wav").write_bytes(b"x")          # a name wav_path never produces
    (tmp_path / ".hidden.wav").write_bytes(b"x")
    (tmp_path / "readme.txt").write_bytes(b"x")
    (tmp_path / "sub.wav").mkdir()
    (tmp_path / ".old9.wav.part").write_bytes(b"x")       # being written
    gone = WavRetention(keep_files=4).prune(tmp_path)
    assert sorted(p.name for p in gone) == ["old0.wav", "old1.wav"]
    assert sorted(os.listdir(tmp_path)) == [".hidden.wav", ".old9.wav.part", "my song.wav", "old2.wav", "old3.wav",
                                            "old4.wav", "old5.wav", "readme.txt", "sub.wav"]
    assert WavRetention(0, 0).prune(tmp_path) == []       # 0 and 0: unlimited


def test_retention_by_size_deletes_oldest_first_and_never_the_file_just_written(tmp_path):
    _files(tmp_path, [("a.wav", 300), ("b.wav", 150), ("c.wav", 400), ("d.wav", 500)])
    r = WavRetention(max_bytes=1000)
    assert [p.name for p in r.prune(tmp_path)] == ["b.wav", "a.wav"]     # d+c = 900 fit; +b = 1050: cut there
    big = tmp_path / "e.wav"
    big.write_bytes(b"\0" * 2000)                                         # over the limit on its own
    assert sorted(p.name for p in r.prune(tmp_path, keep=big)) == ["c.wav", "d.wav"]
    assert os.listdir(tmp_path) == ["e.wav"]


def test_retention_leaves_a_newer_file_to_its_writer_and_ages_files_dated_in_the_future(tmp_path):
    """Two channels finish at once with wav_keep_files 1: each prune sees both files. The older
    writer's prune must not delete the newer file (both were deleted before); the newer one's
    prune deletes the older. A file dated ahead of the clock (a clock stepped back) counts as the
    oldest, even against the file just written."""
    r = WavRetention(keep_files=1)
    _files(tmp_path, [("a.wav", 10), ("b.wav", 10)])
    assert r.prune(tmp_path, keep=tmp_path / "a.wav") == []
    assert [p.name for p in r.prune(tmp_path, keep=tmp_path / "b.wav")] == ["a.wav"]
    ahead = tmp_path / "ahead.wav"
    ahead.write_bytes(b"\0" * 10)
    os.utime(ahead, (time.time() + 3600,) * 2)
    now = tmp_path / "now.wav"
    now.write_bytes(b"\0" * 10)
    assert sorted(p.name for p in r.prune(tmp_path, keep=now)) == ["ahead.wav", "b.wav"]
    assert os.listdir(tmp_path) == ["now.wav"]


def test_the_writer_applies_retention_once_the_file_is_in_place(tmp_path):
    r = WavRetention(keep_files=2)
    base = time.time() - 100.0
    for i in range(4):
        w = WavWriter(tmp_path / f"req{i}.wav", 24000, r)
        w.write(PCM)
        w.close()
        # retention orders by mtime: give each closed file its own, older than the next file's
        # "now", instead of waiting for the clock to tick
        os.utime(tmp_path / f"req{i}.wav", (base + i,) * 2)
    assert sorted(os.listdir(tmp_path)) == ["req2.wav", "req3.wav"]


@pytest.mark.parametrize("section, needle", [
    ({"wav_keep_files": -1}, "service.wav_keep_files: expected an integer between 0 and 1073741824, got -1 (a number of files; 0 = unlimited)"),
    ({"wav_keep_files": 1.5}, "service.wav_keep_files: expected an integer between 0 and 1073741824, got 1.5 (a number of files; 0 = unlimited)"),
    ({"wav_max_mib": -0.5}, "service.wav_max_mib: expected a number between 0 and 1073741824, got -0.5 (MiB, e.g. 512; 0 = unlimited)"),
    ({"wav_max_mib": "1G"}, "service.wav_max_mib: expected a number between 0 and 1073741824, got '1G' (MiB, e.g. 512; 0 = unlimited)"),
    ({"wav_max_mib": True}, "service.wav_max_mib: expected a number between 0 and 1073741824, got True (MiB, e.g. 512; 0 = unlimited)"),
])
def test_retention_keys_are_validated(section, needle):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"service": section})
    assert needle in str(e.value)


def test_retention_keys_defaults_and_values():
    c = config_from_dict({})
    assert (c.service.wav_keep_files, c.service.wav_max_mib) == (200, 512.0)
    c = config_from_dict({"service": {"wav_keep_files": 0, "wav_max_mib": 3}})
    assert AudioOutput(c).retention == WavRetention(0, 3 * MIB)


def test_daemon_cleans_up_at_start_and_keeps_its_wav_dir_bounded(tiny_ckpt, tmp_path, start_daemon):
    wav = tmp_path / "wav"
    wav.mkdir()
    (wav / ".crashed.wav.part").write_bytes(b"RIFF")
    _files(wav, [("old0.wav", 10), ("old1.wav", 10), ("old2.wav", 10)])
    (wav / "keep me.wav").write_bytes(b"x")
    d = start_daemon(service_config(tiny_ckpt, tmp_path, service={"wav_keep_files": 2}))
    assert sorted(os.listdir(wav)) == ["keep me.wav", "old1.wav", "old2.wav"]     # .part gone, pruned to 2
    evs = d.request({"type": "speak", "text": "hello", "seed": 3, "id": "w1", "params": {"max_new_tokens": 30}})
    assert evs[-1]["type"] == "done", evs
    out = Path(evs[-1]["output"])
    assert out == wav / "w1.wav"
    y, rate = read_wav(out)
    assert rate == 24000 and abs(len(y) / 24000 - evs[-1]["audio_s"]) < 1e-3
    assert sorted(os.listdir(wav)) == ["keep me.wav", "old2.wav", "w1.wav"]


# ------------------------------------------------------------------ the WAV directory in health


@pytest.fixture
def wav_fs(tmp_path):
    """``(path, remount)``: a real 1 MiB tmpfs (root only; skipped otherwise); ``remount("ro")``
    / ``remount("rw")`` flips it read-only and back."""
    d = tmp_path / "fs"
    d.mkdir()
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", f"wv-{uuid.uuid4().hex[:6]}", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield d, lambda how: subprocess.run(["mount", "-o", f"remount,{how}", str(d)], check=True)
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_the_wav_directory_is_a_condition_that_clears_when_it_is_writable_again(wav_fs):
    """On a real tmpfs: a directory that does not exist yet is judged by where it would be made;
    a full disk, a read-only remount and a failure only a write meets (the file's name taken by a
    directory) each hold, and each clears once WAV files can be written again, without a request:
    a probe write at once after the file system looked wrong, else after ``PROBE_S``."""
    fs, remount = wav_fs
    now = [100.0]
    h = WavDirHealth(fs / "wav", clock=lambda: now[0])
    assert h.problem() is None and h.condition(UNHEALTHY, "x") is None          # made by the first writer
    w = WavWriter(fs / "wav" / "a.wav", health=h)
    w.write(PCM)
    w.close()

    subprocess.run(["fallocate", "-l", str(os.statvfs(fs).f_bfree * os.statvfs(fs).f_frsize), str(fs / "filler")],
                   check=True)
    c = h.condition(UNHEALTHY, "requests end with no_space")
    assert c.name == "wav_unwritable" and c.severity == UNHEALTHY and "the disk is full (0 KiB free)" in c.reason, c
    with pytest.raises(NoSpaceError):
        WavWriter(fs / "wav" / "b.wav", health=h).write(np.tile(PCM, 100))
    (fs / "filler").unlink()
    assert h.problem() is None and h.condition(UNHEALTHY, "x") is None           # probed at once: clear
    assert list((fs / "wav").iterdir()) == [fs / "wav" / "a.wav"]                  # no probe file left

    remount("ro")
    try:
        assert "is on a read-only file system" in h.problem()
    finally:
        remount("rw")
    assert h.problem() is None

    (fs / "wav" / "c.wav").mkdir()                                            # only a write meets this one

    def write_c():
        w = WavWriter(fs / "wav" / "c.wav", health=h)
        w.write(PCM)
        w.close()
    with pytest.raises(AudioDeviceError):
        write_c()
    assert "cannot complete WAV file" in h.problem()
    now[0] += PROBE_S - 0.1
    assert "cannot complete WAV file" in h.problem()                           # no probe before PROBE_S
    now[0] += 0.2
    assert h.problem() is None                                                 # the probe wrote: the directory is fine
    with pytest.raises(AudioDeviceError):
        write_c()
    w = WavWriter(fs / "wav" / "d.wav", health=h)
    w.write(PCM)
    w.close()
    assert h.problem() is None                                                 # a file written clears it too


def test_audio_output_names_the_wav_directory_where_wav_is_the_output(wav_fs, tmp_path):
    fs, remount = wav_fs
    out = AudioOutput(config_from_dict({"audio": {"output": "wav", "wav_dir": str(fs / "wav")}}, base_dir=str(tmp_path)))
    out.start()
    assert out.conditions() == ()
    remount("ro")
    try:
        (c,) = out.conditions()
        assert (c.name, c.severity) == ("wav_unwritable", UNHEALTHY) and str(fs / "wav") in c.reason, c
    finally:
        remount("rw")
    assert out.conditions() == ()
