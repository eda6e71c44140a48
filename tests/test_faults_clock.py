"""A wall clock that jumps, with real parts: the real daemon runs under libfaketime (Debian's
``libfaketime``, ``LD_PRELOAD``; ``FAKETIME_DONT_FAKE_MONOTONIC=1`` leaves ``CLOCK_MONOTONIC`` and
``CLOCK_BOOTTIME`` alone, as a real clock step does) reading 1970, is SIGKILLed with requests
sounding and queued, and restarts with the clock 56 years forward; then the same backwards. Every
unfinished request is replayed (their age is measured on the boot clock, not the wall clock),
none is dropped as "accepted 1796349004 s ago", and a finished one is answered, not spoken again."""

from __future__ import annotations

import glob
import signal

import pytest

from tests.fixtures_service import alsa_home, launch_daemon, service_config
from tests.waits import journal_states, wait_for, wait_log

LIBFAKETIME = next(iter(sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1"))), None)


def _in_1970() -> dict:
    if LIBFAKETIME is None:
        pytest.skip("libfaketime is not installed (apt-get install libfaketime)")
    return {"LD_PRELOAD": LIBFAKETIME, "FAKETIME": "@1970-01-02 00:00:00", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


def _speak(rid: str, steps: int) -> dict:
    return {"type": "speak", "text": f"{rid}。", "seed": 7, "id": rid,
            "params": {"min_new_tokens": steps, "max_new_tokens": steps}}


def _accept_and_kill(d, spool, reqs: dict) -> None:
    """Send ``reqs`` (id -> steps), wait until the first sounds, SIGKILL the daemon."""
    c = d.connect()
    for rid, steps in reqs.items():
        c.send(_speak(rid, steps))
    c.events_until_ids(set(reqs), kinds=("accepted",))
    c.close()                                          # on_disconnect: finish
    first = next(iter(reqs))
    wait_for(lambda: journal_states(spool).get(first) == "p", 60, f"{first} sounding",
             show=lambda: (journal_states(spool), d.log()[-2000:]))
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)


def test_a_clock_stepped_forward_then_back_neither_drops_nor_repeats_journaled_requests(tiny_ckpt, tmp_path):
    cfg = service_config(tiny_ckpt, tmp_path, audio={"output": "device"}, synthesis={"max_new_tokens": 300},
                         service={"channels": [{"name": "main", "on_disconnect": "finish"}]})
    alsa = alsa_home(tmp_path / "home", tmp_path / "played.raw")
    rc = alsa.home / ".asoundrc"                       # the sound card's clock (the pacer) keeps real time
    rc.write_text(rc.read_text().replace('"|exec ', '"|exec env -u LD_PRELOAD -u FAKETIME '))
    spool = tmp_path / "d" / "spool"
    d = None
    try:
        # run 1, the clock at 1970: r1 sounds, r2 waits; killed
        d = launch_daemon(tmp_path / "d", cfg, alsa=alsa, env=_in_1970())
        _accept_and_kill(d, spool, {"r1": 300, "r2": 20})
        raw = (spool / "journal.log").read_bytes()
        assert b'"t":86' in raw or b'"t":87' in raw, raw[:300]      # written while the clock read 1970-01-02
        # run 2, the clock 56 years on: both replayed (the boot clock says seconds, not decades)
        d = launch_daemon(tmp_path / "d", cfg, alsa=alsa)
        wait_log(d.log, "replaying 2 journaled request(s)")
        for rid in ("r1", "r2"):
            wait_log(d.log, f"replayed request {rid}: done", 120)
        assert "is not replayed" not in d.log(), d.log()[-3000:]
        _accept_and_kill(d, spool, {"r3": 300, "r4": 20})
        # run 3, the clock back at 1970: replayed again (an age below zero is not 'newer than new')
        d = launch_daemon(tmp_path / "d", cfg, alsa=alsa, env=_in_1970())
        wait_log(d.log, "replaying 2 journaled request(s)")
        for rid in ("r3", "r4"):
            wait_log(d.log, f"replayed request {rid}: done", 120)
        assert "is not replayed" not in d.log(), d.log()[-3000:]
        back = d.request(_speak("r1", 300))                      # finished in run 2: answered, not spoken again
        assert [e["type"] for e in back] == ["replayed", "done"], back
        assert d.stop() == 0, d.log()[-3000:]
    finally:
        if d is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait(10)
