"""The request journal on a real file system: durable records, torn and damaged records, bounds,
a full disk (a real tmpfs when the tests run as root), and the replay decisions."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time
import uuid

import pytest

from appliance.config import JournalConfig
from appliance.errors import JournalError
from appliance.service.journal import FILE, RETRY_S, Journal
from appliance.service.records import Stamp, decode, encode
from appliance.service.recovery import Recovery


def _req(i: int, text: str = "你好", **kw) -> dict:
    return dict({"type": "speak", "id": f"r{i}", "text": text, "channel": "main", "seed": i, "priority": "normal"}, **kw)


def test_records_survive_a_restart_with_their_order_attempts_and_outcomes(tmp_path):
    j = Journal(tmp_path)
    assert j.open().pending == []
    ns = [j.accept(_req(i), origin="mqtt" if i == 2 else "socket") for i in range(4)]
    assert ns == [1, 2, 3, 4]
    j.started(ns[0])
    j.end(ns[0], {"type": "done", "id": "r0", "output": "device:x", "seed": 0})
    j.started(ns[1])
    j.end(ns[3], {"type": "error", "id": "r3", "code": "cancelled", "message": "m"})
    # no close(): what a SIGKILL leaves behind
    rec = Journal(tmp_path).open()
    assert [(e.id, e.tries, e.origin) for e in rec.pending] == [("r1", 1, "socket"), ("r2", 0, "mqtt")]
    assert rec.pending[0].req["seed"] == 1 and rec.pending[0].req["text"] == "你好"
    assert rec.finished["r0"]["output"] == "device:x" and rec.finished["r3"]["code"] == "cancelled"
    j2 = Journal(tmp_path)
    rec2 = j2.open()                                   # compacted once: the same state again
    assert [e.id for e in rec2.pending] == ["r1", "r2"] and set(rec2.finished) == {"r0", "r3"}
    assert j2.accept(_req(9)) == 5                     # numbering continues across restarts


def test_a_torn_last_record_is_dropped_and_a_damaged_one_skipped(tmp_path):
    j = Journal(tmp_path)
    j.open()
    for i in range(3):
        j.accept(_req(i))
    data = (tmp_path / FILE).read_bytes()
    lines = data.split(b"\n")
    assert all(decode(x) for x in lines[:-1]) and lines[-1] == b""
    # power cut in the middle of the 4th record: half a line, no newline
    (tmp_path / FILE).write_bytes(data + encode({"k": "a", "n": 4, "t": 1.0, "o": "socket", "req": _req(4)})[:40])
    rec = Journal(tmp_path).open()
    assert rec.torn == 1 and [e.id for e in rec.pending] == ["r0", "r1", "r2"]
    assert (tmp_path / FILE).read_bytes().endswith(b"\n")
    # a flipped byte in the middle record (after the header and r0): skipped (CRC), the others kept
    data = bytearray((tmp_path / FILE).read_bytes())
    second = data.index(b"\n", data.index(b"\n") + 1) + 20
    data[second] ^= 0x01
    (tmp_path / FILE).write_bytes(bytes(data))
    rec = Journal(tmp_path).open()
    assert rec.corrupt == 1 and [e.id for e in rec.pending] == ["r0", "r2"]


def _damaged(tmp_path, how: str) -> tuple[bytes, int, int, int]:
    """A journal of 1 finished and 9 unfinished requests, damaged as a power cut leaves it;
    returns (its bytes, the offset of the damage, records intact, bytes unreadable)."""
    j = Journal(tmp_path)
    j.open()
    ns = [j.accept(_req(i)) for i in range(10)]
    j.end(ns[0], {"type": "done", "id": "r0"})
    j.close()
    data = (tmp_path / FILE).read_bytes()
    starts = [0] + [i + 1 for i, b in enumerate(data) if b == 0x0A][:-1]   # line starts: header, a x10, e
    n_rec = len(starts) - 1                                                 # the header is not a record
    if how == "nul_tail":       # the last 3 lines' blocks never reached the disk: NULs, same size
        at = starts[-3]
        return data[:at] + b"\0" * (len(data) - at), at, n_rec - 3, len(data) - at
    if how == "all_nul":
        return b"\0" * len(data), 0, 0, len(data)
    if how == "zero":
        return b"", 0, 0, 0
    if how == "cut_last_line":
        at = starts[-1]
        return data[:-7], at, n_rec - 1, len(data) - 7 - at
    if how == "bad_crc_middle":
        at = starts[5]
        b = bytearray(data)
        b[at + 30] ^= 0x01
        return bytes(b), at, n_rec - 1, starts[6] - at
    raise ValueError(how)


@pytest.mark.parametrize("how", ["nul_tail", "all_nul", "zero", "cut_last_line", "bad_crc_middle"])
def test_a_damaged_journal_is_set_aside_counted_and_reported_until_a_clean_compaction(tmp_path, how, caplog):
    data, at, intact, lost = _damaged(tmp_path, how)
    (tmp_path / FILE).write_bytes(data)
    j = Journal(tmp_path)
    with caplog.at_level("WARNING", "appliance.service.journal"):
        rec = j.open()
    (w,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"is damaged at byte {at}:" in w and f"{intact} record(s) recovered, {lost} byte(s) could not be read" in w, w
    assert (rec.damaged_at, rec.records, rec.lost_bytes) == (at, intact, lost)
    kept = tmp_path / f"{FILE}.1.corrupt"
    assert rec.set_aside == str(kept) and kept.read_bytes() == data and str(kept) in w
    (c,) = j.conditions()
    assert c.name == "journal_recovered" and c.severity == "degraded" and f"byte {at}" in c.reason, c
    # every intact unfinished request is handed back once; r0's end record survives only a damage before it
    assert len(rec.pending) == len({e.id for e in rec.pending})
    assert ("r0" in [e.id for e in rec.pending]) == (how in ("nul_tail", "cut_last_line"))
    for e in rec.pending:
        j.end(e.n, {"type": "done", "id": e.id})
    assert [x.name for x in j.conditions()] == ["journal_recovered"]      # until a compaction, not an end
    j.max_bytes = 8192                                         # the next compaction comes after a few requests
    for i in range(100, 200):
        j.end(j.accept(_req(i)), {"type": "done", "id": f"r{i}"})
        if not j.conditions():
            break
    assert i > 100 and j.conditions() == ()                    # compacted cleanly: cleared
    j.close()
    again = Journal(tmp_path)
    assert again.open().pending == [] and again.conditions() == ()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([FILE, kept.name])


def test_the_journal_stays_bounded_and_refuses_when_unfinished_requests_fill_it(tmp_path):
    j = Journal(tmp_path, max_bytes=65536)
    j.open()
    big = "长" * 2000                                   # 6 kB of UTF-8 per record
    ns = []
    with pytest.raises(JournalError, match="unfinished request") as e:
        for i in range(100):
            ns.append(j.accept(_req(i, big)))
    assert e.value.code == "journal_error" and "journal.max_bytes" in str(e.value)
    assert 5 <= len(ns) <= 10
    for n in ns[:4]:
        j.end(n, {"type": "done", "id": "x"})
    for i in range(200):                              # finished requests are compacted away
        n = j.accept(_req(1000 + i, big))
        j.end(n, {"type": "done", "id": f"r{1000 + i}"})
        assert (tmp_path / FILE).stat().st_size <= 65536 + 7000
    rec = Journal(tmp_path).open()
    assert [e.n for e in rec.pending] == ns[4:]


def _mount_tmpfs(path, size: str):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", f"jt-{uuid.uuid4().hex[:6]}", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


@pytest.fixture
def small_fs(tmp_path):
    """A real 256 kB tmpfs (root only; skipped otherwise)."""
    d = tmp_path / "fs"
    _mount_tmpfs(d, "256k")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def fill(fs) -> None:
    """Take every free byte of the file system ``fs`` with ``fallocate`` (a file named filler)."""
    st = os.statvfs(fs)
    subprocess.run(["fallocate", "-l", str(st.f_bavail * st.f_frsize), str(fs / "filler")], check=True)


def test_a_full_disk_is_reported_ends_are_marked_in_place_and_nothing_is_replayed_twice(small_fs):
    """The disk fills with requests in the journal: new ones cannot be journaled (the caller plays
    them, not crash-safe; ``condition`` says why), and the ones that end are marked ended in place,
    so no restart while the disk stays full replays them; one still unfinished is replayed once."""
    j = Journal(small_fs / "spool")
    j.open()
    n0, n1 = j.accept(_req(0)), j.accept(_req(1))
    j.started(n0)
    fill(small_fs)
    late = []
    with pytest.raises(JournalError, match="No space left on device") as e:
        for i in range(2, 200):                        # the journal file's last free page fills, then the refusal
            late.append(j.accept(_req(i, "字" * 500)))
    assert "free space" in str(e.value) and "service.spool_dir" in str(e.value)
    assert "No space left on device" in j.condition
    j.end(n0, {"type": "done", "id": "r0", "output": "device:x"})     # never raises: marked in place
    j.close()
    for restart in range(3):                           # clean restarts while the disk stays full
        j = Journal(small_fs / "spool")
        rec = j.open()
        assert "r0" in rec.finished and rec.finished["r0"]["type"] == "done", restart
        assert [p.n for p in rec.pending] == ([n1] + late if restart == 0 else []), restart
        for p in rec.pending:                          # replayed (once) and ended, still on a full disk
            j.started(p.n)
            j.end(p.n, {"type": "error" if p.n == n1 else "done", "id": p.id, "code": "cancelled", "message": "m"})
        j.close()
    assert rec.finished["r1"]["type"] == "error"
    (small_fs / "filler").unlink()
    n = j.accept(_req(500))                            # space again: journaled, the condition clears
    assert j.condition is None
    rec = Journal(small_fs / "spool").open()           # no partial record was left behind
    assert rec.torn == 0 and rec.corrupt == 0 and rec.pending[-1].n == n and set(rec.finished) >= {"r0", "r1"}


def test_storage_degraded_clears_when_the_disk_takes_writes_again_without_a_request(small_fs):
    """Health reads the journal's condition every second: while the file system has no room it
    holds (a compaction that would write a small file is not taken for "writes again"); once room
    returns a compaction is tried at once, so ``storage_degraded`` clears without a request;
    nothing accepted is lost by the attempts."""
    now = [1000.0]
    j = Journal(small_fs / "spool", clock=lambda: now[0])
    j.open()
    n0 = j.accept(_req(0))
    fill(small_fs)
    late = []
    with pytest.raises(JournalError):
        for i in range(1, 200):
            late.append(j.accept(_req(i, "字" * 500)))
    (c,) = j.conditions()                              # the file system has no room: not even tried
    assert c.name == "storage_degraded" and "No space left on device" in c.reason, c
    now[0] += 10 * RETRY_S
    (c,) = j.conditions()                              # still full: holds, whatever a write of nothing would do
    assert c.name == "storage_degraded", c
    (small_fs / "filler").unlink()
    assert j.conditions() == () and j.condition is None                  # room again: compacted at once
    assert sorted(p.name for p in (small_fs / "spool").iterdir()) == [FILE]      # no temporary file left
    j.close()
    assert [e.n for e in Journal(small_fs / "spool").open().pending] == [n0] + late


def test_a_read_only_journal_replays_nothing_and_an_unreadable_one_is_set_aside(tmp_path):
    """A journal that can be read but not written (a read-only file system) could not mark a
    replay ended, so it replays nothing (each would be spoken again at every start); one that
    cannot be read is set aside: no replay, ``condition`` says why, ``accept`` raises."""
    Journal(tmp_path / "j").open()
    j = Journal(tmp_path / "j")
    j.open()
    j.accept(_req(0))
    d = tmp_path / "ro"
    _mount_tmpfs(d, "1m")
    try:
        shutil.copytree(tmp_path / "j", d / "spool")
        subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
        ro = Journal(d / "spool")
        assert ro.open().pending == [] and "read-only" in ro.condition
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / FILE).mkdir()                  # a directory where the file should be: unreadable
    bad = Journal(tmp_path / "bad")
    assert bad.open().pending == [] and "cannot read the request journal" in bad.condition
    with pytest.raises(JournalError):
        bad.accept(_req(1))


def test_replay_decisions_age_alerts_and_attempts(tmp_path):
    j = Journal(tmp_path)
    j.open()
    j.accept(_req(0))
    j.accept(_req(1, priority="alert"))
    n2 = j.accept(_req(2))
    for _ in range(3):                                 # running at three crashes
        j.started(n2)
        j = Journal(tmp_path)
        rec = j.open()
    r = Recovery(j, rec, JournalConfig(max_age_s=3600, alert_max_age_s=30, max_attempts=3))
    e0, e1, e2 = rec.pending
    now = Stamp.now()
    later = lambda s: dataclasses.replace(now, up=now.up + s)     # noqa: E731 - the boot clock moved on
    assert r.why_not(e0, now) is None and r.why_not(e1, now) is None
    assert "alert accepted 40 s ago" in r.why_not(e1, later(40))
    assert r.why_not(e0, later(40)) is None
    assert "journal.max_age_s" in r.why_not(e0, later(4000))
    assert "3 crash(es)" in r.why_not(e2, now)
    # the wall clock stepped back to 1970 or 60 years forward: within the boot it changes nothing
    assert r.why_not(e0, dataclasses.replace(now, wall=86400.0)) is None
    assert r.why_not(e1, dataclasses.replace(now, wall=now.wall + 60 * 365 * 86400)) is None
    # another boot: the wall clock counts only when both readings are plausible and in order
    other = Stamp("another-boot", 5.0, now.wall + 4000)
    assert "journal.max_age_s" in r.why_not(e0, other)
    assert r.why_not(e0, dataclasses.replace(other, wall=86400.0)) is None       # no RTC yet: age unknown, replayed


def test_attempts_count_only_requests_running_at_the_crash(tmp_path):
    """A crash counts an attempt for a request that was synthesizing or sounding (last state
    record ``s`` or ``p``), not for one that was queued, synthesized and waiting to sound, or back
    in the queue after a preemption; the state survives a compaction in the middle of a run."""
    j = Journal(tmp_path, max_bytes=65536)
    j.open()
    n = {k: j.accept(_req(i, text=k)) for i, k in enumerate(
        ["queued", "synthesizing", "sounding", "waiting", "sounded_then_synthesized", "requeued"])}
    for k in ("synthesizing", "sounding", "waiting", "sounded_then_synthesized", "requeued"):
        j.started(n[k])
    j.sounding(n["sounding"])
    j.synthesized(n["waiting"])                        # synthesized, not one sample played
    j.sounding(n["sounded_then_synthesized"])
    j.synthesized(n["sounded_then_synthesized"])       # still sounding: running
    j.requeued(n["requeued"])
    with j._lock:
        j._compact()                                   # the running state is carried by the 'a' record
    rec = Journal(tmp_path).open()
    assert {e.req["text"]: e.tries for e in rec.pending} == {
        "queued": 0, "synthesizing": 1, "sounding": 1, "waiting": 0, "sounded_then_synthesized": 1, "requeued": 0}
    rec = Journal(tmp_path).open()                     # a clean reopen adds nothing
    assert sum(e.tries for e in rec.pending) == 3


def test_a_finished_id_is_answered_again_only_for_the_same_text(tmp_path):
    """After a restart, a speak with a finished request's id gets 'replayed' + the old outcome only
    when its text is the same (a redelivery); with another text (a client reusing ids) it is
    spoken like any new request, as it would be without the restart. The text's digest survives
    the compaction that rewrites finished requests."""
    from appliance.messages.protocol import Speak

    j = Journal(tmp_path)
    j.open()
    n = j.accept(_req(0, text="第一句。"))
    j.end(n, {"type": "done", "id": "r0", "output": "device:x", "seed": 0})
    for rec in (Journal(tmp_path).open(), Journal(tmp_path).open()):   # after the "e" record, then compacted
        assert rec.finished_sha["r0"] and "text" not in str(rec.finished_sha)
        r = Recovery(j, rec, JournalConfig())
        got = []
        assert r.attach(Speak(id="r0", text="第一句。"), lambda ev: got.append(ev.type))
        assert len(got) == 2 and got[0] == "replayed"                      # replayed + the old outcome
        assert not r.attach(Speak(id="r0", text="something new"), lambda ev: got.append(ev.type))
        assert len(got) == 2
        assert not r.attach(Speak(id="r0", text="第一句。"), lambda ev: None)   # forgotten once reused


def _replaying(tmp_path, i: int, text: str):
    """A journal left with one unfinished request (``r<i>``), reopened and replayed (the
    resubmission itself is a no-op): ``(journal, recovered, recovery)``."""
    import asyncio

    j = Journal(tmp_path)
    j.open()
    j.accept(_req(i, text=text))
    rec = Journal(tmp_path).open()
    r = Recovery(j, rec, JournalConfig())

    async def resubmit(speak, channel, sink, n):
        pass

    assert asyncio.run(r.replay(resubmit, None)) == 1
    return j, rec, r


def test_a_request_being_replayed_refuses_its_id_with_another_text(tmp_path):
    """A client sending the id of a request that is being replayed now: the same text attaches it
    ('replayed', never spoken twice); another text is refused with bad_request naming the id."""
    from appliance.errors import RequestError
    from appliance.messages.protocol import Speak

    _, _, r = _replaying(tmp_path, 5, "还在排队。")
    got = []
    assert r.attach(Speak(id="r5", text="还在排队。"), lambda ev: got.append(ev.type))
    assert got == ["replayed"]
    with pytest.raises(RequestError, match="'r5' is being replayed .* another text; give every new request a fresh id"):
        r.attach(Speak(id="r5", text="different"), lambda ev: None)


def test_a_replay_that_ended_gives_its_id_to_a_new_text(tmp_path):
    """Once a replayed request has ended (its journal entry keeps only the text's digest), its id
    with the same text is answered with its outcome, with another text spoken anew."""
    from appliance.messages.protocol import Done, Speak

    j, rec, r = _replaying(tmp_path, 6, "重放的。")
    j.end(rec.pending[0].n, {"type": "done", "id": "r6"})
    r.replays["r6"].sink(Done(id="r6", channel="main", ttfb_ms=1.0, rtf=0.1, audio_s=1.0, steps=47, steps_per_s=470.0))
    got = []
    assert r.attach(Speak(id="r6", text="重放的。"), lambda ev: got.append(ev.type))
    assert got == ["replayed", "done"]
    assert not r.attach(Speak(id="r6", text="a new one"), lambda ev: None)
