"""The one file writer and reader (:mod:`appliance.files`) and every writer of the box that goes
through it: a symlink planted under a temporary or final name is never followed (its target is
unchanged), a file torn by a power cut (empty, NUL-filled, cut JSON) reads as absent with one
warning, a directory others can write into is made private, and two request ids that sanitize
alike get two WAV files."""

from __future__ import annotations

import itertools
import logging
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from appliance import files
from appliance.audio.wav import WavWriter, wav_path
from appliance.audio.wavdir import probe
from appliance.engines import lookahead, manifest
from appliance.model.integrity import write_sums
from appliance.service.journal import FILE, Journal

SECRET = b"the target of a planted link\n"


@pytest.fixture
def target(tmp_path) -> Path:
    """A file outside the box's directories that a planted symlink points at."""
    t = tmp_path / "elsewhere" / "victim"
    t.parent.mkdir()
    t.write_bytes(SECRET)
    return t


@pytest.fixture
def predictable(monkeypatch):
    """Temporary names made predictable (``aaaaaaaa``, then fresh ones), as if an attacker guessed one."""
    seq = itertools.chain(["aaaaaaaa"], (f"{i:08x}" for i in itertools.count(1)))
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: next(seq))
    return "aaaaaaaa"


def _wav(final: Path) -> None:
    w = WavWriter(final, 24000)
    w.write(np.zeros(240, np.float32))
    w.close()


def _journal(final: Path) -> None:
    j = Journal(final.parent)
    j.open()
    j.accept({"type": "speak", "text": "hi", "id": "x"})
    j.close()


def _calibration(final: Path) -> None:
    lookahead.save(final.parent, lookahead.Calibration(
        backend="torch-cpu", precision="fp32", lookahead_tokens=4, exact_lookahead=8, threshold_db=-40.0,
        chunk_tokens=4, checkpoint={"sha256": "0" * 64}))


def _sums(final: Path) -> None:
    from appliance.model import layout

    (final.parent / "asset" / layout.GPT_CONFIG).parent.mkdir(parents=True, exist_ok=True)
    (final.parent / "asset" / layout.GPT_CONFIG).write_text("{}")
    write_sums(final.parent)


WRITERS = {   # final name -> how the box writes it (the names a power cut or a neighbour meets)
    "wav/req.wav": _wav,
    "spool/" + FILE: _journal,
    "eng/calibration.json": _calibration,
    "eng/onnx/fp32/manifest.json": lambda f: manifest.write(f.parent, {"kind": "onnx", "graphs": {}}),
    "ckpt/SHA256SUMS.json": _sums,
    "state/voice": lambda f: files.write_atomic(f, b"alice\n"),
}


@pytest.mark.parametrize("name", list(WRITERS))
def test_a_symlink_planted_at_the_final_name_is_replaced_never_followed(name, tmp_path, target):
    final = tmp_path / "box" / name
    final.parent.mkdir(parents=True)
    final.symlink_to(target)
    try:
        WRITERS[name](final)
    except Exception:   # noqa: BLE001 - refusing is fine (the journal does); writing through the link is not
        pass
    assert target.read_bytes() == SECRET
    if name.endswith(FILE):                      # the journal refuses a symlink: set aside, not replaced
        assert final.is_symlink()
    else:
        assert not final.is_symlink() and final.is_file()


@pytest.mark.parametrize("name", [n for n in WRITERS if not n.endswith(FILE)] + ["spool/compaction"])
def test_a_symlink_planted_at_the_temporary_name_is_never_followed(name, tmp_path, target, predictable):
    final = tmp_path / "box" / (name if name != "spool/compaction" else "spool/" + FILE)
    final.parent.mkdir(parents=True)
    suffix = ".part" if final.suffix == ".wav" else ".tmp"
    planted = final.with_name(f".{final.name}.{predictable}{suffix}")
    planted.symlink_to(target)
    (_journal if name == "spool/compaction" else WRITERS[name])(final)
    assert target.read_bytes() == SECRET and planted.is_symlink()
    assert final.is_file() and not final.is_symlink()


def test_the_wav_probe_never_writes_through_a_link(tmp_path, target, predictable):
    (tmp_path / "wav").mkdir()
    (tmp_path / "wav" / f".write-check.{predictable}.wav.part").symlink_to(target)
    assert probe(tmp_path / "wav") is None
    assert target.read_bytes() == SECRET


def test_a_journal_that_is_a_symlink_is_refused(tmp_path, target):
    (tmp_path / "spool").mkdir()
    (tmp_path / "spool" / FILE).symlink_to(target)
    j = Journal(tmp_path / "spool")
    assert j.open().pending == []
    (c,) = j.conditions()
    assert c.name == "storage_degraded" and "is a symlink: refused" in c.reason, c
    assert target.read_bytes() == SECRET


def test_written_files_are_private_and_complete(tmp_path):
    p = tmp_path / "state.json"
    files.write_json(p, {"a": 1})
    assert stat.S_IMODE(p.stat().st_mode) == 0o600 and files.read_json(p, "state") == {"a": 1}
    files.write_atomic(p, b"x", 0o640)
    assert stat.S_IMODE(p.stat().st_mode) == 0o640 and p.read_bytes() == b"x"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["state.json"]


@pytest.mark.parametrize("torn", [b"", b"\0" * 4096, b'{"entries": [{"back', b'{"a": 1}' + b"\0" * 100, b"[1, 2]"])
def test_a_torn_file_reads_as_absent_with_one_warning(torn, tmp_path, caplog):
    p = tmp_path / "m.json"
    p.write_bytes(torn)
    with caplog.at_level(logging.WARNING, "appliance.files"):
        assert files.read_json(p, "engine manifest") is None
    (rec,) = caplog.records
    assert "engine manifest" in rec.getMessage() and str(p) in rec.getMessage()
    assert files.read_json(tmp_path / "missing.json", "x") is None


def test_readers_of_the_box_take_a_nul_filled_record_as_missing(tmp_path):
    (tmp_path / "calibration.json").write_bytes(b"\0" * 512)
    assert lookahead.read(tmp_path) == []
    (tmp_path / "manifest.json").write_bytes(b"\0" * 512)
    with pytest.raises(manifest.EngineMismatchError, match="no usable engine manifest"):
        manifest.read(tmp_path, "chattts-appliance engines export")


def test_ids_that_sanitize_alike_get_two_files(tmp_path):
    names = {i: wav_path(tmp_path, i).name for i in ("门铃", "晚饭", "a/b/c", "a_b_c", "a:b:c", ".x", "_x", "x")}
    assert len(set(names.values())) == len(names), names
    assert names["a_b_c"] == "a_b_c.wav" and names["x"] == "x.wav"           # a safe id keeps its name
    assert all(wav_path(tmp_path, i).parent == tmp_path for i in ("../../etc/passwd", "/abs", "门铃"))
    for i in ("门铃", "晚饭"):
        _wav(wav_path(tmp_path, i))
    assert len(list(tmp_path.glob("*.wav"))) == 2


def test_a_directory_others_can_write_is_made_private(tmp_path):
    d = tmp_path / "spool"
    d.mkdir()
    os.chmod(d, 0o777)
    assert "mode 0777" in files.fix_dir_mode(d, "service.spool_dir")
    assert stat.S_IMODE(d.stat().st_mode) == 0o755
    assert files.fix_dir_mode(d, "service.spool_dir") is None


def test_the_spool_lock_is_exclusive_names_its_owner_and_never_follows_a_link(tmp_path, target):
    from appliance.errors import ConfigError, SpoolBusyError
    from appliance.service.journal_lock import FILE as LOCK, SpoolLock

    owner = SpoolLock(tmp_path)
    assert owner.acquire(0.0) and (tmp_path / LOCK).read_text() == f"{os.getpid()}\n"
    with pytest.raises(SpoolBusyError, match=f"pid {os.getpid()}.*{LOCK}") as e:
        SpoolLock(tmp_path).acquire(0.3)                   # bounded wait, then refused
    assert e.value.exit_status == 75
    owner.release()
    second = SpoolLock(tmp_path)
    assert second.acquire(0.0)                             # free once the owner lets go
    second.release()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / LOCK).symlink_to(target)
    with pytest.raises(ConfigError, match="is a symlink"):
        SpoolLock(tmp_path / "other").acquire(0.0)
    assert target.read_bytes() == SECRET
