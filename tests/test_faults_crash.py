"""Crash safety with real parts: the real daemon is SIGKILLed with requests playing, synthesizing
and queued, then again while it replays them; after the last restart every accepted, unfinished
request is played exactly once (bit-exact against its own synthesis, read back from the real
ALSA file device), the one that had finished is not played again, and a client that comes back
with a request's id is told ``replayed`` instead of having it spoken twice."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from appliance.config import config_from_dict
from appliance.core import SynthesisRequest, SynthParams
from appliance.service.journal import Journal
from tests.fixtures_service import (
    alsa_home,
    launch_daemon,
    resample_like_daemon,
    service_config,
)
from tests.waits import journal_states, wait_for, wait_log

#: id -> (text, seed, decode steps); r2 is long so that it is still synthesizing at the kill
REQS = {
    "r0": ("第零句。", 10, 40),
    "r1": ("第一句，正在播放。", 11, 100),
    "r2": ("第二句，正在合成，很长很长。", 12, 400),
    "r3": ("第三句。", 13, 40),
    "r4": ("第四句。", 14, 40),
}
RATE = 44100
SLOW = 0.1
"""The card's clock while a test holds "one request sounding, the next ones synthesizing or
waiting" up to a SIGKILL (:meth:`AlsaFile.set_speed <tests.fixtures_service.AlsaFile.set_speed>`)."""


def _speak(rid: str) -> dict:
    text, seed, n = REQS[rid]
    return {"type": "speak", "text": text, "seed": seed, "id": rid,
            "params": {"min_new_tokens": n, "max_new_tokens": n}}


@pytest.fixture(scope="module")
def setup(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("crash")
    cfg = service_config(tiny_ckpt, tmp, audio={"output": "device"}, synthesis={"max_new_tokens": 400},
                         service={"channels": [{"name": "main", "on_disconnect": "finish"}]})
    from appliance.synth.pipeline import Pipeline

    p = Pipeline.from_config(config_from_dict(cfg, base_dir=str(tmp)))
    want = {}
    for rid, (text, seed, n) in REQS.items():
        job = p.prepare(SynthesisRequest(id=rid, text=text, seed=seed, params=SynthParams(min_new_tokens=n, max_new_tokens=n)))
        pcm = resample_like_daemon(np.concatenate([c.samples for c in p.run(job)]), RATE)
        want[rid] = pcm[pcm != 0]
    p.close()
    return tmp, cfg, want


def occurrences(played: np.ndarray, e: np.ndarray, probe: int = 64) -> list[int]:
    """Start indices in ``played`` where all of ``e`` was played exactly (zeros removed from both)."""
    out = []
    for k in np.flatnonzero(played == e[0]):
        if len(played) - k >= len(e) and np.array_equal(played[k:k + probe], e[:probe]):
            assert np.abs(played[k:k + len(e)] - e).max() <= 1e-6, "a replay differs from its own synthesis"
            out.append(int(k))
    return out


def settled_size(alsa, timeout_s: float = 15.0) -> int:
    """The ALSA file's size once the killed daemon's pacer has written what was in its pipe and
    exited (:meth:`AlsaFile.wait_flushed <tests.fixtures_service.AlsaFile.wait_flushed>`)."""
    return alsa.wait_flushed(timeout_s)


def _status(c) -> dict:
    c.send({"type": "status"})
    return c.events(("status",))[-1]["channels"]["main"]


def test_sigkill_playing_synthesizing_queued_and_during_replay_speaks_each_once(setup):
    tmp, cfg, want = setup
    alsa = alsa_home(tmp / "home", tmp / "played.raw")

    # run 1: r0 finishes, then r1 plays, r2 synthesizes, r3 and r4 wait: SIGKILL
    d = launch_daemon(tmp / "d", cfg, alsa=alsa)
    assert d.request(_speak("r0"))[-1]["type"] == "done"
    alsa.set_speed(SLOW)                 # r1 still sounds at the kill, however slow r2's synthesis
    c = d.connect()
    for rid in ("r1", "r2", "r3", "r4"):
        c.send(_speak(rid))
    c.events_until_ids({"r1", "r2", "r3", "r4"}, kinds=("accepted",))
    s = d.connect()
    try:
        wait_for(lambda: (lambda st: st["active"] == "r2" and "r1" in st["playing"] and st["queued"] >= 2)(_status(s)),
                 30, "r1 playing while r2 synthesizes and r3, r4 wait", poll_s=0.005)
    finally:
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
        alsa.set_speed(1.0)
        c.close()
        s.close()
    off1 = settled_size(alsa)
    assert [e.id for e in Journal(tmp / "d" / "spool").open().pending] == ["r1", "r2", "r3", "r4"]

    # run 2: killed again while it replays r1 (playing)
    d = launch_daemon(tmp / "d", cfg, alsa=alsa)
    wait_for(lambda: np.count_nonzero(alsa.read(off1)) >= RATE // 2, 30, "half a second of r1 replayed")
    assert "replaying 4 journaled request(s)" in d.log()
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)
    off2 = settled_size(alsa)
    partial = alsa.read(off1)
    assert len(occurrences(partial[partial != 0], want["r1"][:RATE // 4])) >= 1     # r1 had begun again

    # run 3: everything left is spoken once; returning clients are told 'replayed'
    d = launch_daemon(tmp / "d", cfg, alsa=alsa)
    try:
        back0 = d.request(_speak("r0"))                        # finished in run 1: not spoken again
        assert [e["type"] for e in back0] == ["replayed", "done"] and back0[0]["state"] == "done", back0
        back3 = d.request(_speak("r3"), timeout_s=120)         # queued since run 1: attached, not doubled
        assert back3[0]["type"] == "replayed" and back3[0]["state"] in ("queued", "running", "playing"), back3
        assert back3[-1]["type"] == "done" and back3[-1]["id"] == "r3", back3
        for rid in ("r1", "r2", "r3", "r4"):
            wait_log(d.log, f"replayed request {rid}: done", 120)
    finally:
        assert d.stop() == 0, d.log()[-3000:]
    alsa.wait_flushed()                                       # everything played is in the file
    played = alsa.read(off2)
    played = played[played != 0]
    at = {rid: occurrences(played, want[rid]) for rid in REQS}
    assert at["r0"] == [], "a request that had finished before the crash was played again"
    for rid in ("r1", "r2", "r3", "r4"):
        assert len(at[rid]) == 1, (rid, at)
    assert at["r1"][0] < at["r2"][0] < at["r3"][0] < at["r4"][0]      # in accept order
    assert Journal(tmp / "d" / "spool").open().pending == []


def test_crash_loop_guard_counts_only_the_request_that_was_running(tiny_ckpt, tmp_path):
    """Three SIGKILLs in a row while ``g1`` sounds and ``g2``, ``g3`` (synthesized, not one sample
    played) wait behind it in the channel's play-out queue: only ``g1`` was running at each crash,
    so only ``g1`` reaches ``journal.max_attempts`` (3) and is not replayed; ``g2`` and ``g3`` are
    spoken after the fourth start. Each kill waits for the journal's own state records (``p``:
    g1's first sample reached the device; ``w``: g2 and g3 synthesized and waiting), not for a time.

    The state must still hold at the kill: g1 must outlast the synthesis of g2 and g3. At real
    time it did not on a loaded machine (g1's 8 s synthesized at RTF 1.5 played out before g3
    was synthesized, and the test waited its 60 s for a state that had passed), so the card's
    clock runs at :data:`SLOW` while the state is built: g1 sounds for 80 s, longer than the
    test waits for the state, whatever the load."""
    steps = {"g1": 400, "g2": 40, "g3": 40}
    cfg = service_config(tiny_ckpt, tmp_path, audio={"output": "device"}, synthesis={"max_new_tokens": 400},
                         service={"channels": [{"name": "main", "on_disconnect": "finish"}]})
    alsa = alsa_home(tmp_path / "home", tmp_path / "played.raw")
    spool = tmp_path / "d" / "spool"

    def speak(rid: str) -> dict:
        return {"type": "speak", "text": f"{rid}。", "seed": 20, "id": rid,
                "params": {"min_new_tokens": steps[rid], "max_new_tokens": steps[rid]}}

    want = {"g1": "p", "g2": "w", "g3": "w"}
    d = None
    alsa.set_speed(SLOW)
    try:
        for run in range(3):
            d = launch_daemon(tmp_path / "d", cfg, alsa=alsa)
            if run == 0:
                c = d.connect()
                for rid in steps:
                    c.send(speak(rid))
                c.events_until_ids(set(steps), kinds=("accepted",))
                c.close()                    # on_disconnect: finish
            else:
                wait_log(d.log, "replaying 3 journaled request(s)")
            wait_for(lambda: journal_states(spool) == want, 60,
                     f"run {run + 1}: g1 sounding, g2 and g3 synthesized and waiting",
                     show=lambda: (journal_states(spool), d.log()[-2000:]))
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait(10)
            rec = Journal(spool).open()      # counts the crash: only the running request
            assert {e.id: e.tries for e in rec.pending} == {"g1": run + 1, "g2": 0, "g3": 0}

        alsa.set_speed(1.0)
        d = launch_daemon(tmp_path / "d", cfg, alsa=alsa)
        wait_log(d.log, "replaying 2 journaled request(s)")
        assert "journaled request g1 is not replayed: it was synthesizing or playing during 3 crash(es)" in d.log()
        for rid in ("g2", "g3"):
            back = d.request(speak(rid), timeout_s=120)
            assert back[0]["type"] == "replayed" and back[-1]["type"] == "done" and back[-1]["id"] == rid, back
        assert d.stop() == 0, d.log()[-3000:]
    finally:
        if d is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait(10)
    assert Journal(spool).open().pending == []
